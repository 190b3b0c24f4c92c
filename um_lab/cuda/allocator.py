"""Managed-memory pools, one per data type, hot-swapped into a live PyTorch session.

The segment source is the compiled shim (``_shim.c``): torch's caching allocator keeps working
inside each ``torch.cuda.MemPool`` and calls the shim only for new segments, so a resident managed
pool costs nothing per step. This module adds routing (which thread allocates into which pool),
the per-type advice table, re-application of advice to live segments, phase prefetches, and the
safety cap on live managed bytes.

Pairing rule: every ``begin`` of a pool is matched by ``end`` *and* ``release``, always, or the pool
never frees its segments (unpaired calls in an early probe leaked hundreds of GiB of managed memory).
:meth:`ManagedPools.route` is the only place that begins.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from um_lab.errors import OversubscriptionRefused, SessionStateError
from um_lab.policy import Advice, Policy
from um_lab.segments import AdviceCodes, Runtime, Segment, SegmentIndex
from um_lab.types import DATA_TYPES, DataType

DATA_TYPE_NAMES = tuple(t.value for t in DATA_TYPES)  # the shim's tags, in order

GiB = 1 << 30


def default_cap(free_bytes: int, total_bytes: int) -> int:
    """The safety cap: free GPU memory minus a reserve of max(2 GiB, 5 % of the card)."""
    reserve = max(2 * GiB, total_bytes // 20)
    return max(0, free_bytes - reserve)


class PoolAPI(Protocol):
    """torch's pool calls (a fake implements it in CPU tests)."""

    def new_pool(self, alloc_address: int, free_address: int) -> Any:
        """A pool (with ``.id``) whose segments come from the two C entry points."""

    def begin(self, device: int, pool_id: tuple[int, int]) -> None:
        """Route the calling thread's allocations into the pool."""

    def end(self, device: int, pool_id: tuple[int, int]) -> None:
        """Stop routing into the pool."""

    def release(self, device: int, pool_id: tuple[int, int]) -> None:
        """Drop the reference a begin took."""

    def empty_cache(self) -> None:
        """Free idle cached segments."""


class TorchPoolAPI:
    """The real :class:`PoolAPI`: ``torch.cuda.MemPool`` over the shim's C entry points."""

    def new_pool(self, alloc_address: int, free_address: int) -> Any:
        allocator = torch._C._cuda_customAllocator(alloc_address, free_address)
        return torch.cuda.MemPool(allocator)

    def begin(self, device: int, pool_id: tuple[int, int]) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)

    def end(self, device: int, pool_id: tuple[int, int]) -> None:
        torch._C._cuda_endAllocateToPool(device, pool_id)

    def release(self, device: int, pool_id: tuple[int, int]) -> None:
        torch._C._cuda_releasePool(device, pool_id)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def advice_entries(advice: Advice, device: int, codes: AdviceCodes) -> list[tuple[int, int, int]]:
    """The ``(advice, location type, location id)`` calls that set ``advice`` on a fresh segment."""
    gpu = (codes.location_device, device)
    host = (codes.location_host, 0)
    where = {"gpu": gpu, "cpu": host}
    out: list[tuple[int, int, int]] = []
    if advice.read_mostly:
        out.append((codes.set_read_mostly, *gpu))
    if advice.preferred_location != "none":
        out.append((codes.set_preferred_location, *where[advice.preferred_location]))
    for proc in sorted(advice.accessed_by):
        out.append((codes.set_accessed_by, *where[proc]))
    return out


def reset_entries(device: int, codes: AdviceCodes) -> list[tuple[int, int, int]]:
    """The calls that clear every advice (before a new policy is applied to a live segment)."""
    gpu = (codes.location_device, device)
    host = (codes.location_host, 0)
    return [
        (codes.unset_read_mostly, *gpu),
        (codes.unset_preferred_location, *gpu),
        (codes.unset_accessed_by, *gpu),
        (codes.unset_accessed_by, *host),
    ]


def _shim() -> Any:
    try:
        _shim = importlib.import_module("um_lab.cuda._shim")  # the compiled extension (no stub)
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            f"um_lab's compiled allocation shim is missing ({e}); reinstall with `pip install -e .`"
        ) from None
    return _shim


class SegmentSource:
    """Python face of the process-wide shim: cap, advice table, counters, live segments."""

    def __init__(self) -> None:
        self._shim = _shim()

    def configure(self, malloc_managed: int, free: int, advise: int, get_last_error: int = 0,
                  malloc_device: int = 0) -> None:
        """Give the shim the CUDA runtime's function addresses (or a fake driver's); ``malloc_device``
        (cudaMalloc) serves the pools switched to device memory (:meth:`set_device_memory`)."""
        self._shim.configure(malloc_managed, free, advise, get_last_error, malloc_device)

    def set_device_memory(self, data_type: DataType, on: bool) -> None:
        """New segments of ``data_type`` come from plain device memory (``on``) or managed memory. They stay
        under the same cap and in the same registry (``Segment.managed`` tells them apart)."""
        self._shim.set_device_memory(DATA_TYPES.index(data_type), bool(on))

    def set_cap(self, cap_bytes: int, allow_oversubscription: bool = False) -> None:
        """Live managed bytes may not exceed ``cap_bytes`` (unless oversubscription is allowed)."""
        if cap_bytes < 0:
            raise ValueError(f"cap must be >= 0 bytes, got {cap_bytes}")
        self._shim.set_cap(int(cap_bytes), bool(allow_oversubscription))

    def set_advice(self, data_type: DataType, entries: list[tuple[int, int, int]]) -> None:
        """Advice applied by the shim to every new segment of ``data_type``."""
        self._shim.set_advice(DATA_TYPES.index(data_type), entries)

    def addresses(self) -> tuple[dict[DataType, int], int]:
        """Per-type allocation entry points and the shared free entry point."""
        allocs, free = self._shim.addresses()
        return dict(zip(DATA_TYPES, allocs, strict=True)), free

    def stats(self) -> dict[str, Any]:
        """Counters from the shim (calls, refusals, errors, live bytes)."""
        return self._shim.stats()

    def live_bytes(self) -> dict[str, int]:
        """Live managed bytes per data type name."""
        return dict(zip(DATA_TYPE_NAMES, self._shim.live_by_tag(), strict=True))

    def generation(self) -> int:
        """Changes whenever a segment is allocated or freed (the shim's calls so far), so a cached
        :meth:`segments` list can tell it is stale without building :meth:`stats`."""
        return int(self._shim.generation())

    def refused(self) -> int:
        """Requests the cap has refused so far (cheaper than :meth:`stats`: read on every routing)."""
        return int(self._shim.refused())

    def segments(self, data_type: DataType | None = None) -> list[Segment]:
        """Live segments, optionally of one type."""
        segs = [Segment(p, s, DATA_TYPES[t], not d) for p, s, t, d in self._shim.segments()]
        return [s for s in segs if data_type is None or s.data_type == data_type]

    def managed_segments(self, data_type: DataType | None = None) -> list[Segment]:
        """Live managed segments, optionally of one type: what advice, prefetches and CUPTI apply to (not the
        pools switched to device memory)."""
        return [s for s in self.segments(data_type) if s.managed]

    def index(self) -> SegmentIndex:
        """A snapshot of the live segments for many address lookups."""
        return SegmentIndex(self.segments())

    def data_type_of(self, address: int) -> DataType | None:
        """The data type whose segment holds ``address`` (None: not managed by um_lab)."""
        return self.index().data_type_of(address)

    def allocate(self, data_type: DataType, nbytes: int) -> int:
        """Allocate through the shim directly (probes and tests); 0 when refused or failed."""
        return int(self._shim.alloc(DATA_TYPES.index(data_type), nbytes))

    def free(self, ptr: int) -> None:
        """Free a segment allocated by :meth:`allocate`."""
        self._shim.free(ptr)


class ManagedPools:
    """Five ``MemPool``s (one per data type) with routing, advice and the safety cap."""

    def __init__(self, device: int, api: PoolAPI, runtime: Runtime, source: SegmentSource) -> None:
        self.device = device
        self.api = api
        self.runtime = runtime
        self.source = source
        self._pools: dict[DataType, Any] = {}
        self._routes: dict[int, DataType] = {}  # thread id -> routed type
        self._lock = threading.Lock()
        self.policy: Policy | None = None
        self.device_types: frozenset[DataType] = frozenset()
        self.begins = 0
        self.ends = 0
        self.releases = 0

    @property
    def is_open(self) -> bool:
        """True between :meth:`open` and :meth:`close`."""
        return bool(self._pools)

    def open(self, policy: Policy, cap_bytes: int, allow_oversubscription: bool = False,
             device_types: tuple[DataType, ...] = ()) -> None:
        """Set cap and advice, then create the pools (nothing is allocated yet); the pools of
        ``device_types`` take plain device memory instead of managed memory."""
        if self._pools:
            raise SessionStateError("pools are already open")
        for t in DATA_TYPES:
            self.source.set_device_memory(t, t in device_types)
        self.device_types = frozenset(device_types)  #: the pools of plain device memory (never advised or moved)
        self.source.set_cap(cap_bytes, allow_oversubscription)
        self._set_advice_table(policy)
        allocs, free = self.source.addresses()
        self._pools = {t: self.api.new_pool(allocs[t], free) for t in DATA_TYPES}

    def pool_id(self, data_type: DataType) -> tuple[int, int]:
        """torch's id of the pool for ``data_type``."""
        return self._pools[data_type].id

    @property
    def active_routes(self) -> dict[int, DataType]:
        """Threads currently routed, and to which type."""
        with self._lock:
            return dict(self._routes)

    @contextlib.contextmanager
    def route(self, data_type: DataType) -> Iterator[None]:
        """Route the calling thread's CUDA allocations into ``data_type``'s pool.

        A refusal by the safety cap surfaces as :class:`OversubscriptionRefused`. Routing ends and
        the pool is released on any exit, ``KeyboardInterrupt`` included.
        """
        if not self._pools:
            raise SessionStateError("pools are closed")
        tid = threading.get_ident()
        self._claim(tid, data_type)
        pid = self.pool_id(data_type)
        refused_before = self.source.refused()
        try:  # begin inside the try: a Ctrl-C landing just after begin still ends the routing
            self.api.begin(self.device, pid)
            self.begins += 1
            yield
        except torch.cuda.OutOfMemoryError as e:
            self._raise_if_refused(e, refused_before, {tid})
            raise
        finally:
            self._end(pid, tid)

    def _claim(self, tid: int, data_type: DataType) -> None:
        """Record that ``tid`` routes into ``data_type`` (refusing nesting and a second thread).

        torch counts a pool reference *before* checking that the pool is not already being
        recorded to, so a second begin on a busy pool would leak a reference: refuse it here first.
        """
        with self._lock:
            if tid in self._routes:
                raise SessionStateError(
                    f"this thread is already routed to {self._routes[tid].value}; routes do not nest"
                )
            if data_type in self._routes.values():
                raise SessionStateError(
                    f"another thread is allocating into the {data_type.value} pool; one pool takes one "
                    "thread at a time (run steps and inputs from one thread)"
                )
            self._routes[tid] = data_type

    def _end(self, pid: tuple[int, int], tid: int) -> None:
        """End and release a routing; a routing whose begin never took effect is only forgotten."""
        try:
            try:
                self.api.end(self.device, pid)
            except RuntimeError:
                return  # not recording: begin was interrupted before it took effect
            self.ends += 1
            self.api.release(self.device, pid)
            self.releases += 1
        finally:
            with self._lock:
                self._routes.pop(tid, None)

    def _raise_if_refused(self, error: BaseException, refused_before: int, threads: set[int]) -> None:
        """Re-raise a torch OOM as :class:`OversubscriptionRefused` when the cap refused on ``threads``."""
        stats = self.source.stats()
        refused_here = stats["refused"] > refused_before and stats["last_refusal_thread"] in threads
        if refused_here and not isinstance(error, OversubscriptionRefused):
            size, live, cap, tag = stats["last_refusal"]
            name = DATA_TYPES[tag].value if 0 <= tag < len(DATA_TYPES) else None
            raise OversubscriptionRefused(size, live, cap, name) from error

    @contextlib.contextmanager
    def route_backward(self, data_type: DataType, root: torch.Tensor) -> Iterator[None]:
        """Route the autograd engine's thread into ``data_type``'s pool for one ``backward()``.

        A hook on ``root`` begins routing on whichever thread runs the backward pass (torch's
        device thread for CUDA) and a final engine callback ends it there. If the pass fails before
        that callback runs, the routing is ended from the calling thread on exit, so begin, end and
        release always pair.
        """
        if not self._pools:
            raise SessionStateError("pools are closed")
        pid = self.pool_id(data_type)
        caller = threading.get_ident()
        begun: list[int] = []
        threads = {caller}
        state = {"done": False}
        guard = threading.Lock()

        def finish() -> None:
            with guard:
                state["done"] = True
                if not begun:
                    return
                tid = begun.pop()
            self._end(pid, tid)

        def begin_here(grad: torch.Tensor) -> torch.Tensor:
            tid = threading.get_ident()
            with guard:
                if begun or state["done"]:
                    return grad
                self._claim(tid, data_type)
                threads.add(tid)
                begun.append(tid)
                try:
                    self.api.begin(self.device, pid)
                except BaseException:
                    begun.pop()
                    with self._lock:
                        self._routes.pop(tid, None)
                    raise
                self.begins += 1
            torch.autograd.Variable._execution_engine.queue_callback(finish)
            return grad

        refused_before = self.source.refused()
        handle = root.register_hook(begin_here)
        try:
            yield
        except torch.cuda.OutOfMemoryError as e:
            self._raise_if_refused(e, refused_before, threads)
            raise
        finally:
            handle.remove()
            finish()

    def backward(self, loss: torch.Tensor, data_type: DataType, backward_thread: str) -> torch.Tensor:
        """``loss.backward()`` with its allocations routed into ``data_type``'s pool, on the calling
        thread (``"caller"``) or autograd's device thread (``"worker"``, :meth:`route_backward`).

        Returns the loss detached: the autograd graph is freed here, while the GPU still runs the
        backward kernels (dropped after the step's synchronisation it cost ~0.4 ms of host time on
        ResNet-50, H200)."""
        if backward_thread == "caller":
            with self.route(data_type), torch.autograd.set_multithreading_enabled(False):
                loss.backward()
        else:
            with self.route_backward(data_type, loss):
                loss.backward()
        return loss.detach()

    def _set_advice_table(self, policy: Policy) -> None:
        for t in DATA_TYPES:
            self.source.set_advice(t, advice_entries(policy[t], self.device, self.runtime.codes))
        self.policy = policy

    def set_policy(self, policy: Policy) -> int:
        """Switch policy: new segments get the new advice, live segments are re-advised now.

        Returns the number of live segments re-advised. Call between steps (no route active).
        """
        if self.active_routes:
            raise SessionStateError("cannot change the policy while allocations are routed")
        self._set_advice_table(policy)
        count = 0
        codes = self.runtime.codes
        for seg in self.source.managed_segments():
            calls = reset_entries(self.device, codes) + advice_entries(policy[seg.data_type], self.device, codes)
            for code, loc_type, loc_id in calls:
                self.runtime.advise(seg.ptr, seg.size, code, loc_type, loc_id)
            count += 1
        return count

    def prefetch(self, data_type: DataType, processor: str) -> int:
        """Prefetch every live segment of ``data_type`` to ``"gpu"`` or ``"cpu"``; returns bytes."""
        codes = self.runtime.codes
        loc = (codes.location_device, self.device) if processor == "gpu" else (codes.location_host, 0)
        stream = self.runtime.current_stream()
        total = 0
        for seg in self.source.managed_segments(data_type):
            self.runtime.prefetch(seg.ptr, seg.size, loc[0], loc[1], stream)
            total += seg.size
        return total

    def close(self) -> None:
        """Drop every pool; idle segments are freed now, busy ones when their tensors die."""
        if self.active_routes:
            raise SessionStateError("cannot close while allocations are routed")
        pools, self._pools = self._pools, {}
        for data_type, pool in pools.items():
            extra = int(getattr(pool, "use_count", lambda: 1)()) - 1
            if extra > 0:  # a reference leaked by an interrupted begin: give it back, or nothing frees
                warnings.warn(f"releasing {extra} leaked reference(s) to the {data_type.value} pool",
                              RuntimeWarning, stacklevel=2)
                with contextlib.suppress(RuntimeError):
                    self.api.end(self.device, pool.id)
                for _ in range(extra):
                    self.api.release(self.device, pool.id)
        pools.clear()  # MemPool destructors release the pools and free their idle segments
        self.api.empty_cache()
        self.source.set_cap(0, False)  # nothing may allocate into a closed session's pools
        for t in DATA_TYPES:
            self.source.set_device_memory(t, False)
        self.device_types = frozenset()
