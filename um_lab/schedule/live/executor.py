"""The scheduler in a live session: hook events in, ``cudaMemPrefetchAsync`` calls out.

:class:`BudgetExecutor` is the :class:`~um_lab.schedule.live.record.PositionListener` of a session's
recorder. Every residency change goes through its :class:`~um_lab.schedule.ledger.Ledger`:

- **learning** (no plan yet, or the step left the plan): at each position the ranges it is about to
  use are brought in, least-recently-used blocks evicted first; outputs written by a layer are
  recorded as touched (a first touch on the GPU) and the ledger evicts to get back under the budget;
- **planned** (the step follows the recorded order): the plan's moves for each position are replayed
  (Belady evictions, look-ahead prefetches), after one realignment at step start to the resident set
  the steady step begins with; ranges the plan did not foresee are brought in on demand, and room is
  made before a position for the most it wrote outside the plan in an earlier step (new output addresses);
  a planned look-ahead that no longer fits beside the position's actual ranges is skipped
  (``skipped_ahead``), never an error, as is a planned bring-in that no longer fits beside a fixed pool that
  grew since the plan: only the position's own ranges can fail a step.

Moves are issued on a side stream, by a :mod:`~um_lab.schedule.live.mover` (a thread of its own on a GPU,
where a prefetch call blocks the host until its stream's earlier work is done): before an eviction
the side stream waits for the compute stream
(an event recorded at this position: the layers that used the data are done), and a prefetch is
followed by an event the compute stream waits on at the position the data is for. Both directions
share the one side stream, so an eviction always completes before the prefetch that needs its room.

The ledger applies a move when it is planned, before the mover issues it, so a failed prefetch call
leaves the ledger wrong: the error is raised (to the position waiting for the batch, else at the step's
end, the next step's start or :meth:`BudgetExecutor.close`) and the residency is marked unknown; the next
step begins by pushing every managed range to the host.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from um_lab.errors import BudgetTooSmall
from um_lab.schedule.ledger import BLOCK, Ledger, Move, Span, blocks_of_span
from um_lab.schedule.live.mover import DISCARD, POPULATE, InlineMover, MoveBatch, MoveClock, ThreadMover
from um_lab.schedule.live.streams import StreamOps
from um_lab.schedule.order import Order, Position
from um_lab.schedule.plan import Plan, Scheduler, make_plan
from um_lab.segments import Runtime, Segment, SegmentIndex
from um_lab.types import DataType


class BudgetExecutor:
    """Keeps GPU-resident managed bytes under ``budget_bytes`` in a live session (module docstring).

    ``segments()`` lists the live managed segments, ``generation()`` (optional) changes whenever one is
    allocated or freed, so unknown ranges re-read the segments only then; with ``cover_unknown`` (CPU
    tests, where tensors are not in managed segments) every 2 MiB block a range touches counts as managed
    memory. Segments of ``fixed_types`` (the intermediate-results pool when saved activations are staged) are
    never moved: the ledger counts them resident from registration on, a fixed part of the budget, and the
    plan works around them.
    """

    def __init__(self, budget_bytes: int, runtime: Runtime, device: int, streams: StreamOps,
                 segments: Callable[[], Sequence[Segment]], *, lookahead: int = 2,
                 cover_unknown: bool = False, generation: Callable[[], int] | None = None,
                 mover: InlineMover | ThreadMover | None = None, discard_gradients: bool = False,
                 batch_calls: bool = False,
                 fixed_types: Iterable[DataType] = (), host_written_types: Iterable[DataType] = (),
                 remote_optimizer: bool = False) -> None:
        self.ledger = Ledger(budget_bytes)
        #: optimizer state the plan would move stays in host memory, updated there over the link
        #: (:func:`~um_lab.schedule.plan.make_plan`); only where that pool's writes land on the host
        self.remote_optimizer = remote_optimizer and DataType.OPTIM in frozenset(host_written_types)
        self._remote_asked = remote_optimizer
        #: data types whose segments stay resident, never moved by the scheduler
        self.fixed_types = frozenset(fixed_types)
        #: data types whose pools prefer the host: a kernel's write to a non-resident page lands in host memory
        #: (mapped remotely), so only the scheduler's prefetches make their blocks resident
        self.host_written_types = frozenset(host_written_types)
        #: consecutive prefetches to one location go in one cudaMemPrefetchBatchAsync (runtimes that have it)
        self.batch_calls = batch_calls
        #: plan discards of dead gradient blocks (the caller re-zeroes gradients before they are read)
        self.discard_gradients = discard_gradients
        self._discards_suspended = False  # gradients were re-created since the plan: its discards may be stale
        self.runtime = runtime
        self.device = device
        self.streams = streams
        self.mover = mover or InlineMover(runtime, streams)
        self._segments = segments
        self._generation = generation
        self._seen_generation: int | None = None
        self.lookahead = lookahead
        self.cover_unknown = cover_unknown
        self.plan: Plan | None = None
        self.plan_order: Order | None = None
        self._scheduler: Scheduler | None = None
        self._index = SegmentIndex([])
        self._pending: dict[int, MoveBatch] = {}  # position -> the last batch that prefetches for it
        self._next_pending: dict[int, MoveBatch] = {}  # the same for the next step (look-ahead past its end)
        self._current: set[int] = set()
        self._last_use: dict[int, int] = {}
        self._tick = 0
        self.following_plan = False
        self.stats: dict[str, float] = {}  # counts, bytes and host ms of the step so far
        self._touch_estimate: dict[tuple[int, tuple[str, str]], int] = {}  # most written outside the plan
        self._touch_now: dict[tuple[int, tuple[str, str]], int] = {}
        #: the most a position wrote in fresh activations (outputs, saves, recomputed ones) that land on the GPU, in
        #: the blocks they could take at any address: a plan leaves that much free while the position runs
        self._fresh_bound: dict[tuple[int, tuple[str, str]], int] = {}
        self._fresh_now: dict[tuple[int, tuple[str, str]], int] = {}
        self._keys: dict[int, tuple[str, str]] = {}
        self._live: tuple[int | None, list[int], list[int]] | None = None  # (generation, starts, ends)
        self.residency_unknown = False  # a move failed after the ledger applied it: evict all at the next step
        self.clock: MoveClock | None = None  # side-stream timing of every call (time_moves)
        self._skipped: dict[int, set[int]] = {}  # position -> blocks of its look-ahead skipped this step
        #: room the plan leaves for the fixed pool to grow: the most it grew between two plans. A new fixed segment
        #: is resident at once (its first touch), before evictions can make room; without this room the ledger
        #: passed B by one segment when the pool grew under a plan (H200: GPT-2-large at ratio 3)
        self.fixed_reserve = 0
        #: growth of the fixed pool announced in advance (:meth:`expect_fixed_growth`): plans leave room for it
        #: until it has happened, and it does not count toward ``fixed_reserve``
        self.expected_growth = 0

    # ---- segments ----

    def refresh_segments(self) -> None:
        """Bring the ledger's segments in line with the live ones (new ones host, freed ones gone)."""
        if self._generation is not None:
            self._seen_generation = self._generation()
        live = list(self._segments())
        known = self.ledger.segments()
        current = {s.ptr: s.size for s in live}
        for ptr, size in known.items():
            if current.get(ptr) != size and not self.cover_unknown:
                self.ledger.remove_segment(ptr)
        known = self.ledger.segments()
        fixed, host = self.fixed_types, self.host_written_types
        for s in live:
            if s.ptr not in known:
                self.ledger.add_segment(s.ptr, s.size, fixed=bool(fixed) and s.data_type in fixed,
                                        host_written=s.data_type in host)
        self._index = SegmentIndex(live)

    def live_bytes(self) -> int:
        """Bytes of every live segment of the session's pools now (what could be resident at most)."""
        return sum(s.size for s in self._segments())

    def set_host_written_types(self, types: Iterable[DataType]) -> bool:
        """The pools' advice changed (``Session.set_policy``): ``types`` now prefer the host. Every known segment's
        flag in the ledger follows, and so does leaving optimizer state remote (only where that pool prefers the
        host); the current order is planned again. Returns True when anything changed."""
        types = frozenset(types)
        if types == self.host_written_types:
            return False
        self.host_written_types = types
        self.remote_optimizer = self._remote_asked and DataType.OPTIM in types
        known = self.ledger.segments()
        for s in self._segments():
            if s.ptr in known:
                self.ledger.set_host_written(s.ptr, s.data_type in types)
        if self.plan_order is not None:
            self.set_order(self.plan_order)
        return True

    def span_live(self, ptr: int, nbytes: int) -> bool:
        """True when ``[ptr, ptr + nbytes)`` lies inside one live segment now (the mover asks this right
        before each prefetch call: a range freed since the move was planned is never prefetched). The
        live segments are re-read when ``generation()`` changed (always without one); safe to call
        from the mover thread."""
        return self.cover_unknown or _inside(self._live_segments(), ptr, nbytes)

    def _live_segments(self) -> tuple[int | None, list[int], list[int]]:
        """(generation, starts, ends) of the live segments, re-read when the generation changed."""
        gen = self._generation() if self._generation is not None else None
        live = self._live
        if live is None or gen is None or live[0] != gen:
            segs = sorted((s.ptr, s.ptr + s.size) for s in self._segments())
            live = self._live = (gen, [a for a, _ in segs], [b for _, b in segs])
        return live

    def classify(self, address: int) -> DataType | None:
        """The data type of the segment holding ``address`` (None: not in a known segment)."""
        return self._index.data_type_of(address)

    def blocks(self, spans: Iterable[Span]) -> set[int]:
        """The managed blocks ``spans`` touch, registering new segments (or covering blocks) first."""
        spans = list(spans)
        unknown = self.ledger.unknown(spans)
        if unknown:
            if self.cover_unknown:
                known = self.ledger.segments()
                for b in sorted({b for p, n in unknown for b in blocks_of_span(p, n)}):
                    if b * BLOCK not in known:
                        self.ledger.add_segment(b * BLOCK, BLOCK)
            elif self._generation is None or self._generation() != self._seen_generation:
                self.refresh_segments()  # new segments may hold them; else they are not managed memory
        return self.ledger.blocks(spans)

    def time_moves(self) -> None:
        """Time every call on the side stream from now on (a diagnostic: two events per call); each step's
        numbers then carry ``move_timing`` (bytes, ms and calls by kind, of the calls completed by then)."""
        self.clock = MoveClock(self.streams.timed_side_event, self.runtime.codes.location_host)

    # ---- plan ----

    def set_order(self, order: Order) -> Plan:
        """Plan the next steps on ``order`` (raises :class:`~um_lab.errors.BudgetTooSmall` when one
        position cannot fit the budget; the previous plan is then kept)."""
        if not order.segments:
            order = Order(order.positions, sorted(self.ledger.segments().items()))
        grads = self.gradient_segments() if self.discard_gradients else set()
        ledger = self.ledger
        fixed = {p: n for p, n in ledger.segments().items() if ledger.is_fixed_segment(p)}
        missing = _disjoint(fixed.items(), order.segments)
        if missing:  # fixed segments the recorded order never touched still take their room
            order = Order(order.positions, sorted([*order.segments, *missing]))
        if self.plan is not None and ledger.fixed_bytes > self.plan.fixed_bytes:
            growth = ledger.fixed_bytes - self.plan.fixed_bytes
            expected = min(growth, self.expected_growth)
            self.expected_growth -= expected
            self.fixed_reserve = max(self.fixed_reserve, growth - expected)
        headroom = self.write_headroom(order)
        try:  # room for the fixed pool to grow again by as much as it once did, and by what is announced
            plan = make_plan(order, ledger.budget_bytes - self.fixed_reserve - self.expected_growth, self.lookahead,
                             discard_segments=grads, fixed_segments=set(fixed), remote_optimizer=self.remote_optimizer,
                             headroom=headroom)
        except BudgetTooSmall:
            if not self.fixed_reserve:
                raise
            plan = make_plan(order, ledger.budget_bytes, self.lookahead, discard_segments=grads,
                             fixed_segments=set(fixed), remote_optimizer=self.remote_optimizer, headroom=headroom)
        self.plan, self.plan_order = plan, order
        self._scheduler = Scheduler(self.ledger, order, self.lookahead, grads, plan.remote_blocks, headroom)
        self._discards_suspended = False
        return plan

    def write_headroom(self, order: Order) -> dict[int, int]:
        """Bytes a plan of ``order`` leaves free while each position runs: the most it wrote outside a plan, or in
        fresh activations (at whatever address they come: the caching allocator may hand out others, and a
        recompute allocates them again inside backward), whichever is more."""
        out = {}
        for i, key in enumerate(order.keys()):
            room = max(self._touch_estimate.get((i, key), 0), self._fresh_bound.get((i, key), 0))
            if room:
                out[i] = room
        return out

    def expect_fixed_growth(self, nbytes: int) -> None:
        """The fixed pool will grow by up to ``nbytes`` (saved activations kept on the GPU instead of staged):
        plans from now on leave that room, and the growth, when it comes, is not taken for the unforeseen kind
        that ``fixed_reserve`` guards against. Call :meth:`set_order` after it for a plan that leaves it."""
        self.expected_growth += max(0, int(nbytes))

    def suspend_discards(self) -> None:
        """Gradients were re-created (new addresses): carry out no planned discard until the next plan."""
        self._discards_suspended = True

    @property
    def discards_suspended(self) -> bool:
        """True while planned discards wait for a new plan (gradients were re-created since the last one)."""
        return self.discard_gradients and self._discards_suspended

    def make_resident(self, spans: Iterable[Span]) -> None:
        """Bring ``spans`` onto the GPU now (outside the plan; dead blocks are populated) and make compute
        wait for it: before the training thread writes data the plan did not expect it to."""
        moves = self.ledger.bring_in(self.blocks(spans), self._lru_rank, what="gradients zeroed after backward")
        self._issue(moves or [], -1)

    def gradient_segments(self) -> set[int]:
        """Starts of the live gradient-pool segments (what a plan may discard while dead)."""
        return {s.ptr for s in self._segments() if s.data_type is DataType.GRAD}

    @property
    def plans_discards(self) -> bool:
        """True when the plan being followed discards gradient blocks."""
        plan = self.plan
        return plan is not None and any(m.kind == "discard" for ms in plan.moves for m in ms)

    # ---- a step ----

    def begin_step(self) -> None:
        """Start a step: the mover drained (what the last step queued is issued), segments freed since
        then forgotten, counters at zero; with a plan, realign residency to its starting state."""
        self.mover.drain()
        if not self.cover_unknown:
            self.refresh_segments()
        self._raise_mover_error()  # a batch of the last step failed after it ended: nothing has run yet
        self.ledger.reset_counters()
        self._pending, self._next_pending = self._next_pending, {}
        self._current = set()
        self._touch_now = {}
        self._fresh_now = {}
        self._keys = {}
        self._skipped = {}
        self.stats = {"positions": 0, "unplanned_positions": 0, "demand_bytes": 0, "ahead_bytes": 0,
                      "unforeseen_bytes": 0, "realign_bytes": 0, "host_waits": 0, "skipped_ahead": 0,
                      "host_wait_ms": 0.0, "executor_ms": 0.0}
        self.following_plan = self.plan is not None and self._scheduler is not None
        if self.residency_unknown:  # a move failed: the ledger may be wrong, so start from nothing resident
            moves = self.ledger.evict_everything()
            self.stats["realign_bytes"] = sum(m.nbytes for m in moves)
            self.residency_unknown = False
            self._pending = {}  # batches carried over from the failed step: not waited for
            self._issue(moves, -1)
        if self.plan is not None and self.following_plan:
            start = self._starting_set(self.plan)
            moves = self.ledger.evict(sorted(self.ledger.resident_blocks() - start))
            moves += self.ledger.bring_in(start, self._rank(0), target=0, what="the plan's starting set") or []
            self.stats["realign_bytes"] += sum(m.nbytes for m in moves)
            self._issue(moves, -1)

    def _starting_set(self, plan: Plan) -> set[int]:
        """The plan's starting set, less the blocks used last when fixed blocks that came since the plan leave
        no room for all of it (the step then brings those in on demand; a new plan follows the step)."""
        ledger = self.ledger
        fixed = ledger.fixed_blocks()
        start = set(plan.start_resident) & ledger.segment_blocks()
        room = ledger.budget_bytes - ledger.fixed_bytes
        if ledger.bytes_of(start - fixed) <= room:
            return start
        rank = self._rank(-1)  # from position 0 on, position 0 itself included
        kept: set[int] = set()
        for b in sorted(start - fixed, key=lambda b: (rank(b), b)):  # the soonest used first
            room -= ledger.bytes_of([b])
            if room < 0:
                break
            kept.add(b)
        return kept | (start & fixed)

    def enter(self, index: int, position: Position) -> None:
        """A position opens (the recorder's listener call). Its host time, waits included, adds to
        ``stats["executor_ms"]``."""
        with self._hook_time():
            self._enter(index, position)

    def _enter(self, index: int, position: Position) -> None:
        self._tick += 1
        self.stats["positions"] += 1
        actual = self.blocks(position.spans())
        self._wait_pending(index)
        plan = self.plan
        if self.following_plan and plan is not None and index < len(plan.keys) and plan.keys[index] == position.key:
            actual -= plan.remote_blocks  # used where they are, in host memory
            rank = self._rank(index)
            moves: list[Move] = []
            for planned in plan.moves[index]:
                blocks = self.ledger.known_blocks(planned.blocks)  # a segment freed since planning: gone
                if not blocks:
                    continue
                if planned.kind == "evict":
                    moves += self.ledger.evict(blocks, target=planned.target)
                elif planned.kind == "discard":
                    if self.discard_gradients and not self._discards_suspended:  # blocks wholly in gradient segments
                        blocks = [b for b in blocks if all(self.classify(seg) is DataType.GRAD
                                                           for seg in self.ledger.segment_starts(b))]
                        moves += self.ledger.discard(blocks, target=planned.target)
                elif planned.to_gpu and planned.target == index:
                    what = f"{position.phase} of {position.layer}"
                    try:  # never evict this position's actual ranges (at new addresses they rank last)
                        moves += self.ledger.bring_in(blocks, rank, target=index, protect=actual, what=what) or []
                    except BudgetTooSmall:  # the plan's blocks and the actual ones do not fit together
                        try:
                            moves += self.ledger.bring_in(blocks, rank, target=index, what=what) or []
                        except BudgetTooSmall:  # not even alone beside the fixed pool (it grew): the actual
                            self.stats["skipped_ahead"] += 1  # ranges below decide whether the step can run
                            continue
                elif planned.to_gpu:
                    try:  # a look-ahead: with this position's actual ranges it may no longer fit; skip it
                        got = self.ledger.bring_in(blocks, rank, target=planned.target, protect=actual,
                                                   what=f"{position.phase} of {position.layer}")
                    except BudgetTooSmall:
                        self.stats["skipped_ahead"] += 1
                        self._skipped.setdefault(planned.target, set()).update(blocks)
                        continue
                    moves += got or []
            unforeseen = self.ledger.bring_in(actual, rank, target=index,
                                              what=f"{position.phase} of {position.layer}") or []
            skipped = self._skipped.pop(index, set())  # foreseen, but skipped as a look-ahead: no new plan helps
            self.stats["unforeseen_bytes"] += self.ledger.bytes_of(
                b for m in unforeseen if m.to_gpu for b in m.blocks if b not in skipped)
            moves += unforeseen
        else:
            if self.following_plan:
                self.following_plan = False
            self.stats["unplanned_positions"] += 1
            moves = self.ledger.bring_in(actual, self._lru_rank, target=index,
                                         what=f"{position.phase} of {position.layer or 'the model'}") or []
        reserve = max(self._touch_estimate.get((index, position.key), 0),
                      self._fresh_bound.get((index, position.key), 0) if self.following_plan else 0)
        if reserve:  # last step this position wrote that much outside the plan: make room before it runs
            moves += self.ledger.make_room(reserve, self._rank(index) if self.following_plan else self._lru_rank,
                                           protect=actual, target=index)
        self._current = actual
        self._keys[index] = position.key
        for b in actual:
            self._last_use[b] = self._tick
        self._issue(moves, index)

    def touched(self, index: int, data_type: DataType, spans: list[Span]) -> None:
        """Kernels of position ``index`` wrote ``spans``: record them resident, evict to stay under budget."""
        with self._hook_time():
            self._touched(index, data_type, spans)

    def _touched(self, index: int, data_type: DataType, spans: list[Span]) -> None:
        blocks = self.blocks(spans)
        if data_type is DataType.ACT and DataType.ACT not in self.fixed_types:  # fresh tensors: any address next step
            fresh = sum(_worst_blocks(n) * BLOCK for p, n in spans
                        if not all(self.ledger.written_on_host(b) for b in self.ledger.blocks([(p, n)])))
            if fresh:
                key = (index, self._keys.get(index, ("", "")))
                self._fresh_now[key] = self._fresh_now.get(key, 0) + fresh
        if self.following_plan and self.plan is not None and self.plan.remote_blocks:
            blocks -= self.plan.remote_blocks  # written where they are, in host memory (as in _enter)
        rank = self._rank(index) if self.following_plan else self._lru_rank
        ledger = self.ledger
        missing = ledger.bytes_of(b for b in blocks if ledger.where(b) != "gpu" and not ledger.written_on_host(b))
        if missing:
            key = (index, self._keys.get(index, ("", "")))
            self._touch_now[key] = self._touch_now.get(key, 0) + missing
        moves = self.ledger.touched(blocks, rank, target=index, protect=self._current)
        for b in blocks:
            self._last_use[b] = self._tick
        self._issue(moves, index)

    def touch_now(self, spans: Iterable[Span]) -> None:
        """Outside a step (placement, inputs): the GPU wrote ``spans``."""
        blocks = self.blocks(spans)
        self._issue(self.ledger.touched(blocks, self._lru_rank), -1)

    def evict_all(self) -> int:
        """Push every resident block to the host (after placing a model); returns bytes moved."""
        moves = self.ledger.evict(sorted(self.ledger.resident_blocks()))
        self._issue(moves, -1)
        return sum(m.nbytes for m in moves)

    def abort(self) -> None:
        """A step failed: forget pending events (the ledger still holds what was issued)."""
        self._pending.clear()
        self._next_pending.clear()
        self._current = set()
        self.following_plan = False

    def end_step(self) -> dict[str, Any]:
        """The step's numbers for ``StepRecord.extra["budget"]``; raises an error a move of this step met
        (the ledger is then marked unknown: the next step starts by evicting everything)."""
        self._pending.clear()
        self._raise_mover_error()
        for key, nbytes in self._touch_now.items():  # the most any step wrote there: room only grows
            self._touch_estimate[key] = max(nbytes, self._touch_estimate.get(key, 0))
        for key, nbytes in self._fresh_now.items():
            self._fresh_bound[key] = max(nbytes, self._fresh_bound.get(key, 0))
        ledger = self.ledger
        timing = {"move_timing": self.clock.collect(self.streams.elapsed_ms)} if self.clock is not None else {}
        return {**timing, "budget_bytes": ledger.budget_bytes, "max_resident_ledger": ledger.max_resident,
                "resident_at_end": ledger.resident_bytes, "managed_bytes": ledger.total_bytes,
                "prefetched_bytes": ledger.prefetched_bytes, "evicted_bytes": ledger.evicted_bytes,
                "discarded_bytes": ledger.discarded_bytes, "populated_bytes": ledger.populated_bytes,
                "touched_bytes": ledger.touched_bytes, "first_touch_bytes": ledger.first_touch_bytes,
                "host_touched_bytes": ledger.host_touched_bytes,
                "fixed_bytes": ledger.fixed_bytes, "fixed_reserve_bytes": self.fixed_reserve,
                "remote_bytes": self.plan.remote_bytes if self.plan is not None and self.following_plan else 0,
                "over_budget": ledger.max_resident > ledger.budget_bytes,
                "planned": self.plan is not None, "followed_plan": self.following_plan, **self.stats}

    # ---- internals ----

    @contextlib.contextmanager
    def _hook_time(self) -> Iterator[None]:
        """Add the host time of the ``with`` body to ``stats["executor_ms"]``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.stats["executor_ms"] = self.stats.get("executor_ms", 0.0) + (time.perf_counter() - began) * 1e3

    def _rank(self, now: int) -> Callable[[int], float]:
        scheduler = self._scheduler
        if scheduler is None:
            return self._lru_rank
        return scheduler.rank(now)

    def _lru_rank(self, block: int) -> float:
        return float(self._tick - self._last_use.get(block, -1))

    def _wait_pending(self, index: int) -> None:
        for target in sorted(t for t in self._pending if t <= index):
            self._wait(self._pending.pop(target))

    def _raise_mover_error(self) -> None:
        """Raise an error a batch met that nobody raised yet, marking the ledger's residency unknown."""
        error = self.mover.take_error()
        if error is not None:
            self.residency_unknown = True
            raise error

    def _wait(self, batch: MoveBatch) -> None:
        """Compute waits for ``batch``'s transfers (the host first waits until it was issued: counted in
        ``stats["host_waits"]`` and ``stats["host_wait_ms"]``)."""
        self._wait_issued(batch)

    def _wait_issued(self, batch: MoveBatch) -> None:
        waited = not batch.issued
        began = time.perf_counter()
        try:
            event = batch.wait()
        except BaseException:
            self.residency_unknown = True  # the ledger applied moves that did not all happen
            self.mover.take_error()  # raised here: not again at the step's end
            raise
        finally:
            if waited:
                self.stats["host_waits"] = self.stats.get("host_waits", 0) + 1
                self.stats["host_wait_ms"] = self.stats.get("host_wait_ms", 0.0) + (time.perf_counter() - began) * 1e3
        if event is not None:
            self.streams.compute_wait(event)

    def _issue(self, moves: list[Move], index: int) -> None:
        """Carry out ``moves`` on the side stream in order (see the module docstring). Segments allocated
        or freed since the ledger last read them are brought in line first, and a range that is not in a
        live segment is never prefetched (checked here and again by the mover right before each call)."""
        if not moves:
            return
        if not self.cover_unknown and self._generation is not None and self._generation() != self._seen_generation:
            self.refresh_segments()
        segments = None if self.cover_unknown else self._live_segments()
        codes = self.runtime.codes
        compute_event = self.streams.record_compute() if any(m.kind in ("evict", "discard") for m in moves) else None
        targets: set[int] = set()
        calls = []
        for m in moves:
            if m.kind == "touch":
                continue
            if m.kind == "discard":
                calls += [(ptr, n, DISCARD, 0) for ptr, n in m.spans if segments is None or _inside(segments, ptr, n)]
                continue
            to_gpu = m.to_gpu
            loc = (codes.location_device, self.device) if to_gpu else (codes.location_host, 0)
            if m.kind == "populate":  # a GPU write to discarded pages faults at ~0.7 GB/s: populate them first
                loc = (POPULATE, self.device)
            calls += [(ptr, n, loc[0], loc[1]) for ptr, n in m.spans
                      if segments is None or _inside(segments, ptr, n)]
            if to_gpu:
                targets.add(m.target)
                key = "demand_bytes" if m.target == index else "ahead_bytes"
                self.stats[key] = self.stats.get(key, 0) + m.nbytes
        if not calls:
            return
        live = None if self.cover_unknown else self.span_live
        try:
            batch = self.mover.submit(MoveBatch(compute_event, calls, record=bool(targets), live=live,
                                                clock=self.clock, batched=self.batch_calls))
        except BaseException:  # an earlier batch failed: the ledger holds moves that did not happen
            self.residency_unknown = True
            raise
        if index in targets:
            self._wait(batch)
        for t in targets:  # a target before this position is a look-ahead past the step's end: the next step's
            if t > index:
                self._pending[t] = batch
            elif t < index:
                self._next_pending[t] = batch

    def close(self) -> None:
        """Stop the mover after it issued what it holds, then wait for the side stream's transfers: after
        this no prefetch of this executor is queued or in flight, so managed memory may be freed."""
        try:
            self.mover.close()
        finally:
            self.streams.synchronize_side()
        self._raise_mover_error()


def _worst_blocks(nbytes: int) -> int:
    """The most 2 MiB blocks ``nbytes`` contiguous bytes can touch, wherever they start."""
    return (nbytes + BLOCK - 2) // BLOCK + 1 if nbytes > 0 else 0


def _disjoint(spans: Iterable[Span], others: Sequence[Span]) -> list[Span]:
    """The ``spans`` that overlap none of ``others``."""
    ordered = sorted(others)
    starts = [p for p, _ in ordered]
    out = []
    for ptr, n in spans:
        i = bisect.bisect_right(starts, ptr + n - 1) - 1
        if i < 0 or ordered[i][0] + ordered[i][1] <= ptr:  # the last one starting before its end ends before it
            out.append((ptr, n))
    return out


def _inside(live: tuple[int | None, list[int], list[int]], ptr: int, nbytes: int) -> bool:
    """True when ``[ptr, ptr + nbytes)`` lies inside one of the segments (sorted starts and ends)."""
    i = bisect.bisect_right(live[1], ptr) - 1
    return i >= 0 and ptr + nbytes <= live[2][i]
