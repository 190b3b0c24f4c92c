"""Inside one training step: a timeline of resident bytes per data type, faults, migrations and prefetches.

On the simulator, kernel by kernel (:func:`step_timeline`)::

    from um_lab.models import get_model
    from um_lab.sim.timeline import step_timeline
    case = get_model("gpt2-small", n_layer=1, n_embd=32, n_head=2, seq_len=16, vocab_size=97, batch_size=1)
    tl = step_timeline(case, "um-default", ratio=1.5)
    tl.to_frame()          # one row per kernel (and per explicit prefetch)
    tl.totals()            # what the whole step did: the step's StepRecord, summed from the rows

Each :class:`TimelineRow` is one kernel op of the traced step (or one explicit prefetch, or the batch copy
that precedes the timed step): when it ran on the simulated GPU (µs from the step's start; the batch copy
ends at 0), its phase, the GPU-resident bytes per data type after it, and what the driver model did for
it: GPU page faults, bytes migrated host→GPU and GPU→host per type, chunks evicted and their bytes,
bytes an explicit prefetch moved, bytes read or written remotely over the host link. Summed over the rows,
these are the step's totals: the :class:`~um_lab.types.StepRecord` the :class:`~um_lab.sim.backend.SimBackend`
yields for that step (``tests/test_timeline.py`` checks it).

On a GPU, from CUPTI's timestamped unified-memory records
(:func:`um_lab.cuda.timeline.timeline_from_records`): the step cut into equal time slices, one row per slice.
The figure and the notebook view are in
:mod:`um_lab.widgets.timeline`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from um_lab.errors import InputError, PolicyError, SpecError
from um_lab.models import ModelCase, case_for_spec, get_model
from um_lab.policy import STEP_PHASES, Policy, get_policy, is_scheduled
from um_lab.sim.stepper import REC_OP, REC_PREFETCH_GPU, readmostly_write_us, run_step
from um_lab.sim.uvm import PREFETCH_PHASE, AdviceTable, UvmModel
from um_lab.types import DATA_TYPES, RunSpec

if TYPE_CHECKING:
    import pandas as pd

    from um_lab.sim.backend import PreparedCase, SimBackend

#: What a row is: the batch's host-to-device copy (before the timed step), a kernel op, an explicit prefetch
#: of one data type (``cudaMemPrefetchAsync``) to the GPU or to the host, or (on a GPU) a slice of time.
ROW_KINDS: tuple[str, ...] = ("batch-copy", "kernel", "prefetch-to-gpu", "prefetch-to-host", "slice")
#: The longest run of steps :func:`step_timeline` simulates looking for a steady step when none is named.
MAX_STEADY_SEARCH = 12
TYPE_NAMES: tuple[str, ...] = tuple(t.value for t in DATA_TYPES)


@dataclasses.dataclass(frozen=True)
class TimelineRow:
    """One kernel (or prefetch, or time slice) of a step and what the memory system did for it.

    Bytes per data type are dicts keyed by :data:`TYPE_NAMES`; times are µs from the timed step's start.
    ``evicted_bytes`` is the part of ``dtoh`` that evictions moved; ``prefetched_bytes`` the bytes an explicit
    prefetch moved (either way: in ``htod`` or ``dtoh`` too); ``evictions`` counts 2 MiB chunks.
    """

    index: int  #: position in the timeline
    op: int  #: the traced op's index (-1: not a traced op)
    name: str
    kind: str  #: one of :data:`ROW_KINDS`
    phase: str  #: one of :data:`um_lab.policy.STEP_PHASES`; "" where not known (GPU slices without phase times)
    start_us: float
    end_us: float
    resident: dict[str, int]  #: GPU-resident bytes per data type after this row
    htod: dict[str, int]
    dtoh: dict[str, int]
    faults: int
    evictions: int
    evicted_bytes: int
    prefetched_bytes: int
    remote_bytes: float

    @property
    def duration_us(self) -> float:
        """``end_us - start_us``."""
        return self.end_us - self.start_us

    @property
    def resident_bytes(self) -> int:
        """GPU-resident bytes after this row, all types."""
        return sum(self.resident.values())

    @property
    def htod_bytes(self) -> int:
        """Bytes migrated (or prefetched) host→GPU in this row, all types."""
        return sum(self.htod.values())

    @property
    def dtoh_bytes(self) -> int:
        """Bytes moved GPU→host in this row (evictions and prefetches), all types."""
        return sum(self.dtoh.values())


@dataclasses.dataclass(frozen=True)
class PhaseSpan:
    """Where one phase of the step ran: from its first row's start to its last row's end (µs)."""

    phase: str
    start_us: float
    end_us: float


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """One step, row by row (:class:`TimelineRow`), with the GPU's capacity (or a budget) to draw against.

    ``source``: ``"sim"`` (kernel by kernel, :func:`step_timeline`) or ``"cupti"`` (time slices,
    :func:`um_lab.cuda.timeline.timeline_from_records`). ``steady``: on the simulator, whether the step repeats the
    one before it exactly (the driver state it starts from is the previous step's). ``resident_before``: resident bytes
    per type at the start of the rows (the previous step's end).
    """

    model: str
    policy: str
    step: int
    source: str
    wall_us: float
    capacity_bytes: int | None
    budget_bytes: int | None
    resident_before: dict[str, int]
    rows: tuple[TimelineRow, ...]
    steady: bool = True

    @property
    def data_types(self) -> tuple[str, ...]:
        """The data type names, in the order every per-type field uses."""
        return TYPE_NAMES

    @property
    def kernels(self) -> tuple[TimelineRow, ...]:
        """The rows that are kernel ops of the timed step (no batch copy, no prefetch)."""
        return tuple(r for r in self.rows if r.kind == "kernel")

    @property
    def limit_bytes(self) -> int | None:
        """The line resident bytes stay under: the budget when there is one, else the capacity."""
        return self.budget_bytes if self.budget_bytes is not None else self.capacity_bytes

    def phases(self) -> tuple[PhaseSpan, ...]:
        """The step's phases in order (forward, backward, optimizer; those present), from its kernels and
        prefetches (the batch copy before the step is left out)."""
        spans: dict[str, list[float]] = {}
        for r in self.rows:
            if r.kind == "batch-copy":
                continue
            s = spans.setdefault(r.phase, [r.start_us, r.end_us])
            s[0], s[1] = min(s[0], r.start_us), max(s[1], r.end_us)
        return tuple(PhaseSpan(p, *spans[p]) for p in STEP_PHASES if p in spans)

    def totals(self) -> dict[str, Any]:
        """The step's totals summed over the rows, in :class:`~um_lab.types.StepRecord`'s terms: ``wall_ms``,
        ``gpu_page_faults``, ``evictions``, ``htod_bytes`` / ``dtoh_bytes`` / ``resident_bytes`` per type (resident:
        after the last row), ``remote_bytes``; and ``evicted_bytes``, ``prefetched_bytes``."""
        htod = dict.fromkeys(TYPE_NAMES, 0)
        dtoh = dict.fromkeys(TYPE_NAMES, 0)
        for r in self.rows:
            for t in TYPE_NAMES:
                htod[t] += r.htod[t]
                dtoh[t] += r.dtoh[t]
        return {
            "wall_ms": self.wall_us / 1e3,
            "gpu_page_faults": sum(r.faults for r in self.rows),
            "evictions": sum(r.evictions for r in self.rows),
            "htod_bytes": htod,
            "dtoh_bytes": dtoh,
            "resident_bytes": dict(self.rows[-1].resident if self.rows else self.resident_before),
            "remote_bytes": float(sum(r.remote_bytes for r in self.rows)),
            "evicted_bytes": sum(r.evicted_bytes for r in self.rows),
            "prefetched_bytes": sum(r.prefetched_bytes for r in self.rows),
        }

    def row_at(self, t_us: float) -> TimelineRow | None:
        """The kernel (or slice) running at ``t_us``: the last one that started at or before it (None: before
        the first)."""
        rows, starts = self._running
        i = int(np.searchsorted(starts, t_us, side="right")) - 1
        return rows[i] if i >= 0 else None

    @functools.cached_property
    def _running(self) -> tuple[list[TimelineRow], np.ndarray]:
        rows = [r for r in self.rows if r.kind in ("kernel", "slice")]
        return rows, np.array([r.start_us for r in rows])

    def to_frame(self) -> pd.DataFrame:
        """One row per timeline row: ``index, op, name, kind, phase, start_us, end_us, duration_us``,
        ``resident_<type>`` and ``resident_bytes`` (after it), ``htod_bytes, dtoh_bytes`` (and per type:
        ``htod_<type>``, ``dtoh_<type>``), ``faults, evictions, evicted_bytes, prefetched_bytes, remote_bytes``."""
        import pandas as pd

        cols: dict[str, list[Any]] = {k: [] for k in (
            "index", "op", "name", "kind", "phase", "start_us", "end_us", "duration_us",
            *(f"resident_{t}" for t in TYPE_NAMES), "resident_bytes", "htod_bytes", "dtoh_bytes",
            "faults", "evictions", "evicted_bytes", "prefetched_bytes", "remote_bytes",
            *(f"htod_{t}" for t in TYPE_NAMES), *(f"dtoh_{t}" for t in TYPE_NAMES))}
        for r in self.rows:
            for k in ("index", "op", "name", "kind", "phase", "start_us", "end_us", "duration_us", "resident_bytes",
                      "htod_bytes", "dtoh_bytes", "faults", "evictions", "evicted_bytes", "prefetched_bytes",
                      "remote_bytes"):
                cols[k].append(getattr(r, k))
            for t in TYPE_NAMES:
                cols[f"resident_{t}"].append(r.resident[t])
                cols[f"htod_{t}"].append(r.htod[t])
                cols[f"dtoh_{t}"].append(r.dtoh[t])
        return pd.DataFrame(cols)

    def describe(self) -> str:
        """One line: model, policy, step, step time and the step's traffic, in human units."""
        t = self.totals()
        return (f"{self.model} · {self.policy} · step {self.step}: {t['wall_ms']:.3f} ms, "
                f"{t['gpu_page_faults']} faults, {_mib(sum(t['htod_bytes'].values()))} to GPU, "
                f"{_mib(sum(t['dtoh_bytes'].values()))} to host, {t['evictions']} chunks evicted, "
                f"{_mib(t['prefetched_bytes'])} prefetched, {_mib(t['remote_bytes'])} remote")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _per_type(values: np.ndarray) -> dict[str, int]:
    return {t: int(v) for t, v in zip(TYPE_NAMES, values.tolist(), strict=True)}


class _Recorder:
    """The :data:`~um_lab.sim.stepper.StepRecorder` :func:`step_timeline` hands to ``run_step``: it takes the
    driver model's counters after each op and prefetch and keeps the differences."""

    def __init__(self, model: UvmModel, names: Sequence[str], phases: np.ndarray, batch_copy: bool) -> None:
        self.model = model
        self.names = names
        self.phases = phases
        self.batch_copy = batch_copy
        n = len(TYPE_NAMES)
        self.htod = np.zeros(n, np.int64)  # run_step resets the model's counters: differences start from zero
        self.dtoh = np.zeros(n, np.int64)
        self.faults = self.evictions = 0
        self.remote = 0.0
        self.resident = model.resident_by_type()
        self.before = _per_type(self.resident)
        self.rows: list[TimelineRow] = []

    def __call__(self, kind: str, index: int, start: float, end: float) -> None:
        m = self.model
        htod, dtoh = m.htod - self.htod, m.dtoh - self.dtoh
        faults, evictions, remote = m.faults - self.faults, m.evictions - self.evictions, m.remote_bytes - self.remote
        self.htod, self.dtoh = m.htod.copy(), m.dtoh.copy()
        self.faults, self.evictions, self.remote = m.faults, m.evictions, m.remote_bytes
        if kind != REC_OP or faults or evictions or htod.any() or dtoh.any():
            # only faults, evictions and prefetches change what is resident (a fault for every block brought in,
            # an eviction for every chunk freed): otherwise the last count stands
            self.resident = m.resident_by_type()
        moved_in, moved_out = int(htod.sum()), int(dtoh.sum())
        if kind == REC_OP:
            first = index == 0 and self.batch_copy
            row_kind, name, op = ("batch-copy" if first else "kernel"), self.names[index], index
            phase = STEP_PHASES[int(self.phases[index])]
            if first:  # the batch copy precedes the timed step, whose clocks start at 0 when it ends
                start, end = start - end, 0.0
            evicted, prefetched = moved_out, 0
        elif kind == REC_PREFETCH_GPU:
            t = DATA_TYPES[index]
            row_kind, name, op, phase = kind, f"prefetch {t.value} to GPU", -1, STEP_PHASES[PREFETCH_PHASE[t]]
            evicted, prefetched = moved_out, moved_in
        else:
            row_kind, name, op, phase = kind, f"prefetch {DATA_TYPES[index].value} to host", -1, STEP_PHASES[-1]
            evicted, prefetched = 0, moved_out
        self.rows.append(TimelineRow(
            index=len(self.rows), op=op, name=name, kind=row_kind, phase=phase, start_us=float(start),
            end_us=float(end), resident=_per_type(self.resident), htod=_per_type(htod), dtoh=_per_type(dtoh),
            faults=int(faults), evictions=int(evictions), evicted_bytes=evicted, prefetched_bytes=prefetched,
            remote_bytes=float(remote)))


_DEFAULT_BACKEND: dict[str, SimBackend] = {}


def _default_backend(case: ModelCase) -> SimBackend:
    """The SimBackend for calls that name none: one for the last model configuration asked for (its prepared
    case is reused by the next call on it; another configuration gets a fresh one, so at most one is kept)."""
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.trace import case_key

    key = case_key(case)
    if key not in _DEFAULT_BACKEND:
        _DEFAULT_BACKEND.clear()
        _DEFAULT_BACKEND[key] = SimBackend()
    return _DEFAULT_BACKEND[key]


def _as_policy(policy: object) -> Policy:
    if isinstance(policy, Policy | str):
        return get_policy(policy)
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    raise PolicyError("policy", f"must be a Policy, a preset name or a policy dict, got {type(policy).__name__}")


def _resolve(case: ModelCase | RunSpec | str, policy: object, ratio: float | None, capacity_bytes: int | None,
             model_kwargs: Mapping[str, Any] | None) -> tuple[ModelCase, Policy, RunSpec]:
    """The model case, the policy and a spec carrying the simulated GPU's size."""
    if model_kwargs is not None and not isinstance(case, str):
        raise SpecError("model_kwargs goes with a model name; a ModelCase or RunSpec carries its own knobs",
                        "model_kwargs")
    if isinstance(case, RunSpec):
        spec = case
        if ratio is not None or capacity_bytes is not None:  # given here: they replace the spec's
            spec = dataclasses.replace(spec, oversubscription_ratio=ratio, capacity_bytes=capacity_bytes)
        model = case_for_spec(spec)
        chosen = _as_policy(spec.policy if policy is None else policy)
    else:
        if isinstance(case, str):
            model = get_model(case, **dict(model_kwargs or {}))
        elif isinstance(case, ModelCase):
            model = case
        else:
            raise InputError(f"case must be a ModelCase, a RunSpec or a model name, got {type(case).__name__}",
                             "case")
        chosen = _as_policy("um-default" if policy is None else policy)
        spec = RunSpec(model=model.name, policy=chosen.name, backend="sim", oversubscription_ratio=ratio,
                       capacity_bytes=capacity_bytes)
    if spec.has_budget or is_scheduled(chosen):
        raise SpecError(f"the timeline follows the driver's demand paging; {chosen.name!r} with a GPU budget runs "
                        "the layer-ahead scheduler's model (um_lab.sim.budget), which has no kernel-by-kernel "
                        "timeline yet: pick a policy of advice, without a budget",
                        "budget" if spec.has_budget else "policy")
    return model, chosen, spec


def step_timeline(case: ModelCase | RunSpec | str, policy: Policy | str | Mapping[str, Any] | None = None, *,
                  ratio: float | None = None, capacity_bytes: int | None = None, step: int | None = None,
                  model_kwargs: Mapping[str, Any] | None = None, backend: SimBackend | None = None) -> StepTimeline:
    """Simulate up to one step of ``case`` under ``policy`` and return that step kernel by kernel.

    ``case``: a :class:`~um_lab.models.ModelCase`, a model name (with ``model_kwargs``, as
    :func:`~um_lab.models.get_model` takes them) or a :class:`~um_lab.types.RunSpec` (its model, knobs, policy
    and simulated GPU size; ``ratio`` / ``capacity_bytes`` given here replace its size). ``policy``: a preset
    name, a :class:`~um_lab.policy.Policy` or a policy dict (default: the spec's, else ``um-default``). The
    simulated GPU holds ``footprint / ratio`` or ``capacity_bytes`` (neither: the profile's card).
    ``step``: which step (0 is the first, warm-up steps counted, as :attr:`StepRecord.step`); None: the first
    steady step (one that repeats the step before it), searched up to :data:`MAX_STEADY_SEARCH`.
    ``backend``: the :class:`~um_lab.sim.backend.SimBackend` to use (its profile and prepared cases); default:
    one kept for the last model configuration (calls on the same one reuse its preparation).

    Runs under a GPU budget (``layer-ahead``, ``RunSpec.budget``) are refused (:class:`SpecError`): the
    scheduler's model has no per-kernel timeline. Bad input raises :class:`SpecError` / :class:`PolicyError` /
    :class:`~um_lab.errors.ModelConfigError`, naming the field.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0):
        raise SpecError(f"step must be a whole number >= 0 (0 is the first step, warm-up included), got {step!r}",
                        "step")
    model_case, chosen, spec = _resolve(case, policy, ratio, capacity_bytes, model_kwargs)
    sim = backend if backend is not None else _default_backend(model_case)
    prepared = sim.prepare(model_case)
    capacity = sim.capacity_for(spec, prepared.footprint_bytes)
    return _simulate(sim, prepared, model_case.name, chosen, capacity, None if step is None else int(step))


def _simulate(sim: SimBackend, prepared: PreparedCase, model_name: str, policy: Policy, capacity: int,
              step: int | None) -> StepTimeline:
    from um_lab.sim.backend import initialise
    from um_lab.sim.placement import BLOCK
    from um_lab.sim.trace import KIND_H2D_COPY

    trace = prepared.trace
    layouts = prepared.placement.layouts
    advice = AdviceTable.from_policy(policy)
    final = prepared.placement.final
    model = UvmModel(sim.profile, advice, capacity, final.n_blocks)
    model.block_type[:] = final.block_type
    initialise(model, prepared)
    rm_us: dict[int, np.ndarray] = {}

    def rm(li: int) -> np.ndarray:
        if li not in rm_us:
            rm_us[li] = readmostly_write_us(trace, prepared.op_blocks[li], final.block_type, advice, sim.profile)
        return rm_us[li]

    # walk to the chosen step as SimBackend does; a step that starts from the state (and layout) the step before
    # started from repeats it exactly, and so does every later one: stop there
    last = len(layouts) - 1
    previous: tuple[str, int] | None = None
    s, steady = 0, False
    while True:
        li = min(s, last)
        state = (model.state_digest(), li)
        steady = previous == state
        if steady or s == (step if step is not None else MAX_STEADY_SEARCH):
            break
        run_step(model, trace, layouts[li], prepared.op_blocks[li], prepared.base_us, rm(li), sim.prefetch_stream,
                 prepared.host_us)
        previous = state
        s += 1
    target = step if step is not None else s
    layout = layouts[li]
    model.block_type[: layout.n_blocks] = layout.block_type  # as run_step sets it, for the resident bytes before
    rec = _Recorder(model, trace.op_names, trace.op_phase, trace.n_ops > 0 and trace.op_kind[0] == KIND_H2D_COPY)
    stats = run_step(model, trace, layout, prepared.op_blocks[li], prepared.base_us, rm(li), sim.prefetch_stream,
                     prepared.host_us, recorder=rec)
    return StepTimeline(model=model_name, policy=policy.name, step=target, source="sim", wall_us=float(stats.wall_us),
                        capacity_bytes=int(capacity // BLOCK * BLOCK), budget_bytes=None,
                        resident_before=rec.before, rows=tuple(rec.rows), steady=steady)
