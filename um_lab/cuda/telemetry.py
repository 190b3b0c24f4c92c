"""Measured residency, migrations and page faults per data type, every step (CUPTI + NVML).

Three parts, smallest surface first:

* :class:`Telemetry` — what a :class:`~um_lab.cuda.session.Session` uses: ``start(device)``, then
  ``fill(record, segments)`` at each step end, then ``close()``. Never raises after construction:
  when CUPTI cannot be used, every record says ``telemetry = "unavailable: <reason>"`` and the
  measured fields stay ``None``.
* :class:`CuptiSource` — CUPTI unified-memory counter records through ``cupti-python`` (imported
  lazily). The buffer callback only turns each record into a compact tuple
  ``(kind, value, address, start, end, flags)``; all other work happens at ``drain()``
  (``activity_flush_all(1)``), which the session calls after the step's end event has synchronised,
  so the flush is outside the timed region (``wall_ms``); its cost is reported in
  ``extra["telemetry_ms"]``.
* :class:`ResidencyTracker` — pure NumPy, no CUPTI: attributes each record's address to a data type
  through the allocator's segment ranges (sorted starts + ``searchsorted``) and keeps a residency map
  at 2 MiB granularity per segment block.

Residency rule (per 2 MiB block of each live um_lab segment, applied in record start-time order):

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
import operator
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from um_lab.types import DATA_TYPES, DataType, StepRecord

BLOCK = 2 << 20  #: residency granularity: the UM driver's VA block
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

    ptr: int
    size: int
    data_type: DataType


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


class _Table:
    """A snapshot of live segments as sorted arrays, with a flat index of their 2 MiB blocks."""

    def __init__(self, segments: Iterable[SegmentLike]) -> None:
        segs = sorted(segments, key=lambda s: s.ptr)
        self.keys = [(s.ptr, s.size, s.data_type) for s in segs]
        self.starts = np.array([s.ptr for s in segs], dtype=np.int64)
        self.sizes = np.array([s.size for s in segs], dtype=np.int64)
        self.types = np.array([DATA_TYPES.index(s.data_type) for s in segs], dtype=np.int64)
        nblocks = (self.sizes + BLOCK - 1) // BLOCK
        self.first_block = np.concatenate([[0], np.cumsum(nblocks)[:-1]]).astype(np.int64)
        total = int(nblocks.sum())
        seg_of_block = np.repeat(np.arange(len(segs), dtype=np.int64), nblocks)
        offset = (np.arange(total, dtype=np.int64) - self.first_block[seg_of_block]) * BLOCK
        self.block_bytes = np.minimum(BLOCK, self.sizes[seg_of_block] - offset) if total else np.zeros(0, np.int64)
        self.block_type = self.types[seg_of_block] if total else np.zeros(0, np.int64)
        self.resident = np.zeros(total, dtype=bool)

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
        new = _Table(segments)
        if old.keys and new.keys:
            where = {k: i for i, k in enumerate(old.keys)}
            for i, key in enumerate(new.keys):
                j = where.get(key)
                if j is not None:
                    n = int((key[1] + BLOCK - 1) // BLOCK)
                    a, b = int(new.first_block[i]), int(old.first_block[j])
                    new.resident[a:a + n] = old.resident[b:b + n]
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
            block, state = block[order], on[src][order]
            last = len(block) - 1 - np.unique(block[::-1], return_index=True)[1]  # final event per block
            table.resident[block[last]] = state[last]
        return evicted


# ---- CUPTI ----------------------------------------------------------------------------------------


class TelemetryUnavailable(RuntimeError):
    """CUPTI cannot deliver unified-memory counters here; the message says why."""


class RecordSource(Protocol):
    """Where records come from (CUPTI on a GPU; a fake in CPU tests)."""

    enabled: frozenset[int]
    cause_names: dict[int, str]

    def start(self, device: int) -> None:
        """Begin collecting; raise :class:`TelemetryUnavailable` with the reason when impossible."""

    def drain(self) -> list[Record]:
        """Flush and return every record delivered since the last drain."""

    def stop(self) -> None:
        """Stop collecting (idempotent)."""


class _Hub:
    """Process-wide CUPTI state: callbacks are registered and counters configured once."""

    lock = threading.Lock()
    sink: CuptiSource | None = None
    registered = False
    configured: frozenset[int] | None = None
    buffer_bytes = 8 << 20


class CuptiSource:
    """Unified-memory counter records from CUPTI (``cupti-python``), as compact tuples.

    ``buffer_bytes``: size of each activity buffer CUPTI asks for. ``flush_period_ms``: ``None``
    forces a flush of every buffer at each drain (records complete at every step end); a number lets
    CUPTI's own thread flush that often and each drain only collects completed buffers (cheaper;
    records may then be counted up to one period late, in the next step).
    """

    BUFFER_BYTES = 8 << 20

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, flush_period_ms: int | None = None) -> None:
        if buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes must be >= 4096, got {buffer_bytes}")
        if flush_period_ms is not None and flush_period_ms < 1:
            raise ValueError(f"flush_period_ms must be >= 1 or None, got {flush_period_ms}")
        self.buffer_bytes = buffer_bytes
        self.flush_period_ms = flush_period_ms
        self.enabled: frozenset[int] = frozenset()
        self.cause_names: dict[int, str] = {}
        self._chunks: list[list[Record]] = []
        self._lock = threading.Lock()
        self._cupti: Any = None
        self._active = False

    def start(self, device: int) -> None:
        try:
            from cupti import cupti
        except Exception as e:  # noqa: BLE001 - ImportError, or a missing libcupti
            raise TelemetryUnavailable(
                f"cupti-python is not importable ({type(e).__name__}: {e}); "
                "pip install 'um_lab[telemetry]' (cupti-python 13.0.x with torch cu130)"
            ) from None
        self._cupti = cupti
        for k in KINDS:
            if int(getattr(cupti.ActivityUnifiedMemoryCounterKind, k.name)) != k:
                raise TelemetryUnavailable(f"cupti-python's counter kind {k.name} has an unexpected value")
        self.cause_names = {int(m): m.name for m in cupti.ActivityUnifiedMemoryMigrationCause}
        with _Hub.lock:
            if _Hub.sink is not None:
                raise TelemetryUnavailable("another um_lab Telemetry is collecting in this process")
            try:
                self._configure(cupti, device)
                _Hub.sink = self
                _Hub.buffer_bytes = self.buffer_bytes
                cupti.activity_flush_period(self.flush_period_ms or 0)  # 0: CUPTI's default
                cupti.activity_enable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
            except TelemetryUnavailable:
                _Hub.sink = None
                raise
            except Exception as e:  # noqa: BLE001 - cuptiError, NotSupportedError, ...
                _Hub.sink = None
                hint = "; another profiler may hold CUPTI" if isinstance(e, cupti.cuptiError) else ""
                raise TelemetryUnavailable(
                    f"CUPTI could not enable unified-memory counters ({_describe(cupti, e)}){hint}"
                ) from None
        self.enabled = _Hub.configured or frozenset()
        self._active = True

    def _configure(self, cupti: Any, device: int) -> None:
        if not _Hub.registered:
            cupti.activity_register_callbacks(_buffer_requested, _buffer_completed)
            _Hub.registered = True
        if _Hub.configured is not None:
            return
        errors = {k: self._configure_kinds(cupti, device, [k]) for k in KINDS}
        accepted = [k for k, err in errors.items() if err is None]
        if not accepted:
            first = next(iter(errors.values()))
            raise TelemetryUnavailable(
                f"CUPTI rejected every unified-memory counter kind ({_describe(cupti, first)})")
        err = self._configure_kinds(cupti, device, accepted)
        if err is not None:
            raise TelemetryUnavailable(
                f"CUPTI rejected the unified-memory counter configuration ({_describe(cupti, err)})")
        _Hub.configured = frozenset(accepted)

    @staticmethod
    def _configure_kinds(cupti: Any, device: int, kinds: list[Kind]) -> Exception | None:
        """Configure ``kinds`` for collection; returns the error when CUPTI refuses."""
        cfg = cupti.ActivityUnifiedMemoryCounterConfig(len(kinds))
        for i, k in enumerate(kinds):
            cfg[i].kind = getattr(cupti.ActivityUnifiedMemoryCounterKind, k.name)
            cfg[i].scope = cupti.ActivityUnifiedMemoryCounterScope.PROCESS_SINGLE_DEVICE
            cfg[i].device_id = device
            cfg[i].enable = 1
        try:
            cupti.activity_configure_unified_memory_counter(cfg.ptr, len(kinds))
        except Exception as e:  # noqa: BLE001 - a kind this runtime or device does not support
            return e
        return None

    def _push(self, records: list[Record]) -> None:
        with self._lock:
            self._chunks.append(records)

    def drain(self) -> list[Record]:
        if self._active:
            self._cupti.activity_flush_all(0 if self.flush_period_ms else 1)
        with self._lock:
            chunks, self._chunks = self._chunks, []
        return [r for chunk in chunks for r in chunk]

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self._cupti.activity_disable(self._cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
            self._cupti.activity_flush_all(1)
        finally:
            with _Hub.lock:
                if _Hub.sink is self:
                    _Hub.sink = None
            self._chunks = []


def _describe(cupti: Any, error: BaseException | None) -> str:
    status = getattr(error, "status", None)
    if status is not None:
        try:
            return f"{cupti.Result(status).name}: {error}"
        except Exception:  # noqa: BLE001
            pass
    return f"{type(error).__name__}: {error}"


def _buffer_requested() -> tuple[int, int]:
    return _Hub.buffer_bytes, 0


_FIELDS = operator.attrgetter("counter_kind", "value", "address", "start", "end", "flags_")


def _buffer_completed(activities: list) -> None:
    """CUPTI's buffer callback: only compact tuples, nothing else (may run on CUPTI's thread)."""
    sink = _Hub.sink
    if sink is None or not activities:
        return
    um = 25  # CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER
    records = [_FIELDS(a) for a in activities if a.kind == um]
    if records:
        sink._push(records)


# ---- NVML -----------------------------------------------------------------------------------------


class _Nvml:
    """Device memory used/total and GPU utilisation (nvidia-ml-py); reports why when unavailable."""

    def __init__(self, device: int) -> None:
        self.reason: str | None = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                import torch

                index = torch.cuda._get_nvml_device_index(device)
            except Exception:  # noqa: BLE001 - no torch CUDA, or a private helper gone
                index = device
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001
            self.reason = f"unavailable: {type(e).__name__}: {e}"

    def sample(self) -> dict[str, Any]:
        if self._handle is None:
            return {"nvml": self.reason}
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except Exception as e:  # noqa: BLE001
            return {"nvml": f"unavailable: {type(e).__name__}: {e}"}
        return {"nvml_used_bytes": int(mem.used), "nvml_total_bytes": int(mem.total),
                "gpu_util_pct": int(util.gpu)}


# ---- the session's face ---------------------------------------------------------------------------


class Telemetry:
    """Per-step measured residency and migrations for a session (see the module docstring).

    ``source`` defaults to :class:`CuptiSource`; ``nvml=False`` skips NVML (CPU tests).
    """

    def __init__(self, *, source: RecordSource | None = None, nvml: bool = True,
                 buffer_bytes: int = CuptiSource.BUFFER_BYTES, flush_period_ms: int | None = None) -> None:
        self._source: RecordSource = (source if source is not None
                                      else CuptiSource(buffer_bytes, flush_period_ms))
        self._use_nvml = nvml
        self._nvml: _Nvml | None = None
        self._tracker: ResidencyTracker | None = None
        self.status = "unavailable: telemetry not started"

    @property
    def available(self) -> bool:
        """True while CUPTI records are being collected."""
        return self._tracker is not None

    def start(self, device: int = 0) -> str:
        """Start collecting on GPU ``device``; returns the status (``"cupti..."`` or ``"unavailable: ..."``)."""
        if self._use_nvml and self._nvml is None:
            self._nvml = _Nvml(device)
        try:
            self._source.start(device)
        except TelemetryUnavailable as e:
            self.status = f"unavailable: {e}"
            return self.status
        except Exception as e:  # noqa: BLE001 - never let telemetry stop training
            self.status = f"unavailable: {type(e).__name__}: {e}"
            return self.status
        self._tracker = ResidencyTracker(self._source.enabled, self._source.cause_names)
        missing = sorted(k.name for k in KINDS if k not in self._tracker.enabled)
        self.status = "cupti" + (f" (not collected: {', '.join(missing)})" if missing else "")
        return self.status

    def collect(self, segments: Iterable[SegmentLike]) -> StepTelemetry | None:
        """Flush and account everything since the last call (``None`` when unavailable)."""
        if self._tracker is None:
            return None
        try:
            t0 = time.perf_counter()
            records = self._source.drain()
            t1 = time.perf_counter()
            measured = self._tracker.update(segments, records)
            measured.extra["telemetry_flush_ms"] = (t1 - t0) * 1e3
            measured.extra["telemetry_attribution_ms"] = (time.perf_counter() - t1) * 1e3
            return measured
        except Exception as e:  # noqa: BLE001 - degrade, never crash the training loop
            self.status = f"unavailable: telemetry failed ({type(e).__name__}: {e})"
            self._tracker = None
            self._stop_source()
            return None

    def fill(self, record: StepRecord, segments: Iterable[SegmentLike]) -> None:
        """Write this step's measured fields (and NVML readings) into ``record``."""
        t0 = time.perf_counter()
        measured = self.collect(segments)
        if self._nvml is not None:
            t_nvml = time.perf_counter()
            record.extra.update(self._nvml.sample())
            record.extra["telemetry_nvml_ms"] = (time.perf_counter() - t_nvml) * 1e3
        record.telemetry = self.status
        if measured is None:
            return
        record.resident_bytes = measured.resident_bytes
        record.htod_bytes = measured.htod_bytes
        record.dtoh_bytes = measured.dtoh_bytes
        record.gpu_page_faults = measured.gpu_page_faults
        record.evictions = measured.evictions
        record.extra.update(measured.extra)
        record.extra["telemetry_ms"] = (time.perf_counter() - t0) * 1e3

    def _stop_source(self) -> None:
        try:
            self._source.stop()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop collecting (safe to call more than once)."""
        self._tracker = None
        self._stop_source()
        if not self.status.startswith("unavailable"):
            self.status = "unavailable: telemetry closed"


def check_telemetry_mode(mode: bool | str | Telemetry) -> bool | str | Telemetry:
    """Validate a session's ``telemetry=`` argument (``True``, ``False``, ``"auto"`` or a Telemetry)."""
    if isinstance(mode, Telemetry) or mode in (True, False, "auto"):
        return mode
    raise ValueError(f"telemetry must be True, False, 'auto' or a Telemetry, got {mode!r}")


def open_telemetry(mode: bool | str | Telemetry, device: int) -> Telemetry | None:
    """The session's entry point: ``False`` -> ``None``; ``True``/``"auto"``/an instance -> started.

    With ``True`` an unavailable telemetry also warns (``RuntimeWarning``); ``"auto"`` stays quiet.
    Never raises for an unavailable CUPTI.
    """
    if check_telemetry_mode(mode) is False:
        return None
    telemetry = mode if isinstance(mode, Telemetry) else Telemetry()
    status = telemetry.start(device)
    if mode is True and not telemetry.available:
        warnings.warn(f"um_lab telemetry {status}; training continues without it", RuntimeWarning, stacklevel=3)
    return telemetry
