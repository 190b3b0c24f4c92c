"""The Backend protocol every backend implements, and the registry that turns a name into one.

A backend is an object: callers (the runner, ``compare``, the run log) ask it what it can do and never
test its name. A third backend is one new module::

    from um_lab.backend import BackendBase, register_backend

    class MyBackend(BackendBase):
        name = "mine"
        def run(self, spec, case, policy): ...  # yield one StepRecord(backend=self.name, ...) per step

    register_backend("mine", MyBackend)   # then RunSpec(backend="mine"), run(...), compare(backend="mine")

The built-in backends (``cuda``, ``sim``) are registered as ``"module:Class"`` and imported on first use,
so ``import um_lab`` stays light. ``auto`` is not a backend: it resolves to ``cuda`` when a GPU is present,
else ``sim``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from um_lab.models import ModelCase
    from um_lab.policy import Policy
    from um_lab.types import RunSpec, StepRecord

AUTO = "auto"  #: the name that picks a backend for this process (see :func:`resolve_backend_name`)


@runtime_checkable
class Backend(Protocol):
    """Runs ``spec.steps`` training steps of ``case`` under ``policy``, yielding one record per step.

    Records are yielded as each step completes (warm-up steps first, flagged ``warmup=True``), each with
    ``backend`` set to :attr:`name`. Closing the generator early must leave the process usable (pools
    released, state restored). The class-level members (:attr:`name`, :attr:`simulates_capacity`,
    :meth:`check_available`, :meth:`check_case`) are asked before any backend is built.
    :class:`BackendBase` gives every member but :meth:`run` a default.
    """

    #: the registry name, also written to run folders and records
    name: ClassVar[str]
    #: True when ``RunSpec.capacity_bytes`` / ``oversubscription_ratio`` (and compare's ratios) apply:
    #: the GPU's capacity is simulated. A backend without it refuses specs that set them.
    simulates_capacity: ClassVar[bool]

    @property
    def measures_residency(self) -> bool:
        """True when its records carry GPU-resident bytes per type (measured or simulated)."""
        ...

    @classmethod
    def check_available(cls) -> None:
        """Raise (a :class:`~um_lab.errors.UmLabError`) when this backend cannot run in this process."""
        ...

    @classmethod
    def check_case(cls, case: ModelCase) -> None:
        """Cheap checks of a model case, before any run folder is written (``compare`` runs them for every
        model before its first run); raise to refuse it."""
        ...

    def capacity_for(self, spec: RunSpec, footprint: int) -> int | None:
        """The bytes a run of ``spec`` with ``footprint`` live bytes has to fit in: the simulated GPU, or a
        safety cap on managed memory; None when there is no limit to check."""
        ...

    def preflight(self, spec: RunSpec, case: ModelCase, policy: Policy) -> dict[str, Any] | None:
        """Checks before a run's folder is written (raise to refuse the run); what it returns is recorded
        in ``model.json`` under ``preflight`` (None: nothing to record)."""
        ...

    def environment(self) -> dict[str, Any]:
        """What ``environment.json`` records about this backend: at least ``device``; a calibrated backend
        also ``calibration_profile`` (its name) and ``calibration_profile_sha256``."""
        ...

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]: ...


class BackendBase:
    """Defaults for every :class:`Backend` member but :attr:`name` and :meth:`run`: runs anywhere, no
    simulated capacity, no residency, no pre-flight, a CPU device."""

    name: ClassVar[str]
    simulates_capacity: ClassVar[bool] = False

    @property
    def measures_residency(self) -> bool:
        return False

    @classmethod
    def check_available(cls) -> None:
        return None

    @classmethod
    def check_case(cls, case: ModelCase) -> None:
        return None

    def capacity_for(self, spec: RunSpec, footprint: int) -> int | None:
        return None

    def preflight(self, spec: RunSpec, case: ModelCase, policy: Policy) -> dict[str, Any] | None:
        return None

    def environment(self) -> dict[str, Any]:
        return {"device": {"name": "cpu"}}

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]:
        raise NotImplementedError(f"{type(self).__name__}.run")


# -------------------------------------------------------------------------------------- registry

#: name -> the backend class, or ``"module:Class"`` imported on first use
_REGISTRY: dict[str, type[Backend] | str] = {
    "cuda": "um_lab.cuda.backend:CudaBackend",
    "sim": "um_lab.sim.backend:SimBackend",
}


def register_backend(name: str, factory: type[Backend] | str, *, replace: bool = False) -> None:
    """Make ``name`` a backend: ``factory`` is its class (called with :func:`get_backend`'s options) or
    ``"module:Class"`` (imported on first use). Its ``name`` must be ``name``; an existing name is kept
    unless ``replace=True``."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"a backend name must be a non-empty string other than {AUTO!r}, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"backend {name!r} is registered already; pass replace=True to replace it")
    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise ValueError(f"a backend given by name is 'module:Class', got {factory!r}")
    else:
        _check_named(name, factory)
    _REGISTRY[name] = factory


def unregister_backend(name: str) -> None:
    """Forget the backend registered as ``name`` (``KeyError`` when there is none)."""
    del _REGISTRY[name]


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in registration order (``auto`` is not one)."""
    return tuple(_REGISTRY)


def valid_backend_names() -> str:
    """The names a ``backend`` argument accepts, for error messages: ``"cuda, sim, auto"``."""
    return ", ".join((*_REGISTRY, AUTO))


def cuda_available() -> bool:
    """True when a CUDA GPU and a CUDA build of torch are present."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend_name(name: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is present, else ``sim``; other names must be registered."""
    if name == AUTO:
        return "cuda" if cuda_available() else "sim"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; valid: {valid_backend_names()}")
    return name


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (``auto`` resolved first), imported if need be."""
    name = resolve_backend_name(name)
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _check_named(name, factory)
        _REGISTRY[name] = factory
    return factory


def get_backend(name: str = AUTO, **options: Any) -> Backend:
    """A new backend by name (a registered one, or ``auto``), built with ``options``."""
    return backend_class(name)(**options)


def _check_named(name: str, factory: type[Backend]) -> None:
    """A registered class must be a backend class whose ``name`` is the name it is registered as."""
    if not isinstance(factory, type) or not callable(getattr(factory, "run", None)):
        raise TypeError(f"backend {name!r} must be a class with run(spec, case, policy), got {factory!r}")
    if getattr(factory, "name", None) != name:
        raise ValueError(f"backend class {factory.__qualname__} is named {getattr(factory, 'name', None)!r}; "
                         f"register it as that name or set its name to {name!r}")
