"""The kernel-gap diagnostic's timeline arithmetic (bench/diagnostics/kernel_gaps.py) on made-up traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench" / "diagnostics"))

from kernel_gaps import block_summary, compare_blocks, step_summary, step_timelines, union_us  # noqa: E402

MARK = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def _step(t0: float, gaps: list[float], durs: list[float], names: list[str]) -> list[tuple[str, float, float]]:
    events = [(MARK, t0, t0 + 1.0)]
    t = t0 + 1.0
    for gap, dur, name in zip(gaps, durs, names, strict=True):
        events.append((name, t + gap, t + gap + dur))
        t += gap + dur
    return events


def test_union_merges_overlaps_and_keeps_holes() -> None:
    assert union_us([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_us([]) == 0


def test_steps_are_cut_at_markers_and_events_before_the_first_are_dropped() -> None:
    trace = [("k", -5.0, -4.0)] + _step(0, [1, 1], [2, 2], ["a", "b"]) + _step(100, [3, 0], [2, 2], ["a", "b"])
    steps = step_timelines(list(reversed(trace)))
    assert [len(s) for s in steps] == [3, 3]
    assert all(MARK in s[0][0] for s in steps)


def test_step_summary_splits_span_into_busy_idle_and_lead() -> None:
    step = _step(0, [4, 1, 2], [10, 5, 3], ["a", "Memcpy DtoH (Device -> Pageable)", "b"])
    s = step_summary(step)
    assert s["span"] == pytest.approx(4 + 10 + 1 + 5 + 2 + 3)
    assert s["busy"] == pytest.approx(18) and s["idle"] == pytest.approx(7) and s["lead"] == pytest.approx(4)
    # copies are not kernel positions, but the gap after a copy is measured from its end
    assert s["kernels"] == [("a", 4, 10), ("b", 2, 3)]


def test_pairs_compare_kernel_positions_when_sequences_match() -> None:
    names = ["a", "b", "c"]
    native = block_summary([_step(i * 100, [1, 1, 1], [5, 5, 5], names) for i in range(3)])
    um_lab = block_summary([_step(i * 100, [1, 4, 1], [5, 5, 6], names) for i in range(3)])
    d = compare_blocks(native, um_lab)
    assert d["same_kernels"]
    assert d["d_gap"] == [0, 3, 0] and d["d_dur"] == [0, 0, 1]
    assert d["d_span"] == pytest.approx(4) and d["d_idle"] == pytest.approx(3) and d["d_busy"] == pytest.approx(1)
    other = block_summary([_step(0, [1, 1], [5, 5], ["a", "x"])])
    assert not compare_blocks(native, other)["same_kernels"]
