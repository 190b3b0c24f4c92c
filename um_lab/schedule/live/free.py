"""Moves of blocks the caching allocator holds no tensor in: discarded and populated, never copied.

A managed block whose every byte lies in blocks PyTorch's caching allocator has free (``inactive`` in its
snapshot) holds no live data, so pushing it to the host or bringing it back wastes the link. With
``Session(budget_discard_free=True)`` the executor asks, right before it issues moves, which blocks are free
now (:func:`inactive_ranges`), and :func:`split_free` turns

- an eviction of a free block into a discard (``cudaMemDiscardBatchAsync``), and
- a prefetch of a free block, or the populate of a block discarded that way, into a populate
  (``cudaMemDiscardAndPrefetchBatchAsync``: resident, contents undefined, no copy).

These calls are *ordered*: on a stream that first waits for the compute stream and that compute then waits
for (:meth:`~um_lab.schedule.live.streams.StreamOps.run_ordered`), so they land exactly between the kernels queued
before them (which may still use a tensor freed on the host) and those queued after (which may write a
tensor the allocator puts there next). On the side stream a discard could run after such a write and lose it.
They also wait for every move issued before them on the side stream: CUDA leaves a discard undefined while a
prefetch of the same range runs. (The first version lacked that wait and its discard call never returned on
ResNet-50, H200; an earlier eviction of the same block still in flight is the suspect.)

A block discarded this way and written again (the allocator handed it out) before the ledger brings it
back is not free when that happens: it is then prefetched like any other block.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from um_lab.schedule.ledger import Ledger, Move, Span

#: the counters a step's ``extra["budget"]`` holds with free discards on
STAT_KEYS = ("free_discard_bytes", "free_populate_bytes", "refilled_bytes", "free_queries", "free_query_ms",
             "ordered_calls")

#: ``(ptr, nbytes, kind)`` of an ordered call; kind is "discard" or "populate"
OrderedCall = tuple[int, int, str]


class FreeRanges:
    """Sorted, merged byte ranges the allocator has free; :meth:`covers` answers by bisection."""

    def __init__(self, spans: Iterable[Span]) -> None:
        merged: list[list[int]] = []
        for ptr, n in sorted((int(p), int(n)) for p, n in spans if n > 0):
            if merged and ptr <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], ptr + n)
            else:
                merged.append([ptr, ptr + n])
        self._starts = [a for a, _ in merged]
        self._ends = [b for _, b in merged]

    def __len__(self) -> int:
        return len(self._starts)

    def covers(self, ptr: int, nbytes: int) -> bool:
        """True when ``[ptr, ptr + nbytes)`` lies inside one free range."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._ends[i]

    def free_blocks(self, ledger: Ledger, blocks: Iterable[int]) -> list[int]:
        """Those of ``blocks`` whose every managed byte is free."""
        return [b for b in blocks if all(self.covers(p, n) for p, n in ledger.pieces_of(b))]


def split_free(moves: Sequence[Move], ledger: Ledger, free: FreeRanges,
               discarded: set[int]) -> tuple[list[Move], list[OrderedCall], dict[str, int]]:
    """Turn the moves of free blocks into ordered discards and populates (module docstring).

    ``moves`` are what the ledger just decided (already applied to it); ``discarded`` holds the blocks this
    module discarded and nothing has brought back since (updated here). Returns the moves left for the side
    stream, the ordered calls, and the bytes turned (``free_discard_bytes``, ``free_populate_bytes``,
    ``refilled_bytes``: discarded blocks written since, prefetched after all). The ledger's counters are
    corrected to what is issued."""
    side: list[Move] = []
    ordered: list[OrderedCall] = []
    turned = {"free_discard_bytes": 0, "free_populate_bytes": 0, "refilled_bytes": 0}
    for m in moves:
        if m.kind == "evict":
            idle = free.free_blocks(ledger, m.blocks)
            if idle:
                nbytes = ledger.bytes_of(idle)
                ledger.mark_dead(idle)
                ledger.evicted_bytes -= nbytes
                ledger.discarded_bytes += nbytes
                discarded.update(idle)
                turned["free_discard_bytes"] += nbytes
                ordered += [(p, n, "discard") for p, n in ledger.spans_of(idle)]
                m = _without(m, idle, ledger)
        elif m.kind in ("prefetch", "populate"):
            ours = m.blocks if m.kind == "prefetch" else [b for b in m.blocks if b in discarded]
            idle = free.free_blocks(ledger, ours)
            refilled = [b for b in ours if b not in set(idle)] if m.kind == "populate" else []
            discarded.difference_update(m.blocks)
            if idle:
                nbytes = ledger.bytes_of(idle)
                if m.kind == "prefetch":
                    ledger.prefetched_bytes -= nbytes
                    ledger.populated_bytes += nbytes
                turned["free_populate_bytes"] += nbytes
                ordered += [(p, n, "populate") for p, n in ledger.spans_of(idle)]
            if refilled:  # written since it was discarded: its pages hold live data again
                nbytes = ledger.bytes_of(refilled)
                ledger.populated_bytes -= nbytes
                ledger.prefetched_bytes += nbytes
                turned["refilled_bytes"] += nbytes
                side.append(_only(m, refilled, ledger, "prefetch"))
            m = _without(m, idle + refilled, ledger)
        elif m.kind == "touch":
            discarded.difference_update(m.blocks)
        if m.blocks or m.kind == "touch":
            side.append(m)
    return side, ordered, turned


def _only(m: Move, blocks: Sequence[int], ledger: Ledger, kind: str) -> Move:
    return dataclasses.replace(m, kind=kind, blocks=tuple(blocks), spans=ledger.spans_of(blocks),
                               nbytes=ledger.bytes_of(blocks))


def _without(m: Move, blocks: Sequence[int], ledger: Ledger) -> Move:
    gone = set(blocks)
    if not gone:
        return m
    return _only(m, [b for b in m.blocks if b not in gone], ledger, m.kind)


def inactive_ranges(pool_ids: Iterable[Any], stream: int) -> list[Span]:
    """Byte ranges the caching allocator has free (``inactive``) in segments of ``pool_ids`` (MemPool ids)
    that belong to ``stream`` (a block of another stream's segment may be in use there, unordered with
    the compute stream)."""
    import torch

    ranges: list[Span] = []
    for pool_id in pool_ids:
        try:
            segments = torch.cuda.memory_snapshot(pool_id, include_traces=False)
        except TypeError:  # a torch without include_traces
            segments = torch.cuda.memory_snapshot(pool_id)
        for seg in segments:
            if int(seg.get("stream", 0)) != stream:
                continue
            addr = int(seg["address"])
            for blk in seg["blocks"]:
                size = int(blk["size"])
                if blk.get("state") == "inactive":
                    ranges.append((int(blk.get("address", addr)), size))
                addr = int(blk.get("address", addr)) + size
    return ranges
