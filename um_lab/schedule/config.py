"""The GPU budget a run trains under: one frozen, validated object that every entry point takes.

``Budget("8GiB")``, ``Budget(8 << 30)`` or ``Budget("0.5x")`` (half the run's footprint) bounds the bytes
of managed memory resident on the GPU; the layer-ahead scheduler moves data to keep it. A
:class:`~um_lab.cuda.session.Session` takes bytes; a run (:class:`~um_lab.types.RunSpec`, ``compare``,
the panel, ``um-lab --budget``) also takes a fraction of its estimated footprint.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from um_lab.errors import BudgetError, SpecError
from um_lab.types import budget_fraction, budget_from_text


@dataclasses.dataclass(frozen=True)
class Budget:
    """A GPU budget for the layer-ahead scheduler.

    ``size``: bytes (an int, or a size string such as ``"8GiB"``) or a fraction of the run's footprint
    (``"0.5x"``, or a float in (0, 1]). ``lookahead``: how many positions of the learned order of use the
    scheduler prefetches ahead. ``stage_activations``: copy the activations forward saves for backward to
    pinned host memory and back ahead of use, instead of leaving them to managed prefetch.
    """

    size: int | float | str
    lookahead: int = 2
    stage_activations: bool = False
    #: the budget in bytes (None when it is a fraction of the footprint)
    bytes: int | None = dataclasses.field(init=False)
    #: the budget as a fraction of the footprint, in (0, 1] (None when it is in bytes)
    fraction: float | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        size = self.size
        try:
            if isinstance(size, str):
                nbytes, fraction = budget_from_text(size)
            elif isinstance(size, bool) or not isinstance(size, numbers.Real):
                raise BudgetError(f"a budget is bytes, a size such as '8GiB' or a fraction such as '0.5x'; got "
                                  f"{size!r}")
            elif isinstance(size, numbers.Integral):
                if int(size) <= 0:
                    raise BudgetError(f"a budget in bytes must be > 0, got {size!r}")
                nbytes, fraction = int(size), None
            else:
                nbytes, fraction = None, budget_fraction(size)
        except SpecError as e:
            raise BudgetError(str(e)) from None
        lookahead = self.lookahead
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise BudgetError(f"Budget lookahead must be an int >= 0, got {lookahead!r}")
        if not isinstance(self.stage_activations, bool):
            raise BudgetError(f"Budget stage_activations must be True or False, got {self.stage_activations!r}")
        object.__setattr__(self, "bytes", nbytes)
        object.__setattr__(self, "fraction", fraction)

    def __repr__(self) -> str:
        extra = "" if self.lookahead == 2 else f", lookahead={self.lookahead}"
        extra += ", stage_activations=True" if self.stage_activations else ""
        return f"Budget({self.size!r}{extra})"

    def resolve(self, footprint_bytes: int | None) -> int:
        """The budget in bytes; a fraction needs the footprint it is a fraction of."""
        if self.bytes is not None:
            return self.bytes
        if footprint_bytes is None:
            raise BudgetError(f"the budget {self.size!r} is a fraction of a run's footprint: a Session has no "
                              "footprint, give it bytes (Budget('8GiB'))")
        assert self.fraction is not None
        return int(self.fraction * footprint_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what a run's folder records)."""
        return {"size": self.size, "lookahead": self.lookahead, "stage_activations": self.stage_activations}


def as_budget(value: Budget | int | str | None) -> Budget | None:
    """``value`` as a :class:`Budget` (bytes or a size/fraction string are wrapped; None stays None)."""
    if value is None or isinstance(value, Budget):
        return value
    return Budget(value)
