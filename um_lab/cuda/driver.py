"""Thin, typed access to the CUDA runtime for managed memory (CUDA 12 and 13).

* Advice and prefetch go through ``cuda.bindings.runtime`` with a ``cudaMemLocation``: CuPy's own
  ``memAdvise``/``memPrefetchAsync`` build a *device* location, so the host (-1) fails on CUDA 13.
  The location-taking calls are ``cudaMemAdvise``/``cudaMemPrefetchAsync`` on CUDA 13 and
  ``cudaMemAdvise_v2``/``cudaMemPrefetchAsync_v2`` on CUDA 12.2+.
* CuPy provides standalone managed buffers and array views of segments.
* The allocation shim (``_shim.c``) receives raw function addresses from the runtime library that
  torch loaded, so one build serves both CUDA majors.

Nothing here allocates at import time; CuPy and cuda-bindings are imported on first use.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from um_lab.errors import CudaUnavailableError, UnsupportedDeviceError

GPU = "gpu"
CPU = "cpu"


def require_cuda(*, cupy: bool = False) -> None:
    """Raise :class:`CudaUnavailableError` (pointing to the simulator) unless CUDA is usable.

    The real backend needs cuda-bindings only; ``cupy=True`` also asks for CuPy (the teaching
    experiments' managed arrays)."""
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise CudaUnavailableError(f"this torch build ({torch.__version__}) has no CUDA support")
    if not torch.cuda.is_available():
        raise CudaUnavailableError("no CUDA GPU is visible to torch")
    needed = (("cupy",) if cupy else ()) + ("cuda.bindings.runtime",)
    for module, extra in ((m, "cuda12 or cuda13") for m in needed):
        try:
            __import__(module)
        except ImportError as e:
            raise CudaUnavailableError(
                f"{module} is not installed ({e}); pip install 'um_lab[{extra.split()[0]}]' (or [cuda13])"
            ) from None


@functools.cache
def _cudart() -> Any:
    from cuda.bindings import runtime

    return runtime


def _check(result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    if isinstance(result, tuple) and len(result) == 2:
        return result[1]
    return result[1:] if isinstance(result, tuple) else None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the lab needs to know about a GPU."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    concurrent_managed_access: bool
    compute_capability: tuple[int, int]
    runtime_version: int


def device_info(device: int) -> DeviceInfo:
    """Read the GPU's name, memory and managed-memory capabilities."""
    require_cuda()
    rt = _cudart()
    attr = rt.cudaDeviceAttr.cudaDevAttrConcurrentManagedAccess
    concurrent = _check(rt.cudaDeviceGetAttribute(attr, device), "cudaDeviceGetAttribute")
    free, total = torch.cuda.mem_get_info(device)
    return DeviceInfo(
        index=device,
        name=torch.cuda.get_device_name(device),
        total_bytes=int(total),
        free_bytes=int(free),
        concurrent_managed_access=bool(concurrent),
        compute_capability=torch.cuda.get_device_capability(device),
        runtime_version=runtime_version(),
    )


def check_device(info: DeviceInfo) -> None:
    """Refuse GPUs without concurrent managed access (pre-Pascal, Windows, WSL) with a clear error."""
    if not info.concurrent_managed_access:
        raise UnsupportedDeviceError(
            f"GPU {info.index} ({info.name}) has no concurrent managed access: the CPU cannot touch "
            "managed memory while kernels run, so per-type advice and prefetch do not apply (this is "
            "the case on Windows, WSL and pre-Pascal GPUs). Use the simulator backend instead."
        )


def mem_get_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of the GPU, as the driver reports them."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


# ---- the runtime library torch uses, for the C shim ----


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


@functools.cache
def runtime_library() -> ctypes.CDLL:
    """The CUDA runtime library already loaded by torch (falls back to the CUDA path finder)."""
    torch.cuda.init()
    path = _loaded_cudart_path()
    if path is None:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            path = load_nvidia_dynamic_lib("cudart").abs_path
        except Exception as e:  # noqa: BLE001 - any failure means "not found"
            raise CudaUnavailableError(f"cannot locate the CUDA runtime library (libcudart): {e}") from None
    return ctypes.CDLL(path)


@functools.cache
def runtime_version() -> int:
    """CUDA runtime version as an int (e.g. 13000)."""
    version = ctypes.c_int(0)
    err = runtime_library().cudaRuntimeGetVersion(ctypes.byref(version))
    if err != 0:
        raise RuntimeError(f"cudaRuntimeGetVersion failed with error {err}")
    return version.value


def shim_function_addresses() -> tuple[int, int, int, int, int]:
    """Addresses of cudaMallocManaged, cudaFree, the location-taking cudaMemAdvise, cudaGetLastError,
    cudaMalloc."""
    lib = runtime_library()
    advise_name = "cudaMemAdvise" if runtime_version() >= 13000 else "cudaMemAdvise_v2"
    try:
        advise = getattr(lib, advise_name)
    except AttributeError:
        raise UnsupportedDeviceError(
            f"the CUDA runtime ({runtime_version()}) lacks {advise_name}; CUDA 12.2 or newer is needed"
        ) from None

    def addr(fn: Any) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value or 0

    return (addr(lib.cudaMallocManaged), addr(lib.cudaFree), addr(advise), addr(lib.cudaGetLastError),
            addr(lib.cudaMalloc))


# ---- advice and prefetch from Python (re-applying a policy, phase prefetches) ----


def advice_code(name: str) -> int:
    """The ``cudaMemoryAdvise`` enum value for e.g. ``"SetPreferredLocation"``."""
    return int(getattr(_cudart().cudaMemoryAdvise, f"cudaMemAdvise{name}"))


def location_code(processor: str) -> int:
    """The ``cudaMemLocationType`` enum value for ``"gpu"`` or ``"cpu"``."""
    kind = "Device" if processor == GPU else "Host"
    return int(getattr(_cudart().cudaMemLocationType, f"cudaMemLocationType{kind}"))


def _memory_location(location_type: int, location_id: int) -> Any:
    rt = _cudart()
    loc = rt.cudaMemLocation()
    loc.type = rt.cudaMemLocationType(location_type)
    loc.id = location_id
    return loc


def _location_api(name: str) -> Any:
    rt = _cudart()
    return getattr(rt, f"{name}_v2", None) or getattr(rt, name)


def advise_raw(ptr: int, nbytes: int, code: int, location_type: int, location_id: int) -> None:
    """``cudaMemAdvise`` from enum values (the location-taking call on CUDA 12 and 13)."""
    fn = _location_api("cudaMemAdvise")
    loc = _memory_location(location_type, location_id)
    _check(fn(ptr, nbytes, _cudart().cudaMemoryAdvise(code), loc), f"cudaMemAdvise(advice={code})")


def prefetch_raw(ptr: int, nbytes: int, location_type: int, location_id: int, stream: int) -> None:
    """``cudaMemPrefetchAsync`` from enum values on ``stream`` (a raw stream handle)."""
    fn = _location_api("cudaMemPrefetchAsync")
    _check(fn(ptr, nbytes, _memory_location(location_type, location_id), 0, stream), "cudaMemPrefetchAsync")


def can_discard() -> bool:
    """True when the runtime has ``cudaMemDiscardBatchAsync`` (CUDA 13+)."""
    lib = runtime_library()
    return (runtime_version() >= 13000 and hasattr(lib, "cudaMemDiscardBatchAsync")
            and hasattr(lib, "cudaMemDiscardAndPrefetchBatchAsync"))


def discard_raw(ptr: int, nbytes: int, stream: int) -> None:
    """``cudaMemDiscardBatchAsync`` of one range on ``stream`` (not the legacy default stream: the batch
    calls refuse it): its pages' contents become undefined and resident ones are dropped without a copy
    (through ctypes: the GIL is released for the call). A GPU write to discarded pages that were not
    populated first faults at ~0.7 GB/s on the H200."""
    lib = runtime_library()
    ptrs, sizes = (ctypes.c_void_p * 1)(ptr), (ctypes.c_size_t * 1)(nbytes)
    err = lib.cudaMemDiscardBatchAsync(ptrs, sizes, ctypes.c_size_t(1), ctypes.c_ulonglong(0),
                                       ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"cudaMemDiscardBatchAsync failed: cudaError {err}")


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def discard_and_prefetch_raw(ptr: int, nbytes: int, device: int, stream: int) -> None:
    """``cudaMemDiscardAndPrefetchBatchAsync`` of one range to GPU ``device`` on ``stream`` (not the legacy
    default stream): its pages become resident there with undefined contents and no copy."""
    lib = runtime_library()
    ptrs, sizes = (ctypes.c_void_p * 1)(ptr), (ctypes.c_size_t * 1)(nbytes)
    locs, idxs = (_MemLocation * 1)(_MemLocation(location_code(GPU), device)), (ctypes.c_size_t * 1)(0)
    err = lib.cudaMemDiscardAndPrefetchBatchAsync(ptrs, sizes, ctypes.c_size_t(1), locs, idxs, ctypes.c_size_t(1),
                                                  ctypes.c_ulonglong(0), ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"cudaMemDiscardAndPrefetchBatchAsync failed: cudaError {err}")


def can_prefetch_batch() -> bool:
    """True when the runtime has ``cudaMemPrefetchBatchAsync`` (CUDA 13+)."""
    return runtime_version() >= 13000 and hasattr(runtime_library(), "cudaMemPrefetchBatchAsync")


def prefetch_batch_raw(ptrs: Sequence[int], sizes: Sequence[int], location_type: int, location_id: int,
                       stream: int) -> None:
    """``cudaMemPrefetchBatchAsync`` of many ranges to one location on ``stream`` (not the legacy default
    stream): one driver call instead of one per range; the ranges may move in any order within it."""
    lib = runtime_library()
    count = len(ptrs)
    if count != len(sizes) or count == 0:
        raise ValueError(f"prefetch_batch_raw needs as many sizes as addresses (>= 1), got {count} and {len(sizes)}")
    c_ptrs, c_sizes = (ctypes.c_void_p * count)(*ptrs), (ctypes.c_size_t * count)(*sizes)
    locs, idxs = (_MemLocation * 1)(_MemLocation(location_type, location_id)), (ctypes.c_size_t * 1)(0)
    err = lib.cudaMemPrefetchBatchAsync(c_ptrs, c_sizes, ctypes.c_size_t(count), locs, idxs, ctypes.c_size_t(1),
                                        ctypes.c_ulonglong(0), ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"cudaMemPrefetchBatchAsync of {count} ranges failed: cudaError {err}")


def advise(ptr: int, nbytes: int, advice: str, processor: str, device: int) -> None:
    """``cudaMemAdvise`` by name, e.g. ``advise(p, n, "SetPreferredLocation", "cpu", 0)``."""
    advise_raw(ptr, nbytes, advice_code(advice), location_code(processor), device if processor == GPU else 0)


def prefetch(ptr: int, nbytes: int, processor: str, device: int, stream: int = 0) -> None:
    """``cudaMemPrefetchAsync`` to ``"gpu"`` or ``"cpu"`` on ``stream`` (a raw stream handle)."""
    prefetch_raw(ptr, nbytes, location_code(processor), device if processor == GPU else 0, stream)


# ---- standalone managed buffers through CuPy (experiments, telemetry checks) ----


def malloc_managed(nbytes: int) -> Any:
    """A managed buffer from CuPy (``cupy.cuda.MemoryPointer``); freed when it is garbage collected.

    Not capped: for small experiments only. Training tensors go through :class:`ManagedPools`.
    """
    import cupy

    return cupy.cuda.malloc_managed(nbytes)


def managed_array(ptr: int, nbytes: int, dtype: Any = "float32", owner: Any = None) -> Any:
    """A CuPy array view over managed memory at ``ptr`` (no copy, no ownership)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner)
    itemsize = cupy.dtype(dtype).itemsize
    return cupy.ndarray((nbytes // itemsize,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


class CudaRuntime:
    """The real ``Runtime`` for :class:`um_lab.cuda.allocator.ManagedPools` (enum codes, raw calls)."""

    def __init__(self) -> None:
        from um_lab.cuda.allocator import AdviceCodes

        self.codes = AdviceCodes(
            set_read_mostly=advice_code("SetReadMostly"),
            unset_read_mostly=advice_code("UnsetReadMostly"),
            set_preferred_location=advice_code("SetPreferredLocation"),
            unset_preferred_location=advice_code("UnsetPreferredLocation"),
            set_accessed_by=advice_code("SetAccessedBy"),
            unset_accessed_by=advice_code("UnsetAccessedBy"),
            location_device=location_code(GPU),
            location_host=location_code(CPU),
        )

    def advise(self, ptr: int, nbytes: int, code: int, location_type: int, location_id: int) -> None:
        """Raw ``cudaMemAdvise`` with a location."""
        advise_raw(ptr, nbytes, code, location_type, location_id)

    def prefetch(self, ptr: int, nbytes: int, location_type: int, location_id: int, stream: int) -> None:
        """Raw ``cudaMemPrefetchAsync`` with a location."""
        prefetch_raw(ptr, nbytes, location_type, location_id, stream)

    def discard(self, ptr: int, nbytes: int, stream: int) -> None:
        """Raw ``cudaMemDiscardBatchAsync`` of one range (CUDA 13+; see :func:`can_discard`)."""
        discard_raw(ptr, nbytes, stream)

    def discard_and_prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        """Raw ``cudaMemDiscardAndPrefetchBatchAsync`` of one range to GPU ``device``."""
        discard_and_prefetch_raw(ptr, nbytes, device, stream)

    def can_discard(self) -> bool:
        """True when :meth:`discard` is available."""
        return can_discard()

    def prefetch_batch(self, ptrs: Sequence[int], sizes: Sequence[int], location_type: int, location_id: int,
                       stream: int) -> None:
        """Raw ``cudaMemPrefetchBatchAsync`` of many ranges to one location (CUDA 13+; see
        :func:`can_prefetch_batch`)."""
        prefetch_batch_raw(ptrs, sizes, location_type, location_id, stream)

    def can_prefetch_batch(self) -> bool:
        """True when :meth:`prefetch_batch` is available."""
        return can_prefetch_batch()

    def current_stream(self) -> int:
        """torch's current stream as a raw handle."""
        return int(torch.cuda.current_stream().cuda_stream)
