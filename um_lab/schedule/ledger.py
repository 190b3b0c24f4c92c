"""The budget ledger: which 2 MiB blocks of managed memory are GPU-resident, kept under a budget.

The UM driver moves and places memory in 2 MiB VA blocks, so the ledger accounts per block: a block
is resident when any byte of it is, and a tensor smaller than a block shares it with its neighbours.
A block's bytes are the parts of managed segments inside it (a segment's tail may end mid-block).

Every change of residency the scheduler causes or knows of goes through :meth:`Ledger.bring_in`
(a prefetch to the GPU, or a first touch by a kernel), :meth:`Ledger.evict` (a prefetch to the host)
or :meth:`Ledger.touched` (the GPU touched data already, e.g. an output written by a layer). Each
returns the :class:`Move` objects to carry out (prefetches with their byte ranges, coalesced); the
ledger never lets resident bytes exceed the budget: it evicts first, choosing victims by a rank the
caller gives (the scheduler ranks by next use in the learned order: Belady), and raises
:class:`~um_lab.errors.BudgetTooSmall` before anything moves when the blocks wanted at once cannot fit.

A segment registered as *fixed* (``add_segment(..., fixed=True)``: data the scheduler leaves on the GPU,
such as the intermediate-results pool when saved activations are staged through pinned host memory) counts
as resident from registration on and is never a victim: it is a fixed part of the budget.

Pure Python, no CUDA: the executor (:mod:`um_lab.schedule.live.executor`) turns moves into
``cudaMemPrefetchAsync`` calls.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from um_lab.errors import BudgetError, BudgetTooSmall
from um_lab.units import BLOCK  # noqa: F401 - the ledger's unit, importable here too

GPU = "gpu"
HOST = "host"

Span = tuple[int, int]  #: a byte range: (address, bytes)
SPAN_CACHE_SIZE = 1 << 16  #: byte ranges whose blocks the ledger remembers before it forgets them all


def blocks_of_span(ptr: int, nbytes: int) -> range:
    """The indices of the 2 MiB blocks that a byte range touches (empty for ``nbytes <= 0``)."""
    if nbytes <= 0:
        return range(0)
    return range(ptr // BLOCK, (ptr + nbytes - 1) // BLOCK + 1)


@dataclasses.dataclass(frozen=True)
class Move:
    """One change of residency: ``kind`` is ``prefetch`` (to the GPU), ``evict`` (to the host),
    ``discard`` (contents dead: dropped with no copy; ``nbytes`` is the resident bytes it frees),
    ``populate`` (dead blocks made resident with no copy: ``cudaMemDiscardAndPrefetchBatchAsync``) or
    ``touch`` (the GPU touched it: nothing to issue). ``spans`` are the byte ranges to move (clipped to
    managed segments, adjacent blocks merged), ``nbytes`` their total, ``resident_after`` the ledger's
    resident bytes once it is done, ``target`` the position it serves (scheduler's label, -1: none),
    ``blocks`` the ledger's block indices."""

    kind: str
    spans: tuple[Span, ...]
    nbytes: int
    resident_after: int
    target: int = -1
    blocks: tuple[int, ...] = ()

    @property
    def link_bytes(self) -> int:
        """Bytes this move sends over the host link (none for a discard, a populate or a touch)."""
        return self.nbytes if self.kind in ("prefetch", "evict") else 0

    @property
    def to_gpu(self) -> bool:
        """True for the moves that make blocks resident by a call (prefetch, populate)."""
        return self.kind in ("prefetch", "populate")


@dataclasses.dataclass
class _Block:
    nbytes: int  # managed bytes inside this block
    pieces: list[tuple[int, int, int]]  # (address, bytes, segment start): the segment parts inside it
    where: str = HOST
    ever_on_gpu: bool = False
    dead: bool = False  # contents discarded: bringing it in moves no bytes over the link
    fixed: int = 0  # fixed segments with a piece here: while > 0 the block stays resident, never a victim
    host_written: int = 0  # pieces in segments whose GPU writes land in host memory (preferred location: host)


class Ledger:
    """GPU residency of managed memory per 2 MiB block, never above ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise BudgetError(f"the GPU budget must be a positive number of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._blocks: dict[int, _Block] = {}
        self._segments: dict[int, int] = {}  # segment start -> size
        self._gpu: set[int] = set()
        self._dead: set[int] = set()  # blocks whose contents are dead (mirrors _Block.dead)
        self._fixed: set[int] = set()  # blocks held resident by a fixed segment (mirrors _Block.fixed > 0)
        self._fixed_segments: set[int] = set()
        self._host_written_segments: set[int] = set()
        self._layout = 0  # counts segment registrations and removals (the fixed bytes' cache key)
        self._fixed_cache = (-1, 0)
        self._span_cache: dict[Span, tuple[frozenset[int], bool]] = {}  # see _span_blocks
        self._span_layout = 0
        self.resident_bytes = 0
        self.max_resident = 0
        self.prefetched_bytes = 0
        self.evicted_bytes = 0
        self.first_touch_bytes = 0
        self.touched_bytes = 0
        self.host_touched_bytes = 0  #: GPU writes to non-resident host-written blocks (they stay on the host)
        self.discarded_bytes = 0
        self.populated_bytes = 0
        self.moves: list[Move] = []  #: every move, in order (cleared by :meth:`reset_counters`)
        self.keep_moves = True

    # ---- the managed memory it accounts for ----

    @property
    def total_bytes(self) -> int:
        """All managed bytes the ledger knows (every segment registered)."""
        return sum(self._segments.values())

    def add_segment(self, ptr: int, size: int, *, fixed: bool = False, host_written: bool = False) -> None:
        """Register a managed segment (not resident anywhere on the GPU yet). A ``fixed`` one is resident at
        once and stays so (never a victim); resident bytes may then exceed the budget until the caller makes
        room (:meth:`make_room`), and ``max_resident`` records it. A ``host_written`` one prefers the host:
        a GPU write to a non-resident page lands in host memory, mapped remotely, so :meth:`touched` leaves its
        blocks where they are; only a prefetch makes them resident."""
        if size <= 0:
            raise BudgetError(f"a segment needs a positive size, got {size}")
        if ptr in self._segments:
            if self._segments[ptr] != size:
                raise BudgetError(f"segment at {ptr:#x} registered with {self._segments[ptr]} B, now {size} B")
            if fixed != (ptr in self._fixed_segments):
                raise BudgetError(f"segment at {ptr:#x} registered {'not ' if fixed else ''}fixed, now "
                                  f"{'' if fixed else 'not '}fixed")
            return
        for b in blocks_of_span(ptr, size):
            lo, hi = max(ptr, b * BLOCK), min(ptr + size, (b + 1) * BLOCK)
            block = self._blocks.get(b)
            if block is None:
                self._blocks[b] = _Block(hi - lo, [(lo, hi - lo, ptr)], host_written=int(host_written))
            else:
                if any(p < hi and lo < p + n for p, n, _ in block.pieces):
                    raise BudgetError(f"segment at {ptr:#x} ({size} B) overlaps a registered segment")
                block.host_written += int(host_written)
                block.nbytes += hi - lo
                block.pieces.append((lo, hi - lo, ptr))
                if block.where == GPU:
                    self.resident_bytes += hi - lo
        self._segments[ptr] = size
        self._layout += 1
        if host_written:
            self._host_written_segments.add(ptr)
        if fixed:
            self._fixed_segments.add(ptr)
            for b in blocks_of_span(ptr, size):
                block = self._blocks[b]
                block.fixed += 1
                self._fixed.add(b)
                if block.where != GPU:
                    block.where = GPU
                    block.ever_on_gpu = True
                    self._gpu.add(b)
                    self.resident_bytes += block.nbytes
                if block.dead:
                    block.dead = False
                    self._dead.discard(b)
        self.max_resident = max(self.max_resident, self.resident_bytes)  # a new piece of a resident block

    def remove_segment(self, ptr: int) -> None:
        """Forget a freed segment (its resident bytes stop counting)."""
        size = self._segments.pop(ptr)
        self._layout += 1
        fixed = ptr in self._fixed_segments
        self._fixed_segments.discard(ptr)
        host_written = ptr in self._host_written_segments
        self._host_written_segments.discard(ptr)
        for b in blocks_of_span(ptr, size):
            block = self._blocks[b]
            lo, hi = max(ptr, b * BLOCK), min(ptr + size, (b + 1) * BLOCK)
            block.pieces.remove((lo, hi - lo, ptr))
            block.nbytes -= hi - lo
            if block.where == GPU:
                self.resident_bytes -= hi - lo
            block.host_written -= int(host_written)
            if fixed:
                block.fixed -= 1
                if not block.fixed:  # what else it holds stays resident, now an ordinary victim
                    self._fixed.discard(b)
            if not block.pieces:
                del self._blocks[b]
                self._gpu.discard(b)
                self._dead.discard(b)
                self._fixed.discard(b)

    def set_host_written(self, ptr: int, host_written: bool) -> None:
        """Say again whether the registered segment at ``ptr`` prefers the host (its pool's advice changed):
        what :meth:`touched` does with a GPU write to its blocks follows from here on; residency is unchanged."""
        if ptr not in self._segments:
            raise BudgetError(f"no segment registered at {ptr:#x}")
        if host_written == (ptr in self._host_written_segments):
            return
        step = 1 if host_written else -1
        for b in blocks_of_span(ptr, self._segments[ptr]):
            self._blocks[b].host_written += step
        if host_written:
            self._host_written_segments.add(ptr)
        else:
            self._host_written_segments.discard(ptr)

    def written_on_host(self, block: int) -> bool:
        """True when a GPU write leaves ``block`` on the host: every piece is in a host-written segment."""
        b = self._blocks[block]
        return bool(b.host_written) and b.host_written == len(b.pieces)

    def known_blocks(self, blocks: Iterable[int]) -> list[int]:
        """The blocks of ``blocks`` that still hold managed bytes (a freed segment's blocks are gone)."""
        return [b for b in blocks if b in self._blocks]

    def segment_blocks(self) -> set[int]:
        """Every block index that holds managed bytes."""
        return set(self._blocks)

    def segment_starts(self, block: int) -> set[int]:
        """The starts of the segments that have bytes in ``block``."""
        return {seg for _, _, seg in self._blocks[block].pieces}

    def segments(self) -> dict[int, int]:
        """Registered segments: start -> size."""
        return dict(self._segments)

    def blocks(self, spans: Iterable[Span]) -> set[int]:
        """The managed blocks the byte ranges touch (ranges outside every segment are ignored)."""
        out: set[int] = set()
        for span in spans:
            out.update(self._span_blocks(span)[0])
        return out

    def unknown(self, spans: Iterable[Span]) -> list[Span]:
        """The byte ranges that lie in no registered segment (wholly or partly)."""
        return [span for span in spans if not self._span_blocks(span)[1]]

    def _span_blocks(self, span: Span) -> tuple[frozenset[int], bool]:
        """(the managed blocks ``span`` touches, whether registered segments cover all of it), remembered until
        the segments change: the hooks ask for the same ranges at every position of every step."""
        if self._span_layout != self._layout or len(self._span_cache) > SPAN_CACHE_SIZE:
            self._span_cache.clear()
            self._span_layout = self._layout
        found = self._span_cache.get(span)
        if found is None:
            ptr, n = span
            hit: set[int] = set()
            covered = 0
            for b in blocks_of_span(ptr, n):
                block = self._blocks.get(b)
                if block is None:
                    continue
                for p, m, _ in block.pieces:
                    if p < ptr + n and ptr < p + m:
                        hit.add(b)
                        covered += min(p + m, ptr + n) - max(p, ptr)
            found = self._span_cache[span] = (frozenset(hit), covered >= n)
        return found

    # ---- state ----

    def where(self, block: int) -> str:
        """``gpu`` or ``host`` (host also means: never touched by the GPU)."""
        return self._blocks[block].where

    def is_dead(self, block: int) -> bool:
        """True while ``block``'s contents are discarded (not resident; bringing it in copies nothing)."""
        return self._blocks[block].dead

    def dead_blocks(self) -> frozenset[int]:
        """Every block whose contents are dead now."""
        return frozenset(self._dead)

    def pieces_of(self, block: int) -> list[Span]:
        """The managed byte ranges inside ``block`` (one per segment part)."""
        return [(p, n) for p, n, _ in self._blocks[block].pieces]

    def spans_of(self, blocks: Iterable[int]) -> tuple[Span, ...]:
        """The managed byte ranges of ``blocks``, as a move of them would issue them."""
        return self._spans(sorted(set(blocks)))

    def bytes_of(self, blocks: Iterable[int]) -> int:
        """Managed bytes in ``blocks``."""
        return sum(self._blocks[b].nbytes for b in blocks)

    def resident_blocks(self) -> set[int]:
        """The blocks on the GPU now."""
        return set(self._gpu)

    def fixed_blocks(self) -> frozenset[int]:
        """The blocks fixed segments hold resident (never victims)."""
        return frozenset(self._fixed)

    @property
    def fixed_bytes(self) -> int:
        """Managed bytes in fixed blocks: the part of the budget the scheduler cannot move."""
        if self._fixed_cache[0] != self._layout:  # a block's bytes change only when segments come or go
            self._fixed_cache = (self._layout, self.bytes_of(self._fixed))
        return self._fixed_cache[1]

    def bytes_with_fixed(self, blocks: set[int]) -> int:
        """Managed bytes in ``blocks`` and every fixed block, each counted once."""
        if not self._fixed:
            return self.bytes_of(blocks)
        return self.bytes_of(blocks - self._fixed) + self.fixed_bytes

    def is_fixed_segment(self, ptr: int) -> bool:
        """True when the segment starting at ``ptr`` was registered fixed."""
        return ptr in self._fixed_segments

    def bytes_by_state(self) -> dict[str, int]:
        """Managed bytes per state; they add up to :attr:`total_bytes`."""
        gpu = sum(self._blocks[b].nbytes for b in self._gpu)
        return {GPU: gpu, HOST: sum(b.nbytes for b in self._blocks.values()) - gpu}

    def check_accounting(self) -> None:
        """Raise AssertionError unless resident bytes match the blocks and the states add up to all bytes."""
        by_state = self.bytes_by_state()
        if by_state[GPU] != self.resident_bytes or by_state[GPU] + by_state[HOST] != self.total_bytes:
            raise AssertionError(f"ledger out of balance: {by_state}, resident {self.resident_bytes}, "
                                 f"total {self.total_bytes}")

    def check(self) -> None:
        """:meth:`check_accounting`, and resident bytes within the budget now."""
        self.check_accounting()
        if self.resident_bytes > self.budget_bytes:
            raise AssertionError(f"resident {self.resident_bytes} B above the budget {self.budget_bytes} B")

    def reset_counters(self) -> None:
        """Start a new period (a step): max resident from now, byte counters and move log at zero."""
        self.max_resident = self.resident_bytes
        self.prefetched_bytes = self.evicted_bytes = self.first_touch_bytes = self.touched_bytes = 0
        self.discarded_bytes = self.populated_bytes = self.host_touched_bytes = 0
        self.moves = []

    # ---- moves ----

    def bring_in(self, blocks: Iterable[int], rank: Callable[[int], float], *, target: int = -1,
                 what: str = "one layer's working set", protect: Iterable[int] = (),
                 may_evict: Callable[[int], bool] | None = None, headroom: int = 0) -> list[Move] | None:
        """Make ``blocks`` resident: evict victims (highest ``rank`` first, never one of ``blocks`` or
        ``protect``) until they fit with ``headroom`` bytes left free under the budget (as much of it as
        ``blocks`` and ``protect`` leave), then prefetch the missing ones.

        Raises :class:`BudgetTooSmall` (nothing moved) when ``blocks`` plus ``protect`` exceed the budget.
        With ``may_evict`` (a look-ahead prefetch) only victims it accepts are taken; if those are not
        enough nothing moves and None is returned.
        """
        wanted = set(blocks)
        keep = wanted | set(protect)
        need_all = self.bytes_with_fixed(keep)
        if need_all > self.budget_bytes:
            raise BudgetTooSmall(self.budget_bytes, need_all, what)
        missing = sorted(b for b in wanted if self._blocks[b].where != GPU)
        need = self.bytes_of(missing)
        headroom = max(0, min(headroom, self.budget_bytes - need_all))
        excess = self.resident_bytes + need + headroom - self.budget_bytes
        victims: list[int] = []
        if excess > 0:
            for b in self._by_rank(keep, rank):
                if excess <= 0:
                    break
                if may_evict is not None and not may_evict(b):
                    return None
                victims.append(b)
                excess -= self._blocks[b].nbytes
            if excess > 0:  # pragma: no cover - need_all <= budget guarantees room
                raise BudgetTooSmall(self.budget_bytes, need_all, what)
        moves = self._evict(victims, target) if victims else []
        dead = [b for b in missing if self._blocks[b].dead]
        live = [b for b in missing if not self._blocks[b].dead]
        if dead:  # contents discarded: made resident with no copy (discard-and-prefetch)
            moves.append(self._move_in(dead, "populate", target))
        if live:
            moves.append(self._move_in(live, "prefetch", target))
        return moves

    def make_room(self, nbytes: int, rank: Callable[[int], float], *, protect: Iterable[int] = (),
                  target: int = -1) -> list[Move]:
        """Evict victims (highest ``rank`` first, never ``protect``) until ``nbytes`` more would fit."""
        excess = self.resident_bytes + nbytes - self.budget_bytes
        return self._evict(self._victims(excess, set(protect), rank), target)

    def evict(self, blocks: Iterable[int], target: int = -1) -> list[Move]:
        """Push resident ``blocks`` to the host (blocks already there, and fixed ones, are skipped)."""
        return self._evict([b for b in blocks if self._blocks[b].where == GPU and b not in self._fixed], target)

    def discard(self, blocks: Iterable[int], target: int = -1) -> list[Move]:
        """Declare the contents of ``blocks`` dead (``cudaMemDiscardBatchAsync``): resident ones stop
        counting with no transfer, and bringing any of them in later populates pages instead of copying.
        Blocks already discarded (dead and not resident), and fixed ones, are skipped."""
        chosen = sorted(b for b in set(blocks) if b not in self._fixed
                        and not (self._blocks[b].dead and self._blocks[b].where != GPU))
        if not chosen:
            return []
        freed = 0
        for b in chosen:
            block = self._blocks[b]
            block.dead = True
            self._dead.add(b)
            if block.where == GPU:
                block.where = HOST
                self._gpu.discard(b)
                freed += block.nbytes
        self.resident_bytes -= freed
        self.discarded_bytes += freed
        return [self._log(Move("discard", self._spans(chosen), freed, self.resident_bytes, target, tuple(chosen)))]

    def mark_dead(self, blocks: Iterable[int]) -> None:
        """The contents of ``blocks`` are dead from now on: nothing moves yet, but a resident one picked as a
        victim is discarded instead of copied, and bringing a non-resident one in populates it (fixed blocks
        are skipped: they never move)."""
        for b in blocks:
            if b in self._fixed:
                continue
            self._blocks[b].dead = True
            self._dead.add(b)

    def mark_live(self, blocks: Iterable[int]) -> None:
        """``blocks`` are in use again (written before being read): no longer dead."""
        for b in blocks:
            self._blocks[b].dead = False
            self._dead.discard(b)

    def evict_everything(self, target: int = -1) -> list[Move]:
        """Push every block to the host, whatever the ledger believes about it (after moves that may
        not have happened: its state is unknown); afterwards only fixed blocks count as resident (nothing
        moves them)."""
        blocks = sorted(set(self._blocks) - self._fixed)
        for b in blocks:
            self._blocks[b].where = GPU
        self._gpu.update(blocks)
        self.resident_bytes = sum(self._blocks[b].nbytes for b in self._gpu)
        return self._evict(blocks, target)

    def touched(self, blocks: Iterable[int], rank: Callable[[int], float], *, target: int = -1,
                protect: Iterable[int] = ()) -> list[Move]:
        """The GPU has touched ``blocks`` (a kernel wrote them): mark them resident, evicting victims to
        get back under the budget. The touch is not ours to stop, so this never raises: when the blocks
        alone exceed the budget the excess is recorded (``max_resident``) and ``check`` fails. A block whose
        every piece is host-written (:meth:`add_segment`) stays on the host (``host_touched_bytes``)."""
        missing = []
        for b in sorted(set(blocks)):
            if self._blocks[b].where == GPU:
                continue
            if self.written_on_host(b):
                self.host_touched_bytes += self._blocks[b].nbytes
                if self._blocks[b].dead:  # written: its contents live again (a bring-in must copy, not populate)
                    self._blocks[b].dead = False
                    self._dead.discard(b)
                continue
            missing.append(b)
        if not missing:
            return []
        moves = [self._move_in(missing, "touch", target)]
        excess = self.resident_bytes - self.budget_bytes
        if excess > 0:
            moves += self._evict(self._victims(excess, set(missing) | set(protect), rank), target)
        return moves

    def _victims(self, excess: int, keep: set[int], rank: Callable[[int], float]) -> list[int]:
        """Resident blocks to push out, highest ``rank`` first and never ``keep``, until ``excess`` bytes
        are freed (fewer when nothing else may go)."""
        victims: list[int] = []
        if excess <= 0:  # ranking every resident block costs host time at each position
            return victims
        for b in self._by_rank(keep, rank):
            if excess <= 0:
                break
            victims.append(b)
            excess -= self._blocks[b].nbytes
        return victims

    def _by_rank(self, keep: set[int], rank: Callable[[int], float]) -> Iterator[int]:
        """Resident blocks outside ``keep``, highest rank first (ties: lowest block), lazily. A ``rank`` with a
        ``many`` method (an array of blocks -> their ranks) is evaluated for all of them at once."""
        movable = self._gpu - self._fixed if self._fixed else self._gpu
        many = getattr(rank, "many", None)
        if many is not None:
            candidates = np.fromiter(movable, dtype=np.int64, count=len(movable))
            if keep:
                candidates = candidates[~np.isin(candidates, np.fromiter(keep, dtype=np.int64, count=len(keep)))]
            ranks = np.asarray(many(candidates), dtype=np.float64)
            for k in np.lexsort((candidates, -ranks)):
                yield int(candidates[k])
            return
        heap = [(-rank(b), b) for b in movable if b not in keep]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[1]

    def _move_in(self, blocks: list[int], kind: str, target: int) -> Move:
        nbytes = populated = 0
        for b in blocks:
            block = self._blocks[b]
            block.where = GPU
            if block.dead:
                block.dead = False
                self._dead.discard(b)
                populated += block.nbytes
            nbytes += block.nbytes
            if not block.ever_on_gpu:
                self.first_touch_bytes += block.nbytes
                block.ever_on_gpu = True
            self._gpu.add(b)
        self.resident_bytes += nbytes
        self.max_resident = max(self.max_resident, self.resident_bytes)
        self.populated_bytes += populated
        if kind == "prefetch":
            self.prefetched_bytes += nbytes
        elif kind == "touch":
            self.touched_bytes += nbytes
        return self._log(Move(kind, self._spans(blocks), nbytes, self.resident_bytes, target, tuple(blocks)))

    def _evict(self, blocks: list[int], target: int) -> list[Move]:
        """Push ``blocks`` to the host; those whose contents are dead are discarded instead (no copy)."""
        if not blocks:
            return []
        dead = [b for b in blocks if self._blocks[b].dead]
        if dead:
            return self.discard(dead, target) + self._evict([b for b in blocks if not self._blocks[b].dead], target)
        nbytes = 0
        for b in blocks:
            self._blocks[b].where = HOST
            self._gpu.discard(b)
            nbytes += self._blocks[b].nbytes
        self.resident_bytes -= nbytes
        self.evicted_bytes += nbytes
        return [self._log(Move("evict", self._spans(blocks), nbytes, self.resident_bytes, target, tuple(blocks)))]

    def _log(self, move: Move) -> Move:
        if self.keep_moves:
            self.moves.append(move)
        return move

    def _spans(self, blocks: list[int]) -> tuple[Span, ...]:
        """The managed byte ranges of ``blocks``, adjacent pieces of one segment merged (one prefetch call
        each; a prefetch never spans two allocations)."""
        pieces = sorted(p for b in blocks for p in self._blocks[b].pieces)
        merged: list[list[int]] = []
        for ptr, n, seg in pieces:
            if merged and merged[-1][0] + merged[-1][1] == ptr and merged[-1][2] == seg:
                merged[-1][1] += n
            else:
                merged.append([ptr, n, seg])
        return tuple((p, n) for p, n, _ in merged)
