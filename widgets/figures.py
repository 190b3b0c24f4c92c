"""Plotly figures over the runner's tables and records (the UI layer; plotly is imported lazily)."""

from __future__ import annotations

import atexit
import html
import json
import os
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from um_lab.types import DATA_TYPES, StepRecord
from um_lab.widgets._html import plotly_text


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as e:
        raise ImportError("figures need plotly: pip install 'um_lab[notebook]'") from e
    keep_plots_in_exports()
    return go


def static_images_available() -> bool:
    """True when plotly can draw PNGs here: kaleido is installed and finds a Chrome or Chromium already on
    this machine (it is never downloaded). ``UM_LAB_STATIC_IMAGES=0`` turns the images off."""
    if os.environ.get("UM_LAB_STATIC_IMAGES", "1") == "0":
        return False
    try:
        import kaleido  # noqa: F401
        from choreographer.browsers.chromium import Chromium

        return Chromium.find_browser(skip_local=False) is not None
    except Exception:  # not installed, or a choreographer without find_browser: no images
        return False


def _export_renderer() -> Any:
    """A plotly renderer for notebooks that are shared: the plotly JSON (what JupyterLab draws) plus a PNG
    (what GitHub and nbconvert show: they do not run plotly.js). It falls back to inlined HTML when the
    PNG cannot be drawn, so showing a figure never fails for the image's sake."""
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer

    class ExportRenderer(MimetypeRenderer):
        def __init__(self) -> None:
            self.images = True  # False after the first failed PNG: HTML from then on

        def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, Any]:
            bundle = dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig_dict))
            if self.images:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)  # "kopts ignored with a server"
                        _start_image_server()
                        bundle.update(pio.renderers["png"].to_mimebundle(fig_dict))
                    return bundle
                except Exception:
                    self.images = False
            bundle.update(pio.renderers["notebook"].to_mimebundle(fig_dict))
            return bundle

        def activate(self) -> None:
            pio.renderers["notebook"].activate()  # the HTML fallback's plotly.js, loaded once

    return ExportRenderer()


_EXPORT_RENDERER = "um_lab_export"
_image_server: list[bool] = []  # [True] once kaleido's browser runs in this process


def _start_image_server() -> None:
    """Start kaleido's browser once per process (first PNG ~2 s, then ~0.2 s each); stopped at exit."""
    if _image_server:
        return
    import kaleido

    kaleido.start_sync_server(n=1, timeout=60, silence_warnings=True)
    atexit.register(kaleido.stop_sync_server)
    _image_server.append(True)


def keep_plots_in_exports() -> str:
    """Make figures survive a saved notebook; returns what they carry now (``"png"``, ``"html"`` or
    ``"unchanged"``).

    In a Jupyter kernel whose plotly renderer is the bare mimetype (JupyterLab, nbclient), figures then
    carry the plotly JSON plus a PNG drawn by kaleido (``"png"``: GitHub and nbconvert HTML show it; needs
    kaleido and a Chrome or Chromium on this machine, see :func:`static_images_available`) or, without
    those, HTML with plotly.js inlined (``"html"``: nbconvert HTML keeps the plot, GitHub does not run it).
    Other renderer choices (VS Code, Colab, a user's own) are left alone.
    """
    import plotly.io as pio

    current = pio.renderers.default
    if current == _EXPORT_RENDERER:
        return "png" if pio.renderers[_EXPORT_RENDERER].images else "html"
    if current not in ("plotly_mimetype", "plotly_mimetype+notebook"):
        return "unchanged"
    if not static_images_available():
        pio.renderers.default = "plotly_mimetype+notebook"
        return "html"
    pio.renderers[_EXPORT_RENDERER] = _export_renderer()
    pio.renderers.default = _EXPORT_RENDERER
    return "png"


def _grouped(table: pd.DataFrame, needed: set[str]) -> pd.DataFrame:
    """``table`` with a ``group`` column ``"<model> @ <ratio>x"`` (``card`` for no ratio), checked for columns."""
    missing = {"model", "policy", "ratio", *needed} - set(table.columns)
    if missing:
        raise ValueError(f"table lacks columns {sorted(missing)}; pass the DataFrame from um_lab.sweep.compare")
    # plotly renders tags in category labels: a model's name is shown as text
    groups = [plotly_text(f"{m} @ {'card' if pd.isna(r) else f'{r:g}x'}")
              for m, r in zip(table["model"], table["ratio"], strict=True)]
    return table.assign(group=groups)


def comparison_figure(table: pd.DataFrame, metric: str = "median_ms") -> Any:
    """Grouped bars of ``metric`` per policy, one group per (model, ratio), from ``um_lab.sweep.compare``."""
    go = _plotly()
    frame = _grouped(table, {metric})
    fig = go.Figure()
    for policy, rows in frame.groupby("policy", sort=False):
        fig.add_bar(name=plotly_text(policy), x=rows["group"], y=rows[metric])
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
                                f"steps (shaded): {plotly_text('; '.join(reasons))}",
                           xref="paper", yref="paper", x=0, y=1.08, showarrow=False, align="left")
    return fig


def display_bundle(fig: Any, text: str = "") -> dict[str, Any]:
    """A ``display_data`` output holding ``fig`` as plotly JSON (what JupyterLab draws), for Output widgets:
    built here rather than through IPython's formatters, so it is the same inside and outside a kernel."""
    import plotly.io as pio

    data = json.loads(pio.to_json(fig, validate=False))
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {"data": data.get("data", []),
                                                         "layout": data.get("layout", {}), "config": {}},
                     "text/plain": text or f"<plotly figure: {html.unescape(fig.layout.title.text or 'untitled')}>"}}


# ------------------------------------------------------------------------------------ dashboard

#: the dashboard's trace names, in the order :func:`dashboard_figure` adds them
DASHBOARD_TRACES: tuple[str, ...] = (*[t.value for t in DATA_TYPES], "GPU capacity", "step time",
                                     "oversubscription", "page faults", "migrated to GPU", "migrated to host",
                                     "remote access")
_GIB = 2**30
_MIB = 2**20


def residency_source(records: Iterable[StepRecord]) -> str:
    """What the dashboard's residency panel shows: ``simulated``, ``measured`` or ``live`` (not measured)."""
    records = list(records)
    if not records:
        return "pending"
    last = records[-1]
    if last.resident_bytes is None:
        return "live"
    return "simulated" if last.telemetry == "simulated" else "measured"


_RESIDENCY_TITLES = {
    "pending": "GPU-resident bytes per data type (waiting for the first step)",
    "simulated": "GPU-resident bytes per data type (simulated)",
    "measured": "GPU-resident bytes per data type (measured, CUPTI)",
    "live": "live managed bytes per data type (residency not measured)",
}


_TYPE_NAMES = tuple(t.value for t in DATA_TYPES)
_NAN = float("nan")


def _sum_mib(values: dict[str, int] | None) -> float:
    return _NAN if values is None else sum(values.values()) / _MIB


def dashboard_row(r: StepRecord) -> tuple[float, ...]:
    """One record as the dashboard's numbers: step, then one value per :data:`DASHBOARD_TRACES` entry
    (NaN where the record did not measure it). Cheap: the live dashboard converts thousands a second."""
    per_type = r.resident_bytes if r.resident_bytes is not None else r.live_bytes
    get = per_type.get
    faults = r.gpu_page_faults
    return (r.step, *[get(name, 0) / _GIB for name in _TYPE_NAMES], r.gpu_capacity_bytes / _GIB, r.wall_ms,
            r.oversubscription_ratio, _NAN if faults is None else faults, _sum_mib(r.htod_bytes),
            _sum_mib(r.dtoh_bytes), _NAN if r.remote_bytes is None else r.remote_bytes / _MIB)


def series_from_rows(rows: np.ndarray, max_points: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{trace name: (steps, values)}`` from :func:`dashboard_row` rows; unmeasured (NaN) points are left
    out, and a series longer than ``max_points`` is thinned to every k-th point (its last point kept)."""
    rows = np.asarray(rows, dtype=float).reshape(-1, len(DASHBOARD_TRACES) + 1)
    out = {}
    for i, name in enumerate(DASHBOARD_TRACES, start=1):
        keep = ~np.isnan(rows[:, i])
        x, y = rows[keep, 0], rows[keep, i]
        if max_points is not None and len(x) > max_points:
            stride = -(-len(x) // max_points)
            index = np.arange(0, len(x), stride)
            if index[-1] != len(x) - 1:
                index = np.append(index, len(x) - 1)
            x, y = x[index], y[index]
        out[name] = (x, y)
    return out


def dashboard_figure(records: Iterable[StepRecord] = (), title: str = "", max_points: int | None = None) -> Any:
    """The run dashboard as a static figure: residency per type (stacked) against the GPU capacity, step
    time, oversubscription ratio, page faults, and migrated / remote bytes per step.

    ``records`` are streamed (a run's ``records()`` from disk is fine); with ``max_points`` longer series
    are thinned to every k-th step (the last kept). The live dashboard
    (:class:`um_lab.widgets.LiveDashboard`) is this figure in a ``FigureWidget``.
    """
    rows, last = [], None
    for last in records:
        rows.append(dashboard_row(last))
    return dashboard_figure_from_rows(np.asarray(rows, dtype=float), [last] if last is not None else [], title,
                                      max_points)


def dashboard_figure_from_rows(rows: np.ndarray, last: list[StepRecord], title: str = "",
                               max_points: int | None = None) -> Any:
    """:func:`dashboard_figure` from :func:`dashboard_row` rows; ``last`` (the newest record, or none) names
    the residency source."""
    _plotly()  # a clear ImportError when plotly is missing
    import plotly.colors
    from plotly.subplots import make_subplots

    source = residency_source(last)
    fig = make_subplots(rows=3, cols=2, specs=[[{"colspan": 2}, None], [{}, {}], [{}, {}]],
                        vertical_spacing=0.11, horizontal_spacing=0.1,
                        subplot_titles=(_RESIDENCY_TITLES[source], "step time (ms)",
                                        "oversubscription (live / capacity)", "GPU page faults per step",
                                        "migrated and remote MiB per step"))
    series = series_from_rows(rows, max_points)
    palette = plotly.colors.DEFAULT_PLOTLY_COLORS
    for i, dtype in enumerate(DATA_TYPES):
        x, y = series[dtype.value]
        fig.add_scatter(x=x, y=y, name=dtype.value, stackgroup="residency", mode="lines",
                        line={"color": palette[i % len(palette)]}, legendgroup="types", row=1, col=1)
    x, y = series["GPU capacity"]
    fig.add_scatter(x=x, y=y, name="GPU capacity", mode="lines", line={"color": "black", "dash": "dash"},
                    row=1, col=1)
    for name, row, col, colour in (("step time", 2, 1, "#1f77b4"), ("oversubscription", 2, 2, "#9467bd"),
                                   ("page faults", 3, 1, "#d62728"), ("migrated to GPU", 3, 2, "#2ca02c"),
                                   ("migrated to host", 3, 2, "#ff7f0e"), ("remote access", 3, 2, "#8c564b")):
        x, y = series[name]
        fig.add_scatter(x=x, y=y, name=name, mode="lines+markers", marker={"size": 4},
                        line={"color": colour}, row=row, col=col)
    fig.update_yaxes(title_text="GiB", row=1, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=2)
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dot"}, row=2, col=2)
    fig.update_layout(height=720, title=plotly_text(title) or None, legend={"orientation": "v"},
                      margin={"l": 60, "r": 20, "t": 70 if title else 40, "b": 40})
    return fig


def residency_title(records: Iterable[StepRecord]) -> str:
    """The residency panel's title for these records (which source the bytes come from)."""
    return _RESIDENCY_TITLES[residency_source(records)]


# ------------------------------------------------------------------------------------ comparison


def speedup_figure(table: pd.DataFrame, baseline: str = "um-default", log_scale: bool = False) -> Any:
    """Median step time per policy, grouped by (model, ratio), each bar labelled with its speed-up against
    ``baseline`` (from :func:`um_lab.sweep.compare`). ``log_scale`` puts step time on a log axis."""
    go = _plotly()
    column = f"speedup_vs_{baseline}"
    frame = _grouped(table, {"median_ms", column})
    fig = go.Figure()
    banded = {"band_fast_ms", "band_slow_ms", "speedup_band_lo", "speedup_band_hi"} <= set(frame.columns)
    for policy, rows in frame.groupby("policy", sort=False):
        labels = ["" if pd.isna(s) else f"{s:.2f}x" for s in rows[column]]
        error_y = None
        if banded:  # the band as error bars; a ranking that flips inside it is marked
            flips = (rows["ranking_flips"].fillna(False).astype(bool) if "ranking_flips" in rows
                     else [False] * len(rows))
            labels = [f"{label} ⚠" if flip and label else label for label, flip in zip(labels, flips, strict=True)]
            error_y = {"type": "data", "symmetric": False, "thickness": 1,
                       "array": (rows["band_slow_ms"] - rows["median_ms"]).clip(lower=0),
                       "arrayminus": (rows["median_ms"] - rows["band_fast_ms"]).clip(lower=0)}
        fig.add_bar(name=plotly_text(policy), x=rows["group"], y=rows["median_ms"], text=labels,
                    textposition="outside",
                    error_y=error_y,
                    hovertemplate="%{x}<br>%{y:.2f} ms<br>speed-up %{text}<extra>" + plotly_text(policy) + "</extra>")
    title = f"Median step time; labels: speed-up against {plotly_text(baseline)}"
    if banded:
        title += "<br><sup>error bars: the profile constants' uncertainty band; ⚠ the ranking flips inside it</sup>"
    fig.update_layout(barmode="group", xaxis_title="model @ oversubscription ratio",
                      yaxis_title="median step time (ms)", legend_title="policy", title=title)
    if log_scale:
        fig.update_yaxes(type="log")
    return fig


def step_time_overlay(runs: Iterable[tuple[str, Iterable[StepRecord]]]) -> Any:
    """Step time per step, one line per run: ``runs`` is ``[(label, records), ...]`` (warm-up steps dashed)."""
    go = _plotly()
    fig = go.Figure()
    for label, records in runs:
        records = list(records)
        fig.add_scatter(x=[r.step for r in records], y=[r.wall_ms for r in records], name=plotly_text(label),
                        mode="lines+markers", marker={"size": 4})
    fig.update_layout(xaxis_title="step", yaxis_title="step time (ms)", legend_title="run",
                      title="Step time per step")
    return fig
