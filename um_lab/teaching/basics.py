"""Unified Memory basics: small experiments on one managed buffer, on a GPU or in the simulator.

Each experiment returns a long :class:`pandas.DataFrame`, one row per (case, step): ``time_ms`` and
``GBps`` (buffer bytes / time), and in the simulator also what the driver model did during that step
(``faults``, ``htod_MiB``, ``dtoh_MiB``, ``remote_MiB``, ``evictions``) and where the data is after it
(``on_gpu_MiB``, ``duplicated_MiB`` = valid on both sides). ``df.attrs["backend"]`` says which ran.

* ``backend="cuda"``: managed memory from CuPy, advice and prefetch through :mod:`um_lab.cuda.driver`
  (cuda-bindings, host locations included), two tiny kernels (a sum, a fill) timed with CUDA events; the
  CPU writes and touches the buffer through a NumPy view. Every buffer is counted by a
  :class:`ManagedBudget` (at most 256 MiB each, 2 GiB in all, an eighth of the free memory at most) and
  freed when the experiment ends, also on errors.
* ``backend="sim"``: the same steps on :class:`um_lab.sim.uvm.UvmModel` with the H200 profile (the
  simulator's driver model). It models GPU accesses only: CPU reads are not simulated.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch

from um_lab.errors import CudaUnavailableError, UmLabError
from um_lab.policy import Advice
from um_lab.sim.placement import BLOCK
from um_lab.sim.uvm import PAGE
from um_lab.teaching.basics_sim import (
    NO_ADVICE,
    ZERO_COPY,
    MiB,
    result_row,
    sim_page_faults,
    sim_preferred,
    sim_prefetch,
    sim_read_mostly,
    sim_zero_copy,
)

MAX_ARRAY_BYTES = 256 * MiB  #: largest managed buffer one experiment may ask for
MAX_LIVE_BYTES = 2 << 30  #: live managed bytes of all experiments together, at most
BACKENDS = ("auto", "cuda", "sim")


class BasicsSafetyError(UmLabError, ValueError):
    """A basics experiment asked for more managed memory than its safety limits allow (nothing allocated)."""


def pick_backend(backend: str = "auto") -> tuple[str, str]:
    """``("cuda" | "sim", why)``: ``auto`` takes the GPU when torch sees one and CuPy + cuda-bindings load."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "sim":
        return "sim", "the simulator (asked for), H200 profile"
    try:
        from um_lab.cuda import driver

        driver.require_cuda(cupy=True)
    except CudaUnavailableError as e:
        if backend == "cuda":
            raise
        return "sim", f"the simulator (H200 profile), because {str(e).split('. Use')[0]}"
    return "cuda", f"the GPU: {torch.cuda.get_device_name()}"


def check_size(size_mib: float) -> int:
    """Bytes of a ``size_mib`` buffer; refuses sizes outside 2 MiB .. 256 MiB."""
    if not isinstance(size_mib, int | float) or not math.isfinite(size_mib) or size_mib < 2:
        raise ValueError(f"size_mib must be a number >= 2, got {size_mib!r}")
    nbytes = int(size_mib * MiB) // BLOCK * BLOCK
    if nbytes > MAX_ARRAY_BYTES:
        raise BasicsSafetyError(f"size_mib={size_mib} is above the {MAX_ARRAY_BYTES // MiB} MiB limit per "
                                "buffer: these experiments stay tiny on purpose (a shared GPU must never be "
                                "oversubscribed); study large sizes in the simulator's training runs")
    return nbytes


class ManagedBudget:
    """The running count of live managed bytes of the GPU experiments; refuses far below the card."""

    def __init__(self, limit_bytes: int = MAX_LIVE_BYTES, free_bytes: int | None = None) -> None:
        """``free_bytes``: the GPU's free memory; the limit becomes at most an eighth of it."""
        self.limit = int(limit_bytes if free_bytes is None else min(limit_bytes, free_bytes // 8))
        self.live = 0

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` about to be allocated, or raise :class:`BasicsSafetyError` (nothing counted)."""
        if not 0 < nbytes <= MAX_ARRAY_BYTES:
            raise BasicsSafetyError(f"a managed buffer must hold 1 B .. {MAX_ARRAY_BYTES // MiB} MiB, "
                                    f"got {nbytes} B")
        if self.live + nbytes > self.limit:
            raise BasicsSafetyError(f"refused {nbytes / MiB:.0f} MiB of managed memory: {self.live / MiB:.0f} MiB "
                                    f"live, limit {self.limit / MiB:.0f} MiB")
        self.live += nbytes

    def give(self, nbytes: int) -> None:
        """Count ``nbytes`` as freed."""
        self.live -= nbytes


def _frame(rows: list[dict[str, Any]], backend: str, nbytes: int) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "gpu_memory" in df:
        df.insert(1, "gpu_memory", df.pop("gpu_memory"))
    df.attrs.update(backend=backend, size_mib=nbytes // MiB)
    return df


# ---- the GPU ----------------------------------------------------------------------------------------

_KERNELS = r"""
extern "C" __global__ void read_sum(const float* __restrict__ x, unsigned long long n, float* out) {
    float acc = 0.f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) acc += x[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    __shared__ float part[32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) atomicAdd(out, acc);
    }
}
extern "C" __global__ void fill(float* x, unsigned long long n, float v) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) x[i] = v;
}
"""


class GpuLab:
    """Managed buffers, two kernels and CUDA-event timers for the GPU experiments (close() frees all)."""

    def __init__(self, budget: ManagedBudget | None = None) -> None:
        import cupy

        from um_lab.cuda import driver

        driver.require_cuda(cupy=True)
        self.cp, self.drv = cupy, driver
        self.dev = cupy.cuda.Device().id
        info = driver.device_info(self.dev)
        driver.check_device(info)
        self.budget = budget if budget is not None else ManagedBudget(free_bytes=info.free_bytes)
        self.mem: dict[int, Any] = {}  #: ptr -> CuPy MemoryPointer (the only reference: freed when dropped)
        self.size: dict[int, int] = {}
        module = cupy.RawModule(code=_KERNELS)
        self.k_read, self.k_fill = module.get_function("read_sum"), module.get_function("fill")
        self.grid = cupy.cuda.Device().attributes["MultiProcessorCount"] * 8
        self.out = cupy.zeros(1, cupy.float32)
        warm = cupy.ones(1024, cupy.float32)  # compile and load the kernels outside any timing
        self._launch_read(warm, 1024)
        self._launch_fill(warm, 1024, 1.0)
        cupy.cuda.Device().synchronize()
        self.last_sum = float("nan")

    def _launch_read(self, arr: Any, n: int) -> None:
        self.k_read((self.grid,), (256,), (arr, np.uint64(n), self.out))

    def _launch_fill(self, arr: Any, n: int, value: float) -> None:
        self.k_fill((self.grid,), (256,), (arr, np.uint64(n), np.float32(value)))

    def new(self, nbytes: int, advice: Advice = NO_ADVICE, cpu_value: float | None = 1.0) -> int:
        """A managed buffer (counted first); the CPU fills it with ``cpu_value`` (None: untouched); advised."""
        self.budget.take(nbytes)
        try:
            mem = self.drv.malloc_managed(nbytes)
        except BaseException:
            self.budget.give(nbytes)
            raise
        ptr = int(mem.ptr)
        self.mem[ptr], self.size[ptr] = mem, nbytes
        if cpu_value is not None:
            self.host(ptr)[:] = cpu_value
        if advice.preferred_location != "none":
            self.drv.advise(ptr, nbytes, "SetPreferredLocation", advice.preferred_location, self.dev)
        for proc in sorted(advice.accessed_by):
            self.drv.advise(ptr, nbytes, "SetAccessedBy", proc, self.dev)
        if advice.read_mostly:
            self.drv.advise(ptr, nbytes, "SetReadMostly", "gpu", self.dev)
        self.cp.cuda.Device().synchronize()
        return ptr

    def free(self, ptr: int) -> None:
        """Free one buffer (after the GPU is idle) and uncount it."""
        self.cp.cuda.Device().synchronize()
        del self.mem[ptr]
        self.budget.give(self.size.pop(ptr))

    def close(self) -> None:
        """Free every buffer still alive."""
        with contextlib.suppress(Exception):
            self.cp.cuda.Device().synchronize()
        for ptr in list(self.mem):
            self.mem.pop(ptr)
            self.budget.give(self.size.pop(ptr))

    def host(self, ptr: int) -> np.ndarray:
        """A NumPy float32 view of the buffer (CPU accesses go through it)."""
        n = self.size[ptr] // 4
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n,))

    def _timed(self, launch: Callable[[], None]) -> float:
        stream = self.cp.cuda.get_current_stream()
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end))

    def read(self, ptr: int) -> float:
        """A GPU kernel sums the buffer; returns its ms (the sum is kept in ``last_sum``)."""
        n = self.size[ptr] // 4
        arr = self.drv.managed_array(ptr, self.size[ptr])
        self.out.fill(0)
        ms = self._timed(lambda: self._launch_read(arr, n))
        self.last_sum = float(self.out.get()[0])
        return ms

    def write(self, ptr: int, value: float = 2.0) -> float:
        """A GPU kernel overwrites the buffer with ``value``; returns its ms."""
        arr = self.drv.managed_array(ptr, self.size[ptr])
        return self._timed(lambda: self._launch_fill(arr, self.size[ptr] // 4, value))

    def prefetch(self, ptr: int, to: str = "gpu") -> float:
        """``cudaMemPrefetchAsync`` to ``"gpu"`` or ``"cpu"`` on the current stream; returns its ms."""
        stream = self.cp.cuda.get_current_stream()
        return self._timed(lambda: self.drv.prefetch(ptr, self.size[ptr], to, self.dev, stream.ptr))

    def cpu_touch(self, ptr: int) -> float:
        """The CPU reads one float of every 4 KiB page (GPU idle first); returns its ms."""
        self.cp.cuda.Device().synchronize()
        t = time.perf_counter()
        float(self.host(ptr)[:: PAGE // 4].sum())
        return (time.perf_counter() - t) * 1e3


@contextlib.contextmanager
def gpu_lab(budget: ManagedBudget | None = None) -> Iterator[GpuLab]:
    """A :class:`GpuLab` whose buffers are all freed on exit, errors included."""
    lab = GpuLab(budget)
    try:
        yield lab
    finally:
        lab.close()


def _gpu_page_faults(lab: GpuLab, nbytes: int) -> list[dict[str, Any]]:
    fresh = lab.new(nbytes, cpu_value=None)
    rows = [result_row("fresh memory", f"GPU write {i}", lab.write(fresh), nbytes) for i in (1, 2)]
    lab.free(fresh)
    host = lab.new(nbytes)
    rows += [result_row("CPU-written data", f"GPU read {i}", lab.read(host), nbytes) for i in (1, 2)]
    return rows


def _gpu_prefetch(lab: GpuLab, nbytes: int) -> list[dict[str, Any]]:
    demand = lab.new(nbytes)
    rows = [result_row("demand faults", "GPU read", lab.read(demand), nbytes)]
    lab.free(demand)
    pre = lab.new(nbytes)
    rows.append(result_row("prefetch first", "prefetch to GPU", lab.prefetch(pre), nbytes))
    return rows + [result_row("prefetch first", "GPU read", lab.read(pre), nbytes)]


def _gpu_read_mostly(lab: GpuLab, nbytes: int) -> list[dict[str, Any]]:
    rows = []
    for case, advice in (("no advice", NO_ADVICE), ("read_mostly", Advice(read_mostly=True))):
        b = lab.new(nbytes, advice)
        rows += [result_row(case, "GPU read 1", lab.read(b), nbytes),
                 result_row(case, "GPU read 2", lab.read(b), nbytes),
                 result_row(case, "CPU touch", lab.cpu_touch(b), None),
                 result_row(case, "GPU read 3", lab.read(b), nbytes),
                 result_row(case, "GPU write", lab.write(b), nbytes)]
        lab.free(b)
    return rows


def _gpu_zero_copy(lab: GpuLab, nbytes: int, passes: int) -> list[dict[str, Any]]:
    rows = []
    for case, advice in (("no advice", NO_ADVICE), ("preferred cpu + accessed_by gpu", ZERO_COPY)):
        b = lab.new(nbytes, advice)
        rows += [result_row(case, f"GPU read {i + 1}", lab.read(b), nbytes) for i in range(passes)]
        lab.free(b)
    return rows


def _gpu_preferred(lab: GpuLab, nbytes: int) -> list[dict[str, Any]]:
    rows = []
    for case, advice in (("no advice", NO_ADVICE), ("preferred gpu", Advice(preferred_location="gpu")),
                         ("preferred cpu", Advice(preferred_location="cpu"))):
        b = lab.new(nbytes, advice)
        steps = [("GPU read 1", lab.read, nbytes), ("GPU read 2", lab.read, nbytes),
                 ("CPU touch", lab.cpu_touch, None), ("GPU read 3", lab.read, nbytes)]
        rows += [result_row(case, s, fn(b), nb, gpu_memory="fits") for s, fn, nb in steps]
        lab.free(b)
    return rows


# ---- the experiments ----------------------------------------------------------------------------------


def _run(backend: str, size_mib: float, sim: Callable[[int], list], gpu: Callable[[GpuLab, int], list],
         budget: ManagedBudget | None) -> pd.DataFrame:
    nbytes = check_size(size_mib)
    used, _ = pick_backend(backend)
    if used == "sim":
        return _frame(sim(nbytes), "sim", nbytes)
    with gpu_lab(budget) as lab:
        return _frame(gpu(lab, nbytes), "cuda", nbytes)


def page_faults(size_mib: float = 64, backend: str = "auto", budget: ManagedBudget | None = None) -> pd.DataFrame:
    """First GPU touch of fresh memory (populate) and of CPU-written data (fault + migrate), then again."""
    return _run(backend, size_mib, sim_page_faults, _gpu_page_faults, budget)


def prefetch(size_mib: float = 64, backend: str = "auto", budget: ManagedBudget | None = None) -> pd.DataFrame:
    """GPU read of CPU-written data: on demand (faults) vs after ``cudaMemPrefetchAsync`` to the GPU."""
    return _run(backend, size_mib, sim_prefetch, _gpu_prefetch, budget)


def read_mostly(size_mib: float = 64, backend: str = "auto", budget: ManagedBudget | None = None) -> pd.DataFrame:
    """GPU reads then a GPU write, without advice and with ``read_mostly`` (copies kept, then collapsed)."""
    return _run(backend, size_mib, sim_read_mostly, _gpu_read_mostly, budget)


def zero_copy(size_mib: float = 64, passes: int = 3, backend: str = "auto",
              budget: ManagedBudget | None = None) -> pd.DataFrame:
    """``passes`` GPU reads, without advice and with preferred cpu + accessed_by gpu (remote, no migration)."""
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be an integer >= 1, got {passes!r}")
    return _run(backend, size_mib, lambda n: sim_zero_copy(n, passes),
                lambda lab, n: _gpu_zero_copy(lab, n, passes), budget)


def preferred_location(size_mib: float = 64, backend: str = "auto", ratio: float = 2.0,
                       budget: ManagedBudget | None = None) -> pd.DataFrame:
    """Preferred location none / gpu / cpu. The simulator also runs it on a GPU ``ratio`` times too small
    (a real GPU is never oversubscribed here)."""
    if not isinstance(ratio, int | float) or not ratio > 1:
        raise ValueError(f"ratio must be a number > 1, got {ratio!r}")
    return _run(backend, size_mib, lambda n: sim_preferred(n, ratio), _gpu_preferred, budget)
