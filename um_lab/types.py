"""The schema every part of um_lab speaks: data types, run specifications, step records.

Plain dataclasses only. Backends (:mod:`um_lab.backend`: ``cuda``, ``sim``, any registered one) produce
:class:`StepRecord` objects; the runner, the run log and the dashboards consume them, and cannot tell the
backends apart.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from um_lab.backend import AUTO, backend_names, valid_backend_names
from um_lab.errors import BudgetError, SpecError
from um_lab.schedule.config import Budget
from um_lab.schedule.stats import BudgetStats
from um_lab.units import positive_ratio, size_bytes, whole_bytes  # noqa: F401 - one check each, importable here


class DataType(enum.StrEnum):
    """The kinds of training data that get a pool (and advice) of their own."""

    PARAM = "param"  #: weights and buffers
    GRAD = "grad"  #: parameter gradients
    OPTIM = "optim"  #: optimizer state
    ACT = "act"  #: intermediate results: saved activations, activation gradients, temporaries
    INPUT = "input"  #: batches moved to the GPU

    @classmethod
    def parse(cls, value: str | DataType) -> DataType:
        """Return the member named ``value``; raise ``ValueError`` listing the valid names."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(t.value for t in cls)
            raise ValueError(f"unknown data type {value!r}; valid: {names}") from None


#: Order used wherever per-type values are stored in fixed-size arrays (the C shim's tags).
DATA_TYPES: tuple[DataType, ...] = tuple(DataType)

#: The paper's three types (Choi & Lee 2021) as groups of ours.
PAPER_GROUPS: Mapping[str, tuple[DataType, ...]] = {
    "model parameters": (DataType.PARAM, DataType.GRAD, DataType.OPTIM),
    "intermediate results": (DataType.ACT,),
    "input data": (DataType.INPUT,),
}


#: What a run computes in: fp32, or autocast to bf16 / fp16 with fp32 master weights (:mod:`um_lab.training`).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
#: Which layers recompute their activations in backward, besides a number of layers or layer names
#: (``"auto"``: the memory planner chooses, within the run's GPU budget: :mod:`um_lab.sim.planner`).
RECOMPUTE_NAMES = ("none", "every-layer", "auto")

Recompute = str | int | tuple[str, ...]


def check_precision(precision: object) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else :class:`~um_lab.errors.SpecError`."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}"[:200], "precision")
    return precision


def check_recompute(recompute: object) -> Recompute:
    """``recompute`` in its canonical form (a list of names becomes a tuple), else
    :class:`~um_lab.errors.SpecError` naming what was given."""
    if isinstance(recompute, str):
        if recompute in RECOMPUTE_NAMES:
            return recompute
        if recompute.isdigit():
            return int(recompute)
        return (recompute,)  # one layer's name
    if isinstance(recompute, bool) or recompute is None:
        raise SpecError(f"recompute must be 'none', 'every-layer', a number of layers or layer names; "
                        f"got {recompute!r}", "recompute")
    if isinstance(recompute, int):
        if recompute < 0:
            raise SpecError(f"recompute: a number of layers must be >= 0, got {recompute}", "recompute")
        return recompute
    if isinstance(recompute, Sequence) and recompute and all(isinstance(n, str) and n for n in recompute):
        return tuple(recompute)
    raise SpecError(f"recompute must be 'none', 'every-layer', a number of layers or a list of layer names; "
                    f"got {recompute!r}"[:300], "recompute")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What to run: model, batch, policy, backend, steps and (for the simulator) GPU capacity."""

    model: str = "mlp"
    policy: str = "um-default"
    backend: str = "auto"  #: a registered backend's name ("cuda", "sim", ...) or "auto" (cuda when available, else sim)
    steps: int = 20
    warmup_steps: int = 2
    batch_size: int | None = None
    model_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    capacity_bytes: int | None = None  #: simulated GPU capacity; None = the profile's card
    oversubscription_ratio: float | None = None  #: alternative to capacity_bytes (sim only)
    seed: int = 0
    #: a GPU budget for the layer-ahead scheduler: GPU-resident managed bytes stay <= it (a
    #: :class:`~um_lab.schedule.config.Budget`, or what it takes: bytes, ``"8GiB"``, ``"0.5x"`` of the footprint)
    budget: Budget | None = None
    #: what the step computes in: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast, fp32 master weights)
    precision: str = "fp32"
    #: which layers recompute their activations in backward: ``"none"``, ``"every-layer"``, the first *n*
    #: layers, layer names (:func:`um_lab.training.layer_names`), or ``"auto"``: the memory planner chooses the
    #: layers and whether activations are staged, for the least predicted step within ``budget``
    recompute: Recompute = "none"

    def __post_init__(self) -> None:
        for name in ("model", "policy", "backend"):
            if not isinstance(getattr(self, name), str):
                raise SpecError(f"{name} must be a name (str), got {getattr(self, name)!r}", name)
        _check_int(self, "steps", 1)
        _check_int(self, "warmup_steps", 0)
        _check_int(self, "seed", None)
        if self.batch_size is not None:
            _check_int(self, "batch_size", 1)
        if self.backend != AUTO and self.backend not in backend_names():
            raise SpecError(f"unknown backend {self.backend!r}; valid: {valid_backend_names()}", "backend")
        if not isinstance(self.model_kwargs, Mapping) or not all(isinstance(k, str) for k in self.model_kwargs):
            raise SpecError(f"model_kwargs must be a dict of knob names to values, got {self.model_kwargs!r}",
                            "model_kwargs")
        if self.capacity_bytes is not None:
            object.__setattr__(self, "capacity_bytes", capacity_value("capacity_bytes", self.capacity_bytes))
        if self.oversubscription_ratio is not None:
            object.__setattr__(self, "oversubscription_ratio",
                               ratio_value("oversubscription_ratio", self.oversubscription_ratio))
        if self.capacity_bytes is not None and self.oversubscription_ratio is not None:
            raise SpecError(
                f"give capacity_bytes or oversubscription_ratio, not both: capacity_bytes={self.capacity_bytes} "
                f"({self.capacity_bytes / 2**30:.2f} GiB) sets the simulated GPU's size, and so does "
                f"oversubscription_ratio={self.oversubscription_ratio:g} (the model's footprint / ratio)",
                "capacity_bytes")
        check_precision(self.precision)
        object.__setattr__(self, "recompute", check_recompute(self.recompute))
        if self.budget is not None and not isinstance(self.budget, Budget):
            try:
                object.__setattr__(self, "budget", Budget(self.budget))
            except BudgetError as e:
                raise SpecError(f"budget: {e}", "budget") from None
        if self.recompute == "auto" and self.budget is None:
            raise SpecError("recompute='auto' lets the memory planner choose what to recompute within a GPU budget: "
                            "give one (budget='0.5x' of the footprint, or bytes such as '8GiB')", "recompute")

    @property
    def has_budget(self) -> bool:
        """True when a GPU budget is given (bytes or a fraction of the footprint)."""
        return self.budget is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model_kwargs"] = dict(self.model_kwargs)
        d["budget"] = None if self.budget is None else self.budget.to_dict()
        d["recompute"] = list(self.recompute) if isinstance(self.recompute, tuple) else self.recompute
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, recorded: bool = False) -> RunSpec:
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`~um_lab.errors.SpecError`.

        ``recorded=True`` reads a spec a run already ran with: its backend need not be registered in
        this process (a plugin's run folder reads back without the plugin)."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = dict(data)
        if recorded:  # a run folder written when the budget was two fields
            nbytes, fraction = fields.pop("gpu_budget_bytes", None), fields.pop("gpu_budget_fraction", None)
            if fields.get("budget") is None and (nbytes is not None or fraction is not None):
                fields["budget"] = {"size": nbytes if nbytes is not None else fraction}
        extra = set(fields) - known
        if extra:
            raise SpecError(f"unknown RunSpec fields: {sorted(extra)}")
        if isinstance(fields.get("budget"), Mapping):
            fields["budget"] = Budget.from_dict(fields["budget"])
        late: dict[str, Any] = {}
        if recorded:  # rules newer than a recorded spec (a minimum capacity, not both sizes) do not unread it
            for name in ("capacity_bytes", "oversubscription_ratio"):
                if fields.get(name) is not None:
                    late[name] = (whole_bytes if name == "capacity_bytes" else positive_ratio)(name, fields[name])
                    fields[name] = None
        backend = fields.get("backend", AUTO)
        if recorded and isinstance(backend, str) and backend != AUTO and backend not in backend_names():
            spec = cls(**{**fields, "backend": AUTO})
            object.__setattr__(spec, "backend", backend)  # checked when it ran
        else:
            spec = cls(**fields)
        for name, value in late.items():
            object.__setattr__(spec, name, value)
        return spec


MIN_CAPACITY_BYTES = 2 << 20
#: The largest simulated GPU um_lab takes: 1 PiB (a capacity above it is a typo, not a GPU).
MAX_CAPACITY_BYTES = 1 << 50
#: The smallest oversubscription ratio: below it the simulated GPU is over 1000 times the model's footprint
#: (nothing to study), and a tiny ratio (1e-300) makes a capacity no number can hold.
MIN_RATIO = 1e-3


def capacity_value(name: str, value: Any) -> int:
    """``value`` as a simulated GPU capacity: whole bytes (:func:`whole_bytes`), at least one 2 MiB chunk
    (:data:`MIN_CAPACITY_BYTES`) and at most :data:`MAX_CAPACITY_BYTES`; else :class:`SpecError` naming ``name``."""
    capacity = whole_bytes(name, value)
    if capacity < MIN_CAPACITY_BYTES:
        raise SpecError(f"{name}={value!r} B is below one 2 MiB chunk ({MIN_CAPACITY_BYTES} B), the smallest GPU the "
                        "simulator models; give a larger capacity (e.g. 8GiB)", name)
    if capacity > MAX_CAPACITY_BYTES:
        raise SpecError(f"{name}={value!r} B is above {MAX_CAPACITY_BYTES} B (1 PiB), more than any GPU; give the "
                        "capacity in bytes (e.g. 8GiB)", name)
    return capacity


def ratio_value(name: str, value: Any) -> float:
    """``value`` as an oversubscription ratio: finite, > 0 (:func:`positive_ratio`) and at least
    :data:`MIN_RATIO`; else :class:`SpecError` naming ``name``."""
    ratio = positive_ratio(name, value)
    if ratio < MIN_RATIO:
        raise SpecError(f"{name}={value!r} is below {MIN_RATIO:g}: the simulated GPU would be over "
                        f"{1 / MIN_RATIO:g} times the model's footprint (no oversubscription to study); give a "
                        f"ratio >= {MIN_RATIO:g}, or none for the profile's card", name)
    return ratio


def _check_int(spec: RunSpec, name: str, minimum: int | None) -> None:
    """Raise :class:`SpecError` unless ``spec.<name>`` is an integer (>= ``minimum``)."""
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SpecError(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise SpecError(f"{name} must be >= {minimum}, got {value}", name)
    object.__setattr__(spec, name, int(value))


@dataclasses.dataclass
class StepRecord:
    """One training step as a backend saw it.

    Per-type fields are dicts keyed by data type name (``"param"``, ``"grad"``, ...). Fields a backend
    cannot measure stay ``None`` (never invented); ``telemetry`` says why when they are missing.
    """

    step: int
    wall_ms: float  #: step time (CUDA events on the real backend, the model on the simulator)
    live_bytes: dict[str, int]  #: managed bytes allocated per data type (segments, not tensors)
    cap_bytes: int | None  #: the safety cap on live managed bytes (None: no cap, e.g. simulator)
    gpu_capacity_bytes: int  #: GPU memory (total on the real card; simulated capacity on sim)
    backend: str = "unknown"  #: the name of the backend that ran the step (each backend sets its own)
    policy: str = "um-default"
    loss: float | None = None
    warmup: bool = False
    resident_bytes: dict[str, int] | None = None  #: GPU-resident bytes per type (telemetry / sim)
    htod_bytes: dict[str, int] | None = None  #: migrated host->device per type this step
    dtoh_bytes: dict[str, int] | None = None  #: migrated device->host per type this step
    gpu_page_faults: int | None = None
    evictions: int | None = None  #: evicted 2 MiB chunks this step
    remote_bytes: int | None = None  #: bytes read or written over the host link without migrating
    telemetry: str = "unavailable: not collected"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def live_total(self) -> int:
        """All live managed bytes."""
        return sum(self.live_bytes.values())

    @property
    def oversubscription_ratio(self) -> float:
        """Live managed bytes / GPU capacity (> 1 means the data cannot all be resident)."""
        if self.gpu_capacity_bytes <= 0:
            return math.inf
        return self.live_total / self.gpu_capacity_bytes

    @property
    def budget(self) -> BudgetStats | None:
        """The layer-ahead scheduler's numbers of this step, typed (None: no budget)."""
        numbers = self.extra.get("budget")
        return BudgetStats.from_dict(numbers) if isinstance(numbers, Mapping) else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (includes the derived ``oversubscription_ratio``)."""
        d = dataclasses.asdict(self)
        d["oversubscription_ratio"] = self.oversubscription_ratio
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """Inverse of :meth:`to_dict` (derived and unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
