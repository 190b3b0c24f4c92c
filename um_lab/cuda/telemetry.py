"""Measured residency, migrations and page faults per data type, every step (CUPTI + NVML).

:class:`Telemetry` is what a :class:`~um_lab.cuda.session.Session` uses: ``start(device)``, then
``fill(record, segments)`` at each step end, then ``close()``. It never raises after construction:
when CUPTI cannot be used, every record says ``telemetry = "unavailable: <reason>"`` and the measured
fields stay ``None``. Records come from :class:`~um_lab.cuda.cupti_source.CuptiSource`; attribution
to data types and the residency rule (with its limits) are in :mod:`um_lab.cuda.residency`.

Flushing. A forced CUPTI flush costs milliseconds of host time however few records there are, so by
default (``flush="background"``) a daemon thread flushes CUPTI and samples NVML every
``flush_period_ms`` while training runs, and ``fill`` only attributes what has arrived: the step's
own thread never waits for CUPTI. The price is lag: a record delivered after the step ended is
counted in the next step (residency then trails by at most one period plus the driver's own
delay). ``flush="step"`` flushes on the training thread at every step end instead (exact step
boundaries, slower); ``collect(settle=True)`` flushes once on demand.
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Literal

from um_lab.cuda.cupti_source import CuptiSource, RecordSource, TelemetryUnavailable
from um_lab.cuda.residency import BLOCK, KINDS, Kind, ResidencyTracker, SegmentLike, StepTelemetry
from um_lab.types import StepRecord

__all__ = ["BLOCK", "CuptiSource", "Kind", "RecordSource", "ResidencyTracker", "StepTelemetry", "Telemetry",
           "TelemetryUnavailable", "check_telemetry_mode", "open_telemetry"]

FlushMode = Literal["background", "step"]


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


class _Collector(threading.Thread):
    """Daemon thread: every ``period_s``, flush the record source and take an NVML sample."""

    def __init__(self, source: RecordSource, nvml: _Nvml | None, period_s: float) -> None:
        super().__init__(name="um_lab-telemetry", daemon=True)
        self._source, self._nvml, self._period_s = source, nvml, period_s
        self._halt = threading.Event()
        self.error: Exception | None = None
        self.nvml_sample: dict[str, Any] = {} if nvml is None else nvml.sample()

    def run(self) -> None:
        while not self._halt.wait(self._period_s):
            try:
                self._source.flush()
                if self._nvml is not None:
                    self.nvml_sample = self._nvml.sample()
            except Exception as e:  # noqa: BLE001 - reported to the training thread by collect()
                self.error = e
                return

    def halt(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=10.0)


class Telemetry:
    """Per-step measured residency and migrations for a session (see the module docstring).

    ``source`` defaults to :class:`CuptiSource`; ``nvml=False`` skips NVML (CPU tests).
    ``flush``: ``"background"`` (default; a daemon thread flushes every ``flush_period_ms``) or
    ``"step"`` (flush on the training thread at every step end).
    """

    def __init__(self, *, source: RecordSource | None = None, nvml: bool = True,
                 buffer_bytes: int = CuptiSource.BUFFER_BYTES, flush: FlushMode = "background",
                 flush_period_ms: float = 20.0) -> None:
        if flush not in ("background", "step"):
            raise ValueError(f"flush must be 'background' or 'step', got {flush!r}")
        if not flush_period_ms > 0:
            raise ValueError(f"flush_period_ms must be > 0, got {flush_period_ms}")
        self._source: RecordSource = source if source is not None else CuptiSource(buffer_bytes)
        self.flush_mode: FlushMode = flush
        self.flush_period_ms = float(flush_period_ms)
        self._use_nvml = nvml
        self._nvml: _Nvml | None = None
        self._tracker: ResidencyTracker | None = None
        self._collector: _Collector | None = None
        self.status = "unavailable: telemetry not started"

    @property
    def available(self) -> bool:
        """True while CUPTI records are being collected."""
        return self._tracker is not None

    def start(self, device: int = 0) -> str:
        """Start collecting on GPU ``device``; returns the status (``"cupti..."`` or ``"unavailable: ..."``).

        Starting a telemetry that is already collecting changes nothing.
        """
        if self._tracker is not None:
            return self.status
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
        _RUNNING.add(self)
        if self.flush_mode == "background":
            try:
                collector = _Collector(self._source, self._nvml, self.flush_period_ms / 1e3)
                collector.start()
            except Exception as e:  # noqa: BLE001 - e.g. no thread can be started: give CUPTI back
                self.status = f"unavailable: telemetry thread failed ({type(e).__name__}: {e})"
                self._shut_down()
                return self.status
            self._collector = collector
        return self.status

    def collect(self, segments: Iterable[SegmentLike], *, settle: bool = False) -> StepTelemetry | None:
        """Account every record delivered since the last call (``None`` when unavailable).

        Flushes CUPTI first in ``"step"`` mode, or when ``settle`` is true.
        """
        tracker, collector = self._tracker, self._collector  # close() may run on another thread
        if tracker is None:
            return None
        try:
            if collector is not None and collector.error is not None:
                raise collector.error
            t0 = time.perf_counter()
            if settle or self.flush_mode == "step":
                self._source.flush()
            records = self._source.drain()
            t1 = time.perf_counter()
            measured = tracker.update(segments, records)
            measured.extra["telemetry_flush_ms"] = (t1 - t0) * 1e3
            measured.extra["telemetry_attribution_ms"] = (time.perf_counter() - t1) * 1e3
            return measured
        except Exception as e:  # noqa: BLE001 - degrade, never crash the training loop
            self.status = f"unavailable: telemetry failed ({type(e).__name__}: {e})"
            self._shut_down()
            return None

    def fill(self, record: StepRecord, segments: Iterable[SegmentLike]) -> None:
        """Write this step's measured fields (and NVML readings) into ``record``."""
        t0 = time.perf_counter()
        measured = self.collect(segments)
        collector = self._collector
        if collector is not None:
            record.extra.update(collector.nvml_sample)
        elif self._nvml is not None:
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
        record.extra["telemetry_flush"] = self.flush_mode
        record.extra["telemetry_flush_via"] = getattr(self._source, "flush_via", None)
        record.extra["telemetry_ms"] = (time.perf_counter() - t0) * 1e3

    def _shut_down(self) -> None:
        _RUNNING.discard(self)
        self._tracker = None
        collector, self._collector = self._collector, None
        if collector is not None:
            collector.halt()
        try:
            self._source.stop()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop collecting (safe to call more than once)."""
        self._shut_down()
        if not self.status.startswith("unavailable"):
            self.status = "unavailable: telemetry closed"


_RUNNING: weakref.WeakSet[Telemetry] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Halt collector threads before the interpreter goes (one may be inside a CUPTI flush)."""
    for telemetry in list(_RUNNING):
        telemetry.close()


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
