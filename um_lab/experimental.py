"""Options that may change or vanish: switches of the real backend that are off, or on by default, until
measurements decide.

They are set for a block of code, never as keywords of public constructors::

    from um_lab import experimental
    with experimental.options(partial_staging=True):
        lab = um_lab.Session("um-default", budget=um_lab.Budget("8GiB", stage_activations=True))

A :class:`~um_lab.cuda.session.Session` reads the options in force when it is created
(:func:`current`) and keeps them (``session.options``). Nothing here is covered by compatibility promises.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from um_lab.errors import InputError

ISSUE_MODES = ("thread", "inline")  #: who makes the scheduler's prefetch calls


@dataclasses.dataclass(frozen=True)
class Options:
    """Experimental switches (defaults are what the product uses).

    Session: ``backward_thread`` (``"caller"``, or ``"worker"``: backward on autograd's device thread);
    ``stage_inputs`` (pageable inputs through a pinned buffer).

    Budget scheduler: ``budget_issue`` (``"thread"``: a mover thread makes the prefetch calls, or
    ``"inline"``); ``discard_gradients`` (zero gradients at their first accumulation and discard dead
    gradient blocks instead of copying them; CUDA 13+); ``batch_calls`` (consecutive prefetches as one
    ``cudaMemPrefetchBatchAsync``; CUDA 13+); ``host_advice`` (unadvised pools prefer the host, read
    remotely until prefetched);
    ``device_activations`` (the intermediate-results pool in plain device memory when activations are
    staged; None: as staging); ``remote_optimizer`` (optimizer state the plan would move in and
    out again is updated in host memory over the link); ``partial_staging`` (forward's last saves stay on
    the GPU where the plan leaves room); ``settle_tail_growth`` (give back growth announced for those saves
    that does not come); ``copy_remote_state`` (remote optimizer state copied to device slots for its
    chunk's step).
    """

    backward_thread: str = "caller"
    stage_inputs: bool = True
    budget_issue: str = "thread"
    discard_gradients: bool = False
    batch_calls: bool = False
    host_advice: bool = True
    device_activations: bool | None = None
    remote_optimizer: bool = True
    partial_staging: bool = False
    settle_tail_growth: bool = False
    copy_remote_state: bool = False

    def __post_init__(self) -> None:
        if self.backward_thread not in ("caller", "worker"):
            raise InputError(f"backward_thread must be 'caller' or 'worker', got {self.backward_thread!r}",
                             "backward_thread")
        if self.budget_issue not in ISSUE_MODES:
            raise InputError(f"budget_issue must be one of {ISSUE_MODES}, got {self.budget_issue!r}", "budget_issue")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type.startswith("bool") and not (isinstance(value, bool)
                                                       or (value is None and "None" in field.type)):
                raise InputError(f"{field.name} must be True or False, got {value!r}", field.name)

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults (what a run records)."""
        default = Options()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


_DEFAULT = Options()
_CURRENT: contextvars.ContextVar[Options | None] = contextvars.ContextVar("um_lab_experimental", default=None)


def current() -> Options:
    """The options in force here (the defaults outside any :func:`options` block)."""
    return _CURRENT.get() or _DEFAULT


@contextlib.contextmanager
def options(**changes: Any) -> Iterator[Options]:
    """Set experimental options for the block (unknown names raise :class:`~um_lab.errors.InputError`)."""
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise InputError(f"unknown experimental option(s) {unknown}; known: {sorted(known)}", unknown[0])
    token = _CURRENT.set(dataclasses.replace(current(), **changes))
    try:
        yield current()
    finally:
        _CURRENT.reset(token)
