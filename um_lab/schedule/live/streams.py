"""The streams and events the budget executor uses: :class:`StreamOps` (its protocol), :class:`CudaStreams`
(a side stream beside the current one on a GPU) and :class:`RecordingStreams` (a logging fake for CPU tests)."""

from __future__ import annotations

import itertools
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

    def run_ordered(self, issue: Callable[[int], None]) -> None:
        """Call ``issue(stream handle)`` for work that must land exactly here in compute order: on a stream
        that waits for the compute stream's work so far and for the side stream's (a discard that runs while a
        prefetch of the same range does is undefined behaviour), and that compute's later work waits for."""


class CudaStreams:
    """:class:`StreamOps` on a GPU: one ``torch.cuda.Stream`` beside the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._ordered: torch.cuda.Stream | None = None

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
    """:class:`StreamOps` for CPU tests: events are numbers, every call is logged."""

    SIDE = 7
    ORDERED = 9

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._ids = itertools.count(1)

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
