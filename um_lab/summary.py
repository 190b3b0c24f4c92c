"""Summaries of step records: step-time statistics, traffic totals, DataFrames, speed-up columns.

Re-exported by :mod:`um_lab.runs.runner`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from um_lab.types import DATA_TYPES, StepRecord
from um_lab.units import format_bytes


def _sum_per_type(values: Mapping[str, int] | None) -> int | None:
    return None if values is None else int(sum(values.values()))


def summarize(records: Iterable[StepRecord]) -> dict[str, Any]:
    """Median, mean and p90 step time, traffic and fault totals over the non-warm-up records.

    ``migrated_bytes`` (host to GPU plus GPU to host) is followed by ``remote_bytes``: bytes the GPU read
    over the link without migrating them (zero-copy: data kept in host memory), which migrate nothing
    and fault nothing, yet may be most of the traffic.

    Streams (keeps only the step times). A quantity no record measured is ``None``, never 0.
    """
    times: list[float] = []
    warmup = 0
    totals: dict[str, int | None] = dict.fromkeys(
        ("htod_bytes", "dtoh_bytes", "gpu_page_faults", "evictions", "remote_bytes"))
    peak_live = 0
    peak_ratio = 0.0
    last_loss = None
    capacity = None
    for record in records:
        if record.warmup:
            warmup += 1
            continue
        times.append(float(record.wall_ms))
        step_values = {"htod_bytes": _sum_per_type(record.htod_bytes),
                       "dtoh_bytes": _sum_per_type(record.dtoh_bytes),
                       "gpu_page_faults": record.gpu_page_faults, "evictions": record.evictions,
                       "remote_bytes": record.remote_bytes}
        for key, value in step_values.items():
            if value is not None:
                totals[key] = (totals[key] or 0) + int(value)
        peak_live = max(peak_live, record.live_total)
        peak_ratio = max(peak_ratio, record.oversubscription_ratio)
        capacity = record.gpu_capacity_bytes
        if record.loss is not None:
            last_loss = record.loss
    migrated = None
    if totals["htod_bytes"] is not None or totals["dtoh_bytes"] is not None:
        migrated = (totals["htod_bytes"] or 0) + (totals["dtoh_bytes"] or 0)
    arr = np.asarray(times, dtype=float)
    return {
        "steps": len(times),
        "warmup_steps": warmup,
        "median_ms": float(np.median(arr)) if len(arr) else math.nan,
        "mean_ms": float(arr.mean()) if len(arr) else math.nan,
        "p90_ms": float(np.percentile(arr, 90)) if len(arr) else math.nan,
        "migrated_bytes": migrated,
        "remote_bytes": totals.pop("remote_bytes"),  # read over the link: next to what was migrated
        **totals,
        "peak_live_bytes": peak_live,
        "gpu_capacity_bytes": capacity,
        "oversubscription": peak_ratio,
        "last_loss": last_loss,
    }


def records_frame(records: Iterable[StepRecord]) -> pd.DataFrame:
    """A DataFrame of records: scalar fields as they are, per-type dicts flattened to columns."""
    rows = []
    for record in records:
        row: dict[str, Any] = {}
        for key, value in record.to_dict().items():
            if isinstance(value, dict) and key != "extra":
                for dtype in DATA_TYPES:
                    row[f"{key}.{dtype.value}"] = value.get(dtype.value)
            elif key != "extra":
                row[key] = value
        row["live_total"] = record.live_total
        rows.append(row)
    return pd.DataFrame(rows)


def speedup_over(table: pd.DataFrame, baseline: str, column: str = "median_ms") -> np.ndarray:
    """The baseline policy's ``column`` / each row's, within each (model, ratio); NaN without a baseline row.
    A (model, ratio) with several baseline rows (a table put together from several comparisons) takes the
    mean of their measured values."""
    key = table["ratio"].astype(object).where(table["ratio"].notna(), "none")
    is_base = (table["policy"] == baseline).to_numpy()
    values = pd.to_numeric(table[column], errors="coerce").to_numpy(dtype=float)
    measured: dict[tuple[Any, Any], list[float]] = {}
    for model, k, value in zip(table["model"][is_base], key[is_base], values[is_base], strict=True):
        measured.setdefault((model, k), [])
        if not math.isnan(value):
            measured[(model, k)].append(value)
    base = {cell: float(np.mean(found)) if found else math.nan for cell, found in measured.items()}
    base_for_row = [base.get((m, k), math.nan) for m, k in zip(table["model"], key, strict=True)]
    return np.asarray(base_for_row, dtype=float) / values


def with_speedup(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Insert ``speedup_vs_<baseline>`` after ``p90_ms``: the baseline policy's median / each row's median,
    within each (model, ratio)."""
    column = f"speedup_vs_{baseline}"
    if table.empty:
        table[column] = []
        return table
    position = table.columns.get_loc("p90_ms") + 1
    table.insert(position, column, speedup_over(table, baseline))
    return table


# ------------------------------------------------------------------------------- readable values

NOT_MEASURED = "—"  #: shown for a quantity no record measured (None, never 0) or an undefined statistic
NO_RATIO = "none"  #: shown for a ``ratio`` of None (or NaN, as a table column holds it): the profile's card
_COUNT_KEYS = frozenset({"steps", "warmup_steps", "gpu_page_faults", "evictions", "steps_completed"})
_RATIO_KEYS = frozenset({"oversubscription", "ratio", "oversubscription_ratio"})


def _missing(value: Any) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def format_value(key: str, value: Any) -> str:
    """One summary/table value as text, by what its key names.

    ``*_ms``: 2 decimals and ``ms``; ``speedup*``: 2 decimals and ``x``; ``*_bytes``: KiB/MiB/GiB/TiB;
    ratios: 2 decimals; counts: whole numbers with thousands separators; other numbers: 4 significant
    digits. An unmeasured value (None or NaN) is ``—``, never ``nan`` (a ``ratio`` of None is ``none``:
    no ratio was asked, the profile's whole card, as ``um-lab compare --ratios none`` names it; a missing
    text value is empty).
    """
    numeric = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if _missing(value):
        if key == "ratio":
            return NO_RATIO
        if key.endswith(("_ms", "_bytes")) or key.startswith("speedup") or key in _COUNT_KEYS | _RATIO_KEYS \
                or key == "last_loss":
            return NOT_MEASURED
        return ""
    if not numeric:
        return str(value)
    if key.endswith("_ms"):
        return f"{float(value):,.2f} ms"
    if key.startswith("speedup"):
        return f"{float(value):.2f}x"
    if key.endswith("_bytes"):
        return format_bytes(float(value))
    if key in _RATIO_KEYS:
        return f"{float(value):.2f}"
    if isinstance(value, (int, np.integer)) or (key in _COUNT_KEYS and float(value).is_integer()):
        return f"{int(value):,}"
    return f"{float(value):.4g}"


def format_summary(summary: Mapping[str, Any]) -> dict[str, str]:
    """A :func:`summarize` dict with every value as readable text (see :func:`format_value`)."""
    return {key: format_value(key, value) for key, value in summary.items()}


def readable_table(table: pd.DataFrame, keep_paths: bool = False) -> pd.DataFrame:
    """A copy of a ``compare()`` table for reading: times in ms with 2 decimals, speed-ups as ``1.23x``,
    bytes in KiB/MiB/GiB/TiB, unmeasured values as ``—``, a ratio of None as ``none`` (never ``NaN``).
    Columns keep their order (a ``compare()`` table has ``remote_bytes``, read over the link and never
    migrated, right after ``migrated_bytes``). ``run_dir`` is dropped unless ``keep_paths``."""
    readable = table.drop(columns=[] if keep_paths else [c for c in ("run_dir",) if c in table.columns])
    readable = readable.astype(object)
    for column in readable.columns:
        readable[column] = [format_value(str(column), value) for value in readable[column]]
    return readable
