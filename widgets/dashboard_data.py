"""The dashboard's numbers, without plotly: records as rows, rows as per-trace series in a readable unit, and
the relayout keys (titles, units, ticks, empty-panel notes) that the static dashboard figure and the live
``FigureWidget`` both apply."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from um_lab.types import DATA_TYPES, StepRecord

REMOTE_TRACE = "remote (read over the link)"  #: bytes the GPU read in host memory, never migrated
#: the dashboard's trace names, in the order :func:`um_lab.widgets.figures.dashboard_figure` adds them
DASHBOARD_TRACES: tuple[str, ...] = (*[t.value for t in DATA_TYPES], "GPU capacity", "step time",
                                     "oversubscription", "page faults", "migrated to GPU", "migrated to host",
                                     REMOTE_TRACE)
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


#: the dashboard's panels: (x axis, y axis, the traces drawn in it), in subplot order (the subplot titles
#: are ``layout.annotations[0:5]`` in this order, the empty-state notes ``layout.annotations[5:10]``)
DASHBOARD_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("xaxis", "yaxis", (*_TYPE_NAMES, "GPU capacity")),
    ("xaxis2", "yaxis2", ("step time",)),
    ("xaxis3", "yaxis3", ("oversubscription",)),
    ("xaxis4", "yaxis4", ("page faults",)),
    ("xaxis5", "yaxis5", ("migrated to GPU", "migrated to host", REMOTE_TRACE)),
)


def whole_dtick(largest: float) -> int:
    """The tick spacing of an axis of whole counts (steps, faults) up to ``largest``: a whole 1, 2 or 5 times a
    power of ten giving about five ticks, never below 1 (plotly's own would put ticks at 0.5 on a short axis).
    Always explicit: a live figure's axis is never handed back to plotly's choice mid-run."""
    if not largest > 0:
        return 1
    raw = largest / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return max(1, int(round(step)))


NO_DATA_YET = "no data yet"  #: what an empty panel says before the first step
NOT_MEASURED_HERE = "not measured in this run"  #: what a panel says whose quantity no step measured
_EMPTY_NOTE_FIRST = 5  # index of the first empty-state note in layout.annotations
_TRAFFIC_TITLE = "migrated / remote per step"  #: remote: read over the link (the legend says so)
_UNITS = (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def byte_unit(largest_bytes: float, smallest: str = "MiB") -> tuple[str, float]:
    """``(unit, bytes per unit)`` to show values up to ``largest_bytes``: the largest binary unit of which it
    is at least one (never below ``smallest``), so an axis reads ``3.7 TiB``, not ``3,700,000 MiB``."""
    names = [name for name, _ in _UNITS]
    chosen = _UNITS[names.index(smallest)]
    for unit in _UNITS[names.index(smallest):]:
        if largest_bytes >= unit[1]:
            chosen = unit
    return chosen


def _nanmax(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    return float(values.max()) if values.size else 0.0


def dashboard_series(rows: np.ndarray, last: Iterable[StepRecord] = (), max_points: int | None = None
                     ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Any]]:
    """What the dashboard draws for :func:`dashboard_row` rows: ``(series, layout)``.

    ``series`` is :func:`series_from_rows` with the residency and traffic panels in a readable unit (MiB,
    GiB or TiB, by their largest value). ``layout`` holds flat plotly relayout keys for the rest: the
    residency title (``last``, the newest record, names the source), each panel's unit, and for each
    panel with nothing to draw an explicit range from zero and a note (:data:`NO_DATA_YET` before the
    first step, :data:`NOT_MEASURED_HERE` once steps arrived without that quantity) instead of plotly's
    negative default range; panels with data autorange from zero (their axes' ``rangemode``).
    """
    rows = np.asarray(rows, dtype=float).reshape(-1, len(DASHBOARD_TRACES) + 1)
    series = series_from_rows(rows, max_points)
    n_types = len(_TYPE_NAMES)
    resident_gib = max(_nanmax(np.nansum(rows[:, 1:1 + n_types], axis=1)) if len(rows) else 0.0,
                       _nanmax(rows[:, 1 + n_types]))
    traffic_mib = _nanmax(rows[:, -3:])
    res_unit, res_size = byte_unit(resident_gib * _GIB)
    traffic_unit, traffic_size = byte_unit(traffic_mib * _MIB)
    for names, scale in (((*_TYPE_NAMES, "GPU capacity"), _GIB / res_size),
                         (DASHBOARD_PANELS[4][2], _MIB / traffic_size)):
        if scale != 1.0:
            for name in names:
                x, y = series[name]
                series[name] = (x, y * scale)
    layout: dict[str, Any] = {
        "annotations[0].text": residency_title(last),
        "annotations[4].text": f"{_TRAFFIC_TITLE} ({traffic_unit})",
        "yaxis.title.text": res_unit, "yaxis5.title.text": traffic_unit,
        "showlegend": bool(len(rows)),  # no legend over an empty panel's note
        "yaxis4.dtick": whole_dtick(_nanmax(rows[:, DASHBOARD_TRACES.index("page faults") + 1])),
    }
    steps_tick = whole_dtick(_nanmax(rows[:, 0]))
    for xaxis, _, _ in DASHBOARD_PANELS:
        layout[f"{xaxis}.dtick"] = steps_tick
    for k, (xaxis, yaxis, names) in enumerate(DASHBOARD_PANELS):
        empty = all(len(series[name][0]) == 0 for name in names)
        note = f"annotations[{_EMPTY_NOTE_FIRST + k}]"
        layout[f"{note}.visible"] = empty
        layout[f"{note}.text"] = NO_DATA_YET if not len(rows) else NOT_MEASURED_HERE
        for axis in (xaxis, yaxis):
            layout[f"{axis}.autorange"] = not empty
            if empty:
                layout[f"{axis}.range"] = [0, 1]
    return series, layout


def residency_title(records: Iterable[StepRecord]) -> str:
    """The residency panel's title for these records (which source the bytes come from)."""
    return _RESIDENCY_TITLES[residency_source(records)]
