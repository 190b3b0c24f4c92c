"""The order in which a training step uses its data: positions of (phase, layer), each with the byte
ranges it touches per data type. Recorded by :mod:`um_lab.schedule.live.record`; read by the planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from um_lab.errors import BudgetError
from um_lab.schedule.ledger import BLOCK, Span, blocks_of_span
from um_lab.types import DataType

PHASES = ("forward", "backward", "optimizer")
#: The layer name of the position that holds the ops outside the model's layers (input, output head, loss).
STEP_POSITION = "(step)"


@dataclasses.dataclass(frozen=True)
class Access:
    """One use: in ``phase`` (forward | backward | optimizer) ``layer`` touches ``spans`` of ``data_type``."""

    phase: str
    layer: str
    data_type: DataType
    spans: tuple[Span, ...]

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise BudgetError(f"phase must be one of {PHASES}, got {self.phase!r}")


@dataclasses.dataclass
class Position:
    """A point of the step the scheduler acts at: one layer in one phase, and what it touches."""

    phase: str
    layer: str
    accesses: list[Access] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        """(phase, layer): what the hooks see."""
        return self.phase, self.layer

    def spans(self, data_type: DataType | None = None) -> list[Span]:
        """The byte ranges touched here (of one data type, or all)."""
        return [s for a in self.accesses if data_type is None or a.data_type is data_type for s in a.spans]

    def add(self, data_type: DataType, spans: Iterable[Span]) -> None:
        """Record more ranges touched here (empty ranges dropped)."""
        kept = tuple((int(p), int(n)) for p, n in spans if n > 0)
        if kept:
            self.accesses.append(Access(self.phase, self.layer, data_type, kept))


@dataclasses.dataclass
class Order:
    """A step's positions in order of use, and the managed segments (address, size) they lie in.

    ``segments`` empty means: none known (an order recorded on the CPU); the planner then treats each
    2 MiB block the ranges touch as managed memory (:func:`covering_segments`)."""

    positions: list[Position] = dataclasses.field(default_factory=list)
    segments: list[Span] = dataclasses.field(default_factory=list)

    @classmethod
    def from_accesses(cls, accesses: Iterable[Access], segments: Sequence[Span] = ()) -> Order:
        """Group consecutive accesses of one (phase, layer) into positions."""
        positions: list[Position] = []
        for a in accesses:
            if not positions or positions[-1].key != (a.phase, a.layer):
                positions.append(Position(a.phase, a.layer))
            positions[-1].accesses.append(a)
        return cls(positions, list(segments))

    def keys(self) -> list[tuple[str, str]]:
        """(phase, layer) of every position, in order."""
        return [p.key for p in self.positions]

    def accesses(self) -> list[Access]:
        """Every access, in order."""
        return [a for p in self.positions for a in p.accesses]

    def managed_segments(self) -> list[Span]:
        """``segments``, or the blocks the ranges touch when none were recorded."""
        return list(self.segments) or covering_segments(s for p in self.positions for s in p.spans())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (for saving a recorded order)."""
        return {"segments": [list(s) for s in self.segments],
                "accesses": [{"phase": a.phase, "layer": a.layer, "data_type": a.data_type.value,
                              "spans": [list(s) for s in a.spans]} for a in self.accesses()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Order:
        """The inverse of :meth:`to_dict`."""
        accesses = [Access(a["phase"], a["layer"], DataType.parse(a["data_type"]),
                           tuple((int(p), int(n)) for p, n in a["spans"])) for a in data["accesses"]]
        return cls.from_accesses(accesses, [(int(p), int(n)) for p, n in data.get("segments", [])])


def covering_segments(spans: Iterable[Span]) -> list[Span]:
    """Whole 2 MiB blocks covering ``spans``, one pseudo-segment per block (disjoint, sorted)."""
    blocks = sorted({b for p, n in spans for b in blocks_of_span(p, n)})
    return [(b * BLOCK, BLOCK) for b in blocks]


#: under a GPU budget the optimizer is stepped in chunks of consecutive modules whose parameters hold at most
#: B / this (an AdamW chunk then touches about 4x that: parameters, gradients and two state tensors)
OPTIMIZER_CHUNK_DIVISOR = 64


def join_consecutive(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` in runs of consecutive items holding at most ``max_bytes`` together (an item larger
    than that alone): how the optimizer's chunks are joined, in the session and in the simulator."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    runs: list[list[int]] = []
    held = 0
    for i, nbytes in enumerate(sizes):
        if runs and held + nbytes <= max_bytes:
            runs[-1].append(i)
            held += nbytes
        else:
            runs.append([i])
            held = nbytes
    return runs
