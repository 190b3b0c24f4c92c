"""The memo the budget simulations share: the derived orders (:mod:`um_lab.sim.budget_order`) and the simulated
steps (:mod:`um_lab.sim.budget`, :mod:`um_lab.sim.staged`), so a pre-flight and the run that follows plan once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

_SIMULATED: dict[tuple[Any, ...], Any] = {}
_SIMULATED_KEEP = 16
_T = TypeVar("_T")


def memoised(key: tuple[Any, ...], compute: Callable[[], _T]) -> _T:
    """``compute()``, kept for the next call with the same ``key`` (the last :data:`_SIMULATED_KEEP` results): a
    pre-flight and the run that follows plan once."""
    hit = _SIMULATED.get(key)
    if hit is not None:
        return cast(_T, hit)
    result = compute()
    if len(_SIMULATED) >= _SIMULATED_KEEP:
        _SIMULATED.pop(next(iter(_SIMULATED)))
    _SIMULATED[key] = result
    return result
