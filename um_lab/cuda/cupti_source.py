"""CUPTI unified-memory counter records through ``cupti-python`` (imported lazily), as compact tuples.

The buffer callback only turns each record into ``(kind, value, address, start, end, flags)``;
attribution happens later in :mod:`um_lab.cuda.residency`. CUPTI's activity state is process-wide,
so one :class:`CuptiSource` collects at a time.

Flushing (``cuptiActivityFlushAll``) is what delivers records. :meth:`CuptiSource.flush` forces a
flush of every buffer, complete or not; it costs milliseconds of host time whatever the number of
records, which is why :class:`um_lab.cuda.telemetry.Telemetry` calls it from a background thread by
default instead of at every step end. CUPTI's own periodic flush (``cuptiActivityFlushPeriod``) is
not used: it returns only *full* buffers, so a few records a step may wait indefinitely.
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
from typing import Any, Protocol

from um_lab.cuda.residency import KINDS, Kind, Record
from um_lab.errors import UmLabError


class TelemetryUnavailable(UmLabError, RuntimeError):
    """CUPTI cannot deliver unified-memory counters here; the message says why."""


class RecordSource(Protocol):
    """Where records come from (CUPTI on a GPU; a fake in CPU tests)."""

    enabled: frozenset[int]
    cause_names: dict[int, str]

    def start(self, device: int) -> None:
        """Begin collecting; raise :class:`TelemetryUnavailable` with the reason when impossible."""

    def flush(self) -> None:
        """Make CUPTI deliver every record it holds (may be called from any thread)."""

    def drain(self) -> list[Record]:
        """Return (and forget) every record delivered since the last drain; does not flush."""

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
    """Unified-memory counter records from CUPTI (``cupti-python``).

    ``buffer_bytes``: size of each activity buffer CUPTI asks for (>= 4096).
    """

    BUFFER_BYTES = 8 << 20

    def __init__(self, buffer_bytes: int = BUFFER_BYTES) -> None:
        if buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes must be >= 4096, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.enabled: frozenset[int] = frozenset()
        self.cause_names: dict[int, str] = {}
        self._chunks: list[list[Record]] = []
        self._lock = threading.Lock()
        self._cupti: Any = None
        self._flush_all: Any = None
        self.flush_via = "cupti-python"
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
        self._flush_all, self.flush_via = _flush_function(cupti)  # after cupti-python has loaded libcupti
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

    def flush(self) -> None:
        if self._active:
            self._flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED

    def drain(self) -> list[Record]:
        with self._lock:
            chunks, self._chunks = self._chunks, []
        return [r for chunk in chunks for r in chunk]

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self._cupti.activity_disable(self._cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
            self._flush_all(1)
        finally:
            with _Hub.lock:
                if _Hub.sink is self:
                    _Hub.sink = None
            with self._lock:
                self._chunks = []


def _flush_function(cupti: Any, maps: str = "/proc/self/maps") -> tuple[Any, str]:
    """``cuptiActivityFlushAll`` through ctypes when exactly one libcupti is loaded, else cupti-python's.

    ctypes drops the GIL for the whole call, so a flush on the collector thread (milliseconds)
    never holds up the training thread; CUPTI's buffer callbacks take the GIL back themselves. With
    two different libcupti copies in the process the one cupti-python uses is unknown, so its own
    wrapper is used instead (``flush_via`` says which).
    """
    try:
        with open(maps) as lines:
            paths = {os.path.realpath(line.split()[-1]) for line in lines if "/libcupti.so" in line}
        if len(paths) != 1:
            return cupti.activity_flush_all, "cupti-python"
        function = ctypes.CDLL(paths.pop()).cuptiActivityFlushAll
        function.argtypes, function.restype = [ctypes.c_uint32], ctypes.c_int
    except (OSError, AttributeError):
        return cupti.activity_flush_all, "cupti-python"

    def flush_all(flag: int) -> None:
        status = function(flag)
        if status != 0:
            raise cupti.cuptiError(status)

    return flush_all, "ctypes"


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
