"""The streams and events the budget executor uses: :class:`StreamOps` (its protocol), :class:`CudaStreams`
(a side stream beside the current one on a GPU) and :class:`RecordingStreams` (a logging fake for CPU tests)."""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch


class StreamOps(Protocol):
    """The stream and event calls the executor makes (CUDA, or a recording fake on the CPU)."""

    def side_handle(self) -> int:
        """The raw handle of the side stream prefetches go on."""

    def record_compute(self) -> Any:
        """An event recorded now on the compute (current) stream."""

    def record_side(self) -> Any:
        """An event recorded now on the side stream."""

    def side_wait(self, event: Any) -> None:
        """The side stream waits for ``event``."""

    def compute_wait(self, event: Any) -> None:
        """The compute (current) stream waits for ``event``."""

    def synchronize_side(self) -> None:
        """Block the host until everything issued on the side stream is done."""

    def timed_side_event(self) -> Any:
        """An event that can be timed, recorded now on the side stream (move timing)."""

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        """Milliseconds between two timed events; None while ``end`` has not completed."""

    def value_waits(self) -> bool:
        """True when compute can wait on the GPU for a counter the side stream writes (no host wait)."""

    def next_value(self) -> int:
        """The next counter value: one per batch that compute may wait for."""

    def side_write_value(self, value: int) -> None:
        """The side stream writes ``value`` to the counter once its earlier work is done."""

    def compute_wait_value(self, value: int) -> None:
        """The compute (current) stream waits until the counter has reached ``value``."""

    def release_values(self) -> None:
        """After a failure: every wait for a value handed out so far passes (the counter jumps past them)."""

    def run_ordered(self, issue: Callable[[int], None]) -> None:
        """Call ``issue(stream handle)`` for work that must land exactly here in compute order: on a stream
        that waits for the compute stream's work so far and for the side stream's (a discard that runs while a
        prefetch of the same range does is undefined behaviour), and that compute's later work waits for."""


#: how far :meth:`CudaStreams.release_values` moves the counter past the last value handed out (waits compare
#: cyclically, so the jump stays far below 2**31)
RELEASE_JUMP = 1 << 20


class _ValueCounter:
    """The values handed out for GPU-side waits, shared by the mover and training threads."""

    def __init__(self, start: int = 0) -> None:
        self.value = start
        self._lock = threading.Lock()

    def advance(self, by: int = 1) -> int:
        """Move on by ``by`` (1: the next batch's value; RELEASE_JUMP: past every value handed out)."""
        with self._lock:
            self.value += by
            return self.value


class CudaStreams:
    """:class:`StreamOps` on a GPU: one ``torch.cuda.Stream`` beside the current stream.

    With ``value_waits`` a 32-bit counter in ordinary device memory lets compute wait for the side stream's
    batches on the GPU (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``), so the training thread never
    waits for the mover to issue a batch. Where the driver refuses the calls (a probe at construction),
    value waits stay off and ``value_waits()`` says so."""

    def __init__(self, device: torch.device, value_waits: bool = False) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._values = _ValueCounter()
        self._counter: torch.Tensor | None = None
        self._rescue: torch.cuda.Stream | None = None
        self._ordered: torch.cuda.Stream | None = None
        if value_waits:
            self._open_counter()

    def _open_counter(self) -> None:
        from um_lab.cuda import driver

        counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # allocated outside every pool
        try:  # the probe: a write, then a wait that it already satisfies
            driver.stream_write_value32(self.side_handle(), counter.data_ptr(), 1)
            driver.stream_wait_value32(self.side_handle(), counter.data_ptr(), 1)
            self.stream.synchronize()
        except (OSError, AttributeError, RuntimeError) as e:
            warnings.warn(f"GPU-side waits are unavailable here ({e}); the training thread waits for the mover",
                          RuntimeWarning, stacklevel=3)
            return
        self._counter, self._values, self._rescue = counter, _ValueCounter(1), torch.cuda.Stream(self.device)

    def value_waits(self) -> bool:
        return self._counter is not None

    def next_value(self) -> int:
        return self._values.advance()

    def side_write_value(self, value: int) -> None:
        from um_lab.cuda import driver

        assert self._counter is not None
        driver.stream_write_value32(self.side_handle(), self._counter.data_ptr(), value)

    def compute_wait_value(self, value: int) -> None:
        from um_lab.cuda import driver

        assert self._counter is not None
        driver.stream_wait_value32(int(torch.cuda.current_stream(self.device).cuda_stream),
                                   self._counter.data_ptr(), value)

    def release_values(self) -> None:
        from um_lab.cuda import driver

        if self._counter is None or self._rescue is None:
            return
        value = self._values.advance(RELEASE_JUMP)
        try:  # the side stream's earlier writes first: none may land after the jump and pull the counter back
            self.stream.synchronize()
        except RuntimeError:  # a broken side stream: release anyway
            pass
        driver.stream_write_value32(int(self._rescue.cuda_stream), self._counter.data_ptr(), value)
        self._rescue.synchronize()

    def side_handle(self) -> int:
        return int(self.stream.cuda_stream)

    def run_ordered(self, issue: Callable[[int], None]) -> None:
        if self._ordered is None:  # not the compute stream itself: the batch calls refuse the legacy default one
            self._ordered = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        # the host first waits for compute to get here: issued while its stream still waited for compute, a
        # discard call never returned (ResNet-50 on the H200); with compute caught up none waits
        compute.record_event().synchronize()
        self._ordered.wait_stream(compute)
        self._ordered.wait_stream(self.stream)
        try:
            issue(int(self._ordered.cuda_stream))
        finally:
            compute.wait_stream(self._ordered)

    def record_compute(self) -> Any:
        return torch.cuda.current_stream(self.device).record_event()

    def record_side(self) -> Any:
        return self.stream.record_event()

    def side_wait(self, event: Any) -> None:
        self.stream.wait_event(event)

    def compute_wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize_side(self) -> None:
        self.stream.synchronize()

    def timed_side_event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        return float(start.elapsed_time(end)) if end.query() else None


class RecordingStreams:
    """:class:`StreamOps` for CPU tests: events are numbers, every call is logged (``value_waits``: the
    counter calls too)."""

    SIDE = 7
    ORDERED = 9

    def __init__(self, value_waits: bool = False) -> None:
        self.log: list[tuple[str, int]] = []
        self._ids = itertools.count(1)
        self._value_waits = value_waits
        self._values = _ValueCounter()

    def value_waits(self) -> bool:
        return self._value_waits

    def next_value(self) -> int:
        return self._values.advance()

    def side_write_value(self, value: int) -> None:
        self.log.append(("side_write_value", value))

    def compute_wait_value(self, value: int) -> None:
        self.log.append(("compute_wait_value", value))

    def release_values(self) -> None:
        self.log.append(("release_values", self._values.advance(RELEASE_JUMP)))

    def side_handle(self) -> int:
        return self.SIDE

    def run_ordered(self, issue: Callable[[int], None]) -> None:
        self.log.append(("ordered_begin", self.ORDERED))
        try:
            issue(self.ORDERED)
        finally:
            self.log.append(("ordered_end", self.ORDERED))

    def record_compute(self) -> Any:
        ev = next(self._ids)
        self.log.append(("record_compute", ev))
        return ev

    def record_side(self) -> Any:
        ev = next(self._ids)
        self.log.append(("record_side", ev))
        return ev

    def side_wait(self, event: Any) -> None:
        self.log.append(("side_wait", event))

    def compute_wait(self, event: Any) -> None:
        self.log.append(("compute_wait", event))

    def synchronize_side(self) -> None:
        self.log.append(("synchronize_side", 0))

    def timed_side_event(self) -> Any:
        """A number that doubles as its time in ms (each call between two of them: 1 ms)."""
        ev = next(self._ids)
        self.log.append(("timed_side", ev))
        return ev

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        return float(end - start)
