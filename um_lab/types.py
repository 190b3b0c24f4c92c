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
import re
from collections.abc import Mapping
from typing import Any

from um_lab.backend import AUTO, backend_names, valid_backend_names
from um_lab.errors import SpecError


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
    #: a GPU budget for the layer-ahead scheduler (issue 13): GPU-resident managed bytes stay <= it
    gpu_budget_bytes: int | None = None
    #: the budget as a fraction of the run's footprint, in (0, 1] (0.5: footprint/budget = 2)
    gpu_budget_fraction: float | None = None

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
        if self.gpu_budget_bytes is not None:
            object.__setattr__(self, "gpu_budget_bytes", whole_bytes("gpu_budget_bytes", self.gpu_budget_bytes))
        if self.gpu_budget_fraction is not None:
            object.__setattr__(self, "gpu_budget_fraction", budget_fraction(self.gpu_budget_fraction))
            if self.gpu_budget_bytes is not None:
                raise SpecError("give gpu_budget_bytes or gpu_budget_fraction, not both", "gpu_budget_fraction")

    @property
    def has_budget(self) -> bool:
        """True when a GPU budget is given (bytes or a fraction of the footprint)."""
        return self.gpu_budget_bytes is not None or self.gpu_budget_fraction is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["model_kwargs"] = dict(self.model_kwargs)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, recorded: bool = False) -> RunSpec:
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`~um_lab.errors.SpecError`.

        ``recorded=True`` reads a spec a run already ran with: its backend need not be registered in
        this process (a plugin's run folder reads back without the plugin)."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(data) - known
        if extra:
            raise SpecError(f"unknown RunSpec fields: {sorted(extra)}")
        fields = dict(data)
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


def whole_bytes(name: str, value: Any) -> int:
    """``value`` as a whole number of bytes > 0 (``1e9`` and NumPy integers are accepted), else
    :class:`SpecError` naming ``name``: the one check of a capacity in bytes (:class:`RunSpec`,
    :func:`um_lab.sizing.size_for_ratio`, the simulator's capacity)."""
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value <= 0:
        raise SpecError(f"{name} must be > 0 and a whole number of bytes, got {value!r}", name)
    return int(value)


def positive_ratio(name: str, value: Any) -> float:
    """``value`` as a finite number > 0 (an oversubscription ratio), else :class:`SpecError` naming ``name``:
    the one check of a ratio (:class:`RunSpec`, :func:`um_lab.sizing.size_for_ratio`, the simulator)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not float(value) > 0):
        raise SpecError(f"{name} must be > 0 and finite, got {value!r}", name)
    return float(value)


#: The smallest simulated GPU: one 2 MiB chunk (the simulator's unit of residency).
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


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def size_bytes(text: str, field: str | None = None) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5GB"`` and ``"1.5e9"`` -> 1500000000; plain numbers are bytes.
    Anything else, or a size <= 0, raises :class:`SpecError` (naming ``field``)."""
    match = _SIZE.fullmatch(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecError(f"not a size: {text!r} (examples: 8GiB, 512MiB, 1.5GB, 1e9, 1048576)", field)
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number):
        raise SpecError(f"size too large: {text!r}", field)
    value = int(number)
    if value <= 0:
        raise SpecError(f"size must be > 0: {text!r}", field)
    return value


def budget_from_text(text: str) -> tuple[int | None, float | None]:
    """A GPU budget as a user writes it: a size (``8GiB``, ``1.5e9``) -> ``(bytes, None)``, or a fraction of
    the run's footprint (``0.5x``, in (0, 1]) -> ``(None, 0.5)``; else :class:`SpecError`."""
    stripped = text.strip()
    if stripped.lower().endswith("x"):
        try:
            fraction = float(stripped[:-1])
        except ValueError:
            raise SpecError(f"not a budget: {text!r} (a size such as 8GiB, or a fraction of the footprint such "
                            "as 0.5x)", "gpu_budget_fraction") from None
        try:
            return None, budget_fraction(fraction)
        except SpecError:
            raise SpecError(f"a budget fraction is budget / footprint, in (0, 1]: {text!r} (0.5x: footprint/budget "
                            "= 2)", "gpu_budget_fraction") from None
    try:
        return size_bytes(text, "gpu_budget_bytes"), None
    except SpecError as e:
        raise SpecError(f"{e}; a budget is a size or a fraction of the footprint such as 0.5x",
                        "gpu_budget_bytes") from None


def budget_fraction(value: Any) -> float:
    """``value`` as a GPU budget's fraction of the footprint, finite in (0, 1], else :class:`SpecError`."""
    fraction = positive_ratio("gpu_budget_fraction", value)
    if fraction > 1:
        raise SpecError(f"gpu_budget_fraction is the budget / footprint, in (0, 1]; got {value!r} (a budget at "
                        "or above the footprint constrains nothing)", "gpu_budget_fraction")
    return fraction


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
