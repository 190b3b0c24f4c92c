"""A step's timeline on a GPU, from CUPTI's timestamped unified-memory records: the same
:class:`~um_lab.sim.timeline.StepTimeline` the simulator draws kernel by kernel, here in equal slices of time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from um_lab.cuda.residency import ResidencyTracker
from um_lab.errors import InputError
from um_lab.sim.timeline import STEP_PHASES, TYPE_NAMES, StepTimeline, TimelineRow


def timeline_from_records(records: Iterable[Sequence[int]], segments: Iterable[Any], *, start_ns: int, end_ns: int,
                          slices: int = 100, phases: Mapping[str, tuple[int, int]] | None = None,
                          cause_names: Mapping[int, str] | None = None, tracker: Any = None,
                          model: str = "", policy: str = "", step: int = 0,
                          capacity_bytes: int | None = None, budget_bytes: int | None = None) -> StepTimeline:
    """A step's timeline on a GPU from CUPTI's unified-memory records, in ``slices`` equal slices of time.

    ``records``: ``(kind, value, address, start_ns, end_ns, flags)`` tuples as :mod:`um_lab.cuda.cupti_source`
    delivers them (records starting outside ``[start_ns, end_ns)`` are left out); ``segments``: the live um_lab
    segments (``ptr``, ``size``, ``data_type``), as :class:`~um_lab.cuda.residency.ResidencyTracker` takes them;
    ``tracker``: a tracker that has seen the records before the step (default: a fresh one, so residency starts
    from nothing resident, an under-count). ``phases``: ``{phase: (start_ns, end_ns)}`` on CUPTI's clock, to
    label each slice with the phase its middle falls in (elsewhere, and by default: ``""``, not known). ``cause_names``:
    CUPTI's migration causes by value (needed to count evictions; ``USER`` is an explicit prefetch).
    Each row carries what :class:`~um_lab.cuda.residency.ResidencyTracker` attributes to the records starting
    in its slice; remote bytes are not measured (CUPTI reports remote mappings, not bytes read): 0.
    """
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise InputError(f"slices must be a whole number >= 1, got {slices!r}", "slices")
    if not isinstance(start_ns, int | np.integer) or not isinstance(end_ns, int | np.integer) or end_ns <= start_ns:
        raise InputError(f"end_ns must be after start_ns, got start_ns={start_ns!r}, end_ns={end_ns!r}", "end_ns")
    for name, (lo, hi) in (phases or {}).items():
        if name not in STEP_PHASES or not hi >= lo:
            raise InputError(f"phases: {name!r}: ({lo!r}, {hi!r}) is not a phase of {STEP_PHASES} with end >= start",
                             "phases")
    tracker = tracker if tracker is not None else ResidencyTracker(cause_names=cause_names)
    segs = list(segments)
    arr = np.array([tuple(r) for r in records], dtype=np.int64).reshape(-1, 6)
    arr = arr[(arr[:, 3] >= start_ns) & (arr[:, 3] < end_ns)]
    arr = arr[np.argsort(arr[:, 3], kind="stable")]
    edges = np.linspace(start_ns, end_ns, slices + 1)
    cut = np.searchsorted(arr[:, 3], edges[1:-1], side="left")
    before = tracker.update(segs, [])
    resident_before = before.resident_bytes or dict.fromkeys(TYPE_NAMES, 0)
    zero = dict.fromkeys(TYPE_NAMES, 0)
    rows: list[TimelineRow] = []
    for i, part in enumerate(np.split(arr, cut)):
        got = tracker.update(segs, [tuple(int(v) for v in r) for r in part])
        mid = (edges[i] + edges[i + 1]) / 2
        phase = next((p for p, (lo, hi) in (phases or {}).items() if lo <= mid < hi), "")
        dtoh_cause = got.extra.get("dtoh_by_cause", {})
        htod_cause = got.extra.get("htod_by_cause", {})
        rows.append(TimelineRow(
            index=i, op=-1, name=f"slice {i}", kind="slice", phase=phase,
            start_us=(edges[i] - start_ns) / 1e3, end_us=(edges[i + 1] - start_ns) / 1e3,
            resident=dict(got.resident_bytes or zero), htod=dict(got.htod_bytes or zero),
            dtoh=dict(got.dtoh_bytes or zero), faults=int(got.gpu_page_faults or 0), evictions=int(got.evictions or 0),
            evicted_bytes=int(dtoh_cause.get("EVICTION", 0)),
            prefetched_bytes=int(htod_cause.get("USER", 0)) + int(dtoh_cause.get("USER", 0)), remote_bytes=0.0))
    return StepTimeline(model=model, policy=policy, step=step, source="cupti", wall_us=(end_ns - start_ns) / 1e3,
                        capacity_bytes=capacity_bytes, budget_bytes=budget_bytes,
                        resident_before=dict(resident_before), rows=tuple(rows))
