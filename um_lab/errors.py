"""Typed errors raised by um_lab (each says what went wrong and what to do)."""

from __future__ import annotations

import torch


class UmLabError(Exception):
    """Base class of um_lab's own errors."""


class PolicyError(UmLabError, ValueError):
    """A policy (or its JSON) is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # picklable (worker processes) despite the two-argument signature
        return (type(self), (self.field, self.message))


class InputError(UmLabError, ValueError):
    """Bad input caught before any work: ``field`` names the argument, knob or field (None: unnamed)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.field))


class ModelConfigError(InputError):
    """A model name or size knob is invalid (unknown, wrongly typed, fixed by the name, inconsistent)."""


class SpecError(InputError):
    """A run specification or sizing argument is invalid (a RunSpec field, a ratio, a capacity)."""


class FileReadError(InputError):
    """A file given to um_lab (a policy, a profile, a run's records) cannot be read as what it should be:
    missing, not a regular file, too large for its format, not UTF-8 or not valid JSON. ``path`` names it."""

    def __init__(self, path: object, what: str, reason: str) -> None:
        self.path, self.what, self.reason = path, what, reason
        super().__init__(f"{what} file {str(path)!r} {reason}", what)

    def __reduce__(self):
        return (type(self), (self.path, self.what, self.reason))


class HostMemoryRefused(UmLabError, MemoryError):
    """The simulator's own arrays for this size would not fit in host memory; nothing was built."""

    def __init__(self, needed: int, available: int, what: str) -> None:
        self.needed, self.available, self.what = needed, available, what
        super().__init__(
            f"the simulator refused to build {what}: it needs about {gib(needed)} ({needed} B) of host "
            f"memory, more than the {gib(available)} ({available} B) available here; it was not built. "
            "Use a smaller batch or model (the simulated GPU capacity can shrink with it: a ratio is "
            "relative to the footprint).")

    def __reduce__(self):
        return (type(self), (self.needed, self.available, self.what))


class CudaUnavailableError(UmLabError, RuntimeError):
    """The real backend needs a CUDA GPU; points to the simulator backend."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"the cuda backend cannot run here: {reason}. Use the simulator instead: "
            "RunSpec(backend='sim') or `um-lab run --backend sim` (no GPU needed)."
        )


class UnsupportedDeviceError(UmLabError, RuntimeError):
    """The GPU lacks a feature the lab needs (e.g. concurrent managed access)."""


class SessionStateError(UmLabError, RuntimeError):
    """A session method was called in the wrong state (closed, already open, nested)."""


def gib(n: int) -> str:
    """``n`` bytes as a short GiB figure for messages, e.g. ``1.50 GiB``."""
    return f"{n / 2**30:.2f} GiB"


class OversubscriptionRefused(torch.cuda.OutOfMemoryError, UmLabError):
    """A managed allocation would have pushed live managed bytes past the safety cap.

    Nothing was allocated: the cap is checked before CUDA is called. ``message`` replaces the default
    text (a refusal made before the run, e.g. :class:`um_lab.sizing.SizeRefused`).
    """

    def __init__(self, requested: int, live: int, cap: int, data_type: str | None = None,
                 message: str | None = None) -> None:
        self.requested = requested
        self.live = live
        self.cap = cap
        self.data_type = data_type
        kind = f" for {data_type}" if data_type else ""
        super().__init__(message or
            f"um_lab refused a managed segment{kind}: requested {requested} B ({gib(requested)}), "
            f"live {live} B ({gib(live)}), cap {cap} B ({gib(cap)}). Nothing was allocated. "
            "The cap keeps managed memory below the GPU's free memory; asking for more can hang a "
            "shared GPU. Use a smaller model or batch, study oversubscription in the simulator "
            "(backend='sim'), or on your own machine pass allow_oversubscription=True."
        )

    def __reduce__(self):  # keep picklable despite the custom signature
        return (type(self), (self.requested, self.live, self.cap, self.data_type))


class BudgetError(UmLabError, ValueError):
    """A GPU budget (:class:`~um_lab.schedule.config.Budget`) is invalid or cannot be kept."""


class BudgetTooSmall(BudgetError):
    """One layer's working set alone does not fit the GPU budget; the numbers say by how much."""

    def __init__(self, budget: int, needed: int, what: str) -> None:
        self.budget, self.needed, self.what = budget, needed, what
        super().__init__(
            f"the GPU budget of {budget} B ({gib(budget)}) cannot hold {what}: it needs {needed} B "
            f"({gib(needed)}) resident at once (counted in whole 2 MiB blocks). Raise the budget to at "
            "least that, or use a smaller batch or model.")

    def __reduce__(self):
        return (type(self), (self.budget, self.needed, self.what))


class UnsupportedOptimizer(BudgetError):
    """A budget steps the optimizer one layer at a time; only optimizers whose step is per parameter (and
    known to be) are allowed: ``torch.optim.SGD``, ``Adam`` and ``AdamW`` (not subclasses)."""


class OutputExistsError(UmLabError, FileExistsError):
    """A file um_lab was asked to write (a comparison's ``--csv``) already exists and was not to be replaced;
    ``path`` names it."""

    def __init__(self, path: object, message: str) -> None:
        self.path = path
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.path, self.args[0]))


class ProfileError(InputError):
    """A simulator profile is invalid: not a JSON object, an unknown or missing field, a value that is not
    a finite positive number, an unsupported format version. ``path`` names its file (None: a dict)."""

    def __init__(self, message: str, field: str | None = None, path: object = None) -> None:
        self.message, self.path = message, path
        where = f"profile file {str(path)!r}: " if path is not None else "profile: "
        super().__init__(where + message, field)

    def __reduce__(self):
        return (type(self), (self.message, self.field, self.path))


class OptimizerNeedsClosure(ModelConfigError):
    """A model case's optimizer needs a closure in ``step()`` (``torch.optim.LBFGS``): a run steps the
    optimizer once per training step, without one. ``optimizer`` names its class."""

    def __init__(self, optimizer: str, model: str) -> None:
        self.optimizer, self.model = optimizer, model
        super().__init__(
            f"model {model!r}: optimizer {optimizer} needs a closure in step() (it re-evaluates the loss "
            "several times per step), which a run does not give: each training step is one forward, one "
            "backward and one optimizer.step(). Use an optimizer whose step() takes no closure (SGD, Adam, "
            "AdamW, Adagrad, ...).", "make_optimizer")

    def __reduce__(self):
        return (type(self), (self.optimizer, self.model))


class ModelTypeError(ModelConfigError, TypeError):
    """A model argument of the wrong type (``custom(name, 42, ...)``); also a ``TypeError``."""


class MissingDependencyError(ModelConfigError, ImportError):
    """A zoo model needs an optional library this install cannot import (``module``); the message carries the
    command that adds it. Also an ``ImportError``."""

    def __init__(self, model: str, module: str, message: str) -> None:
        self.model, self.module = model, module
        super().__init__(message, "model")

    def __reduce__(self):
        return (type(self), (self.model, self.module, self.args[0]))
