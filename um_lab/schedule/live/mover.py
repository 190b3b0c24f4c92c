"""Who makes the scheduler's CUDA calls: the training thread itself, or a mover thread.

On the H200 a ``cudaMemPrefetchAsync`` call returns only once its stream's earlier work is done
(the simulator's profile: ``prefetch_host_sync = 1``). Made from the training thread, each call would
hold up the launches of the next layers until the transfers queued before it finished, and compute
would stop overlapping the moves. :class:`ThreadMover` makes the calls from a thread of its own
(cuda-bindings releases the GIL around each call), in submission order; the training thread only
records the compute event an eviction waits for, and waits on the host for a batch to be *issued*
only when compute needs its data (then makes the compute stream wait for the batch's side event).
:class:`InlineMover` makes the calls at once, on the calling thread (CPU tests, and for comparison).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from um_lab.segments import Runtime

Call = tuple[int, int, int, int]  #: (address, bytes, location type, location id) of one prefetch
#: The location type of a call that discards its range instead (``runtime.discard``, CUDA 13+).
DISCARD = -1
#: The location type of a call that discards its range and prefetches it to device ``location id``: dead pages
#: made resident with no copy (``runtime.discard_and_prefetch``, CUDA 13+).
POPULATE = -2


class MoveClock:
    """Side-stream timing of the mover's calls, a diagnostic (off unless an executor's ``time_moves()`` made
    one): an event after a batch's wait for compute and after each call, so each call's span on the side
    stream is its transfer (a call waits for nothing else there), and the host time the call took (which
    includes waiting for the stream's earlier work: a prefetch call returns only then). :meth:`collect`
    sums the completed calls' bytes, side-stream ms, host ms and counts by kind: ``to_gpu``, ``to_host``,
    ``discard``, ``populate``."""

    def __init__(self, timed_event: Callable[[], Any], host_location: int) -> None:
        self.timed_event = timed_event
        self.host_location = host_location
        self._records: list[tuple[str, int, Any, Any, float]] = []
        self._lock = threading.Lock()

    def kind(self, loc_type: int) -> str:
        """The kind of a call by its location type."""
        if loc_type == DISCARD:
            return "discard"
        if loc_type == POPULATE:
            return "populate"
        return "to_host" if loc_type == self.host_location else "to_gpu"

    def add(self, kind: str, nbytes: int, start: Any, end: Any, host_s: float = 0.0) -> None:
        """One call's kind, bytes, the side events around it and its host seconds (the mover thread calls this)."""
        with self._lock:
            self._records.append((kind, nbytes, start, end, host_s))

    def collect(self, elapsed_ms: Callable[[Any, Any], float | None]) -> dict[str, dict[str, float]]:
        """Totals of the calls whose events completed (``elapsed_ms`` None: not yet; kept for later)."""
        with self._lock:
            records, self._records = self._records, []
        out: dict[str, dict[str, float]] = {}
        waiting = []
        for record in records:
            kind, nbytes, start, end, host_s = record
            ms = elapsed_ms(start, end)
            if ms is None:
                waiting.append(record)
                continue
            total = out.setdefault(kind, {"bytes": 0, "ms": 0.0, "host_ms": 0.0, "calls": 0})
            total["bytes"] += nbytes
            total["ms"] += ms
            total["host_ms"] += host_s * 1e3
            total["calls"] += 1
        with self._lock:
            self._records[:0] = waiting
        return out


class MoveBatch:
    """One batch of prefetches (and discards, location type :data:`DISCARD`) on the side stream: after
    ``compute_event`` (if any), the ``calls`` in order, then a side event when ``record`` (what compute
    waits for). ``live(address, bytes)`` (optional) is asked right before each call: a range it rejects
    (its segment was freed since the batch was made) is skipped, never touched (``skipped`` counts them)."""

    def __init__(self, compute_event: Any, calls: Sequence[Call], record: bool,
                 live: Callable[[int, int], bool] | None = None, clock: MoveClock | None = None,
                 batched: bool = False) -> None:
        self.compute_event = compute_event
        self.clock = clock
        self.batched = batched  #: consecutive prefetches to one location in one batch call (runtime.prefetch_batch)
        self.calls = list(calls)
        self.record = record
        self.live = live
        self.skipped = 0
        self.side_event: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self, runtime: Runtime, streams: Any) -> None:
        """Make the batch's calls on this thread."""
        try:
            if self.compute_event is not None:
                streams.side_wait(self.compute_event)
            side = streams.side_handle()
            live = self.live
            clock = self.clock
            mark = clock.timed_event() if clock is not None else None
            batch_call = getattr(runtime, "prefetch_batch", None) if self.batched else None
            for planned in _groups(self.calls, batch_call is not None):
                group = [c for c in planned if live is None or live(c[0], c[1])]  # right before the call
                self.skipped += len(planned) - len(group)
                if not group:
                    continue
                loc_type, loc_id = group[0][2], group[0][3]
                began = time.perf_counter()
                if len(group) > 1:
                    assert batch_call is not None
                    batch_call([c[0] for c in group], [c[1] for c in group], loc_type, loc_id, side)
                elif loc_type == DISCARD:
                    runtime.discard(group[0][0], group[0][1], side)  # type: ignore[attr-defined]  # can_discard
                elif loc_type == POPULATE:
                    runtime.discard_and_prefetch(group[0][0], group[0][1], loc_id, side)  # type: ignore[attr-defined]
                else:
                    runtime.prefetch(group[0][0], group[0][1], loc_type, loc_id, side)
                if clock is not None:
                    after = clock.timed_event()
                    clock.add(clock.kind(loc_type), sum(c[1] for c in group), mark, after, time.perf_counter() - began)
                    mark = after
            if self.record:
                self.side_event = streams.record_side()
        except BaseException as e:  # handed to whoever waits for the batch
            self.error = e
        finally:
            self._done.set()

    def wait(self) -> Any:
        """Block until the batch was issued; its side event (raises the error it met)."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.side_event

    @property
    def issued(self) -> bool:
        """True once every call was made (or one failed)."""
        return self._done.is_set()


def _groups(calls: Sequence[Call], batch: bool) -> list[list[Call]]:
    """``calls`` in order, as the driver calls to make: with ``batch``, runs of consecutive prefetches to one
    location become one group (one batch call); discards and populates always go alone."""
    groups: list[list[Call]] = []
    for call in calls:
        last = groups[-1] if groups else None
        if (batch and last is not None and call[2] not in (DISCARD, POPULATE)
                and last[0][2] == call[2] and last[0][3] == call[3]):
            last.append(call)
        else:
            groups.append([call])
    return groups


class InlineMover:
    """Issues each batch at once on the calling thread."""

    def __init__(self, runtime: Runtime, streams: Any) -> None:
        self.runtime, self.streams = runtime, streams
        self._error: BaseException | None = None

    def submit(self, batch: MoveBatch) -> MoveBatch:
        """Issue ``batch`` now (an error it meets is kept for :meth:`take_error`)."""
        batch.run(self.runtime, self.streams)
        if batch.error is not None and self._error is None:
            self._error = batch.error
        return batch

    def take_error(self) -> BaseException | None:
        """The first error a batch met since the last call (None: none), cleared."""
        error, self._error = self._error, None
        return error

    def drain(self) -> None:
        """Nothing is ever queued."""

    def close(self, timeout: float = 60.0) -> bool:
        """Nothing to stop."""
        return True


class ThreadMover:
    """Issues batches in order from a daemon thread (see the module docstring).

    ``thread_init`` runs first on that thread (on a GPU: select the session's device). An error in a
    batch is raised to whoever waits for that batch, and by the next :meth:`submit` (or handed out by
    :meth:`take_error`); batches queued after it are not issued (they fail with the same error) until
    the error has been raised or taken.
    """

    def __init__(self, runtime: Runtime, streams: Any, thread_init: Callable[[], None] | None = None) -> None:
        self.runtime, self.streams = runtime, streams
        self._queue: queue.Queue[MoveBatch | None] = queue.Queue()
        self._error: BaseException | None = None
        self._init = thread_init
        self._thread = threading.Thread(target=self._loop, name="um_lab-budget-mover", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except BaseException as e:
                self._error = e
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            if self._error is not None:
                batch.error = self._error
                batch._done.set()
                continue
            batch.run(self.runtime, self.streams)
            if batch.error is not None:
                self._error = batch.error

    def submit(self, batch: MoveBatch) -> MoveBatch:
        """Queue ``batch``; returns it (wait on it for its side event)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if not self._thread.is_alive():
            raise RuntimeError("the budget mover thread has stopped")
        self._queue.put(batch)
        return batch

    def take_error(self) -> BaseException | None:
        """The error a batch met that was not raised yet (None: none), cleared."""
        error, self._error = self._error, None
        return error

    def drain(self) -> None:
        """Block until every queued batch was issued (at once when the thread has stopped)."""
        if not self._thread.is_alive():
            return
        marker = MoveBatch(None, (), record=False)
        self._queue.put(marker)
        while not marker._done.wait(timeout=1.0):
            if not self._thread.is_alive():  # pragma: no cover - the loop only ends on close's None
                return

    def close(self, timeout: float = 60.0) -> bool:
        """Issue what is queued, then stop the thread; returns True once it has stopped.

        Warns (RuntimeWarning) when the thread is still issuing after ``timeout`` seconds: the caller
        must not free managed memory it may still prefetch."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            warnings.warn(f"the budget mover thread did not stop within {timeout:g} s; prefetches it still "
                          "holds may be issued late", RuntimeWarning, stacklevel=2)
            return False
        return True
