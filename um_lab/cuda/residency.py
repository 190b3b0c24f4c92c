"""Attribution of CUPTI unified-memory counter records to data types, and the 2 MiB residency map.

Pure NumPy, no CUPTI: :class:`ResidencyTracker` takes the live segments and a batch of records
``(kind, value, address, start_ns, end_ns, flags)`` and returns one step's :class:`StepTelemetry`.

Residency rule (per 2 MiB block of each live um_lab segment, applied in record start-time order,
across flushes too: a record delivered late never undoes a block's newer event):

* a block becomes GPU-resident when the GPU faults on it (``GPU_PAGE_FAULT``) or it receives
  host-to-device bytes (``BYTES_TRANSFER_HTOD``);
* it stops being GPU-resident when device-to-host bytes leave it (``BYTES_TRANSFER_DTOH``, any
  cause: eviction, prefetch, coherence, ...) or when it is mapped remotely (``REMOTE_MAP``: the
  GPU reaches host memory without migrating, e.g. ``preferred_location=cpu``);
* a new segment starts with no resident block (``cudaMallocManaged`` populates nothing); a block
  counts its full size (the last block of a segment only its part inside the segment).

Limits (what the rule cannot see):

* population without a record: pages first populated on the GPU by a copy engine
  (``cudaMemcpy`` / ``tensor.to(device)`` into fresh managed memory) or by ``cudaMemPrefetchAsync``
  of never-touched pages may produce neither a fault nor a transfer record; such blocks count as
  not resident until a later record says otherwise (under-count);
* one fault marks the whole 2 MiB block resident, even if the driver populated only part of it;
* read-duplicated pages (``read_mostly``): the GPU copy counts as resident; a CPU write collapses
  the duplicates without a DtoH record, so the block stays counted (over-count);
* evictions appear only as DtoH bytes with cause ``EVICTION`` (``evictions`` counts such blocks);
  eviction of a block that was never recorded as resident is counted but changes nothing;
* ``REMOTE_MAP`` is read as "the GPU maps host memory"; a CPU mapping GPU memory would under-count;
* pages are freed with their segment: a segment that disappears drops out of the map; a segment
  freed and re-created at the same address, size and type between two steps is not noticed;
* bursts of demand migrations can lose records: on the H200, 160 MiB of fault-driven migrations
  in ~35 ms lost the newest 6-48 MiB of HtoD records (and the burst's fault records) in 8 of 10
  trials, while the same migrations one 32 MiB tensor at a time were reported in full (README,
  "Limits"); under heavy demand paging HtoD bytes and residency are lower bounds;
* records arrive when CUPTI delivers them: a step's counters cover everything since the previous
  flush (including ``lab.inputs()`` copies made before the step), and a late record is counted in
  the next step;
* addresses outside every um_lab segment (other managed memory in the process, segments created and
  freed within one step) are counted in ``extra["unattributed"]``, never in a data type.

Per step: ``resident_bytes``, ``htod_bytes``, ``dtoh_bytes`` per type; ``gpu_page_faults`` (sum of
CUPTI's fault-group counts); ``evictions`` (2 MiB blocks moved to the host with cause ``EVICTION``);
``extra``: per-cause bytes each way, GPU faults per type, remote-mapped bytes per type, thrashing /
throttling / CPU-fault record counts, unattributed counters, NVML device memory used/total and GPU
utilisation. ``remote_bytes`` stays ``None``: CUPTI reports the size of remotely mapped regions, not
the bytes read over the link.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from um_lab.types import DATA_TYPES, DataType
from um_lab.units import BLOCK

NEVER = np.iinfo(np.int64).min
Record = tuple[int, int, int, int, int, int]  #: (kind, value, address, start_ns, end_ns, flags)


class Kind(enum.IntEnum):
    """CUPTI's ``CUpti_ActivityUnifiedMemoryCounterKind`` values (checked against cupti at start)."""

    BYTES_TRANSFER_HTOD = 1
    BYTES_TRANSFER_DTOH = 2
    CPU_PAGE_FAULT_COUNT = 3
    GPU_PAGE_FAULT = 4
    THRASHING = 5
    THROTTLING = 6
    REMOTE_MAP = 7


#: Kinds the tracker asks for, in order.
KINDS: tuple[Kind, ...] = tuple(Kind)
#: Kinds without which residency cannot be tracked.
RESIDENCY_KINDS = frozenset({Kind.BYTES_TRANSFER_HTOD, Kind.BYTES_TRANSFER_DTOH, Kind.GPU_PAGE_FAULT})


class SegmentLike(Protocol):
    """What the tracker needs of a segment (:class:`um_lab.cuda.allocator.Segment` fits)."""

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def data_type(self) -> DataType: ...


@dataclasses.dataclass
class StepTelemetry:
    """One step's measured values (``None``: the counter kind it needs was not enabled)."""

    resident_bytes: dict[str, int] | None
    htod_bytes: dict[str, int] | None
    dtoh_bytes: dict[str, int] | None
    gpu_page_faults: int | None
    evictions: int | None
    extra: dict[str, Any]


def _per_type(values: np.ndarray) -> dict[str, int]:
    return {t.value: int(v) for t, v in zip(DATA_TYPES, values, strict=True)}


def _keys(segments: Iterable[SegmentLike]) -> list[tuple[int, int, DataType]]:
    return sorted((s.ptr, s.size, s.data_type) for s in segments)


class _Table:
    """A snapshot of live segments as sorted arrays, with a flat index of their 2 MiB blocks."""

    def __init__(self, keys: list[tuple[int, int, DataType]]) -> None:
        self.keys = keys
        self.starts = np.array([ptr for ptr, _, _ in keys], dtype=np.int64)
        self.sizes = np.array([size for _, size, _ in keys], dtype=np.int64)
        self.types = np.array([DATA_TYPES.index(data_type) for _, _, data_type in keys], dtype=np.int64)
        nblocks = (self.sizes + BLOCK - 1) // BLOCK
        self.first_block = np.concatenate([[0], np.cumsum(nblocks)[:-1]]).astype(np.int64)
        total = int(nblocks.sum())
        seg_of_block = np.repeat(np.arange(len(keys), dtype=np.int64), nblocks)
        offset = (np.arange(total, dtype=np.int64) - self.first_block[seg_of_block]) * BLOCK
        self.block_bytes = np.minimum(BLOCK, self.sizes[seg_of_block] - offset) if total else np.zeros(0, np.int64)
        self.block_type = self.types[seg_of_block] if total else np.zeros(0, np.int64)
        self.resident = np.zeros(total, dtype=bool)
        self.changed_at = np.full(total, NEVER, dtype=np.int64)  # start time of each block's latest event

    def locate(self, address: np.ndarray) -> np.ndarray:
        """Segment index of each address, -1 where none holds it."""
        if not len(self.starts):
            return np.full(address.shape, -1, dtype=np.int64)
        i = np.searchsorted(self.starts, address, side="right") - 1
        j = np.clip(i, 0, None)
        inside = (i >= 0) & (address < self.starts[j] + self.sizes[j])
        return np.where(inside, i, -1)

    def blocks(self, seg: np.ndarray, address: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat block indices covered by each ``[address, address + length)`` (clipped to its segment).

        Returns ``(row, block)``: ``row`` says which input each block came from.
        """
        start = address - self.starts[seg]
        end = np.minimum(start + np.maximum(length, 1), self.sizes[seg]) - 1
        first, last = start // BLOCK, np.maximum(end, start) // BLOCK
        count = last - first + 1
        row = np.repeat(np.arange(len(seg)), count)
        step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        return row, self.first_block[seg[row]] + first[row] + step


class ResidencyTracker:
    """Attribution of UM counter records to data types and the 2 MiB residency map (no CUPTI).

    ``enabled`` lists the counter kinds actually collected; fields that need a missing kind come out
    ``None``. ``cause_names`` maps CUPTI's migration-cause values to names (``"EVICTION"``, ...).
    """

    def __init__(self, enabled: Iterable[int] = KINDS, cause_names: Mapping[int, str] | None = None) -> None:
        self.enabled = frozenset(Kind(k) for k in enabled)
        self.cause_names = dict(cause_names or {})
        self._table = _Table([])

    def _sync_segments(self, segments: Iterable[SegmentLike]) -> _Table:
        """Install the new snapshot, carrying residency over for segments that did not change."""
        old = self._table
        keys = _keys(segments)
        if keys == old.keys:
            return old  # the usual case in training: no segment came or went since the last step
        new = _Table(keys)
        if old.keys and new.keys:
            where = {k: i for i, k in enumerate(old.keys)}
            for i, key in enumerate(new.keys):
                j = where.get(key)
                if j is not None:
                    n = int((key[1] + BLOCK - 1) // BLOCK)
                    a, b = int(new.first_block[i]), int(old.first_block[j])
                    new.resident[a:a + n] = old.resident[b:b + n]
                    new.changed_at[a:a + n] = old.changed_at[b:b + n]
        self._table = new
        return new

    def update(self, segments: Iterable[SegmentLike], records: Sequence[Record]) -> StepTelemetry:
        """Apply one step's records against the live segments (taken at the step's end)."""
        table = self._sync_segments(segments)
        arr = np.array(records, dtype=np.int64).reshape(-1, 6)
        kind, value, address, start, _end, flags = arr.T
        seg = table.locate(address)
        hit = seg >= 0
        n = len(DATA_TYPES)

        def by_type(mask: np.ndarray, weights: np.ndarray) -> np.ndarray:
            m = mask & hit
            return np.bincount(table.types[seg[m]], weights=weights[m], minlength=n).astype(np.int64)

        def outside(mask: np.ndarray, weights: np.ndarray) -> int:
            return int(weights[mask & ~hit].sum())

        htod, dtoh = kind == Kind.BYTES_TRANSFER_HTOD, kind == Kind.BYTES_TRANSFER_DTOH
        fault, remote = kind == Kind.GPU_PAGE_FAULT, kind == Kind.REMOTE_MAP
        counted = {
            Kind.REMOTE_MAP: ("remote_map_bytes", lambda: _per_type(by_type(remote, value))),
            Kind.THRASHING: ("thrashing_records", lambda: int((kind == Kind.THRASHING).sum())),
            Kind.THROTTLING: ("throttling_records", lambda: int((kind == Kind.THROTTLING).sum())),
            Kind.CPU_PAGE_FAULT_COUNT: ("cpu_page_faults", lambda: int((kind == Kind.CPU_PAGE_FAULT_COUNT).sum())),
        }
        extra: dict[str, Any] = {
            "htod_by_cause": self._by_cause(htod, value, flags),
            "dtoh_by_cause": self._by_cause(dtoh, value, flags),
            "gpu_faults_by_type": _per_type(by_type(fault, value)),
            "gpu_fault_records": int(fault.sum()),
            **{name: count() for k, (name, count) in counted.items() if k in self.enabled},
            "unattributed": {"htod_bytes": outside(htod, value), "dtoh_bytes": outside(dtoh, value),
                             "gpu_faults": outside(fault, value), "records": int((~hit).sum())},
            "um_records": len(arr),
        }
        evictions = self._apply(table, seg, kind, value, address, start, flags, hit)
        has = self.enabled.__contains__
        tracked = RESIDENCY_KINDS <= self.enabled
        resident = np.bincount(table.block_type[table.resident], weights=table.block_bytes[table.resident],
                               minlength=n).astype(np.int64)
        return StepTelemetry(
            resident_bytes=_per_type(resident) if tracked else None,
            htod_bytes=_per_type(by_type(htod, value)) if has(Kind.BYTES_TRANSFER_HTOD) else None,
            dtoh_bytes=_per_type(by_type(dtoh, value)) if has(Kind.BYTES_TRANSFER_DTOH) else None,
            gpu_page_faults=int(value[fault].sum()) if has(Kind.GPU_PAGE_FAULT) else None,
            evictions=evictions if has(Kind.BYTES_TRANSFER_DTOH) and self.cause_names else None,
            extra=extra,
        )

    def _by_cause(self, mask: np.ndarray, value: np.ndarray, flags: np.ndarray) -> dict[str, int]:
        out: dict[str, int] = {}
        for code in np.unique(flags[mask]):
            name = self.cause_names.get(int(code), f"cause_{int(code)}")
            out[name] = int(value[mask & (flags == code)].sum())
        return out

    def _apply(self, table: _Table, seg: np.ndarray, kind: np.ndarray, value: np.ndarray, address: np.ndarray,
               start: np.ndarray, flags: np.ndarray, hit: np.ndarray) -> int:
        """Update the residency map in start-time order; returns blocks evicted to the host."""
        on = (kind == Kind.GPU_PAGE_FAULT) | (kind == Kind.BYTES_TRANSFER_HTOD)
        off = (kind == Kind.BYTES_TRANSFER_DTOH) | (kind == Kind.REMOTE_MAP)
        use = hit & (on | off)
        rows = np.flatnonzero(use)
        length = np.where(kind[rows] == Kind.GPU_PAGE_FAULT, 1, value[rows])
        row, block = table.blocks(seg[rows], address[rows], length)
        src = rows[row]
        evict_code = next((c for c, n in self.cause_names.items() if n == "EVICTION"), None)
        evicted = 0
        if evict_code is not None:
            ev = (kind[src] == Kind.BYTES_TRANSFER_DTOH) & (flags[src] == evict_code)
            evicted = int(len(np.unique(block[ev])))
        if len(block):
            order = np.lexsort((np.arange(len(block)), start[src]))  # time order, arrival order on ties
            block, state, when = block[order], on[src][order], start[src][order]
            last = len(block) - 1 - np.unique(block[::-1], return_index=True)[1]  # final event per block
            block, state, when = block[last], state[last], when[last]
            newer = when >= table.changed_at[block]  # a record delivered late never undoes a newer one
            table.resident[block[newer]] = state[newer]
            table.changed_at[block[newer]] = when[newer]
        return evicted
