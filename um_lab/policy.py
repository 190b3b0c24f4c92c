"""Memory-advice policies: one :class:`Advice` per data type, presets, validation, JSON round trip.

Loading a policy never evaluates code: only JSON is read, and every field is checked against the
vocabulary below. Errors are :class:`PolicyError` and name the offending field.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from um_lab.errors import FileReadError, InputError, PolicyError
from um_lab.files import POLICY_LIMIT, parse_json, read_text, refused_character
from um_lab.types import DATA_TYPES, DataType


class Location(enum.StrEnum):
    """A preferred location (``cudaMemAdviseSetPreferredLocation``; ``none``: unset)."""

    NONE = "none"
    GPU = "gpu"
    CPU = "cpu"


class Processor(enum.StrEnum):
    """A processor that can keep a mapping of the data (``cudaMemAdviseSetAccessedBy``)."""

    GPU = "gpu"
    CPU = "cpu"


class Prefetch(enum.StrEnum):
    """An explicit prefetch: to the GPU before the phase that uses the type, or to the host after the step."""

    NONE = "none"
    TO_GPU_BEFORE_USE = "to-gpu-before-use"
    TO_CPU_AFTER_USE = "to-cpu-after-use"


PREFERRED_LOCATIONS: tuple[str, ...] = tuple(v.value for v in Location)
PROCESSORS: tuple[str, ...] = tuple(v.value for v in Processor)
PREFETCHES: tuple[str, ...] = tuple(v.value for v in Prefetch)
#: The step's phases in order, and the data types each one touches first: a ``to-gpu-before-use``
#: prefetch of a type is issued at the start of its phase. One table for the real session
#: (:mod:`um_lab.cuda.session`) and the simulator (:mod:`um_lab.sim.uvm`).
STEP_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
PREFETCH_BEFORE: dict[str, tuple[DataType, ...]] = {
    "forward": (DataType.PARAM, DataType.INPUT, DataType.ACT),
    "backward": (DataType.GRAD,),
    "optimizer": (DataType.OPTIM,),
}
FORMAT_VERSION = 1

_ADVICE_FIELDS = ("preferred_location", "accessed_by", "read_mostly", "prefetch")
#: The longest policy name and description taken (a policy is a few KB; its name names folders and rows).
NAME_LIMIT = 200
DESCRIPTION_LIMIT = 16 * 1024


class PolicyFileError(FileReadError, PolicyError):  # type: ignore[misc]  # field: str in both
    """A policy file cannot be read as one: missing, not a regular file (a directory, ``/dev/null``, a FIFO),
    larger than a policy may be, not UTF-8, not JSON, or nested too deep. Both a
    :class:`~um_lab.errors.FileReadError` (``path``, ``reason``) and a :class:`PolicyError` (``field`` is
    ``policy``)."""

    def __init__(self, path: object, reason: str) -> None:
        self.path, self.what, self.reason = path, "policy", reason
        self.field, self.message = "policy", f"policy file {str(path)!r} {reason}"
        Exception.__init__(self, self.message)

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


@dataclasses.dataclass(frozen=True)
class Advice:
    """``cudaMemAdvise`` settings and prefetch action for one data type.

    ``preferred_location``: where pages should live (``none``, ``gpu``, ``cpu``).
    ``accessed_by``: processors that keep a mapping, so they access remotely instead of faulting.
    ``read_mostly``: duplicate pages on read (collapses on every write: bad for written data).
    ``prefetch``: ``to-gpu-before-use`` before the phase that uses the type, or ``to-cpu-after-use``
    after the step.
    Strings are accepted and stored as the enums :class:`Location`, :class:`Processor` and
    :class:`Prefetch` (which compare equal to their strings).
    """

    preferred_location: Location | str = Location.NONE
    accessed_by: frozenset[Processor | str] = frozenset()
    read_mostly: bool = False
    prefetch: Prefetch | str = Prefetch.NONE

    def __post_init__(self) -> None:
        accessed = self.accessed_by
        # one processor given alone ("gpu"), not the set of its characters
        object.__setattr__(self, "accessed_by", frozenset([accessed] if isinstance(accessed, str) else accessed))
        _check_values(dataclasses.asdict(self), "advice")
        object.__setattr__(self, "preferred_location", Location(self.preferred_location))
        object.__setattr__(self, "accessed_by", frozenset(Processor(p) for p in self.accessed_by))
        object.__setattr__(self, "prefetch", Prefetch(self.prefetch))

    @property
    def is_default(self) -> bool:
        """True when this is no advice at all (plain Unified Memory)."""
        return self == Advice()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``accessed_by`` sorted)."""
        return {
            "preferred_location": str(self.preferred_location),
            "accessed_by": sorted(str(p) for p in self.accessed_by),
            "read_mostly": self.read_mostly,
            "prefetch": str(self.prefetch),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "advice") -> Advice:
        """Build from a dict, rejecting unknown keys and values with a :class:`PolicyError`."""
        if not isinstance(data, Mapping):
            raise PolicyError(where, f"must be an object, got {type(data).__name__}")
        extra = sorted(set(data) - set(_ADVICE_FIELDS))
        if extra:
            raise PolicyError(f"{where}.{extra[0]}", f"unknown field; valid: {', '.join(_ADVICE_FIELDS)}")
        accessed = data.get("accessed_by", [])
        if isinstance(accessed, str) or not isinstance(accessed, Iterable):
            raise PolicyError(f"{where}.accessed_by", f"must be a list of {PROCESSORS}, got {accessed!r}")
        accessed = list(accessed)
        values = {
            "preferred_location": data.get("preferred_location", "none"),
            "accessed_by": accessed,
            "read_mostly": data.get("read_mostly", False),
            "prefetch": data.get("prefetch", "none"),
        }
        _check_values(values, where)
        return cls(**values)


def _check_chars(field: str, text: str, allowed: str = "") -> None:
    """Refuse control, bidi, invisible and surrogate characters (the rule run names follow), so that a policy's
    name reads as what it is in a terminal, a table or a file."""
    why = refused_character(text, allowed)
    if why is not None:
        raise PolicyError(field, f"{ascii(text[:60])} holds {why}; a policy {field} may not hold control, bidi, "
                                 "invisible or surrogate characters")


def _check_text(name: str, description: Any) -> None:
    """Lengths and characters of a policy's name and description (:class:`PolicyError` naming the field)."""
    if len(name) > NAME_LIMIT:
        raise PolicyError("name", f"is {len(name):,} characters, more than the {NAME_LIMIT} a policy name may have")
    if name != name.strip():
        raise PolicyError("name", f"{ascii(name)} has leading or trailing whitespace; a policy name may not "
                                  "(it would read as another policy's)")
    _check_chars("name", name)
    if isinstance(description, str) and len(description) > DESCRIPTION_LIMIT:
        raise PolicyError("description", f"is {len(description):,} characters, more than the {DESCRIPTION_LIMIT:,} a "
                                         "policy description may have")
    if isinstance(description, str):
        _check_chars("description", description, allowed="\n\t")


def _check_values(values: Mapping[str, Any], where: str) -> None:
    location = values["preferred_location"]
    if not isinstance(location, str) or location not in PREFERRED_LOCATIONS:
        raise PolicyError(
            f"{where}.preferred_location", f"{location!r} is not one of {', '.join(PREFERRED_LOCATIONS)}"
        )
    for proc in values["accessed_by"]:
        if not isinstance(proc, str) or proc not in PROCESSORS:
            raise PolicyError(f"{where}.accessed_by", f"{proc!r} is not one of {', '.join(PROCESSORS)}")
    if not isinstance(values["read_mostly"], bool):
        raise PolicyError(f"{where}.read_mostly", f"must be true or false, got {values['read_mostly']!r}")
    prefetch = values["prefetch"]
    if not isinstance(prefetch, str) or prefetch not in PREFETCHES:
        raise PolicyError(f"{where}.prefetch", f"{prefetch!r} is not one of {', '.join(PREFETCHES)}")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named set of :class:`Advice`, one per :class:`DataType` (missing types get no advice)."""

    name: str
    advice: Mapping[DataType, Advice] = dataclasses.field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise PolicyError("name", "must be a non-empty string")
        _check_text(self.name, self.description)
        full: dict[DataType, Advice] = {t: Advice() for t in DATA_TYPES}
        for key, adv in dict(self.advice).items():
            try:
                dtype = DataType.parse(key)
            except ValueError as e:
                raise PolicyError(f"advice.{key}", str(e)) from None
            if not isinstance(adv, Advice):
                raise PolicyError(f"advice.{dtype.value}", f"must be an Advice, got {type(adv).__name__}")
            full[dtype] = adv
        object.__setattr__(self, "advice", full)

    def __getitem__(self, dtype: DataType | str) -> Advice:
        return self.advice[DataType.parse(dtype)]

    def replace(self, name: str | None = None, **advice: Advice) -> Policy:
        """A copy with some types' advice replaced, e.g. ``p.replace(param=Advice(...))``."""
        merged = dict(self.advice)
        for key, adv in advice.items():
            merged[DataType.parse(key)] = adv
        return Policy(name or self.name, merged, self.description)

    @classmethod
    def from_paper_groups(
        cls,
        name: str,
        model_parameters: Advice = Advice(),
        intermediate_results: Advice = Advice(),
        input_data: Advice = Advice(),
        description: str = "",
    ) -> Policy:
        """Build from the paper's three data types (parameters = param + grad + optim)."""
        advice = {t: model_parameters for t in (DataType.PARAM, DataType.GRAD, DataType.OPTIM)}
        advice[DataType.ACT] = intermediate_results
        advice[DataType.INPUT] = input_data
        return cls(name, advice, description)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every data type present."""
        return {
            "um_lab_policy": FORMAT_VERSION,
            "name": self.name,
            "description": self.description,
            "advice": {t.value: self.advice[t].to_dict() for t in DATA_TYPES},
        }

    @classmethod
    def from_dict(cls, data: Any) -> Policy:
        """Build from a dict (as :meth:`to_dict` writes), validating every field."""
        if not isinstance(data, Mapping):
            raise PolicyError("policy", f"must be a JSON object, got {type(data).__name__}")
        allowed = {"um_lab_policy", "name", "description", "advice"}
        extra = sorted(set(data) - allowed)
        if extra:
            raise PolicyError(extra[0], f"unknown field; valid: {', '.join(sorted(allowed))}")
        version = data.get("um_lab_policy", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise PolicyError("um_lab_policy", f"unsupported format version {version!r}")
        name = data.get("name")
        if not isinstance(name, str) or not name.strip():
            raise PolicyError("name", "must be a non-empty string")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise PolicyError("description", "must be a string")
        raw = data.get("advice", {})
        if not isinstance(raw, Mapping):
            raise PolicyError("advice", "must be an object keyed by data type")
        advice = {}
        for key, value in raw.items():
            try:
                dtype = DataType.parse(key)
            except ValueError as e:
                raise PolicyError(f"advice.{key}", str(e)) from None
            advice[dtype] = Advice.from_dict(value, where=f"advice.{dtype.value}")
        return cls(name, advice, description)

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Policy:
        """Parse JSON text (nothing is evaluated; at most :data:`~um_lab.files.POLICY_LIMIT` bytes, nested at
        most :data:`~um_lab.files.JSON_DEPTH_LIMIT` levels) and validate it."""
        if not isinstance(text, str | bytes):
            raise PolicyError("policy", f"must be JSON text, got {type(text).__name__}")
        if len(text) > POLICY_LIMIT:
            raise PolicyError("policy", f"JSON text of {len(text):,} characters is more than the {POLICY_LIMIT:,} "
                                    "bytes a policy may be")
        try:
            data = parse_json(text, "policy")
        except InputError as e:
            raise PolicyError("policy", str(e).removeprefix("policy: ").replace("is not valid JSON", "not valid JSON")
                              ) from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        """Write the policy as JSON to ``path``."""
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """Read a policy JSON file: a regular file (not a directory, device or FIFO) of at most
        :data:`~um_lab.files.POLICY_LIMIT` bytes, UTF-8 JSON of bounded depth (:class:`PolicyFileError`
        naming it otherwise), then validated (:class:`PolicyError` naming the field). ``path`` must be a ``str``
        or path-like (:class:`PolicyError`, field ``path``, otherwise)."""
        if not isinstance(path, str | os.PathLike):
            raise PolicyError("path", f"a policy file's path must be a str or path-like, got {type(path).__name__} "
                                      f"{path!r}"[:200])
        try:
            data = parse_json(read_text(path, "policy", POLICY_LIMIT), "policy", source=path)
        except FileReadError as e:
            raise PolicyFileError(e.path, e.reason) from None
        try:
            return cls.from_dict(data)
        except PolicyError as e:
            raise PolicyError(e.field, f"{e.message} (in policy file {str(path)!r})") from None


_GPU_PINNED = Advice(preferred_location="gpu", accessed_by=frozenset({"gpu"}))
_ZERO_COPY = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))

#: The preset policies by name (read-only): plain UM, the paper's per-type settings and common placements.
presets: Mapping[str, Policy] = types.MappingProxyType({
    p.name: p
    for p in (
        Policy("um-default", {}, "No advice: plain Unified Memory, the paper's baseline."),
        Policy(
            "gpu-first",
            {t: _GPU_PINNED for t in DATA_TYPES},
            "Every type prefers the GPU and stays mapped there: near-native when data fits.",
        ),
        Policy(
            "zero-copy-params",
            {DataType.PARAM: _ZERO_COPY},
            "Parameters live in host memory and are read over the host link (no migration).",
        ),
        Policy(
            "offload-optimizer",
            {DataType.OPTIM: _ZERO_COPY},
            "Optimizer state lives in host memory, accessed remotely by the optimizer step.",
        ),
        Policy(
            "input-read-mostly",
            {DataType.INPUT: Advice(read_mostly=True, prefetch="to-gpu-before-use")},
            "Input batches are duplicated read-only on the GPU and prefetched before the forward pass.",
        ),
        Policy(
            "prefetch-all",
            {t: Advice(prefetch="to-gpu-before-use") for t in DATA_TYPES},
            "Every type is prefetched to the GPU before the phase that uses it.",
        ),
        # Chosen by the simulator experiment; its machine-readable provenance is
        # um_lab.teaching.paper.PRESET_PROVENANCE, the full results bench/results/paper_three_types.json.
        Policy.from_paper_groups(
            "paper-3type",
            model_parameters=Advice(),
            intermediate_results=Advice(preferred_location="gpu", accessed_by=frozenset({"gpu"}),
                                        prefetch="to-gpu-before-use"),
            input_data=_GPU_PINNED,
            description=(
                "Choi & Lee (2021)'s three types as chosen by this project's simulator experiment"
                " (notebooks/03_paper_three_types, bench/paper_three_types.py, run 2026-12-08 with the packaged"
                " h200 profile): model parameters no advice,"
                " intermediate results preferred on and mapped by the GPU and prefetched to it before use,"
                " input data preferred on and mapped by the GPU. Best of 252 mappings on GPT-2-medium,"
                " BERT-large and ResNet-50 at oversubscription 0.8-2.0: 1.29x geometric-mean speed-up over"
                " um-default, i.e. 22% less time (1.44x above ratio 1, but 0.92x at 0.8, where its prefetch"
                " calls cost time; the paper reports 9.4% less time). Everything above ratio 1 rests on the"
                " simulator alone: no GPU is oversubscribed in this project; evictions are priced at the"
                " measured GPU->host prefetch rate (18 GB/s; 3.65-5.4 GB/s the first time after a machine"
                " starts). The paper does not say which advice it used."
            ),
        ),
    )
})


LAYER_AHEAD = "layer-ahead"
LAYER_AHEAD_STAGED = "layer-ahead-staged"

#: Named policies that run a scheduler instead of (only) advising the driver. ``layer-ahead``: the
#: layer-ahead scheduler of :mod:`um_lab.schedule` keeps GPU-resident managed bytes under a budget
#: (``RunSpec.budget``; on the simulator, by default, the simulated
#: capacity), with no advice. Not in :data:`presets` (advice-only sweeps and searches leave it out); a
#: bare name reaches it through :func:`get_policy`, the CLI and the lab's panel.
SCHEDULED: dict[str, Policy] = {
    LAYER_AHEAD: Policy(
        LAYER_AHEAD, {},
        "The layer-ahead scheduler: module hooks learn the order of use in the first step, then each "
        "layer's data is prefetched to the GPU a few layers ahead and data done with is pushed to the host, "
        "keeping GPU-resident managed bytes under a budget (on the simulator by default its capacity; on a GPU "
        "--budget SIZE or a fraction of the footprint such as 0.5x). No advice."),
    LAYER_AHEAD_STAGED: Policy(
        LAYER_AHEAD_STAGED, {},
        "The layer-ahead scheduler with saved activations staged through pinned host memory (experimental): "
        "the tensors forward saves for backward are copied to the host at the link's rate (~52 GB/s on the H200, "
        "where managed prefetch to the host ran at 8-16) and back a window ahead of backward; the "
        "intermediate-results pool stays resident (plain device memory) and the scheduler moves parameters, "
        "gradients and optimizer state around it. On the H200, GPT-2-large at half its footprint: about 1.0 s a "
        "step (2026-12-03), where managed prefetch alone took 7.8 s. Budget as for layer-ahead. No advice."),
}


def stages_activations(policy: Policy | str) -> bool:
    """True for the scheduled policy that stages saved activations (``layer-ahead-staged``)."""
    return (policy.name if isinstance(policy, Policy) else policy) == LAYER_AHEAD_STAGED


def named_policies() -> dict[str, Policy]:
    """Every policy a bare name stands for: the presets and the scheduled policies."""
    return {**presets, **SCHEDULED}


def is_scheduled(policy: Policy | str) -> bool:
    """True when ``policy`` (or the name) is a scheduled policy such as ``layer-ahead``."""
    return (policy.name if isinstance(policy, Policy) else policy) in SCHEDULED


def check_preset_name(policy: Policy, baseline: str | None = None) -> Policy:
    """``policy`` unless it takes the name of a named policy (a preset, or a scheduled one such as
    ``layer-ahead``) with other advice: it would be recorded, compared and read back as that preset. One rule
    for :func:`~um_lab.runs.runner.run` and :func:`~um_lab.runs.sweep.compare` (``baseline``: the comparison's baseline
    name, said so in the error). A name that differs from a preset's only in letter case or surrounding
    whitespace counts as that preset's. Raises :class:`PolicyError` (field ``name``) naming the policy."""
    named = {key.casefold(): p for key, p in named_policies().items()}
    preset = named.get(policy.name.strip().casefold())
    if preset is not None and policy is not preset and policy.advice != preset.advice:
        role = " (the baseline)" if baseline is not None and _same_name(policy.name, baseline) else ""
        same = "the name" if policy.name == preset.name else f"the name (in other spelling: {preset.name!r})"
        raise PolicyError("name", f"policy {policy.name!r} reuses {same} of a preset{role} with other advice; "
                                  f"rename it (e.g. 'my-{preset.name}')")
    return policy


def _same_name(a: str, b: str) -> bool:
    return a.strip().casefold() == b.strip().casefold()


def get_policy(policy: Policy | str) -> Policy:
    """Return ``policy`` itself, or the preset (or scheduled policy) of that name (a :class:`PolicyError`
    lists them)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in presets:
        return presets[policy]
    if isinstance(policy, str) and policy in SCHEDULED:
        return SCHEDULED[policy]
    raise PolicyError("policy", f"unknown preset {policy!r}; valid: {', '.join(named_policies())}")
