"""The notebook lab without a browser: panel controls, runs on the simulator, live dashboard, comparison view."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from um_lab.backend import cuda_available  # noqa: E402
from um_lab.policy import Advice, presets  # noqa: E402
from um_lab.types import StepRecord  # noqa: E402
from um_lab.widgets import AdviceGrid, CompareView, Lab, LiveDashboard  # noqa: E402
from um_lab.widgets.compare_view import parse_ratios, readable  # noqa: E402
from um_lab.widgets.figures import DASHBOARD_TRACES  # noqa: E402
from um_lab.widgets.workload import model_knobs  # noqa: E402

TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "batch_size": 2, "seq_len": 32}
TINY_MLP = {"width": 256, "depth": 2, "batch_size": 32}


def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def _wait(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_um_lab_widgets_installs_under_um_lab_not_as_a_top_level_widgets_module(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not the tree
    if subprocess.run([sys.executable, "-c", "import um_lab"], cwd=tmp_path, env=env).returncode:
        pytest.skip("um_lab is not installed here (used from the source tree on PYTHONPATH)")
    code = ("import importlib.util, um_lab.widgets; "
            "print(importlib.util.find_spec('widgets') is None, um_lab.widgets.Lab.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "um_lab.widgets.lab"]


def test_um_lab_widgets_is_found_in_a_source_tree_that_is_not_installed(tmp_path):
    root = Path(__file__).parents[1]
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            "import um_lab.widgets.figures as f; print(f.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(root / "widgets" / "figures.py")


def test_model_knobs_come_from_the_zoo_signatures():
    assert model_knobs("mlp") == {"width": 4096, "depth": 8, "batch_size": 256, "classes": 10}
    gpt2 = model_knobs("gpt2-medium")
    assert gpt2["n_layer"] == 24 and gpt2["n_embd"] == 1024 and gpt2["seq_len"] == 1024
    assert "size" not in gpt2
    with pytest.raises(ValueError, match="unknown model"):
        model_knobs("nope")


def test_registered_custom_models_are_in_the_dropdown_with_their_knobs(tmp_path):
    import torch

    from um_lab import models

    def tiny(width: int = 32, batch_size: int = 8):
        def batch(g):
            return torch.randn(batch_size, width, generator=g), torch.randint(0, 4, (batch_size,))

        return models.custom("tiny-net", lambda: torch.nn.Linear(width, 4), batch)

    models.register("tiny-net", tiny)
    try:
        lab = Lab(model="tiny-net", model_kwargs={"width": 16}, backend="sim", steps=2, out_dir=tmp_path)
        assert "tiny-net" in lab.workload.model.options
        assert set(lab.workload.knobs) == {"width", "batch_size"} and lab.workload.knobs["width"].value == 16
        assert lab.workload.wait_estimate().bytes_per_type["param"] == (16 * 4 + 4) * 4
        lab.run(wait=True, timeout=60)
        assert lab.state == "complete" and lab.result.spec.model == "tiny-net"
    finally:
        models.ZOO.pop("tiny-net", None)


def test_panel_shows_the_ratio_the_simulated_run_will_have_before_running(tmp_path):
    from um_lab.models import get_model
    from um_lab.sim import SimBackend

    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", ratio=2.0, steps=2, warmup_steps=0,
              out_dir=tmp_path)
    estimate = lab.workload.wait_estimate()
    assert estimate is not None and estimate.total_bytes > 0 and "param" in lab.workload.estimate.value
    footprint = SimBackend().prepare(get_model("mlp", **TINY_MLP)).footprint_bytes
    assert lab.workload.last_footprint == footprint
    assert not list(tmp_path.iterdir()), "nothing runs before Run is pressed"
    lab.workload.capacity_mode.value = "capacity GiB"
    lab.workload.capacity_value.value = 0.005  # 5 MiB: below the footprint of the tiny MLP
    lab.workload.wait_estimate()
    shown = footprint / (int(0.005 * 2**30) // (2 << 20) * (2 << 20))  # whole 2 MiB chunks: 4 MiB
    assert f"{shown:.3g}x" in lab.workload.estimate.value
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete"
    assert lab.records[-1].oversubscription_ratio == pytest.approx(shown, rel=0.02), "shown before = measured after"
    lab.workload.model.value = "gpt2-small"  # new knobs, new estimate
    assert "n_layer" in lab.workload.knobs and "width" not in lab.workload.knobs


def test_run_button_streams_records_into_the_live_dashboard_then_a_static_figure(tmp_path):
    lab = Lab(model="gpt2-small", model_kwargs=TINY_GPT2, backend="sim", steps=6, warmup_steps=1, ratio=1.5,
              out_dir=tmp_path)
    lab.advice.preset.value = "gpu-first"
    assert lab.policy == presets["gpu-first"]
    lab.run_button.click()
    assert lab.wait(120)
    assert lab.state == "complete" and "complete" in lab.status.value
    fig = lab.dashboard.widget
    assert len(_trace(fig, "step time").x) == 7 and len(_trace(fig, "param").x) == 7
    assert _trace(fig, "oversubscription").y[-1] == pytest.approx(lab.records[-1].oversubscription_ratio)
    assert "simulated" in fig.layout.annotations[0].text
    assert lab.progress.value == lab.progress.max == 7
    assert lab.static_output.outputs, "a static figure follows the run"
    assert "application/vnd.plotly.v1+json" in lab.static_output.outputs[0]["data"]
    loaded = lab.result
    assert loaded.spec.policy == "gpu-first" and loaded.complete
    assert [t.name for t in lab.static_figure().data] == list(DASHBOARD_TRACES)


def test_stop_ends_the_run_after_the_current_step_and_the_panel_says_so(tmp_path):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=500, warmup_steps=0, pace_s=0.05,
              out_dir=tmp_path)
    lab.run()
    _wait(lambda: len(_trace(lab.dashboard.widget, "step time").x) >= 3)
    first = len(_trace(lab.dashboard.widget, "step time").x)
    _wait(lambda: len(_trace(lab.dashboard.widget, "step time").x) > first)  # it grows while running
    assert "running" in lab.status.value and lab.stop_button.disabled is False
    lab.stop_button.click()
    assert lab.wait(30)
    assert lab.state == "stopped" and "stopped" in lab.status.value
    done = lab.active.steps_completed
    assert 3 <= done < 500
    assert len(_trace(lab.dashboard.widget, "step time").x) == done, "the last state is drawn"
    assert lab.run_button.disabled is False and lab.stop_button.disabled is True
    status = json.loads((lab.active.path / "status.json").read_text())
    assert status["status"] == "stopped" and status["steps_completed"] == done


def test_an_interrupt_while_waiting_stops_the_run_and_leaves_the_panel_usable(tmp_path):
    import _thread
    import threading

    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=10_000, warmup_steps=0, pace_s=0.02,
              out_dir=tmp_path)
    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while lab.dashboard.count < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        _thread.interrupt_main()  # as Ctrl-C (or the notebook's stop button) would, while run() waits

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        lab.run(wait=True)
    assert lab.state == "stopped" and 0 < lab.active.steps_completed < 10_000
    lab.steps.value = 2
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete"


def test_engine_errors_show_in_the_panel_not_as_tracebacks(tmp_path):
    if cuda_available():
        pytest.skip("this machine has a GPU: the no-GPU error cannot happen")  # pragma: no cover
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="cuda", out_dir=tmp_path)
    assert lab.run() is None
    assert lab.state == "error" and "the cuda backend cannot run here" in lab.status.value
    assert "CudaUnavailableError" not in lab.status.value  # um_lab's own errors speak by their message
    assert "no CUDA GPU" in lab.workload.cap_note.value
    # a simulated GPU smaller than one 2 MiB chunk: once the estimate knows the footprint, Run refuses it
    # before the run's folder exists, quoting the ratio given
    lab.workload.backend.value = "sim"
    lab.workload.capacity_mode.value = "ratio"
    lab.workload.capacity_value.value = 10_000.0
    lab.workload.wait_estimate()
    assert "below one 2 MiB chunk" in lab.workload.estimate.value
    assert lab.run() is None and lab.state == "error"
    assert "ratio 10000.0" in lab.status.value and "below one 2 MiB chunk" in lab.status.value
    assert not any(tmp_path.iterdir())
    # before the estimate is done, the run's own pre-flight refuses it, before its folder exists too
    lab.workload.last_sized = None
    lab.run(wait=True, timeout=60)
    assert lab.state == "error" and "below one 2 MiB chunk" in lab.status.value
    assert not any(tmp_path.iterdir()) and lab.run_button.disabled is False


def test_advice_grid_presets_custom_edits_three_type_view_and_notes():
    changes = []
    grid = AdviceGrid("um-default", on_change=changes.append)
    grid.preset.value = "zero-copy-params"
    assert grid.policy == presets["zero-copy-params"]
    row = grid._rows5[0]  # param
    assert row.preferred.value == "cpu" and row.by_gpu.value is True
    row.read_mostly.value = True
    assert grid.preset.value == "custom" and grid.policy.name == "custom"
    assert grid.policy["param"].read_mostly and not grid.policy["grad"].read_mostly
    assert "read-mostly on param" in grid.notes.value
    grid.three_types.value = True
    assert len(grid.rows.children) == 3
    params = grid._rows3[0]
    assert "differ" in params.note.value  # param is zero-copy, grad and optim are not
    params.preferred.value = "gpu"
    assert {grid.policy[t].preferred_location for t in ("param", "grad", "optim")} == {"gpu"}
    assert grid.policy["act"] == Advice()
    assert changes and changes[-1] == grid.policy
    grid.set_policy("gpu-first")
    assert grid.preset.value == "gpu-first" and grid.notes.value == ""


def test_advice_grid_saves_and_loads_json_and_explains_a_bad_file(tmp_path):
    grid = AdviceGrid("offload-optimizer")
    path = tmp_path / "mine.json"
    assert grid.save(path) == path
    grid.set_policy("um-default")
    assert grid.load(path) == presets["offload-optimizer"] and grid.preset.value == "offload-optimizer"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "advice": {"param": {"preferred_location": "moon"}}}))
    assert grid.load(bad) is None
    assert "not a valid policy" in grid.file_status.value and "moon" in grid.file_status.value
    assert grid.policy == presets["offload-optimizer"], "a bad file leaves the grid as it was"
    assert grid.load(tmp_path / "missing.json") is None and "cannot read" in grid.file_status.value


def _record(step):
    return StepRecord(step=step, wall_ms=1.0 + step, live_bytes={"param": 2**30}, cap_bytes=None,
                      gpu_capacity_bytes=2**31, backend="sim", resident_bytes={"param": 2**29},
                      gpu_page_faults=step, htod_bytes={"param": 2**20}, dtoh_bytes=None, telemetry="simulated")


def test_live_dashboard_redraws_at_most_four_times_a_second_and_always_draws_the_last_state():
    board = LiveDashboard(max_redraws_per_s=4)
    board.start()
    start = time.monotonic()
    for step in range(200):
        board.feed(_record(step))
        time.sleep(0.005)
    board.finish()
    elapsed = time.monotonic() - start
    assert board.redraws <= 4 * elapsed + 2
    assert board.redraws >= 2, "it draws while records arrive, not only at the end"
    fig = board.widget
    assert list(_trace(fig, "step time").x) == list(range(200))
    assert _trace(fig, "page faults").y[-1] == 199
    assert len(_trace(fig, "migrated to host").x) == 0, "unmeasured quantities are not drawn as zeros"
    with pytest.raises(ValueError):
        LiveDashboard(max_redraws_per_s=0)


def test_live_dashboard_thins_long_series_but_keeps_the_last_step():
    board = LiveDashboard(max_points=50)
    for step in range(1000):
        board.feed(_record(step))
    board.draw()
    x = list(_trace(board.widget, "step time").x)
    assert len(x) <= 51 and x[0] == 0 and x[-1] == 999
    board.feed(_record(1000))
    board.draw()
    assert list(_trace(board.widget, "step time").x)[-1] == 1000
    board.reset()
    assert len(_trace(board.widget, "step time").x) == 0


def test_dashboard_labels_live_bytes_when_residency_is_not_measured():
    board = LiveDashboard()
    record = _record(0)
    record.resident_bytes, record.telemetry = None, "unavailable: no CUPTI"
    board.feed(record)
    board.finish()
    assert "residency not measured" in board.widget.layout.annotations[0].text
    assert _trace(board.widget, "param").y[0] == 1.0  # live bytes, GiB


def test_parse_ratios():
    assert parse_ratios("0.8, 1.5x; none") == [0.8, 1.5, None]
    for bad in ("", "abc", "-1"):
        with pytest.raises(ValueError):
            parse_ratios(bad)


def test_compare_view_runs_policies_by_ratios_and_shows_figures_and_a_readable_table(tmp_path):
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[0.8, 1.5], steps=2,
                       out_dir=tmp_path)
    view.ratios.value = "oops"
    view.run(wait=True)
    assert "not a ratio" in view.status.value and view.table is None
    view.ratios.value = "0.8, 1.5"
    view.run(wait=True, timeout=120)
    assert "done: 4 runs" in view.status.value and view.progress.value == view.progress.max == 4
    table = readable(view.table)
    assert list(table["ratio"]) == ["0.80", "0.80", "1.50", "1.50"]
    assert all(s.endswith("x") for s in table["speed-up vs um-default"])
    assert table["speed-up vs um-default"][0] == "1.00x"
    assert all(v.endswith(" ms") and len(v[:-3].split(".")[-1]) == 2 for v in table["median ms"])
    bars, overlay = view.figures()
    assert {t.name for t in bars.data} == {"um-default", "gpu-first"} and len(overlay.data) == 4
    # small multiples: a panel per (model, ratio), a line per policy, each policy once in the legend
    assert [a.text for a in overlay.layout.annotations] == ["mlp @ 0.8x", "mlp @ 1.5x"]
    assert sorted(t.name for t in overlay.data if t.showlegend is not False) == ["gpu-first", "um-default"]
    assert overlay.layout.yaxis.rangemode == overlay.layout.yaxis2.rangemode == "tozero"
    assert list(table.columns).index("remote (read over the link)") == list(table.columns).index("migrated") + 1
    # on the simulator the uncertainty band is on by default: a column, error bars and the flip marker
    assert all(b.endswith("x") and "–" in b for b in table["speed-up band"])
    assert set(table["ranking flips in band"]) <= {"yes", ""}
    assert all(t.error_y.array is not None for t in bars.data) and "band" in bars.layout.title.text
    view.log_scale.value = True
    assert view.figures()[0].layout.yaxis.type == "log"
    assert len(view.output.outputs) == 3  # bars, overlay, table


def test_editing_one_paper_group_leaves_the_other_types_advice_alone():
    grid = AdviceGrid("offload-optimizer")
    grid.three_types.value = True
    results = grid._rows3[1]  # intermediate results
    results.prefetch.value = "to-gpu-before-use"
    assert grid.policy["act"].prefetch == "to-gpu-before-use"
    assert grid.policy["optim"] == presets["offload-optimizer"]["optim"], "optimizer offload kept"
    assert grid.policy["param"] == Advice() and grid.policy["grad"] == Advice()


def test_a_loaded_policy_with_a_presets_name_but_other_advice_is_not_recorded_as_that_preset(tmp_path):
    from um_lab.policy import Policy

    fake = Policy("gpu-first", {"param": Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))})
    path = fake.save(tmp_path / "fake.json")
    grid = AdviceGrid()
    grid.load(path)
    assert grid.preset.value == "custom" and grid.policy.name == "gpu-first (edited)"
    assert grid.policy["param"].preferred_location == "cpu"
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    assert grid.load(binary) is None and "not a valid policy" in grid.file_status.value


def test_a_second_run_waits_until_the_panel_has_shown_the_first_ones_end(tmp_path, monkeypatch):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=2, warmup_steps=0, out_dir=tmp_path)
    original = lab.static_figure

    def slow_static_figure(*args, **kwargs):
        time.sleep(1.0)  # a big run's static figure takes a while to build
        return original(*args, **kwargs)

    monkeypatch.setattr(lab, "static_figure", slow_static_figure)
    first = lab.run()
    _wait(lambda: first.done)
    assert lab.run() is None and "already going" in lab.status.value
    assert lab.wait(30) and lab.state == "complete"
    second = lab.run(wait=True, timeout=60)
    assert second is not None and second is not first and lab.state == "complete"


def test_a_run_refused_at_start_leaves_the_last_run_on_show(tmp_path):
    if cuda_available():
        pytest.skip("this machine has a GPU: the no-GPU refusal cannot happen")  # pragma: no cover
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=3, warmup_steps=0, out_dir=tmp_path)
    lab.run(wait=True, timeout=60)
    shown = lab.result.path
    lab.workload.backend.value = "cuda"
    assert lab.run() is None and lab.state == "error"
    assert lab.result.path == shown and lab.static_output.outputs
    assert len(_trace(lab.dashboard.widget, "step time").x) == 3


def test_a_failure_while_showing_the_end_never_leaves_the_panel_stuck(tmp_path, monkeypatch):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=2, warmup_steps=0, out_dir=tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("figure trouble")

    monkeypatch.setattr(lab, "static_figure", broken)
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete" and "figure trouble" in lab.status.value
    assert lab.run_button.disabled is False and lab.stop_button.disabled is True


def test_live_dashboard_incremental_thinning_keeps_a_regular_grid_and_the_newest_step():
    import random

    rng = random.Random(0)
    board = LiveDashboard(max_points=7)
    fed = 0
    for _ in range(60):
        for _ in range(rng.randrange(0, 40)):
            board.feed(_record(fed))
            fed += 1
        board.draw()
        x = [int(v) for v in _trace(board.widget, "step time").x]
        if not fed:
            assert x == []
            continue
        assert x[-1] == fed - 1, "the newest step is always drawn"
        body = x[:-1] if len(x) > 1 and (x[-1] - x[-2]) % board._stride else x
        assert body == list(range(0, body[-1] + 1, board._stride)), "every stride-th step from 0, none twice"
        assert len(x) <= board.max_points + 1


def test_compare_view_stop_ends_after_the_current_run(tmp_path):
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first", "prefetch-all", "zero-copy-params"],
                       ratios=[0.8, 1.5, 2.0], steps=200, out_dir=tmp_path)
    view.run()
    _wait(lambda: view.progress.value >= 1, timeout=120)
    view.stop_button.click()
    assert view.wait(120)
    assert "stopped after" in view.status.value
    done = view.progress.value
    # the runs made before Stop are shown (never the previous comparison's), as their table
    assert view.table is not None and 1 <= len(view.table) <= done + 1 and len(view.output.outputs) == 3
    assert 1 <= done < view.progress.max == 12
    runs = list(tmp_path.glob("compare-*/*/status.json"))
    assert len(runs) in (done, done + 1)  # the run in progress when Stop was pressed ends too
    assert view.run_button.disabled is False and view.stop_button.disabled is True


def test_compare_views_stop_ends_the_run_in_progress_after_its_current_step(tmp_path):
    """A long run is not waited for: Stop ends it after the step in progress (status stopped, in the table)."""
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.5], steps=100_000,
                       out_dir=tmp_path)
    view.run()
    _wait(lambda: any(tmp_path.glob("compare-*/*/records.jsonl")), timeout=120)
    started = time.monotonic()
    view.stop()
    assert view.wait(60) and time.monotonic() - started < 30
    statuses = [json.loads(p.read_text())["status"] for p in tmp_path.glob("compare-*/*/status.json")]
    assert "stopped" in statuses and view.table is not None and "stopped" in set(view.table["status"])


# ------------------------------------------------------------ a third backend: no widget edits


def test_a_registered_backend_is_in_the_lab_dropdown_and_runs_from_the_panel(third, tmp_path):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, policy="gpu-first", backend="sim", steps=3, warmup_steps=1,
              out_dir=tmp_path)
    assert list(lab.workload.backend.options) == ["auto", "cuda", "sim", "third"]
    assert lab.workload.capacity_box.layout.display is None  # the simulator's capacity controls
    lab.workload.backend.value = "third"
    assert lab.workload.resolved_backend == "third" and not lab.workload.simulates_capacity
    assert lab.workload.capacity_box.layout.display == "none"  # it does not simulate capacity: no controls
    assert lab.workload.cap_note.value == ""  # available, and no limit it puts on a run
    assert lab.workload.wait_estimate() is not None and "ratio" not in lab.workload.estimate.value
    spec = lab.spec()
    assert spec.backend == "third" and spec.oversubscription_ratio is None and spec.capacity_bytes is None
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete", lab.status.value
    assert "on third" in lab.status.value and [r.backend for r in lab.records] == ["third"] * 4
    assert lab.result.environment["device"] == {"name": "third device"}
    assert len(_trace(lab.dashboard.widget, "step time").x) == 4
    assert Lab(backend="third", out_dir=tmp_path).workload.backend.value == "third"


def test_the_lab_asks_a_backend_whether_it_can_run_and_what_options_it_takes(third, tmp_path):
    from um_lab.backend import register_backend, unregister_backend
    from um_lab.errors import UmLabError

    built = []

    class Asleep(third.ThirdBackend):
        name = "asleep"

        def __init__(self, telemetry="auto") -> None:
            super().__init__()
            built.append(telemetry)

        @classmethod
        def check_available(cls) -> None:
            raise UmLabError("the asleep card is asleep")

    register_backend("asleep", Asleep)
    try:
        lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="asleep", telemetry=False, out_dir=tmp_path / "runs")
        assert "asleep: the asleep card is asleep" in lab.workload.cap_note.value
        assert lab.run() is None and lab.state == "error" and "asleep card" in lab.status.value
        assert built == [] and not (tmp_path / "runs").exists()  # refused before it was built
        Asleep.check_available = classmethod(lambda cls: None)  # type: ignore[method-assign]
        lab.workload.backend.value = "sim"
        lab.workload.backend.value = "asleep"
        assert lab.workload.cap_note.value == ""
        lab.run(wait=True, timeout=60)
        assert lab.state == "complete" and built == [False]  # the lab's telemetry: it takes that option
    finally:
        unregister_backend("asleep")
    with pytest.raises(ValueError, match="unknown backend 'asleep'; valid: cuda, sim, third, auto"):
        Lab(backend="asleep")


def test_a_registered_backend_is_in_the_compare_dropdown_without_the_simulators_band(third, tmp_path):
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[None], steps=2,
                       out_dir=tmp_path)
    assert set(view.backend.options) == {"auto", "cuda", "sim", "third"}
    assert view.band.disabled is False and view.band.value  # the simulator reports a band
    view.backend.value = "third"
    assert view.band.disabled is True and "not on this backend" in view.band.description
    view.run(wait=True, timeout=120)
    assert "done: 2 runs" in view.status.value, view.status.value
    assert (view.table["backend"] == "third").all() and "band_fast_ms" not in view.table
    table = readable(view.table)
    assert list(table["ratio"]) == ["none", "none"] and "speed-up band" not in table
    assert list(table["speed-up vs um-default"]) == ["1.00x", "2.33x"]  # 10.5 ms / 4.5 ms
    assert "NaN" not in table.to_string() and "nan" not in table.to_string()
    view.backend.value = "sim"
    assert view.band.disabled is False
    with pytest.raises(ValueError, match="unknown backend 'tpu'; valid: cuda, sim, third, auto"):
        CompareView(backend="tpu")


def test_one_dashboard_per_run_and_a_model_switch_clears_the_last_models_plots(tmp_path):
    from um_lab.widgets.figures import NO_DATA_YET

    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=3, warmup_steps=0, out_dir=tmp_path)
    notes = lambda: [a for a in lab.dashboard.widget.layout.annotations[5:]]  # noqa: E731
    assert all(n.visible and n.text == NO_DATA_YET for n in notes()), "an empty panel says so"
    assert lab.dashboard.widget.layout.yaxis2.range == (0, 1)  # not plotly's negative default
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete" and lab.static_output.outputs
    assert lab._live.layout.display == "none", "the static figure replaces the live one: one dashboard"
    assert not any(n.visible for n in notes()[:3])
    assert lab.dashboard.widget.layout.yaxis2.autorange is True
    assert lab.dashboard.widget.layout.yaxis2.rangemode == "tozero"
    path = lab.active.path
    lab.workload.model.value = "gpt2-small"
    assert lab.static_output.outputs == () and lab._live.layout.display is None
    assert lab.dashboard.count == 0 and len(_trace(lab.dashboard.widget, "step time").x) == 0
    assert all(n.visible and n.text == NO_DATA_YET for n in notes())
    assert "gpt2-small" in lab.status.value and str(path) in lab.status.value  # the mlp run stays on disk
    assert lab.result.path == path
    lab.workload.model.value = "mlp"
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete" and len(_trace(lab.dashboard.widget, "step time").x) == 3
    lab.workload.wait_estimate()


def test_a_model_switch_during_a_run_keeps_that_runs_dashboard(tmp_path):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=500, warmup_steps=0, pace_s=0.02,
              out_dir=tmp_path)
    lab.run()
    _wait(lambda: len(_trace(lab.dashboard.widget, "step time").x) >= 2)
    lab.workload.model.value = "gpt2-small"
    assert lab.dashboard.count >= 2, "the running run's plots stay"
    lab.stop()
    assert lab.wait(30) and lab.state == "stopped" and lab.static_output.outputs
    lab.workload.wait_estimate()


def test_compare_view_lists_the_picked_models_first_so_they_are_in_view():
    view = CompareView(models={"gpt2-small": TINY_GPT2, "mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.5])
    assert list(view.models.options[:2]) == ["gpt2-small", "mlp"]
    assert list(view.models.value) == ["gpt2-small", "mlp"] and view.models.rows >= 2
    assert len(set(view.models.options)) == len(view.models.options)


def test_the_inside_a_step_tab_simulates_the_panels_workload_when_opened(tmp_path):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", ratio=1.5, out_dir=tmp_path)
    assert lab.tabs.titles == ("per step", "inside a step") and lab.timeline.timelines == (None, None)  # not yet
    lab.tabs.selected_index = 1
    a, b = lab.timeline.timelines
    assert a.model == "mlp" and a.policy != b.policy and a.wall_us > 0 and a.capacity_bytes > 0
    assert not any(tmp_path.iterdir())  # the timeline writes no run folder


def test_the_panel_runs_in_the_precision_and_recompute_it_shows(tmp_path):
    from um_lab.models import get_model
    from um_lab.sim import SimBackend
    from um_lab.training import with_training

    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", ratio=2.0, steps=1, warmup_steps=0,
              out_dir=tmp_path)
    lab.workload.wait_estimate()
    lab.workload.precision.value = "bf16"
    lab.workload.recompute.value = "every-layer"
    lab.workload.wait_estimate()
    expected = SimBackend().prepare(with_training(get_model("mlp", **TINY_MLP), "bf16", "every-layer"))
    assert lab.workload.last_footprint == expected.footprint_bytes
    spec = lab.spec()
    assert spec.precision == "bf16" and spec.recompute == "every-layer"
    lab.run(wait=True, timeout=60)
    assert lab.state == "complete"
    assert json.loads(next(tmp_path.rglob("spec.json")).read_text())["precision"] == "bf16"


def test_the_estimate_table_shows_native_pytorchs_peak_beside_um_labs_pools():
    from um_lab.sizing import estimate_memory
    from widgets.workload import estimate_html

    traced = estimate_memory("mlp", width=64, depth=2, batch_size=8)
    html = estimate_html(traced, 1 << 30, "h200")
    assert "native peak" in html and "total" in html
    assert "native peak" not in estimate_html(estimate_memory("mlp", width=64, depth=2, batch_size=8,
                                                              use_sim_trace=False), 1 << 30, "h200")


def test_switching_models_keeps_each_models_sizes_and_is_locked_during_a_run(tmp_path):
    """A teacher's small sizes come back when the model comes back; the model cannot change under a run."""
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=400, warmup_steps=0, pace_s=0.01,
              out_dir=tmp_path)
    lab.workload.model.value = "gpt2-small"
    lab.workload.knobs["n_layer"].value = 2
    lab.workload.model.value = "mlp"
    assert lab.workload.model_kwargs() == {**model_knobs("mlp"), **TINY_MLP}
    lab.workload.model.value = "gpt2-small"
    assert lab.workload.model_kwargs()["n_layer"] == 2
    lab.workload.model.value = "mlp"
    lab.run()
    assert lab.workload.model.disabled
    lab.stop()
    assert lab.wait(60)
    assert not lab.workload.model.disabled


def test_an_open_step_timeline_follows_the_panels_settings_and_policy(tmp_path):
    lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", ratio=1.5, out_dir=tmp_path)
    lab.tabs.selected_index = 1  # the timeline tab: simulated now
    first = lab.timeline.timelines[0]
    assert first is not None and first.policy == "um-default"
    lab.workload.capacity_value.value = 3.0  # a setting changes: the open timeline follows at once
    assert lab.timeline.timelines[0] is not None and lab.timeline.timelines[0].capacity_bytes < first.capacity_bytes
    lab.workload.capacity_value.value = -1.0  # refused: the error, and no figure of the old settings
    assert lab.timeline.figure is None and "ratio" in lab.timeline.status.value
    lab.workload.capacity_value.value = 1.5
    lab.advice.preset.value = "gpu-first"  # the panel's policy becomes policy A
    assert lab.timeline.policy_a.value == "gpu-first" and lab.timeline.timelines[0].policy == "gpu-first"
