"""The comparison and residency figures carry the data they are given."""

import pandas as pd
import pytest

pytest.importorskip("plotly")

from um_lab.types import StepRecord  # noqa: E402
from widgets.figures import comparison_figure, residency_figure  # noqa: E402


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


def test_unmeasured_residency_is_a_gap_with_the_reason_not_zeros():
    live = {"param": 2**30}
    recs = [StepRecord(step=0, wall_ms=1.0, live_bytes=live, cap_bytes=None, gpu_capacity_bytes=2**34,
                       resident_bytes={"param": 2**29}, telemetry="cupti"),
            StepRecord(step=1, wall_ms=1.0, live_bytes=live, cap_bytes=None, gpu_capacity_bytes=2**34,
                       telemetry="unavailable: cupti-python is not importable")]
    fig = residency_figure(recs, "resident_bytes")
    assert list(fig.data[0].y) == [0.5, None]
    notes = [a.text for a in fig.layout.annotations]
    assert len(notes) == 1 and "1 of 2 steps" in notes[0] and "cupti-python is not importable" in notes[0]
    assert not residency_figure(recs).layout.annotations  # live bytes are always known
