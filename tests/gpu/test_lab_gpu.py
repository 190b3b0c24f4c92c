"""The notebook lab on the real backend (H200 test machine, safety cap on, small models far below the card)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from um_lab.widgets import Lab  # noqa: E402

pytestmark = pytest.mark.gpu

SMALL_MLP = {"width": 1024, "depth": 4, "batch_size": 64}


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_lab_runs_on_the_gpu_with_the_cap_shown_and_residency_measured_where_it_can_be(tmp_path):
    lab = Lab(model="mlp", model_kwargs=SMALL_MLP, policy="gpu-first", backend="auto", steps=8, warmup_steps=2,
              out_dir=tmp_path)
    assert lab.workload.resolved_backend == "cuda"
    assert "capped at" in lab.workload.cap_note.value
    estimate = lab.workload.wait_estimate()
    assert estimate is not None and "safety cap" in lab.workload.estimate.value
    lab.run(wait=True, timeout=300)
    assert lab.state == "complete", lab.status.value
    records = lab.records
    assert len(records) == 10 and all(r.backend == "cuda" for r in records)
    assert records[-1].live_total > 0 and records[-1].cap_bytes is not None
    assert len(_trace(lab.dashboard.widget, "step time").x) == 10
    title = lab.dashboard.widget.layout.annotations[0].text
    if records[-1].resident_bytes is not None:  # CUPTI available: measured residency is drawn
        assert "measured, CUPTI" in title
        assert sum(records[-1].resident_bytes.values()) <= records[-1].live_total
    else:  # no CUPTI here: live bytes, labelled so, and the record says why
        assert "residency not measured" in title and records[-1].telemetry.startswith("unavailable")
    print("telemetry:", records[-1].telemetry, "| title:", title)


def test_a_model_above_the_safety_cap_is_refused_in_the_panel_before_any_allocation(tmp_path):
    import torch

    free_before = torch.cuda.mem_get_info()[0]
    lab = Lab(model="mlp", model_kwargs={"width": 65536, "depth": 64, "batch_size": 64}, backend="cuda",
              out_dir=tmp_path)
    assert lab.run() is None
    assert lab.state == "error" and "refused" in lab.status.value and "safety cap" in lab.status.value
    assert torch.cuda.mem_get_info()[0] >= free_before - 64 * 2**20


def test_stop_on_the_gpu_ends_after_the_current_step(tmp_path):
    lab = Lab(model="mlp", model_kwargs=SMALL_MLP, backend="cuda", steps=10_000, warmup_steps=1, pace_s=0.02,
              out_dir=tmp_path)
    lab.run()
    deadline = time.monotonic() + 120
    while lab.dashboard.count < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    lab.stop()
    assert lab.wait(120)
    assert lab.state == "stopped" and 5 <= lab.active.steps_completed < 10_001
    assert lab.result.state == "stopped"
