"""The layer-ahead scheduler and its plan for a recorded order.

At each position ``i`` of the step (one layer in forward, backward or the optimizer) the
:class:`Scheduler` makes position ``i``'s blocks resident (the demand), then prefetches the blocks of
the next ``lookahead`` positions while that can be done by evicting only blocks needed later than the
one brought in. Victims are chosen by Belady's rule on the learned order, which repeats every step:
the block whose next use (cyclically) is furthest away goes first. Every move goes through the
:class:`~um_lab.schedule.ledger.Ledger`, so resident bytes never exceed the budget.

:func:`make_plan` runs the scheduler over a recorded order until it repeats itself (the steady state
of step 2 onwards) and returns the moves per position with their totals: what a session issues, and
what tests and the simulator check.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping

import numpy as np

from um_lab.errors import BudgetError, BudgetTooSmall
from um_lab.schedule.ledger import Ledger, Move, blocks_of_span
from um_lab.schedule.order import STEP_POSITION, Order
from um_lab.types import DataType


class Scheduler:
    """Belady evictions and look-ahead prefetches over a cyclic :class:`Order` (see the module doc)."""

    def __init__(self, ledger: Ledger, order: Order, lookahead: int = 2,
                 discard_segments: Iterable[int] = (), remote_blocks: Iterable[int] = (),
                 headroom: Mapping[int, int] | None = None) -> None:
        if lookahead < 0:
            raise BudgetError(f"lookahead must be >= 0, got {lookahead}")
        self.ledger = ledger
        #: bytes to leave free under the budget while position ``i`` runs: what its kernels may write in blocks the
        #: order does not name (fresh outputs and saves at new addresses); its moves, look-ahead included, keep it
        self.headroom = {int(i): int(n) for i, n in (headroom or {}).items() if n > 0}
        self.order = order
        self.lookahead = lookahead
        self.n = len(order.positions)
        #: blocks left in host memory and accessed there (never brought in: see :func:`make_plan`)
        self.remote_blocks = frozenset(remote_blocks)
        self.blocks = [ledger.blocks(p.spans()) - self.remote_blocks for p in order.positions]
        uses: dict[int, list[int]] = {}
        for i, blocks in enumerate(self.blocks):
            for b in blocks:
                uses.setdefault(b, []).append(i)
        self._uses = uses
        # the same uses as arrays, for ranking many blocks at once (next_uses): block ids sorted, each one's
        # uses in order in ``_flat`` from ``_ptr[k]``, searchable as ``k * (n + 1) + use`` in ``_keys``
        ids = sorted(uses)
        counts = np.array([len(uses[b]) for b in ids], dtype=np.int64)
        self._ids = np.array(ids, dtype=np.int64)
        self._ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._flat = np.fromiter((u for b in ids for u in uses[b]), dtype=np.int64, count=int(counts.sum()))
        self._keys = np.repeat(np.arange(len(ids), dtype=np.int64), counts) * (self.n + 1) + self._flat
        self.discard_at = dead_gradient_blocks(ledger, order, set(discard_segments))

    def next_use(self, block: int, now: int) -> float:
        """Positions from ``now`` until ``block`` is used again, after ``now`` (cyclic; inf: never)."""
        uses = self._uses.get(block)
        if not uses:
            return math.inf
        k = bisect.bisect_right(uses, now)
        return uses[k] - now if k < len(uses) else uses[0] + self.n - now

    def next_uses(self, blocks: np.ndarray, now: int) -> np.ndarray:
        """:meth:`next_use` of every block in ``blocks`` (an int64 array) at once, as floats."""
        out = np.full(len(blocks), math.inf)
        if not len(self._ids) or not len(blocks):
            return out
        k = np.minimum(np.searchsorted(self._ids, blocks), len(self._ids) - 1)
        found = self._ids[k] == blocks
        at = np.searchsorted(self._keys, k * (self.n + 1) + now, side="right")
        later = at < self._ptr[k + 1]
        ahead = self._flat[np.minimum(at, len(self._flat) - 1)] - now
        wrapped = self._flat[self._ptr[k]] + self.n - now
        out[found] = np.where(later, ahead, wrapped)[found]
        return out

    def rank(self, now: int, dead_first: bool = False) -> NextUse:
        """The eviction rank at position ``now`` (Belady: furthest next use first; ``dead_first``: blocks
        whose contents are dead before all)."""
        return NextUse(self, now, dead_first)

    def working_set(self, i: int) -> int:
        """Managed bytes position ``i`` needs resident at once (fixed blocks included: they never leave)."""
        return self.ledger.bytes_with_fixed(self.blocks[i])

    def check_fits(self) -> None:
        """Raise :class:`BudgetTooSmall` for the largest position that cannot fit the budget alone."""
        if not self.n:
            return
        i = max(range(self.n), key=self.working_set)
        if self.working_set(i) > self.ledger.budget_bytes:
            phase, layer = self.order.positions[i].key
            where = ("the ops outside the model's layers (input, output head, loss)" if layer == STEP_POSITION
                     else layer or "the model")
            raise BudgetTooSmall(self.ledger.budget_bytes, self.working_set(i), f"the {phase} of {where}")

    def enter(self, i: int, extra: Iterable[int] = ()) -> list[Move]:
        """Moves at position ``i``: its blocks (and ``extra`` blocks seen now) resident, then look-ahead."""
        now = self.blocks[i] | set(extra)
        ledger = self.ledger
        ledger.mark_dead(self.discard_at.get(i, ()))
        rank = self.rank(i, dead_first=True)
        phase, layer = self.order.positions[i].key
        room = self.headroom.get(i, 0)
        moves = ledger.bring_in(now, rank, target=i, what=f"{phase} of {layer or 'the model'}", headroom=room)
        assert moves is not None
        ledger.mark_live(now)
        protect = set(now)
        for d in range(1, min(self.lookahead, self.n - 1) + 1):
            j = (i + d) % self.n
            try:
                ahead = self.ledger.bring_in(self.blocks[j], rank, target=j, protect=protect, headroom=room,
                                             may_evict=lambda b, d=d: rank(b) > d)  # type: ignore[misc]
            except BudgetTooSmall:
                break  # these positions together do not fit: stop looking ahead
            if ahead is None:
                break
            moves += ahead
            protect |= self.blocks[j]
        return moves


class NextUse:
    """A block's rank at one position: positions until its next use (inf: never, or dead with
    ``dead_first``). Callable on one block; :meth:`many` ranks an array of blocks at once (the ledger
    uses it to order thousands of resident blocks without a Python call each)."""

    def __init__(self, scheduler: Scheduler, now: int, dead_first: bool) -> None:
        self.scheduler = scheduler
        self.now = now
        self.dead_first = dead_first

    def __call__(self, block: int) -> float:
        if self.dead_first and self.scheduler.ledger.is_dead(block):
            return math.inf
        return self.scheduler.next_use(block, self.now)

    def many(self, blocks: np.ndarray) -> np.ndarray:
        """The ranks of ``blocks`` (an int64 array)."""
        ranks = self.scheduler.next_uses(blocks, self.now)
        dead = self.scheduler.ledger.dead_blocks() if self.dead_first else frozenset()
        if dead:
            ranks[np.isin(blocks, np.fromiter(dead, dtype=np.int64, count=len(dead)))] = math.inf
        return ranks


@dataclasses.dataclass
class Plan:
    """The scheduler's steady-state moves for one step of a recorded order, and their totals."""

    budget_bytes: int
    lookahead: int
    keys: list[tuple[str, str]]
    moves: list[list[Move]]  #: per position, in issue order
    footprint_bytes: int  #: every managed byte the order's segments hold
    max_resident: int  #: the ledger's highest resident bytes in the steady step
    prefetched_bytes: int  #: host->GPU bytes per steady step
    evicted_bytes: int  #: GPU->host bytes per steady step
    largest_working_set: int  #: the largest single position, in whole blocks
    steady: bool  #: True when the step after the planned one issues the same moves
    start_resident: frozenset[int] = frozenset()  #: the blocks resident when the steady step begins
    discarded_bytes: int = 0  #: resident bytes dropped with no copy per steady step (dead gradients)
    populated_bytes: int = 0  #: bytes brought in with no copy (dead blocks made resident again)
    fixed_bytes: int = 0  #: bytes of fixed blocks the plan worked around (a fixed part of the budget)
    #: optimizer-state blocks left in host memory, read and written there by the optimizer's kernels
    remote_blocks: frozenset[int] = frozenset()
    remote_bytes: int = 0  #: their bytes

    def evictions(self) -> list[Move]:
        """Every eviction of the steady step, in order."""
        return [m for ms in self.moves for m in ms if m.kind == "evict"]

    def summary(self) -> dict[str, int | bool]:
        """The totals, JSON-able."""
        return {"budget_bytes": self.budget_bytes, "footprint_bytes": self.footprint_bytes,
                "max_resident_ledger": self.max_resident, "prefetched_bytes": self.prefetched_bytes,
                "evicted_bytes": self.evicted_bytes, "discarded_bytes": self.discarded_bytes,
                "populated_bytes": self.populated_bytes, "largest_working_set": self.largest_working_set,
                "fixed_bytes": self.fixed_bytes, "remote_bytes": self.remote_bytes,
                "positions": len(self.keys), "steady": self.steady}


def dead_gradient_blocks(ledger: Ledger, order: Order, discard_segments: set[int]) -> dict[int, list[int]]:
    """Gradient blocks to discard, by the position at which their contents die.

    With ``zero_grad`` every step, a gradient is dead from the optimizer position that last reads it until
    the backward that writes it next (the session zeroes it again there, :mod:`um_lab.schedule.live.control`). A
    block qualifies when every piece of it lies in ``discard_segments`` (the gradient pool's), every access
    to it is a gradient access, backward before optimizer, and every gradient an optimizer position reads in
    it is written by a backward position (not a frozen parameter's); it is marked dead as the position after
    its last optimizer read opens (the first position of the next step for the last chunk), and discarded only
    when room is needed (dead blocks are the first victims)."""
    if not discard_segments or not order.positions:
        return {}
    first_backward: dict[int, int] = {}
    last_optimizer: dict[int, int] = {}
    written: dict[int, set[tuple[int, int]]] = {}  # block -> gradient spans a backward position writes
    read: dict[int, set[tuple[int, int]]] = {}  # block -> gradient spans an optimizer position reads
    excluded: set[int] = set()
    for i, position in enumerate(order.positions):
        for access in position.accesses:
            if access.data_type is not DataType.GRAD:
                excluded |= ledger.blocks(access.spans)
                continue
            for span in access.spans:
                for b in ledger.blocks([span]):
                    if position.phase == "backward":
                        first_backward.setdefault(b, i)
                        written.setdefault(b, set()).add(span)
                    elif position.phase == "optimizer":
                        last_optimizer[b] = i
                        read.setdefault(b, set()).add(span)
    out: dict[int, list[int]] = {}
    n = len(order.positions)
    for b, last in last_optimizer.items():
        if b in excluded or b not in first_backward or first_backward[b] > last:
            continue
        if not read.get(b, set()) <= written.get(b, set()):  # a gradient no backward writes (a frozen one)
            continue
        if not all(seg in discard_segments for seg in ledger.segment_starts(b)):
            continue
        out.setdefault((last + 1) % n, []).append(b)
    return out


def new_ledger(order: Order, budget_bytes: int, fixed_segments: Iterable[int] = ()) -> Ledger:
    """A ledger over the order's managed segments, nothing resident but the segments starting at
    ``fixed_segments`` (resident for good)."""
    ledger = Ledger(budget_bytes)
    fixed = set(fixed_segments)
    for ptr, size in order.managed_segments():
        ledger.add_segment(ptr, size, fixed=ptr in fixed)
    return ledger


def make_plan(order: Order, budget_bytes: int, lookahead: int = 2, *, max_cycles: int = 6,
              discard_segments: Iterable[int] = (), fixed_segments: Iterable[int] = (),
              remote_optimizer: bool = False, remote_blocks: Iterable[int] = (),
              headroom: Mapping[int, int] | None = None) -> Plan:
    """Plan ``order`` under ``budget_bytes``: run the scheduler step after step (from nothing resident)
    until a step repeats the previous one's moves, and return that step's moves. Gradient blocks lying
    in ``discard_segments`` are discarded while dead (:func:`dead_gradient_blocks`); the segments starting at
    ``fixed_segments`` stay resident throughout and are never moved (a fixed part of the budget);
    ``remote_blocks`` are never brought in (the positions that use them access them in host memory);
    ``headroom`` (position -> bytes) is left free under the budget while that position runs (:class:`Scheduler`).

    ``remote_optimizer``: optimizer state that the plan would move (in for the optimizer, out again after
    it) stays in host memory instead, read and written there by the optimizer's kernels over the link:
    the state is replanned without those blocks until no optimizer state moves
    (:func:`optimizer_only_blocks`). Only for pools whose non-resident pages the GPU maps remotely
    (host advice); a GPU prefetch to the host runs at a third of the link's rate or less, the remote
    update at about the link's.

    Raises :class:`BudgetTooSmall` before planning when one position alone (with the fixed blocks) does
    not fit.
    """
    remote = frozenset(remote_blocks)
    plan = _make_plan(order, budget_bytes, lookahead, max_cycles, discard_segments, fixed_segments, remote, headroom)
    if not remote_optimizer:
        return plan
    optim = optimizer_only_blocks(order)
    for _ in range(REMOTE_ROUNDS):
        moved = {b for ms in plan.moves for m in ms if m.kind in ("prefetch", "evict") for b in m.blocks} & optim
        if not moved - remote:
            break
        remote |= moved
        plan = _make_plan(order, budget_bytes, lookahead, max_cycles, discard_segments, fixed_segments, remote,
                          headroom)
    return plan


#: at most this many replans while leaving optimizer state in host memory (a replan may move other optimizer
#: state into the room the first left); on the simulated GPT-2-large and GPT-2-XL orders at ratios 2-3 one was enough
REMOTE_ROUNDS = 4


def optimizer_only_blocks(order: Order) -> frozenset[int]:
    """The blocks that only optimizer positions use and that hold optimizer state (no other type's data)."""
    optim: set[int] = set()
    other: set[int] = set()
    for p in order.positions:
        for a in p.accesses:
            blocks = {b for ptr, n in a.spans for b in blocks_of_span(ptr, n)}
            if a.data_type is DataType.OPTIM and p.phase == "optimizer":
                optim |= blocks
            else:
                other |= blocks
    return frozenset(optim - other)


def _make_plan(order: Order, budget_bytes: int, lookahead: int, max_cycles: int, discard_segments: Iterable[int],
               fixed_segments: Iterable[int], remote: frozenset[int],
               headroom: Mapping[int, int] | None = None) -> Plan:
    ledger = new_ledger(order, budget_bytes, fixed_segments)
    scheduler = Scheduler(ledger, order, lookahead, discard_segments, remote, headroom)
    scheduler.check_fits()
    largest = max((scheduler.working_set(i) for i in range(scheduler.n)), default=0)
    previous: list[list[Move]] | None = None
    moves: list[list[Move]] = []
    steady = False
    start: frozenset[int] = frozenset()
    for _ in range(max(2, max_cycles)):
        ledger.reset_counters()
        start = frozenset(ledger.resident_blocks())
        moves = [scheduler.enter(i) for i in range(scheduler.n)]
        if previous is not None and _same(previous, moves):
            steady = True
            break
        previous = moves
    return Plan(budget_bytes, lookahead, order.keys(), moves, ledger.total_bytes, ledger.max_resident,
                ledger.prefetched_bytes, ledger.evicted_bytes, largest, steady, start,
                discarded_bytes=ledger.discarded_bytes, populated_bytes=ledger.populated_bytes,
                fixed_bytes=ledger.fixed_bytes, remote_blocks=remote,
                remote_bytes=ledger.bytes_of(ledger.known_blocks(remote)))


def _same(a: list[list[Move]], b: list[list[Move]]) -> bool:
    return [[(m.kind, m.spans) for m in ms] for ms in a] == [[(m.kind, m.spans) for m in ms] for ms in b]
