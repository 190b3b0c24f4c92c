"""What a backend is: the :class:`Backend` protocol and :class:`BackendBase`, its defaults.

A backend is an object: callers (the runner, ``compare``, the run log) ask it what it can do and never
test its name. A third backend is one new module::

    from um_lab.backend import register_backend
    from um_lab.backend_base import BackendBase

    class MyBackend(BackendBase):
        name = "mine"
        def run(self, spec, case, policy): ...  # yield one StepRecord(backend=self.name, ...) per step

    register_backend("mine", MyBackend)   # then RunSpec(backend="mine"), run(...), compare(backend="mine")

The registry (names to classes) is :mod:`um_lab.backend`; it imports no other um_lab module, so
:mod:`um_lab.types` can check a ``RunSpec``'s backend name against it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from um_lab.models import ModelCase
    from um_lab.policy import Policy
    from um_lab.types import RunSpec, StepRecord


@runtime_checkable
class Backend(Protocol):
    """Runs ``spec.steps`` training steps of ``case`` under ``policy``, yielding one record per step.

    Records are yielded as each step completes (warm-up steps first, flagged ``warmup=True``), each with
    ``backend`` set to :attr:`name`. Closing the generator early must leave the process usable (pools
    released, state restored). The class-level members (:attr:`name`, :attr:`simulates_capacity`,
    :attr:`reports_uncertainty_band`, :meth:`check_available`, :meth:`check_case`) are asked before any
    backend is built. :class:`BackendBase` gives every member but :meth:`run` a default. Options are
    the constructor's keyword parameters (:func:`um_lab.backend.backend_options` lists them: the CLI's
    ``--profile`` goes to a backend that takes ``profile``, the lab's ``telemetry`` to one that takes
    ``telemetry``).
    """

    #: the registry name, also written to run folders and records
    name: ClassVar[str]
    #: True when ``RunSpec.capacity_bytes`` / ``oversubscription_ratio`` (and compare's ratios) apply:
    #: the GPU's capacity is simulated. A backend without it refuses specs that set them.
    simulates_capacity: ClassVar[bool]
    #: True when ``compare(band=True)`` can bracket each run's step time (the simulator: at both ends of
    #: its profile constants' ranges); the comparison panel offers its band only then.
    reports_uncertainty_band: ClassVar[bool]

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
    simulated capacity, no uncertainty band, no residency, no pre-flight, a CPU device."""

    name: ClassVar[str]
    simulates_capacity: ClassVar[bool] = False
    reports_uncertainty_band: ClassVar[bool] = False

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
