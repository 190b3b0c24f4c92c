"""bench/allocator_overhead.py's alternating mode: the row it builds from in-process pairs (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

import allocator_overhead  # noqa: E402


def _run(native: list[float], um_lab: list[float]) -> dict:
    blocks = {"native": [{"median_ms": n, "median_gpu_ms": n - 0.1} for n in native],
              "um_lab": [{"median_ms": u, "median_gpu_ms": u - 0.1} for u in um_lab]}
    pairs = [{"wall": u / n, "gpu": (u - 0.1) / (n - 0.1)} for n, u in zip(native, um_lab, strict=True)]
    return {"model": "mlp", "blocks": blocks, "pair_ratios": pairs}


def test_the_alternating_row_pairs_blocks_inside_each_process() -> None:
    """Two processes 10% apart in speed: the ratio comes from the pairs (1.01), not from mixing them, while
    the block medians show the spread between processes."""
    fast = _run([9.0, 9.0, 9.0], [9.09, 9.09, 9.09])
    slow = _run([11.0, 11.0, 11.0], [11.11, 11.11, 11.0])
    row = allocator_overhead.alternating_row("mlp", [fast, slow])
    assert row["um_lab_over_native"] == pytest.approx(1.01, abs=1e-4)
    assert row["pairs"] == 6 and row["pair_ratio_range"] == [1.0, 1.01]
    assert row["per_process_over_native"] == [1.01, 1.01]
    assert row["native_ms"] == pytest.approx(10.0) and row["um_lab_ms"] == pytest.approx(10.045)
    assert 1.0 < row["um_lab_gpu_over_native"] < 1.02


@pytest.mark.parametrize("modes", [["um_lab", "native"], ["native", "naive"], ["native", "um_lab", "um_lab+no_staging"],
                                   ["native", "um_lab+native_persistent"],
                                   ["native", "um_lab+no_gradcheck"]])
def test_alternating_takes_native_and_one_um_lab_mode_that_can_act_after_placing(modes, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["allocator_overhead.py", "--alternate", "2", "--modes", *modes])
    with pytest.raises(SystemExit) as info:
        allocator_overhead.main()
    assert info.value.code == 2 and "--alternate" in capsys.readouterr().err


def test_backward_runs_on_the_caller_unless_a_variant_asks_for_autograds_thread() -> None:
    assert allocator_overhead.backward_thread_of([]) == "caller"
    assert allocator_overhead.backward_thread_of(["caller", "no_timer"]) == "caller"
    assert allocator_overhead.backward_thread_of(["worker"]) == "worker"
