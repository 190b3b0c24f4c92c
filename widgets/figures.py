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
from um_lab.widgets.dashboard_data import _RESIDENCY_TITLES, _TRAFFIC_TITLE
from um_lab.widgets.dashboard_data import DASHBOARD_PANELS as DASHBOARD_PANELS
from um_lab.widgets.dashboard_data import DASHBOARD_TRACES as DASHBOARD_TRACES
from um_lab.widgets.dashboard_data import NO_DATA_YET as NO_DATA_YET
from um_lab.widgets.dashboard_data import NOT_MEASURED_HERE as NOT_MEASURED_HERE
from um_lab.widgets.dashboard_data import REMOTE_TRACE as REMOTE_TRACE
from um_lab.widgets.dashboard_data import byte_unit as byte_unit
from um_lab.widgets.dashboard_data import dashboard_row as dashboard_row
from um_lab.widgets.dashboard_data import dashboard_series as dashboard_series
from um_lab.widgets.dashboard_data import residency_source as residency_source
from um_lab.widgets.dashboard_data import residency_title as residency_title
from um_lab.widgets.dashboard_data import series_from_rows as series_from_rows
from um_lab.widgets.dashboard_data import whole_dtick as whole_dtick


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
        raise ValueError(f"table lacks columns {sorted(missing)}; pass the DataFrame from um_lab.runs.sweep.compare")
    # plotly renders tags in category labels: a model's name is shown as text
    groups = [plotly_text(f"{m} @ {'card' if pd.isna(r) else f'{r:g}x'}")
              for m, r in zip(table["model"], table["ratio"], strict=True)]
    return table.assign(group=groups)


def comparison_figure(table: pd.DataFrame, metric: str = "median_ms") -> Any:
    """Grouped bars of ``metric`` per policy, one group per (model, ratio), from ``um_lab.runs.sweep.compare``."""
    go = _plotly()
    frame = _grouped(table, {metric})
    fig = go.Figure()
    for policy, rows in frame.groupby("policy", sort=False):
        fig.add_bar(name=plotly_text(policy), x=rows["group"], y=rows[metric])
    fig.update_layout(barmode="group", xaxis_title="model @ oversubscription ratio",
                      yaxis_title=metric.replace("_", " "), legend_title="policy",
                      title=f"{metric.replace('_', ' ')} by policy")
    fig.update_yaxes(rangemode="tozero")
    if frame.empty:
        empty_note(fig, "no runs to draw")
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
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(rangemode="nonnegative")
    if not records:
        empty_note(fig)
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
    the residency source.

    Read at a glance: every y axis starts at zero (a steady 320 ms step is a flat line at 320 on a 0–350 ms
    axis, not noise filling the panel), byte panels are in MiB, GiB or TiB, an empty panel says so, and
    the residency and traffic panels each have their own legend (the other panels' titles name their one
    line).
    """
    _plotly()  # a clear ImportError when plotly is missing
    import plotly.colors
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=3, cols=2, specs=[[{"colspan": 2}, None], [{}, {}], [{}, {}]],
                        vertical_spacing=0.11, horizontal_spacing=0.1,
                        subplot_titles=(_RESIDENCY_TITLES["pending"], "step time (ms)",
                                        "oversubscription (live / capacity)", "GPU page faults per step",
                                        _TRAFFIC_TITLE))
    for subplot_title in fig.layout.annotations:  # the two columns' titles side by side must not run together
        subplot_title.font.size = 14
    series, layout = dashboard_series(rows, last, max_points)
    palette = plotly.colors.DEFAULT_PLOTLY_COLORS
    for i, dtype in enumerate(DATA_TYPES):
        x, y = series[dtype.value]
        fig.add_scatter(x=x, y=y, name=dtype.value, stackgroup="residency", mode="lines",
                        line={"color": palette[i % len(palette)]}, legendgroup="types", legend="legend",
                        row=1, col=1)
    x, y = series["GPU capacity"]
    fig.add_scatter(x=x, y=y, name="GPU capacity", mode="lines", line={"color": "black", "dash": "dash"},
                    legend="legend", row=1, col=1)
    hover = {"step time": "%{y:,.2f} ms", "oversubscription": "%{y:.2f}x", "page faults": "%{y:,.0f} faults"}
    for name, row, col, colour in (("step time", 2, 1, "#1f77b4"), ("oversubscription", 2, 2, "#9467bd"),
                                   ("page faults", 3, 1, "#d62728"), ("migrated to GPU", 3, 2, "#2ca02c"),
                                   ("migrated to host", 3, 2, "#ff7f0e"), (REMOTE_TRACE, 3, 2, "#8c564b")):
        x, y = series[name]
        single = name in hover  # the panel's title names its one line: no legend entry
        fig.add_scatter(x=x, y=y, name=name, mode="lines+markers", marker={"size": 4}, line={"color": colour},
                        showlegend=not single, legend="legend2",
                        hovertemplate=f"step %{{x}}<br>{hover[name]}<extra></extra>" if single else None,
                        row=row, col=col)
    fig.update_yaxes(rangemode="tozero")  # counts and times from zero, never zoomed into the noise
    fig.update_xaxes(rangemode="nonnegative")
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="ratio", row=2, col=2)
    fig.update_yaxes(title_text="faults", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=2)
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dot"}, row=2, col=2)
    for xaxis, yaxis, _names in DASHBOARD_PANELS:  # the empty-state notes, one per panel (shown by layout)
        fig.add_annotation(text=NO_DATA_YET, xref=f"{xaxis.replace('axis', '')} domain",
                           yref=f"{yaxis.replace('axis', '')} domain", x=0.5, y=0.5, showarrow=False,
                           font={"color": "grey", "size": 14})
    top = fig.layout.yaxis.domain[1]
    traffic_top = fig.layout.yaxis5.domain[1]
    fig.update_layout(height=720, title=plotly_text(title) or None,
                      legend={"x": 1.02, "y": top, "yanchor": "top", "title": {"text": "data type"}},
                      legend2={"x": 1.02, "y": traffic_top, "yanchor": "top", "title": {"text": "traffic"}},
                      margin={"l": 60, "r": 20, "t": 70 if title else 40, "b": 40})
    fig.plotly_relayout(layout)
    return fig



# ------------------------------------------------------------------------------------ comparison


def speedup_figure(table: pd.DataFrame, baseline: str = "um-default", log_scale: bool = False) -> Any:
    """Median step time per policy, grouped by (model, ratio), each bar labelled with its speed-up against
    ``baseline`` (from :func:`um_lab.runs.sweep.compare`). ``log_scale`` puts step time on a log axis."""
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
    else:
        fig.update_yaxes(rangemode="tozero")
        if frame.empty:
            empty_note(fig, "no runs to draw")
    return fig


MAX_LINES = 8  #: step-time lines drawn in one panel; the others are drawn as one line, their median
MAX_PANELS = 12  #: (model, ratio) panels drawn by :func:`step_time_panels`; a note counts the others


def empty_note(fig: Any, text: str = NO_DATA_YET, xref: str = "x domain", yref: str = "y domain") -> Any:
    """Mark an empty plot: ``text`` in its middle and its axes from 0 to 1 (plotly's default range for no
    data is negative). Returns ``fig``."""
    fig.add_annotation(text=text, xref=xref, yref=yref, x=0.5, y=0.5, showarrow=False,
                       font={"color": "grey", "size": 14})
    fig.update_xaxes(range=[0, 1], autorange=False)
    fig.update_yaxes(range=[0, 1], autorange=False)
    return fig


def _step_times(records: Iterable[StepRecord]) -> tuple[list[int], list[float]]:
    steps, times = [], []
    for r in records:
        steps.append(r.step)
        times.append(float(r.wall_ms))
    return steps, times


def _capped(lines: list[tuple[str, list[int], list[float]]], max_lines: int
            ) -> tuple[list[tuple[str, list[int], list[float]]], tuple[str, list[int], list[float]] | None]:
    """At most ``max_lines`` lines: the first ``max_lines - 1`` as given, the rest as one line of their
    per-step median (named with how many it stands for); no grouping when they fit."""
    if len(lines) <= max_lines:
        return lines, None
    keep, rest = lines[:max_lines - 1], lines[max_lines - 1:]
    by_step: dict[int, list[float]] = {}
    for _, steps, times in rest:
        for step, ms in zip(steps, times, strict=True):
            by_step.setdefault(step, []).append(ms)
    steps = sorted(by_step)
    return keep, (f"median of {len(rest)} other runs", steps, [float(np.median(by_step[s])) for s in steps])


def step_time_overlay(runs: Iterable[tuple[str, Iterable[StepRecord]]], max_lines: int = MAX_LINES) -> Any:
    """Step time per step, one line per run: ``runs`` is ``[(label, records), ...]``. At most ``max_lines``
    lines: past that, the first ``max_lines - 1`` runs and one line for the median of the others (48
    lines with one legend cannot be read). The y axis starts at zero."""
    go = _plotly()
    fig = go.Figure()
    lines = [(label, *_step_times(records)) for label, records in runs]
    shown, grouped = _capped(lines, max_lines)
    for label, steps, times in shown:
        fig.add_scatter(x=steps, y=times, name=plotly_text(label), mode="lines+markers", marker={"size": 4},
                        hovertemplate="step %{x}<br>%{y:,.2f} ms")
    if grouped is not None:
        label, steps, times = grouped
        fig.add_scatter(x=steps, y=times, name=label, mode="lines", line={"color": "grey", "dash": "dash"},
                        hovertemplate="step %{x}<br>%{y:,.2f} ms")
    fig.update_layout(xaxis_title="step", yaxis_title="step time (ms)", legend_title="run",
                      title="Step time per step")
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(rangemode="nonnegative", dtick=whole_dtick(max((max(s, default=0) for _, s, _ in lines),
                                                                    default=0)))
    if not lines:
        empty_note(fig, "no runs to draw")
    return fig


def step_time_panels(runs: Iterable[tuple[str, str, Iterable[StepRecord]]], max_lines: int = MAX_LINES,
                     max_panels: int = MAX_PANELS, columns: int = 3) -> Any:
    """Step time per step as small multiples: ``runs`` is ``[(panel, line, records), ...]``, e.g.
    ``("mlp @ 1.5x", "gpu-first", records)``. One panel per ``panel`` label (at most ``max_panels``; a note
    counts the others), one line per ``line`` label in the same colour in every panel and one legend entry
    each, at most ``max_lines`` lines a panel (the others as their median). Every y axis starts at zero."""
    _plotly()
    import plotly.colors
    from plotly.subplots import make_subplots

    panels: dict[str, list[tuple[str, list[int], list[float]]]] = {}
    for panel, line, records in runs:
        panels.setdefault(panel, []).append((line, *_step_times(records)))
    if not panels:
        fig = step_time_overlay([])
        fig.update_layout(title="Step time per step")
        return fig
    labels = list(panels)[:max_panels]
    cols = max(1, min(columns, len(labels)))
    n_rows = -(-len(labels) // cols)
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=[plotly_text(label) for label in labels],
                        vertical_spacing=min(0.12, 0.3 / n_rows), horizontal_spacing=0.06)
    palette = plotly.colors.qualitative.Plotly
    colours: dict[str, str] = {}
    in_legend: set[str] = set()
    for k, label in enumerate(labels):
        shown, grouped = _capped(panels[label], max_lines)
        row, col = k // cols + 1, k % cols + 1
        for line, steps, times in shown:
            colour = colours.setdefault(line, palette[len(colours) % len(palette)])
            fig.add_scatter(x=steps, y=times, name=plotly_text(line), legendgroup=line,
                            showlegend=line not in in_legend, mode="lines+markers", marker={"size": 4},
                            line={"color": colour}, row=row, col=col,
                            hovertemplate=f"{plotly_text(label)}<br>step %{{x}}<br>%{{y:,.2f}} ms")
            in_legend.add(line)
        if grouped is not None:
            name, steps, times = grouped
            fig.add_scatter(x=steps, y=times, name=name, legendgroup="others", showlegend="others" not in in_legend,
                            mode="lines", line={"color": "grey", "dash": "dash"}, row=row, col=col)
            in_legend.add("others")
    title = "Step time per step: a panel per model @ ratio, a line per policy"
    if len(panels) > len(labels):
        title += f"<br><sup>the first {len(labels)} of {len(panels)} panels; the table has every run</sup>"
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(rangemode="nonnegative", dtick=whole_dtick(
        max((max(steps, default=0) for lines in panels.values() for _, steps, _ in lines), default=0)))
    fig.update_yaxes(title_text="ms", col=1)
    fig.update_xaxes(title_text="step", row=n_rows)
    fig.update_layout(title=title, legend_title="policy", height=120 + 240 * n_rows,
                      margin={"l": 60, "r": 20, "t": 90, "b": 40})
    return fig
