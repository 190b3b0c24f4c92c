"""Inside one step: resident bytes per data type against time, with the step's faults, migrations, evictions and
prefetches, for one or two policies on one time axis (:class:`~um_lab.sim.timeline.StepTimeline`).

::

    from um_lab.widgets import TimelineView
    TimelineView(model="gpt2-small", model_kwargs={"n_layer": 2}, ratio=1.5,
                 policies=("um-default", "prefetch-all"))      # pick policies and a step; Play walks the step

    from um_lab.units import format_bytes
from um_lab.sim.timeline import step_timeline
    from um_lab.widgets.timeline import timeline_figure
    fig = timeline_figure(step_timeline(case, "um-default", ratio=1.5),
                          step_timeline(case, "prefetch-all", ratio=1.5))   # a plain go.Figure: exports, Play button

Each policy gets two panels sharing the time axis: the stacked resident bytes per data type (from zero, with
the GPU's capacity or budget as a dashed line, the forward / backward / optimizer phases as shaded bands) and a
strip of events, one lane each for page faults, bytes migrated to the GPU, bytes migrated to the host (evictions),
bytes an explicit prefetch moved and bytes read remotely over the link (marker area grows with the amount).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from um_lab.errors import SpecError, UmLabError
from um_lab.policy import Policy, get_policy, presets
from um_lab.sim.timeline import TYPE_NAMES, StepTimeline, TimelineRow, step_timeline
from um_lab.units import format_bytes
from um_lab.widgets._html import html_text, plotly_text, wrapping
from um_lab.widgets.dashboard_data import byte_unit
from um_lab.widgets.figures import _plotly  # plotly's graph objects, with the export renderer set up

#: Event lanes, top to bottom: (trace name, colour, marker symbol, unit: "bytes" or "count").
EVENT_LANES: tuple[tuple[str, str, str, str], ...] = (
    ("page faults", "#d62728", "x", "count"),
    ("migrated to GPU", "#1f77b4", "triangle-up", "bytes"),
    ("migrated to host (evicted)", "#ff7f0e", "triangle-down", "bytes"),
    ("prefetched", "#2ca02c", "diamond", "bytes"),
    ("read remotely", "#9467bd", "circle", "bytes"),
)
PHASE_FILL = {"forward": "rgba(31,119,180,0.08)", "backward": "rgba(255,127,14,0.09)",
              "optimizer": "rgba(44,160,44,0.09)"}
BATCH_FILL = "rgba(127,127,127,0.12)"
CURSOR = "now"  #: the name of the cursor traces that Play / the slider move
STEADY = -1  #: the step picker's value for "the first steady step"
FRAMES = 60  #: cursor positions the figure's slider and Play button walk through
_TYPE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def time_scale(longest_us: float) -> tuple[str, float]:
    """The unit to draw times in (µs below 1 ms, else ms) and its size in µs."""
    return ("ms", 1e3) if longest_us >= 1e3 else ("µs", 1.0)


def _lane_value(r: TimelineRow, lane: str) -> float:
    if lane == "page faults":
        return float(r.faults)
    if lane == "migrated to GPU":
        return float(r.htod_bytes - (r.prefetched_bytes if r.kind == "prefetch-to-gpu" else 0))
    if lane.startswith("migrated to host"):  # on the simulator: what evictions moved (a prefetch is in its own lane)
        return float(r.dtoh_bytes - (r.prefetched_bytes if r.kind == "prefetch-to-host" else 0))
    if lane == "prefetched":
        return float(r.prefetched_bytes)
    return float(r.remote_bytes)


def _lane_text(r: TimelineRow, lane: str, unit: str) -> str:
    if unit == "count":
        return f"{r.faults:,} faults"
    text = format_bytes(_lane_value(r, lane))
    if lane.startswith("migrated to host") and r.evictions:
        text += f" ({r.evictions:,} chunks evicted)"
    return text


def _band_edges(tl: StepTimeline) -> list[tuple[str, float, float]]:
    """Contiguous phase bands: each phase from its start (the first from the step's start) to the next one's."""
    spans = tl.phases()
    out = []
    for i, s in enumerate(spans):
        lo = min(0.0, s.start_us) if i == 0 else s.start_us
        hi = spans[i + 1].start_us if i + 1 < len(spans) else max(tl.wall_us, s.end_us)
        out.append((s.phase, lo, hi))
    return out


def _title(tl: StepTimeline, t_unit: str, t_size: float) -> str:
    t = tl.totals()
    where = {"sim": "simulated", "cupti": "CUPTI"}.get(tl.source, tl.source)
    moved = [(t["gpu_page_faults"], f"{t['gpu_page_faults']:,} faults"),
             (sum(t["htod_bytes"].values()), f"{format_bytes(sum(t['htod_bytes'].values()))} to GPU"),
             (t["evicted_bytes"], f"{format_bytes(t['evicted_bytes'])} evicted"),
             (t["prefetched_bytes"], f"{format_bytes(t['prefetched_bytes'])} prefetched"),
             (t["remote_bytes"], f"{format_bytes(t['remote_bytes'])} remote")]
    traffic = ", ".join(text for amount, text in moved if amount) or "nothing moved"  # zeros left out
    # two lines: one would run past the plot's right edge
    return (plotly_text(f"{tl.policy} · {tl.model} · step {tl.step} ({where}): {tl.wall_us / t_size:.2f} {t_unit}")
            + f"<br><span style='font-size:11px'>{plotly_text(traffic)}</span>")


def cursor_text(tl: StepTimeline, t_us: float, t_unit: str = "ms", t_size: float = 1e3) -> str:
    """What runs at ``t_us`` in ``tl``, as plain text (escape it for HTML): phase, kernel, resident bytes."""
    row = tl.row_at(t_us)
    if row is None:
        return f"{tl.policy}: before the step"
    return (f"{tl.policy}: {row.phase or 'step'} · {row.name} ({row.duration_us / t_size:.3f} {t_unit}) · "
            f"resident {format_bytes(row.resident_bytes)}")


def _cursor_label(tl: StepTimeline, t_us: float) -> str:
    row = tl.row_at(t_us)
    return " before the step" if row is None else f" {row.name} ({row.phase or 'step'})"


def timeline_figure(timeline: StepTimeline, other: StepTimeline | None = None, *, frames: bool = True,
                    cursor: bool | None = None, n_frames: int = FRAMES) -> Any:
    """A plotly ``go.Figure`` of one step (two, ``other``, below it on the same time axis).

    Per timeline: stacked resident bytes per data type against time (MiB or GiB from zero; time in ms, µs for
    a step under 1 ms) with the capacity (or budget) line and phase bands, and an event strip (faults,
    migrations to the GPU, evictions, prefetches, remote reads). ``frames``: add plotly frames, a slider and a
    Play button that move a cursor line through the step (a static export shows the cursor at the start).
    ``cursor``: draw the cursor traces (named :data:`CURSOR`) even without frames (default: with frames).
    """
    _plotly()
    from plotly.subplots import make_subplots

    if not isinstance(timeline, StepTimeline) or (other is not None and not isinstance(other, StepTimeline)):
        raise SpecError("timeline_figure takes StepTimeline objects (um_lab.sim.timeline.step_timeline)", "timeline")
    tls = [timeline] + ([other] if other is not None else [])
    cursor = frames if cursor is None else cursor
    t_lo, t_hi = time_extent(tls)
    t_unit, t_size = time_scale(t_hi - t_lo)
    stack_max = max(max([sum(tl.resident_before.values())] + [r.resident_bytes for r in tl.rows]) for tl in tls)
    limit_max = max((tl.limit_bytes or 0) for tl in tls)
    b_unit, b_size = byte_unit(max(stack_max, limit_max))
    y_top = max(stack_max, limit_max, 1) / b_size * 1.1
    lane_max = {lane: max([_lane_value(r, lane) for tl in tls for r in tl.rows] + [0.0])
                for lane, *_ in EVENT_LANES}
    lanes = [lane for lane, *_ in EVENT_LANES]

    n = len(tls)
    heights = [0.7 / n, 0.3 / n] * n
    fig = make_subplots(rows=2 * n, cols=1, shared_xaxes=True, vertical_spacing=0.09 / n, row_heights=heights,
                        subplot_titles=[x for tl in tls for x in (_title(tl, t_unit, t_size), "")])
    cursor_traces: list[int] = []
    legend: set[str] = set()  # event lanes listed in the legend so far
    for k, tl in enumerate(tls):
        res_row, ev_row = 2 * k + 1, 2 * k + 2
        first = k == 0
        xs = [t_lo / t_size]
        ys = {t: [tl.resident_before[t] / b_size] for t in TYPE_NAMES}
        names = ["start"]
        x_prev = t_lo
        for r in tl.rows:
            x_prev = max(x_prev, r.start_us)  # residency changes as a row starts (faults serviced, prefetch issued)
            xs.append(x_prev / t_size)
            names.append(plotly_text(f"{r.name} ({r.phase})"))
            for t in TYPE_NAMES:
                ys[t].append(r.resident[t] / b_size)
        xs.append(max(tl.wall_us, x_prev) / t_size)
        names.append("step end")
        for t in TYPE_NAMES:
            ys[t].append(ys[t][-1])
        for i, t in enumerate(TYPE_NAMES):
            fig.add_scatter(x=xs, y=ys[t], name=t, legendgroup=t, showlegend=first, stackgroup=f"resident{k}",
                            mode="lines", line={"color": _TYPE_COLOURS[i], "width": 0.5, "shape": "hv"},
                            customdata=names,
                            hovertemplate=f"{t}: %{{y:.2f}} {b_unit}<br>%{{customdata}}<extra></extra>",
                            row=res_row, col=1)
        limit = tl.limit_bytes
        if limit is not None:
            what = "GPU budget" if tl.budget_bytes is not None else "GPU capacity"
            fig.add_scatter(x=[t_lo / t_size, t_hi / t_size], y=[limit / b_size] * 2, mode="lines",
                            name=f"{what} {format_bytes(limit)}", legendgroup=f"limit {limit}",
                            showlegend=first or limit != tls[0].limit_bytes,
                            line={"color": "black", "dash": "dash", "width": 1.5}, hoverinfo="name",
                            row=res_row, col=1)
        for lane, colour, symbol, unit in EVENT_LANES:
            hits = [r for r in tl.rows if _lane_value(r, lane) > 0]
            # plotly lists no trace without points: the first panel with some carries the legend entry
            top = lane_max[lane] or 1.0
            sizes = [6 + 14 * math.sqrt(_lane_value(r, lane) / top) for r in hits]
            text = [plotly_text(f"{r.name} ({r.phase}): " + _lane_text(r, lane, unit)) for r in hits]
            fig.add_scatter(x=[r.start_us / t_size for r in hits], y=[lane] * len(hits), mode="markers",
                            name=lane, legendgroup=f"event {lane}", showlegend=bool(hits) and lane not in legend,
                            marker={"color": colour, "symbol": symbol, "size": sizes, "line": {"width": 0}},
                            text=text, hovertemplate="%{text}<br>%{x:.3f} " + t_unit + "<extra></extra>",
                            row=ev_row, col=1)
            if hits:
                legend.add(lane)
        for phase, lo, hi in _band_edges(tl):
            for row in (res_row, ev_row):
                fig.add_vrect(x0=lo / t_size, x1=hi / t_size, fillcolor=PHASE_FILL.get(phase, BATCH_FILL),
                              line_width=0, layer="below", row=row, col=1)
            fig.add_annotation(x=(lo + hi) / 2 / t_size, y=1.0, xref=f"x{2 * k + 1 if k else ''}",
                               yref=f"y{2 * k + 1 if k else ''} domain", text=phase, showarrow=False,
                               yanchor="top", font={"size": 11, "color": "#555"})
        batch = [r for r in tl.rows if r.kind == "batch-copy"]
        if batch:
            for row in (res_row, ev_row):
                fig.add_vrect(x0=batch[0].start_us / t_size, x1=0.0, fillcolor=BATCH_FILL, line_width=0,
                              layer="below", row=row, col=1)
        if cursor:
            cursor_traces.append(len(fig.data))
            fig.add_scatter(x=[t_lo / t_size] * 2, y=[0.0, y_top * 0.86], mode="lines+text", name=CURSOR,
                            text=["", plotly_text(_cursor_label(tl, t_lo))], textposition="bottom right",
                            textfont={"size": 11}, showlegend=False, line={"color": "rgba(0,0,0,0.7)", "width": 2},
                            hoverinfo="skip", row=res_row, col=1)
            cursor_traces.append(len(fig.data))
            fig.add_scatter(x=[t_lo / t_size] * 2, y=[lanes[0], lanes[-1]], mode="lines", name=CURSOR,
                            showlegend=False, line={"color": "rgba(0,0,0,0.7)", "width": 2}, hoverinfo="skip",
                            row=ev_row, col=1)
        fig.update_yaxes(title_text=f"resident ({b_unit})", range=[0, y_top], rangemode="tozero",
                         row=res_row, col=1)
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=lanes[::-1],
                         range=[-0.5, len(lanes) - 0.5], showgrid=False, tickfont={"size": 10}, row=ev_row, col=1)
    fig.update_xaxes(range=[t_lo / t_size, t_hi / t_size])
    before = "; the batch copy before 0" if any(r.kind == "batch-copy" for tl in tls for r in tl.rows) else ""
    fig.update_xaxes(title_text=f"time in the step ({t_unit}{before})", row=2 * n, col=1)
    height, top, bottom = 160 + 330 * n, 95, 120 if frames else 50
    fig.update_layout(height=height, margin={"t": top, "b": bottom, "l": 70, "r": 20}, hovermode="closest",
                      legend={"orientation": "h", "y": 1 + 24 / (height - top - bottom), "yanchor": "bottom", "x": 0,
                              "font": {"size": 11}},
                      template="plotly_white")
    for ann in fig.layout.annotations:  # the subplot titles: small, left-aligned, below the legend
        if ann.text and ann.yref == "paper":
            ann.update(font={"size": 12}, x=0, xanchor="left", align="left")
    if frames and cursor_traces:
        _add_frames(fig, tls, cursor_traces, t_lo, t_hi, t_size, t_unit, n_frames)
    return fig


def time_extent(timelines: Sequence[StepTimeline]) -> tuple[float, float]:
    """The time axis (µs) the timelines share: from the earliest row (the batch copy before 0) or 0 to the
    latest step end."""
    lo = min([0.0] + [r.start_us for tl in timelines for r in tl.rows])
    hi = max([tl.wall_us for tl in timelines] + [r.end_us for tl in timelines for r in tl.rows])
    return lo, hi


def frame_times(t_lo: float, t_hi: float, n_frames: int = FRAMES) -> list[float]:
    """``n_frames`` cursor times (µs) from ``t_lo`` to ``t_hi``."""
    n_frames = max(2, int(n_frames))
    return [t_lo + (t_hi - t_lo) * i / (n_frames - 1) for i in range(n_frames)]


def _add_frames(fig: Any, tls: Sequence[StepTimeline], cursor_traces: list[int], t_lo: float, t_hi: float,
                t_size: float, t_unit: str, n_frames: int) -> None:
    go = _plotly()
    times = frame_times(t_lo, t_hi, n_frames)
    frames = []
    for i, t in enumerate(times):
        x = [t / t_size] * 2
        data = []
        for j, _ in enumerate(cursor_traces):
            if j % 2 == 0:  # a residency panel's cursor: it names the kernel running there
                data.append(go.Scatter(x=x, text=["", plotly_text(_cursor_label(tls[j // 2], t))]))
            else:
                data.append(go.Scatter(x=x))
        frames.append(go.Frame(name=str(i), traces=cursor_traces, data=data))
    fig.frames = frames
    play = {"frame": {"duration": 120, "redraw": False}, "fromcurrent": True, "transition": {"duration": 0},
            "mode": "immediate"}
    pause = {"frame": {"duration": 0, "redraw": False}, "mode": "immediate", "transition": {"duration": 0}}
    fig.update_layout(
        updatemenus=[{"type": "buttons", "direction": "left", "x": 0, "y": -0.02, "xanchor": "left", "yanchor": "top",
                      "pad": {"t": 30, "r": 10}, "showactive": False,
                      "buttons": [{"label": "Play", "method": "animate", "args": [None, play]},
                                  {"label": "Pause", "method": "animate", "args": [[None], pause]}]}],
        sliders=[{"active": 0, "x": 0.12, "len": 0.88, "y": -0.02, "yanchor": "top", "pad": {"t": 20},
                  "currentvalue": {"prefix": "t = ", "suffix": f" {t_unit}", "font": {"size": 11}},
                  "steps": [{"label": f"{t / t_size:.2f}", "method": "animate",
                             "args": [[str(i)], pause]} for i, t in enumerate(times)],
                  "font": {"size": 9}, "ticklen": 3}])


class TimelineView:
    """Inside one step, for two policies side by side: pick policy A and B (B may be none) and a step; the
    figure shows both on one time axis, and Play (or the slider) walks a cursor through the step while the
    line below says which kernel runs at that moment under each policy.

    ``model`` / ``model_kwargs`` (or ``case``, a :class:`~um_lab.models.ModelCase`), ``ratio`` or
    ``capacity_bytes``: the workload and the simulated GPU, as :func:`~um_lab.sim.timeline.step_timeline`
    takes them; ``policies``: one or two preset names (or :class:`~um_lab.policy.Policy` objects); ``step``:
    None for the first steady step. ``simulate_now=False``: draw nothing until :meth:`refresh` (or a change of
    policy or step), for a panel that builds the view before its tab is opened. Display it directly, or put
    :attr:`widget` in a container (a Tab); :meth:`set_workload` follows another workload.
    """

    def __init__(self, model: str = "mlp", model_kwargs: Mapping[str, Any] | None = None, ratio: float | None = 1.5,
                 policies: Sequence[str | Policy] = ("um-default", "prefetch-all"), step: int | None = None, *,
                 capacity_bytes: int | None = None, case: Any = None, backend: Any = None,
                 simulate_now: bool = True) -> None:
        import ipywidgets as w

        if isinstance(policies, str | Policy) or not 1 <= len(policies) <= 2:
            raise SpecError(f"policies must be one or two policies (A, and B to compare), got {policies!r}",
                            "policies")
        self._policies: dict[str, Policy] = {name: p for name, p in presets.items()}
        chosen = []
        for p in policies:
            pol = get_policy(p)
            self._policies[pol.name] = pol
            chosen.append(pol.name)
        self._workload: dict[str, Any] = {"model": model, "model_kwargs": model_kwargs, "ratio": ratio,
                                          "capacity_bytes": capacity_bytes, "case": case}
        self.backend = backend
        names = list(self._policies)
        self.policy_a = w.Dropdown(options=names, value=chosen[0], description="policy A",
                                   layout=w.Layout(width="260px"))
        self.policy_b = w.Dropdown(options=[("(none)", ""), *((n, n) for n in names)],
                                   value=chosen[1] if len(chosen) > 1 else "", description="policy B",
                                   layout=w.Layout(width="260px"))
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise SpecError(f"step must be a whole number >= 0 or None (the first steady step), got {step!r}", "step")
        steps = sorted({*range(10), *([step] if step is not None else [])})
        self.step = w.Dropdown(options=[("steady", STEADY), *((str(i), i) for i in steps)],
                               value=STEADY if step is None else step, description="step",
                               layout=w.Layout(width="180px"))
        self.play = w.Play(min=0, max=FRAMES - 1, step=1, interval=120, description="walk through the step")
        self.slider = w.IntSlider(min=0, max=FRAMES - 1, value=0, readout=False, description="time",
                                  layout=w.Layout(width="420px"))
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.readout = w.HTML()
        self.status = w.HTML()
        self.figure: Any = None
        self._box = w.Box()
        self.timelines: tuple[StepTimeline | None, StepTimeline | None] = (None, None)
        self._times: list[float] = [0.0]
        self._cursor: list[int] = []
        self._units = ("ms", 1e3)
        self._quiet = False  # True while use_policy sets the pickers: one redraw, after them
        self.widget = w.VBox([w.HBox([self.policy_a, self.policy_b, self.step], layout=wrapping()), self.status,
                              self._box,
                              w.HBox([self.play, self.slider], layout=wrapping()), self.readout])
        self.widget.add_class("um-lab-timeline")
        for control in (self.policy_a, self.policy_b, self.step):
            control.observe(lambda _c: self.refresh(), names="value")
        self.slider.observe(lambda c: self._move(int(c["new"])), names="value")
        if simulate_now:
            self.refresh()
        else:
            self.status.value = "<i>pick the policies and a step</i>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def set_workload(self, *, policy: tuple[Policy, str] | None = None, **changes: Any) -> None:
        """Show another workload: any of ``model``, ``model_kwargs``, ``ratio``, ``capacity_bytes``, ``case``
        (what the Lab panel's workload picker holds), and ``policy=(policy, label)`` as policy A
        (:meth:`use_policy`), then redraw once."""
        unknown = sorted(set(changes) - set(self._workload))
        if unknown:
            raise SpecError(f"unknown workload field {unknown[0]!r}; valid: {', '.join(self._workload)}", unknown[0])
        self._workload.update(changes)
        if policy is not None:
            self.use_policy(*policy)
        else:
            self.refresh()

    def _timeline(self, policy: str, step: int | None = None) -> StepTimeline:
        wl = self._workload
        case = wl["case"] if wl["case"] is not None else wl["model"]
        if step is None:
            step = None if self.step.value == STEADY else self.step.value
        return step_timeline(case, self._policies[policy], ratio=wl["ratio"], capacity_bytes=wl["capacity_bytes"],
                             step=step, model_kwargs=wl["model_kwargs"] if wl["case"] is None else None,
                             backend=self.backend)

    def use_policy(self, policy: Policy, label: str) -> None:
        """Offer ``policy`` under ``label`` in both pickers (replacing an earlier one of that label) and show it
        as policy A (the Lab panel's own advice, edited per data type), then redraw once."""
        self._policies[label] = policy
        names = list(self._policies)
        self._quiet = True
        try:
            b = self.policy_b.value
            self.policy_a.options = names
            self.policy_b.options = [("(none)", ""), *((n, n) for n in names)]
            self.policy_a.value = label
            self.policy_b.value = b if b in names else ""
        finally:
            self._quiet = False
        self.refresh()

    def clear(self, message: str) -> None:
        """Show ``message`` (HTML) and no figure: nothing on show may belong to other settings."""
        self.figure, self.timelines, self._cursor = None, (None, None), []
        self._box.children = ()
        self.readout.value = ""
        self.status.value = message

    def refresh(self) -> None:
        """Simulate the chosen step under policy A (and B) and redraw; a refused input is shown, not raised.
        "steady" shows the same step for both: the later of their first steady steps."""
        import plotly.graph_objects as go

        if self._quiet:
            return
        self.status.value = "<i>simulating…</i>"
        try:
            a = self._timeline(self.policy_a.value)
            b = self._timeline(self.policy_b.value) if self.policy_b.value else None
            if b is not None and self.step.value == STEADY and a.step != b.step:
                step = max(a.step, b.step)
                a, b = (self._timeline(name, step) for name in (self.policy_a.value, self.policy_b.value))
        except UmLabError as e:
            self.clear(f"<span style='color:#b00'>{html_text(e)}</span>")
            return
        self.timelines = (a, b)
        fig = timeline_figure(a, b, frames=False, cursor=True)
        self._cursor = [i for i, tr in enumerate(fig.data) if tr.name == CURSOR]
        t_lo, t_hi = time_extent([tl for tl in (a, b) if tl is not None])
        self._units = time_scale(t_hi - t_lo)
        self._times = frame_times(t_lo, t_hi, FRAMES)
        self.figure = go.FigureWidget(fig)
        self._box.children = (self.figure,)
        self.status.value = html_text(" | ".join(tl.describe() for tl in (a, b) if tl is not None))
        self._move(self.slider.value)

    def _move(self, i: int) -> None:
        if self.figure is None or not self._times:
            return
        t = self._times[min(max(i, 0), len(self._times) - 1)]
        unit, size = self._units
        with self.figure.batch_update():
            for n, j in enumerate(self._cursor):
                self.figure.data[j].x = (t / size, t / size)
                tl = self.timelines[n // 2]
                if n % 2 == 0 and tl is not None:
                    self.figure.data[j].text = ("", plotly_text(_cursor_label(tl, t)))
        lines = [cursor_text(tl, t, unit, size) for tl in self.timelines if tl is not None]
        self.readout.value = f"<b>t = {html_text(f'{t / size:.3f} {unit}')}</b><br>" + "<br>".join(
            html_text(line) for line in lines)

    def cursor_x(self) -> float:
        """Where the cursor stands now, in the figure's time unit."""
        return float(self.figure.data[self._cursor[0]].x[0]) if self.figure is not None and self._cursor else 0.0

    def static_figure(self) -> Any:
        """The shown comparison as a plain ``go.Figure`` with Play and a slider (for exports and static pages)."""
        a, b = self.timelines
        if a is None:
            raise SpecError("nothing simulated yet: the last refresh was refused (see the status line)", "policies")
        return timeline_figure(a, b)


__all__ = ["EVENT_LANES", "TimelineView", "cursor_text", "frame_times", "time_extent",
           "time_scale", "timeline_figure"]
