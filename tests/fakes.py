"""Fake CUDA pieces for CPU tests: a driver for the C shim, torch's pool API, the advice runtime."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from typing import Any

from um_lab.cuda.allocator import AdviceCodes, SegmentSource


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
ADVISE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, MemLocation)
MALLOC_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)

CODES = AdviceCodes(
    set_read_mostly=1, unset_read_mostly=2, set_preferred_location=3, unset_preferred_location=4,
    set_accessed_by=5, unset_accessed_by=6, location_device=1, location_host=2,
)


class FakeDriver:
    """Stands in for cudaMallocManaged/cudaFree/cudaMemAdvise: hands out fake, never-touched addresses."""

    def __init__(self) -> None:
        self.next_address = 1 << 40
        self.mallocs: list[tuple[int, int]] = []
        self.device_mallocs: list[tuple[int, int]] = []  # cudaMalloc stand-in's calls
        self.frees: list[int] = []
        self.advice: list[tuple[int, int, int, int, int]] = []
        self.fail_next = 0  # error code to return from the next malloc

        @MALLOC
        def malloc(out, size, flags):
            if self.fail_next:
                err, self.fail_next = self.fail_next, 0
                return err
            addr = self.next_address
            self.next_address += (size + (2 << 20) - 1) // (2 << 20) * (2 << 20) + (2 << 20)
            out[0] = addr
            self.mallocs.append((addr, size))
            return 0

        @FREE
        def free(ptr):
            self.frees.append(ptr)
            return 0

        @ADVISE
        def advise(ptr, size, advice, loc):
            self.advice.append((ptr, size, advice, loc.type, loc.id))
            return 0

        @MALLOC_DEVICE
        def malloc_device(out, size):
            addr = self.next_address
            self.next_address += (size + (2 << 20) - 1) // (2 << 20) * (2 << 20) + (2 << 20)
            out[0] = addr
            self.device_mallocs.append((addr, size))
            return 0

        self._callbacks = (malloc, free, advise)  # keep alive
        self._device_callback = malloc_device

    def addresses(self) -> tuple[int, int, int]:
        return tuple(ctypes.cast(c, ctypes.c_void_p).value for c in self._callbacks)  # type: ignore[return-value]

    def device_malloc_address(self) -> int:
        """The cudaMalloc stand-in (configure's ``malloc_device``)."""
        return int(ctypes.cast(self._device_callback, ctypes.c_void_p).value or 0)


def install_fake_driver(cap: int = 1 << 40) -> tuple[SegmentSource, FakeDriver]:
    """Point the process-wide shim at a fresh fake driver with an empty registry."""
    source = SegmentSource()
    drain(source)
    driver = FakeDriver()
    source.configure(*driver.addresses(), malloc_device=driver.device_malloc_address())
    source.set_cap(cap, False)
    for t in range(5):
        source._shim.set_advice(t, [])
        source._shim.set_device_memory(t, False)
    return source, driver


def drain(source: SegmentSource) -> None:
    """Free every live segment (keeps tests independent: the shim is process-wide)."""
    for seg in source.segments():
        source.free(seg.ptr)


@dataclasses.dataclass
class FakePool:
    id: tuple[int, int]
    alloc_address: int
    free_address: int


class FakePoolAPI:
    """Records torch's pool calls and checks the pairing rule as torch would."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.calls: list[tuple[str, Any]] = []
        self.recording: dict[tuple[int, int], int] = {}  # pool -> begins without end
        self.use_count: dict[tuple[int, int], int] = {}
        self.empty_caches = 0
        self.pools: list[FakePool] = []
        self.interrupt_after_begin = False

    def new_pool(self, alloc_address: int, free_address: int) -> FakePool:
        pool = FakePool((0, next(self.ids)), alloc_address, free_address)
        self.pools.append(pool)
        self.use_count[pool.id] = 1
        self.calls.append(("new", pool.id))
        return pool

    def begin(self, device: int, pool_id: tuple[int, int]) -> None:
        self.use_count[pool_id] += 1  # torch counts the reference before its check
        if self.recording.get(pool_id):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording[pool_id] = 1
        self.calls.append(("begin", pool_id))
        if self.interrupt_after_begin:
            self.interrupt_after_begin = False
            raise KeyboardInterrupt  # a Ctrl-C delivered as the C call returns

    def end(self, device: int, pool_id: tuple[int, int]) -> None:
        if not self.recording.get(pool_id):
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording[pool_id] = 0
        self.calls.append(("end", pool_id))

    def release(self, device: int, pool_id: tuple[int, int]) -> None:
        self.use_count[pool_id] -= 1
        self.calls.append(("release", pool_id))

    def empty_cache(self) -> None:
        self.empty_caches += 1

    def balanced(self) -> bool:
        """Every begin has its end and release (use counts back at the pools' own reference)."""
        return not any(self.recording.values()) and all(v == 1 for v in self.use_count.values())


class FakeRuntime:
    """Records advise and prefetch calls."""

    codes = CODES

    def __init__(self) -> None:
        self.advised: list[tuple[int, int, int, int, int]] = []
        self.prefetched: list[tuple[int, int, int, int, int]] = []

    def advise(self, ptr: int, nbytes: int, code: int, location_type: int, location_id: int) -> None:
        self.advised.append((ptr, nbytes, code, location_type, location_id))

    def prefetch(self, ptr: int, nbytes: int, location_type: int, location_id: int, stream: int) -> None:
        self.prefetched.append((ptr, nbytes, location_type, location_id, stream))

    def current_stream(self) -> int:
        return 0


#: The public keywords of ``Session``; any other keyword a test gives is an experimental option.
SESSION_KEYWORDS = {"device", "cap_bytes", "allow_oversubscription", "telemetry", "budget", "evacuate_on_close",
                    "_pool_api", "_runtime", "_source", "_device_memory"}


def new_session(policy: Any = "um-default", **kw: Any) -> Any:
    """``Session(policy, **session_keywords)`` created inside ``um_lab.experimental.options(**the_rest)``
    (``session_class``: a subclass of Session instead)."""
    from um_lab import experimental
    from um_lab.cuda.session import Session

    session_class = kw.pop("session_class", Session)
    options = {k: kw.pop(k) for k in list(kw) if k not in SESSION_KEYWORDS}
    with experimental.options(**options):
        return session_class(policy, **kw)
