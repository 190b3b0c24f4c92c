"""The GPU budget a run trains under: one frozen, validated object that every entry point takes.

``Budget("8GiB")``, ``Budget(8 << 30)`` or ``Budget("0.5x")`` (half the run's footprint) bounds the bytes
of managed memory resident on the GPU; the layer-ahead scheduler moves data to keep it. A
:class:`~um_lab.cuda.session.Session` takes bytes; a run (:class:`~um_lab.types.RunSpec`, ``compare``,
the panel, ``um-lab --budget``) also takes a fraction of its estimated footprint.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from um_lab.errors import BudgetError, SpecError
from um_lab.units import positive_ratio, size_bytes


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budget:
        """Inverse of :meth:`to_dict` (unknown keys raise :class:`~um_lab.errors.BudgetError`)."""
        unknown = sorted(set(data) - {"size", "lookahead", "stage_activations"})
        if unknown or "size" not in data:
            raise BudgetError(f"a budget is {{size, lookahead, stage_activations}}, got {dict(data)!r}")
        return cls(data["size"], lookahead=data.get("lookahead", 2),
                   stage_activations=data.get("stage_activations", False))


def as_budget(value: Budget | int | str | None) -> Budget | None:
    """``value`` as a :class:`Budget` (bytes or a size/fraction string are wrapped; None stays None)."""
    if value is None or isinstance(value, Budget):
        return value
    return Budget(value)
