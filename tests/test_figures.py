"""The comparison and residency figures carry the data they are given."""

import pandas as pd
import pytest

pytest.importorskip("plotly")

from um_lab.types import StepRecord  # noqa: E402
from um_lab.widgets.figures import comparison_figure, residency_figure  # noqa: E402


def test_comparison_figure_has_one_bar_series_per_policy():
    table = pd.DataFrame({
        "model": ["mlp"] * 4, "policy": ["um-default", "gpu-first"] * 2,
        "ratio": [0.8, 0.8, 1.5, 1.5], "median_ms": [10.0, 9.0, 30.0, 20.0],
    })
    fig = comparison_figure(table)
    assert [t.name for t in fig.data] == ["um-default", "gpu-first"]
    assert list(fig.data[1].y) == [9.0, 20.0]
    assert list(fig.data[0].x) == ["mlp @ 0.8x", "mlp @ 1.5x"]
    with pytest.raises(ValueError, match="lacks columns"):
        comparison_figure(table.drop(columns=["ratio"]))


def test_residency_figure_stacks_every_data_type():
    recs = [StepRecord(step=i, wall_ms=1.0, live_bytes={"param": 2**30 * (i + 1), "act": 2**29},
                       cap_bytes=None, gpu_capacity_bytes=2**34) for i in range(3)]
    fig = residency_figure(recs)
    assert [t.name for t in fig.data] == ["param", "grad", "optim", "act", "input"]
    assert list(fig.data[0].y) == [1.0, 2.0, 3.0] and list(fig.data[3].y) == [0.5] * 3


def test_unmeasured_residency_is_a_shaded_gap_with_the_reason_not_zeros():
    live = {"param": 2**30}

    def record(step, resident):
        status = "cupti" if resident is not None else "unavailable: cupti-python is not importable"
        return StepRecord(step=step, wall_ms=1.0, live_bytes=live, cap_bytes=None, gpu_capacity_bytes=2**34,
                          resident_bytes=resident, telemetry=status)

    recs = [record(0, {"param": 2**29}), record(1, {"param": 2**30}), record(2, None), record(3, {"param": 2**28})]
    fig = residency_figure(recs, "resident_bytes")
    param = [t for t in fig.data if t.name == "param"]
    assert [list(t.x) for t in param] == [[0, 1], [3]]  # two stacks: nothing drawn across step 2
    assert [list(t.y) for t in param] == [[0.5, 1.0], [0.25]]
    assert len({t.stackgroup for t in fig.data}) == 2 and sum(t.showlegend for t in fig.data) == 5
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(1.5, 2.5)]
    notes = [a.text for a in fig.layout.annotations]
    assert len(notes) == 1 and "1 of 4 steps" in notes[0] and "cupti-python is not importable" in notes[0]
    plain = residency_figure(recs)  # live bytes are always known
    assert not plain.layout.annotations and not plain.layout.shapes and len(plain.data) == 5
