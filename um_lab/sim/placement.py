"""Place a traced step's storages into per-type pools the way PyTorch's caching allocator would.

One pool per data type (as in the real backend), each with PyTorch's rules: requests rounded to 512 B;
requests of at most 1 MiB share 2 MiB segments, requests under 10 MiB share 20 MiB segments, larger
requests get their size rounded up to 2 MiB; best-fit reuse of cached blocks, splitting (small pool:
remainder >= 512 B; large pool: remainder > 1 MiB) and merging of free neighbours; segments are never
released. Segments are 2 MiB aligned, so every 2 MiB VA block holds one data type: advice granularity
matches the real backend.

The step is replayed until the addresses of one step equal those of the previous one (the steady
state); each replay gives a :class:`Layout`.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from um_lab.sim.trace import StepTrace
from um_lab.types import DATA_TYPES
from um_lab.units import BLOCK

BIG_PAGE = 64 << 10  #: big page: the residency unit tracked inside a block (64 KiB)
PAGES_PER_BLOCK = BLOCK // BIG_PAGE  #: 32: one bit each in a uint32 mask
SMALL_REQUEST = 1 << 20  #: <= 1 MiB: small pool
SMALL_SEGMENT = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_SEGMENT = 20 << 20
ROUND_LARGE = 2 << 20
MIN_BLOCK = 512


def round_request(nbytes: int) -> int:
    """PyTorch's request rounding: at least 512 B, a multiple of 512 B."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(request: int) -> int:
    """Size of a new segment for a rounded request (2 MiB, 20 MiB, or the request rounded to 2 MiB)."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-request // ROUND_LARGE)


class CachingPool:
    """One data type's pool: segments, blocks, best-fit reuse, split and merge (PyTorch's rules)."""

    def __init__(self, va_source: list[int]) -> None:
        self.va_source = va_source  # [next free VA], shared by all pools
        self.segments: list[tuple[int, int]] = []
        self.blocks: dict[int, list[int]] = {}  # start -> [size, segment id, free]
        self.free_by_end: dict[int, int] = {}
        self.free_sorted: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # is_small -> [(size, start)]
        self._seg_small: list[bool] = []

    @property
    def segment_bytes(self) -> int:
        """Bytes in all segments of the pool (what the real backend counts as live managed bytes)."""
        return sum(s for _, s in self.segments)

    def _insert_free(self, start: int, size: int, seg: int) -> None:
        self.blocks[start] = [size, seg, True]
        self.free_by_end[start + size] = start
        bisect.insort(self.free_sorted[self._seg_small[seg]], (size, start))

    def _remove_free(self, start: int) -> None:
        size, seg, _ = self.blocks[start]
        del self.free_by_end[start + size]
        lst = self.free_sorted[self._seg_small[seg]]
        lst.pop(bisect.bisect_left(lst, (size, start)))

    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes``; return the block's virtual address."""
        req = round_request(nbytes)
        small = req <= SMALL_REQUEST
        lst = self.free_sorted[small]
        i = bisect.bisect_left(lst, (req, -1))
        if i < len(lst):
            size, start = lst[i]
            self._remove_free(start)
            seg = self.blocks[start][1]
        else:
            size = segment_size(req)
            start = self.va_source[0]
            self.va_source[0] += size
            seg = len(self.segments)
            self.segments.append((start, size))
            self._seg_small.append(small)
        remaining = size - req
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_REQUEST):
            self.blocks[start] = [req, seg, False]
            self._insert_free(start + req, remaining, seg)
        else:
            self.blocks[start] = [size, seg, False]
        return start

    def release(self, start: int) -> None:
        """Return a block to the cache, merging it with free neighbours in its segment."""
        size, seg, _ = self.blocks[start]
        nxt = start + size
        if nxt in self.blocks and self.blocks[nxt][2] and self.blocks[nxt][1] == seg:
            self._remove_free(nxt)
            size += self.blocks.pop(nxt)[0]
        prev = self.free_by_end.get(start)
        if prev is not None and self.blocks[prev][1] == seg:
            self._remove_free(prev)
            size += self.blocks[prev][0]
            del self.blocks[start]
            start = prev
        self._insert_free(start, size, seg)


@dataclasses.dataclass
class Layout:
    """Where each storage of one step lies: ``st_va`` (-1: empty storage), and the pools' segments."""

    st_va: np.ndarray
    segment_bytes: dict[str, int]  #: per data type, after this step
    segment_count: dict[str, int]  #: segments per data type (one prefetch call each)
    n_blocks: int  #: VA blocks covered by all segments so far
    block_type: np.ndarray  #: data type index per VA block


@dataclasses.dataclass
class Placement:
    """The replayed steps' layouts; ``layout(i)`` is the one step ``i`` uses (steady after the last)."""

    layouts: list[Layout]

    def layout(self, step: int) -> Layout:
        """Layout of step ``step`` (0-based)."""
        return self.layouts[min(step, len(self.layouts) - 1)]

    @property
    def final(self) -> Layout:
        """The steady-state layout (most segments)."""
        return self.layouts[-1]


def place(trace: StepTrace, max_replays: int = 4) -> Placement:
    """Replay the trace's allocations and frees through per-type caching pools (see module doc)."""
    va = [0]
    pools = [CachingPool(va) for _ in DATA_TYPES]
    n_st = len(trace.st_nbytes)
    st_va = np.full(n_st, -1, np.int64)
    seg_types: list[tuple[int, int, int]] = []  # (start, size, type)
    seen_segments = [0] * len(pools)

    def note_segments() -> None:
        for ti, pool in enumerate(pools):
            for start, size in pool.segments[seen_segments[ti]:]:
                seg_types.append((start, size, ti))
            seen_segments[ti] = len(pool.segments)

    for i in np.flatnonzero(trace.st_persistent):
        if trace.st_nbytes[i] > 0:
            st_va[i] = pools[trace.st_type[i]].allocate(int(trace.st_nbytes[i]))
    transient = np.flatnonzero(~trace.st_persistent & (trace.st_nbytes > 0))
    n = trace.n_ops
    # event list: (time, kind, storage); frees before allocs at the same op index
    alloc_t = np.clip(trace.st_alloc[transient], 0, n).astype(np.int64)
    free_t = np.clip(trace.st_free[transient], 0, n).astype(np.int64)
    times = np.concatenate([free_t * 2, alloc_t * 2 + 1])
    kinds = np.concatenate([np.zeros(len(transient), np.int8), np.ones(len(transient), np.int8)])
    who = np.concatenate([transient, transient])
    order = np.lexsort((who, times))
    events = list(zip(kinds[order].tolist(), who[order].tolist(), strict=True))
    layouts: list[Layout] = []
    prev = None
    for _ in range(max_replays):
        live: dict[int, int] = {}
        step_va = st_va.copy()
        for kind, s in events:
            pool = pools[trace.st_type[s]]
            if kind == 1:
                addr = pool.allocate(int(trace.st_nbytes[s]))
                live[s] = addr
                step_va[s] = addr
            elif s in live:
                pool.release(live.pop(s))
        for s, addr in live.items():  # still alive at the end: freed at step end
            pools[trace.st_type[s]].release(addr)
        note_segments()
        n_blocks = va[0] // BLOCK
        block_type = np.zeros(n_blocks, np.int8)
        for start, size, ti in seg_types:
            block_type[start // BLOCK:(start + size) // BLOCK] = ti
        layout = Layout(step_va, {t.value: pools[i].segment_bytes for i, t in enumerate(DATA_TYPES)},
                        {t.value: len(pools[i].segments) for i, t in enumerate(DATA_TYPES)},
                        n_blocks, block_type)
        if prev is not None and np.array_equal(prev.st_va, step_va) and prev.n_blocks == n_blocks:
            break
        layouts.append(layout)
        prev = layout
    return Placement(layouts)
