"""Plotly figures over the runner's tables and records (the UI layer; plotly is imported lazily)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from um_lab.types import DATA_TYPES, StepRecord


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as e:
        raise ImportError("figures need plotly: pip install 'um_lab[notebook]'") from e
    return go


def comparison_figure(table: pd.DataFrame, metric: str = "median_ms") -> Any:
    """Grouped bars of ``metric`` per policy, one group per (model, ratio), from ``runner.compare``."""
    go = _plotly()
    missing = {"model", "policy", "ratio", metric} - set(table.columns)
    if missing:
        raise ValueError(f"table lacks columns {sorted(missing)}; pass the DataFrame from runner.compare")
    groups = [f"{m} @ {'card' if pd.isna(r) else f'{r:g}x'}" for m, r in zip(table["model"], table["ratio"],
                                                                              strict=True)]
    frame = table.assign(group=groups)
    fig = go.Figure()
    for policy, rows in frame.groupby("policy", sort=False):
        fig.add_bar(name=str(policy), x=rows["group"], y=rows[metric])
    fig.update_layout(barmode="group", xaxis_title="model @ oversubscription ratio",
                      yaxis_title=metric.replace("_", " "), legend_title="policy",
                      title=f"{metric.replace('_', ' ')} by policy")
    return fig


def residency_figure(records: Iterable[StepRecord], field: str = "live_bytes") -> Any:
    """Stacked area of a per-type byte field (``live_bytes`` or ``resident_bytes``) over steps.

    Steps whose field was not measured (``None``: telemetry unavailable) are left empty and shaded,
    never drawn as zeros or bridged, and an annotation gives the records' ``telemetry`` reason.
    """
    go = _plotly()
    import plotly.colors

    records = list(records)
    fig = go.Figure()
    palette = plotly.colors.DEFAULT_PLOTLY_COLORS
    runs: list[list[StepRecord]] = []  # consecutive measured steps; each run is its own stack
    for r in records:
        if getattr(r, field) is None:
            runs.append([])
        elif runs and runs[-1]:
            runs[-1].append(r)
        else:
            runs.append([r])
    runs = [run for run in runs if run]
    for k, run in enumerate(runs):
        for i, dtype in enumerate(DATA_TYPES):
            fig.add_scatter(x=[r.step for r in run], y=[getattr(r, field).get(dtype.value, 0) / 2**30 for r in run],
                            name=dtype.value, legendgroup=dtype.value, showlegend=k == 0,
                            stackgroup=f"run{k}", mode="lines", line={"color": palette[i % len(palette)]})
    fig.update_layout(xaxis_title="step", yaxis_title=f"{field.replace('_', ' ')} (GiB)",
                      legend_title="data type")
    unmeasured = [r for r in records if getattr(r, field) is None]
    if unmeasured:
        for r in unmeasured:
            fig.add_vrect(x0=r.step - 0.5, x1=r.step + 0.5, fillcolor="lightgrey", opacity=0.4, line_width=0)
        reasons = sorted({r.telemetry for r in unmeasured})
        fig.add_annotation(text=f"{field.replace('_', ' ')} not measured in {len(unmeasured)} of {len(records)} "
                                f"steps (shaded): {'; '.join(reasons)}",
                           xref="paper", yref="paper", x=0, y=1.08, showarrow=False, align="left")
    return fig
