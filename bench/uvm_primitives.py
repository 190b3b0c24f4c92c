"""Unified Memory primitives on the GPU: the numbers the simulator's remote-access and migration
models are fitted to. ``python bench/uvm_primitives.py [--quick] [--sections ...] [--out PATH]``

* remote: GPU kernels on a buffer at preferred=cpu + accessed_by=gpu (written by the CPU first) against
  the same kernel on a GPU-resident copy: streaming read / write, in-place axpy, strided reads, re-reads
  (does L2 help?), many small launches (a Python launch loop and a CUDA graph).
* kernel: fp32 GEMM, conv (forward, backward), norms, elementwise, softmax, max-pool with ONE operand
  remote (a torch view of a CuPy managed array), the rest GPU-resident. ``effective_link_passes`` =
  (remote_ms - resident_ms) * LINK_GBPS / 1e3 / operand bytes: how often the operand crossed the link.
* migration: prefetch GPU->host of fresh and re-used pages per cycle, host->GPU, fault-driven host->GPU,
  GPU first touch, both directions at once.
* gemm_tiles (only when named; ``--out bench/results/gemm_tiles.json``): a grid of GEMM shapes in the four
  layouts a weight is read in (x @ W^T and x @ W, with and without a bias), W remote: how the re-read count
  of a remote weight depends on the layout and the shape.
* call_size (only when named; ``--out bench/results/uvm_call_size.json``): one buffer prefetched GPU->host
  and back in calls of 2 MiB to the whole buffer, one stream, its pages written by a GPU kernel before each
  D2H or clean (prefetched in, not written): does the D2H rate depend on how the range is cut into calls?
  Then D2H on one stream and H2D on another at once (no overlap in the 4 GiB probe), in 32 MiB calls.

Medians of ``repeats`` CUDA-event timings after a warm-up. Every managed byte is counted by a ManagedBudget
(min(16 GiB, free/8)) before it is allocated and freed on gpu_lab's exit: nothing is oversubscribed. An
item that raises becomes an error row; a section past its time budget skips the rest.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import math
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from um_lab.teaching.basics import BasicsSafetyError, GpuLab, ManagedBudget, gpu_lab  # noqa: E402
from um_lab.teaching.basics_sim import NO_ADVICE, ZERO_COPY  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LINK_GBPS = 47.77  #: the h200 profile's remote read rate, the unit of effective_link_passes
SECTIONS = ("remote", "kernel", "migration", "gemm_tiles", "call_size")
#: What a plain run measures (the profile's inputs); ``--sections gemm_tiles`` writes its grid apart
#: (bench/results/gemm_tiles.json).
DEFAULT_SECTIONS = ("remote", "kernel", "migration")
DUPLEX_MODES = ("two streams, one thread", "two streams, two threads", "one stream")
Rows = list[dict[str, Any]]

KERNELS = r"""
#define EACH(i, n) for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
                        i < (n); i += (unsigned long long)gridDim.x * blockDim.x)
extern "C" __global__ void axpy(float* x, unsigned long long n, float a, float b) { EACH(i, n) x[i] = a * x[i] + b; }
extern "C" __global__ void strided_sum(const float* __restrict__ x, unsigned long long words,
                                       unsigned long long stride, float* out) {
    float acc = 0.f;
    EACH(i, words) acc += x[i * stride];
    if (acc == -1.f) *out = acc;  // keeps the loads
}
extern "C" __global__ void reread_sum(const float* __restrict__ x, unsigned long long n, int passes, float* out) {
    float acc = 0.f;
    for (int p = 0; p < passes; ++p) { EACH(i, n) acc += x[i]; }
    if (acc == -1.f) *out = acc;
}
"""

#: Sizes and shapes. conv: (N, C, H=W, K, R), stride 1, same padding; gemm: (M tokens, K, N).
FULL: dict[str, Any] = dict(
    repeats=5, budget_s={"remote": 60, "kernel": 150, "migration": 110, "gemm_tiles": 150, "call_size": 120},
    remote_sizes=(64 * MiB, 256 * MiB, GiB), reread_sizes=(16 * MiB, 64 * MiB), slice_buffer=64 * MiB,
    slice_sizes=(64 * KiB, MiB),
    gemm=((512, 1024, 1024), (512, 4096, 4096), (2048, 1024, 1024), (2048, 4096, 4096), (8192, 1024, 1024),
          (8192, 4096, 4096), (197 * 64, 768, 3072), (197 * 64, 3072, 768)),
    conv=((128, 64, 56, 64, 3), (128, 64, 56, 256, 1), (128, 128, 28, 128, 3), (128, 256, 14, 256, 3),
          (128, 1024, 14, 256, 1), (128, 512, 7, 512, 3), (64, 64, 56, 64, 3), (64, 256, 14, 256, 3)),
    act=(128, 64, 56, 56), norm=(16384, 1024), softmax=(32768, 1024), gelu=(8192, 4096), pool=(64, 64, 112, 112),
    migration_sizes=(256 * MiB, GiB, 4 * GiB), cpu_written_sizes=(256 * MiB, GiB), duplex_sizes=(GiB, 4 * GiB),
    call_size_buffer=2 * GiB, call_sizes=(2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB, 512 * MiB, 2 * GiB),
    gemm_tiles=tuple((m, k, n) for m in (512, 2048, 3152, 8192, 12608)
                     for k, n in ((768, 768), (768, 2304), (768, 3072), (3072, 768), (1024, 1024), (1024, 4096),
                                  (4096, 1024), (4096, 4096))))
QUICK: dict[str, Any] = FULL | dict(
    repeats=2, budget_s={"remote": 60, "kernel": 60, "migration": 60, "gemm_tiles": 60, "call_size": 60},
    remote_sizes=(4 * MiB,),
    reread_sizes=(4 * MiB,), slice_buffer=4 * MiB, gemm=((256, 256, 512),),
    conv=((4, 16, 14, 16, 3), (4, 32, 7, 16, 1)), act=(4, 16, 14, 14), norm=(256, 256), softmax=(256, 256),
    gelu=(256, 256), pool=(4, 16, 28, 28),
    migration_sizes=(8 * MiB,), cpu_written_sizes=(8 * MiB,), duplex_sizes=(8 * MiB,), gemm_tiles=((256, 256, 512),),
    call_size_buffer=16 * MiB, call_sizes=(2 * MiB, 16 * MiB))


class RunBudget(ManagedBudget):
    """A ManagedBudget whose single buffers may be as large as its limit (the basics cap one at 256 MiB)."""

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` about to be allocated, or raise BasicsSafetyError (nothing counted)."""
        if nbytes <= 0 or self.live + nbytes > self.limit:
            raise BasicsSafetyError(f"refused {nbytes / MiB:.0f} MiB of managed memory: {self.live / MiB:.0f} MiB "
                                    f"live, limit {self.limit / MiB:.0f} MiB")
        self.live += nbytes


def size_label(nbytes: int) -> str:
    """``"4 GiB"``, ``"64 MiB"``, ``"64 KiB"``."""
    unit, name = next((u, n) for u, n in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"), (1, "B")) if nbytes % u == 0)
    return f"{nbytes // unit} {name}"


def dims(shape: tuple[int, ...]) -> str:
    """``"128x64x56x56"``."""
    return "x".join(map(str, shape))


def event_ms(lab: GpuLab, launch: Callable[[], Any], repeats: int, stream: Any = None) -> float:
    """Median CUDA-event ms of ``launch`` over ``repeats`` runs after one warm-up run (on ``stream``)."""
    stream = stream if stream is not None else lab.cp.cuda.get_current_stream()
    launch()
    pairs = [(lab.cp.cuda.Event(), lab.cp.cuda.Event()) for _ in range(repeats)]
    for start, end in pairs:
        start.record(stream)
        launch()
        end.record(stream)
    pairs[-1][1].synchronize()
    return statistics.median(lab.cp.cuda.get_elapsed_time(s, e) for s, e in pairs)


def once(lab: GpuLab, launch: Callable[[], Any]) -> tuple[float, float]:
    """(CUDA-event ms, ms the host call itself took) of one ``launch`` on the current stream."""
    stream, (start, end) = lab.cp.cuda.get_current_stream(), (lab.cp.cuda.Event(), lab.cp.cuda.Event())
    start.record(stream)
    t = time.perf_counter()
    launch()
    issue_ms = (time.perf_counter() - t) * 1e3
    end.record(stream)
    end.synchronize()
    return lab.cp.cuda.get_elapsed_time(start, end), issue_ms


def compare_row(group: str, name: str, key: str, label: str, shape: str, nbytes: int, resident_ms: float,
                remote_ms: float, useful_bytes: int = 0, **extra: Any) -> dict[str, Any]:
    """A remote-vs-resident row; ``nbytes``: the remote operand, ``useful_bytes``: what the kernel moves."""
    useful = useful_bytes or nbytes
    return {"group": group, "name": name, key: label, "shape": shape, "bytes": nbytes, "useful_bytes": useful,
            "resident_ms": resident_ms, "remote_ms": remote_ms, "ratio": remote_ms / resident_ms,
            "GBps": useful / (remote_ms * 1e6), "resident_GBps": useful / (resident_ms * 1e6),
            "effective_link_passes": (remote_ms - resident_ms) * LINK_GBPS * 1e6 / nbytes, **extra}


def migration_row(name: str, pattern: str, nbytes: int, cycle: int | None, ms: list[float], **extra: Any) -> dict:
    """A migration row from per-repeat ms, the first being the warm-up: the median of the rest, and the first."""
    med = statistics.median(ms[1:])
    return {"group": "migration", "name": name, "pattern": pattern, "shape": size_label(nbytes), "bytes": nbytes,
            "cycle": cycle, "ms": med, "GBps": nbytes / (med * 1e6), "reps": len(ms) - 1, "warmup_ms": ms[0],
            "warmup_GBps": nbytes / (ms[0] * 1e6), **extra}


class Recorder:
    """The rows of one run: items run under their section's time budget; one that raises is an error row."""

    def __init__(self) -> None:
        self.rows: Rows = []
        self.seconds: dict[str, float] = {}
        self.group, self.budget_s, self.t0 = "", 0.0, time.perf_counter()

    @contextlib.contextmanager
    def section(self, group: str, budget_s: float) -> Iterator[None]:
        """A section: timed, printed, and an error row if it raises."""
        self.group, self.budget_s, self.t0 = group, budget_s, time.perf_counter()
        print(f"== {group} (time budget {budget_s:.0f} s)", flush=True)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
            self.error(f"section {group}", e)
        self.seconds[group] = round(time.perf_counter() - self.t0, 1)
        print(f"== {group} done in {self.seconds[group]:.1f} s", flush=True)

    def add(self, row: dict[str, Any]) -> None:
        """Keep a row and print it as a progress line."""
        self.rows.append(row)
        head = " | ".join(str(row[k]) for k in ("name", "pattern", "operand", "shape") if row.get(k) is not None)
        nums = ", ".join(f"{k} {row[k]:.4g}" for k in ("cycle", "resident_ms", "remote_ms", "ms", "GBps",
                                                       "effective_link_passes") if isinstance(row.get(k), int | float))
        tail = row.get("error") or row.get("skipped") or ""
        print(f"  [{time.perf_counter() - self.t0:6.1f} s] {head}: {nums}{tail}", flush=True)

    def error(self, name: str, exc: BaseException) -> None:
        """Record an error row for ``name`` (traceback printed)."""
        traceback.print_exception(exc)
        self.add({"group": self.group, "name": name, "error": f"{type(exc).__name__}: {exc}"})

    def attempt(self, name: str, measure: Callable[[], Rows]) -> None:
        """Run one item unless the section's time is spent: its rows, or an error or skip row."""
        if time.perf_counter() - self.t0 > self.budget_s:
            self.add({"group": self.group, "name": name, "skipped": f"section time budget {self.budget_s:.0f} s"})
            return
        try:
            rows = measure()
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            self.error(name, e)
            return
        for row in rows:
            self.add(row)


# ---- A. raw remote access ------------------------------------------------------------------------------------


def read(lab: GpuLab, arr: Any) -> None:
    """GpuLab's sum kernel over the whole of ``arr`` (a grid no larger than the data)."""
    lab.k_read((min(lab.grid, max(1, arr.size // 256)),), (256,), (arr, np.uint64(arr.size), lab.out))


@contextlib.contextmanager
def paired_buffers(lab: GpuLab, nbytes: int) -> Iterator[tuple[Any, Any]]:
    """(remote, resident) CuPy views: both written by the CPU first; one zero-copy, one prefetched to the GPU."""
    remote, resident = lab.new(nbytes, ZERO_COPY), lab.new(nbytes, NO_ADVICE)
    try:
        lab.prefetch(resident, "gpu")
        yield lab.drv.managed_array(remote, nbytes), lab.drv.managed_array(resident, nbytes)
    finally:
        lab.free(remote)
        lab.free(resident)


Pattern = tuple[str, int, Callable[[Any], Any], int]  #: label, bytes moved, launch(array), accesses (strided)


def compare_patterns(lab: GpuLab, name: str, nbytes: int, patterns: list[Pattern], repeats: int) -> Rows:
    """Each pattern on a resident and on a remote buffer of ``nbytes``."""
    rows = []
    with paired_buffers(lab, nbytes) as buffers:
        for label, useful, launch, accesses in patterns:
            remote_ms, resident_ms = (event_ms(lab, functools.partial(launch, a), repeats) for a in buffers)
            extra = {"accesses": accesses, "remote_ns_per_access": remote_ms * 1e6 / accesses} if accesses else {}
            rows.append(compare_row("remote", name, "pattern", label, size_label(nbytes), nbytes, resident_ms,
                                    remote_ms, useful, **extra))
    return rows


def raw_access(lab: GpuLab, fn: dict[str, Any], nbytes: int, repeats: int) -> Rows:
    """Streaming read / write, in-place axpy and strided reads of one buffer size."""
    n, grid = nbytes // 4, (lab.grid,)

    def strided(stride: int) -> Callable[[Any], Any]:
        return lambda a: fn["strided_sum"](grid, (256,), (a, np.uint64(n // stride), np.uint64(stride), lab.out))

    return compare_patterns(lab, "raw access", nbytes, [
        ("streaming read", nbytes, functools.partial(read, lab), 0),
        ("streaming write", nbytes, lambda a: lab.k_fill(grid, (256,), (a, np.uint64(n), np.float32(1))), 0),
        ("read+write (axpy in place)", 2 * nbytes,
         lambda a: fn["axpy"](grid, (256,), (a, np.uint64(n), np.float32(0.5), np.float32(0.5))), 0),
        ("strided read, 4 B per 128 B", 4 * (n // 32), strided(32), n // 32),
        ("strided read, 4 B per 4 KiB", 4 * (n // 1024), strided(1024), n // 1024)], repeats)


def reread(lab: GpuLab, fn: dict[str, Any], nbytes: int, repeats: int, passes: int = 8) -> Rows:
    """One buffer read ``passes`` times in one launch and in ``passes`` launches: does L2 keep remote data?"""
    n, grid = nbytes // 4, (lab.grid,)
    return compare_patterns(lab, "re-read", nbytes, [
        ("streaming read x1", nbytes, functools.partial(read, lab), 0),
        (f"re-read x{passes}, one launch", passes * nbytes,
         lambda a: fn["reread_sum"](grid, (256,), (a, np.uint64(n), np.int32(passes), lab.out)), 0),
        (f"re-read x{passes}, {passes} launches", passes * nbytes, lambda a: [read(lab, a) for _ in range(passes)],
         0)], repeats)


def small_transactions(lab: GpuLab, nbytes: int, slice_bytes: int, repeats: int) -> Rows:
    """Many launches, each reading one ``slice_bytes`` slice: a Python launch loop and a CUDA graph of them."""
    launches, m, stream, rows = nbytes // slice_bytes, slice_bytes // 4, lab.cp.cuda.Stream(non_blocking=True), []
    with paired_buffers(lab, nbytes) as buffers:
        views = [[a[i * m:(i + 1) * m] for i in range(launches)] for a in buffers]  # remote, resident
        graphs = []
        for slices in views:
            with stream:
                stream.begin_capture()
                try:
                    for v in slices:
                        read(lab, v)
                finally:
                    graphs.append(stream.end_capture())
        for how, launch, on in (("launch loop", lambda i: [read(lab, v) for v in views[i]], None),
                                ("CUDA graph", lambda i: graphs[i].launch(stream), stream)):
            remote_ms, resident_ms = (event_ms(lab, functools.partial(launch, i), repeats, on) for i in (0, 1))
            rows.append(compare_row("remote", "small transactions", "pattern",
                                    f"{launches} x {size_label(slice_bytes)} slices, {how}", size_label(nbytes),
                                    nbytes, resident_ms, remote_ms, launches=launches,
                                    remote_us_per_launch=remote_ms * 1e3 / launches,
                                    resident_us_per_launch=resident_ms * 1e3 / launches))
    return rows


def remote_section(rec: Recorder, lab: GpuLab, plan: dict[str, Any]) -> None:
    """A. raw remote access."""
    module = lab.cp.RawModule(code=KERNELS)
    fn, repeats = {name: module.get_function(name) for name in ("axpy", "strided_sum", "reread_sum")}, plan["repeats"]
    for nbytes in plan["remote_sizes"]:
        rec.attempt(f"raw access {size_label(nbytes)}", functools.partial(raw_access, lab, fn, nbytes, repeats))
    for nbytes in plan["reread_sizes"]:
        rec.attempt(f"re-read {size_label(nbytes)}", functools.partial(reread, lab, fn, nbytes, repeats))
    for slice_bytes in plan["slice_sizes"]:
        rec.attempt(f"small transactions {size_label(slice_bytes)}", functools.partial(
            small_transactions, lab, plan["slice_buffer"], slice_bytes, repeats))


# ---- B. real kernels with one operand remote ---------------------------------------------------------------


class KernelCase(NamedTuple):
    """One op: its tensors' shapes by name, the names put remote in turn, and ``run(tensors)``."""

    name: str
    shape: str
    specs: dict[str, tuple[int, ...]]
    roles: tuple[str, ...]
    run: Callable[[dict[str, torch.Tensor]], Any]
    note: str = ""


def conv_forward(pad: int, t: dict[str, torch.Tensor]) -> None:
    """cuDNN convolution (stride 1) writing straight into ``t["y"]``."""
    torch.ops.aten.cudnn_convolution.out(t["x"], t["w"], [pad, pad], [1, 1], [1, 1], 1, False, False,
                                         bool(torch.backends.cudnn.allow_tf32), out=t["y"])


def conv_backward(pad: int, mask: list[bool], t: dict[str, torch.Tensor]) -> None:
    """Convolution backward: the input grad (mask [T, F, F]) or the weight grad (mask [F, T, F])."""
    torch.ops.aten.convolution_backward(t["gy"], t["x"], t["w"], None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1,
                                        mask)


def kernel_cases(plan: dict[str, Any]) -> list[KernelCase]:
    """Every op of section B at the plan's shapes."""
    cases = []
    for m, k, n in plan["gemm"]:
        shape = f"M={m} K={k} N={n}"
        cases += [KernelCase("linear fwd y=x@W^T", shape, {"x": (m, k), "W": (n, k), "y": (m, n)}, ("W", "x", "y"),
                             lambda t: torch.mm(t["x"], t["W"].t(), out=t["y"])),
                  KernelCase("linear grad_W=gy^T@x", shape, {"gy": (m, n), "x": (m, k), "gW": (n, k)}, ("x", "gy"),
                             lambda t: torch.mm(t["gy"].t(), t["x"], out=t["gW"])),
                  KernelCase("linear grad_x=gy@W", shape, {"gy": (m, n), "W": (n, k), "gx": (m, k)}, ("W",),
                             lambda t: torch.mm(t["gy"], t["W"], out=t["gx"]))]
    for n, c, h, k, r in plan["conv"]:
        shape, specs = f"N={n} {c}->{k} {h}x{h} {r}x{r}", {"x": (n, c, h, h), "w": (k, c, r, r), "gy": (n, k, h, h)}
        cases += [KernelCase("conv fwd", shape, {**specs, "y": (n, k, h, h)}, ("x", "w", "y"),
                             functools.partial(conv_forward, r // 2)),
                  KernelCase("conv bwd input grad", shape, specs, ("w", "gy"),
                             functools.partial(conv_backward, r // 2, [True, False, False])),
                  KernelCase("conv bwd weight grad", shape, specs, ("x", "gy"),
                             functools.partial(conv_backward, r // 2, [False, True, False]), "x: the saved input")]
    act, ch, (rows, dim), pool = plan["act"], plan["act"][1], plan["norm"], plan["pool"]
    pooled = (*pool[:2], (pool[2] + 1) // 2, (pool[3] + 1) // 2)
    stats = {name: (ch,) for name in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd")}
    return cases + [
        KernelCase("batch_norm train", dims(act), {"x": act, "y": act, **stats}, ("x", "y"),
                   lambda t: torch.ops.aten.native_batch_norm.out(
                       t["x"], t["weight"], t["bias"], t["running_mean"], t["running_var"], True, 0.1, 1e-5,
                       out=t["y"], save_mean=t["save_mean"], save_invstd=t["save_invstd"])),
        KernelCase("layer_norm", dims(plan["norm"]), {"x": (rows, dim), "y": (rows, dim), "weight": (dim,),
                                                  "bias": (dim,), "mean": (rows, 1), "rstd": (rows, 1)}, ("x", "y"),
                   lambda t: torch.ops.aten.native_layer_norm.out(t["x"], [t["x"].shape[-1]], t["weight"], t["bias"],
                                                                  1e-5, out0=t["y"], out1=t["mean"], out2=t["rstd"]),
                   "out= is generated: computed into a temporary, then copied into y"),
        KernelCase("relu", dims(act), {"x": act, "y": act}, ("x", "y"),
                   lambda t: torch.clamp_min(t["x"], 0.0, out=t["y"])),
        KernelCase("add", dims(act), {"a": act, "b": act, "y": act}, ("a", "y"),
                   lambda t: torch.add(t["a"], t["b"], out=t["y"])),
        KernelCase("gelu", dims(plan["gelu"]), {"x": plan["gelu"], "y": plan["gelu"]}, ("x", "y"),
                   lambda t: torch.ops.aten.gelu.out(t["x"], approximate="none", out=t["y"])),
        KernelCase("softmax", dims(plan["softmax"]), {"x": plan["softmax"], "y": plan["softmax"]},
                   ("x", "y"), lambda t: torch.ops.aten._softmax.out(t["x"], -1, False, out=t["y"])),
        KernelCase("max_pool2d 3x3/2", dims(pool), {"x": pool, "y": pooled, "idx": pooled}, ("x", "y"),
                   lambda t: torch.ops.aten.max_pool2d_with_indices.out(
                       t["x"], [3, 3], [2, 2], [1, 1], [1, 1], False, out=t["y"], indices=t["idx"]))]


@contextlib.contextmanager
def remote_copy(lab: GpuLab, source: torch.Tensor) -> Iterator[torch.Tensor]:
    """A float32 copy of ``source`` in managed memory at preferred=cpu + accessed_by=gpu, host-populated first."""
    nbytes = source.numel() * 4
    ptr = lab.new(nbytes, ZERO_COPY, cpu_value=0.0)
    held = []
    try:
        held.append(torch.as_tensor(lab.drv.managed_array(ptr, nbytes, "float32", owner=lab.mem[ptr]),
                                    device="cuda").view(source.shape))
        if held[0].data_ptr() != ptr:
            raise RuntimeError("torch.as_tensor copied the managed array instead of viewing it")
        held[0].copy_(source)
        torch.cuda.synchronize()
        yield held[0]
    finally:
        held.clear()
        lab.free(ptr)


def remote_operand_row(lab: GpuLab, case: KernelCase, tensors: dict[str, torch.Tensor], role: str,
                       baseline: list[float], repeats: int) -> Rows:
    """``case`` with ``role`` remote against the all-resident run (measured once per case, kept in baseline)."""
    if not baseline:
        baseline.append(event_ms(lab, functools.partial(case.run, tensors), repeats))
    with remote_copy(lab, tensors[role]) as far:
        operands = {**tensors, role: far}
        del far
        remote_ms = event_ms(lab, functools.partial(case.run, operands), repeats)
        del operands
    return [compare_row("kernel", case.name, "operand", role, case.shape, tensors[role].numel() * 4, baseline[0],
                        remote_ms, **({"note": case.note} if case.note else {}))]


def kernel_section(rec: Recorder, lab: GpuLab, plan: dict[str, Any]) -> None:
    """B. real kernels, fp32, one operand remote at a time (the max-pool indices stay resident)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    assert torch.cuda.current_stream().cuda_stream == lab.cp.cuda.get_current_stream().ptr == 0
    for case in kernel_cases(plan):
        try:
            tensors = {name: (torch.zeros(shape, dtype=torch.int64, device="cuda") if name == "idx" else
                              torch.empty(shape, device="cuda").uniform_(-1, 1)) for name, shape in case.specs.items()}
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            rec.error(f"{case.name} {case.shape}", e)
            continue
        baseline: list[float] = []
        for role in case.roles:
            rec.attempt(f"{case.name} {case.shape} [{role} remote]",
                        functools.partial(remote_operand_row, lab, case, tensors, role, baseline, plan["repeats"]))
        del tensors
    torch.cuda.empty_cache()


def gemm_tile_cases(plan: dict[str, Any]) -> list[KernelCase]:
    """A weight W read by the GEMM layouts of a training step, with and without a bias (cuBLASLt's epilogue
    kernels for ``addmm``): how often each re-reads W when W is remote (zero-copy parameters)."""
    cases = []
    for m, k, n in plan["gemm_tiles"]:
        shape = f"M={m} K={k} N={n}"
        nt = {"x": (m, k), "W": (n, k), "b": (n,)}
        nn = {"x": (m, k), "W": (k, n), "b": (n,)}
        cases += [KernelCase("nt x@W^T", shape, nt, ("W",), lambda t: torch.mm(t["x"], t["W"].t())),
                  KernelCase("nt x@W^T+b", shape, nt, ("W",), lambda t: torch.addmm(t["b"], t["x"], t["W"].t())),
                  KernelCase("nn x@W", shape, nn, ("W",), lambda t: torch.mm(t["x"], t["W"])),
                  KernelCase("nn x@W+b", shape, nn, ("W",), lambda t: torch.addmm(t["b"], t["x"], t["W"]))]
    return cases


def gemm_tile_rows(lab: GpuLab, case: KernelCase, tensors: dict[str, torch.Tensor], repeats: int) -> Rows:
    """:func:`remote_operand_row` for W, filed under the ``gemm_tile`` group."""
    return [{**row, "group": "gemm_tile"} for row in remote_operand_row(lab, case, tensors, "W", [], repeats)]


def gemm_tile_section(rec: Recorder, lab: GpuLab, plan: dict[str, Any]) -> None:
    """D. GEMM layouts with the weight remote, over a grid of shapes (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for case in gemm_tile_cases(plan):
        tensors = {name: torch.empty(shape, device="cuda").uniform_(-1, 1) for name, shape in case.specs.items()}
        rec.attempt(f"{case.name} {case.shape} [W remote]",
                    functools.partial(gemm_tile_rows, lab, case, tensors, plan["repeats"]))
        del tensors
    torch.cuda.empty_cache()


# ---- C. migration primitives --------------------------------------------------------------------------------


def migration_cycles(lab: GpuLab, nbytes: int, repeats: int) -> Rows:
    """Fresh buffers: GPU first touch, prefetch D2H / H2D cycles 1..4, then D2H (5..7) + fault-driven H2D (1..3)."""
    samples: dict[tuple[str, str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    stream = lab.cp.cuda.get_current_stream()
    for _ in range(repeats + 1):  # the first is the warm-up
        ptr = lab.new(nbytes, NO_ADVICE, cpu_value=None)
        try:
            arr = lab.drv.managed_array(ptr, nbytes)
            to_host, to_gpu = (functools.partial(lab.drv.prefetch, ptr, nbytes, to, lab.dev, stream.ptr)
                               for to in ("cpu", "gpu"))
            fill = functools.partial(lab.k_fill, (lab.grid,), (256,), (arr, np.uint64(nbytes // 4), np.float32(1)))
            fault_back = functools.partial(read, lab, arr)  # a GPU read faults the pages back
            steps = [(("GPU first touch (populate)", "GPU", 1), once(lab, fill))]
            for cycle in range(1, 8):
                pages = "fresh" if cycle == 1 else "reused" if cycle <= 4 else "reused (after fault H2D)"
                steps.append(((f"prefetch D2H {pages}", "D2H", cycle), once(lab, to_host)))
                if cycle <= 4:
                    steps.append((("prefetch H2D", "H2D", cycle), once(lab, to_gpu)))
                else:
                    steps.append((("fault H2D after prefetch D2H", "H2D", cycle - 4), once(lab, fault_back)))
        finally:
            lab.free(ptr)
        for key, sample in steps:
            samples[key].append(sample)
    return [migration_row(name, pattern, nbytes, cycle, [s[0] for s in got],
                          issue_ms=statistics.median(s[1] for s in got[1:]))
            for (name, pattern, cycle), got in samples.items()]


def cpu_written_faults(lab: GpuLab, nbytes: int, repeats: int) -> Rows:
    """Fault-driven H2D of data the CPU wrote (its first GPU use), each repeat in a fresh buffer."""
    ms = []
    for _ in range(repeats + 1):
        ptr = lab.new(nbytes, NO_ADVICE, cpu_value=1.0)
        try:
            ms.append(once(lab, functools.partial(read, lab, lab.drv.managed_array(ptr, nbytes)))[0])
        finally:
            lab.free(ptr)
    return [migration_row("fault H2D of CPU-written data", "H2D", nbytes, 1, ms)]


def duplex_once(lab: GpuLab, src: int, dst: int, nbytes: int, mode: str, streams: tuple[Any, Any]) -> list[float]:
    """Prefetch ``src`` to the host and ``dst`` to the GPU at once: [total, d2h, h2d, wall] ms."""
    cuda = lab.cp.cuda
    s_d2h, s_h2d = (streams[0], streams[0]) if mode == "one stream" else streams
    start, ends, errors = cuda.Event(), (cuda.Event(), cuda.Event()), []
    cuda.Device().synchronize()
    start.record(s_d2h)
    s_h2d.wait_event(start)

    def issue(ptr: int, to: str, stream: Any, end: Any) -> None:
        try:
            lab.drv.prefetch(ptr, nbytes, to, lab.dev, stream.ptr)
            end.record(stream)
        except Exception as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    jobs = [(src, "cpu", s_d2h, ends[0]), (dst, "gpu", s_h2d, ends[1])]
    t = time.perf_counter()
    threads = [threading.Thread(target=issue, args=job) for job in jobs] if "threads" in mode else []
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for job in jobs if not threads else ():
        issue(*job)
    if errors:
        raise errors[0]
    for end in ends:
        end.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    d2h, h2d = (cuda.get_elapsed_time(start, end) for end in ends)
    return [max(d2h, h2d), d2h, h2d, wall]


@contextlib.contextmanager
def duplex_buffers(lab: GpuLab, nbytes: int) -> Iterator[tuple[int, int]]:
    """Two buffers, the first GPU-resident and the second on the host, each backed on both sides before
    (freed on exit)."""
    a, b = lab.new(nbytes, NO_ADVICE, cpu_value=None), lab.new(nbytes, NO_ADVICE, cpu_value=1.0)
    try:
        lab.write(a)
        for ptr, path in ((a, ("cpu", "gpu")), (b, ("gpu", "cpu"))):
            for to in path:
                lab.prefetch(ptr, to)
        yield a, b
    finally:
        lab.free(a)
        lab.free(b)


def both_directions(lab: GpuLab, nbytes: int, repeats: int) -> Rows:
    """D2H of one buffer and H2D of another at once (pages host- and GPU-backed before); roles swap each repeat."""
    with duplex_buffers(lab, nbytes) as (a, b):
        streams = (lab.cp.cuda.Stream(non_blocking=True), lab.cp.cuda.Stream(non_blocking=True))
        on_gpu, on_host, rows = a, b, []
        for mode in DUPLEX_MODES:
            got = []
            for _ in range(repeats + 1):
                got.append(duplex_once(lab, on_gpu, on_host, nbytes, mode, streams))
                on_gpu, on_host = on_host, on_gpu
            d2h, h2d, wall = (statistics.median(s[i] for s in got[1:]) for i in (1, 2, 3))
            rows.append(migration_row("both directions (D2H + H2D)", mode, 2 * nbytes, None, [s[0] for s in got],
                                      shape=f"{size_label(nbytes)} each way", d2h_ms=d2h, h2d_ms=h2d, wall_ms=wall,
                                      d2h_GBps=nbytes / (d2h * 1e6), h2d_GBps=nbytes / (h2d * 1e6)))
        return rows


def migration_section(rec: Recorder, lab: GpuLab, plan: dict[str, Any]) -> None:
    """C. migration primitives."""
    for sizes, name, measure in (("migration_sizes", "prefetch and fault cycles", migration_cycles),
                                 ("cpu_written_sizes", "fault H2D of CPU-written data", cpu_written_faults),
                                 ("duplex_sizes", "both directions", both_directions)):
        for nbytes in plan[sizes]:
            rec.attempt(f"{name} {size_label(nbytes)}", functools.partial(measure, lab, nbytes, plan["repeats"]))


# ---- D. prefetch rate by call size (the budget scheduler's evictions ran at 11 GB/s) ---------------------------


def chunked_prefetch(lab: GpuLab, ptr: int, nbytes: int, chunk: int, to: str, stream: Any) -> None:
    """Prefetch ``[ptr, ptr + nbytes)`` to ``to`` in calls of ``chunk`` bytes on ``stream``."""
    for offset in range(0, nbytes, chunk):
        lab.drv.prefetch(ptr + offset, min(chunk, nbytes - offset), to, lab.dev, stream.ptr)


def call_size_rows(lab: GpuLab, nbytes: int, chunk: int, repeats: int) -> Rows:
    """D2H (pages GPU-written, then clean) and H2D of one buffer in calls of ``chunk`` bytes, one stream."""
    stream = lab.cp.cuda.get_current_stream()
    ptr = lab.new(nbytes, NO_ADVICE, cpu_value=None)
    try:
        arr = lab.drv.managed_array(ptr, nbytes)
        fill = functools.partial(lab.k_fill, (lab.grid,), (256,), (arr, np.uint64(nbytes // 4), np.float32(1)))
        moves = {to: functools.partial(chunked_prefetch, lab, ptr, nbytes, chunk, to, stream) for to in ("cpu", "gpu")}
        got: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        once(lab, fill)
        for _ in range(repeats + 1):  # the first is the warm-up
            once(lab, fill)  # written on the GPU: what the scheduler evicts after a layer wrote it
            got["D2H written"].append(once(lab, moves["cpu"]))
            got["H2D"].append(once(lab, moves["gpu"]))
            got["D2H clean"].append(once(lab, moves["cpu"]))  # prefetched in, never written
            once(lab, moves["gpu"])
    finally:
        lab.free(ptr)
    calls = -(-nbytes // chunk)
    return [migration_row(f"prefetch {name} by call size", name.split()[0], nbytes, None, [s[0] for s in samples],
                          group="call_size", call_bytes=chunk, call_MiB=chunk / MiB, calls=calls,
                          issue_ms=statistics.median(s[1] for s in samples[1:]))
            for name, samples in got.items()]


def duplex_chunked(lab: GpuLab, nbytes: int, chunk: int, repeats: int) -> Rows:
    """D2H of one buffer on one stream and H2D of another on a second stream, in ``chunk`` calls interleaved
    from one thread (as the scheduler's mover issues them): [total, d2h, h2d] ms per repeat."""
    cuda = lab.cp.cuda
    with duplex_buffers(lab, nbytes) as (a, b):
        s_d2h, s_h2d = cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True)
        on_gpu, on_host, got = a, b, []
        for _ in range(repeats + 1):
            start, ends = cuda.Event(), (cuda.Event(), cuda.Event())
            cuda.Device().synchronize()
            start.record(s_d2h)
            s_h2d.wait_event(start)
            for offset in range(0, nbytes, chunk):
                size = min(chunk, nbytes - offset)
                lab.drv.prefetch(on_gpu + offset, size, "cpu", lab.dev, s_d2h.ptr)
                lab.drv.prefetch(on_host + offset, size, "gpu", lab.dev, s_h2d.ptr)
            ends[0].record(s_d2h)
            ends[1].record(s_h2d)
            for end in ends:
                end.synchronize()
            d2h, h2d = (cuda.get_elapsed_time(start, end) for end in ends)
            got.append((max(d2h, h2d), d2h, h2d))
            on_gpu, on_host = on_host, on_gpu
        d2h, h2d = (statistics.median(s[i] for s in got[1:]) for i in (1, 2))
        return [migration_row("both directions, two streams, chunked", "D2H+H2D", 2 * nbytes, None,
                              [s[0] for s in got], group="call_size", call_bytes=chunk, call_MiB=chunk / MiB,
                              calls=2 * -(-nbytes // chunk), d2h_ms=d2h, h2d_ms=h2d, d2h_GBps=nbytes / (d2h * 1e6),
                              h2d_GBps=nbytes / (h2d * 1e6))]


def call_size_section(rec: Recorder, lab: GpuLab, plan: dict[str, Any]) -> None:
    """D. prefetch rate by call size, then both directions on two streams in mid-sized calls."""
    nbytes = plan["call_size_buffer"]
    for chunk in plan["call_sizes"]:
        rec.attempt(f"call size {size_label(chunk)}",
                    functools.partial(call_size_rows, lab, nbytes, chunk, plan["repeats"]))
    chunk = plan["call_sizes"][min(2, len(plan["call_sizes"]) - 1)]
    rec.attempt(f"both directions in {size_label(chunk)} calls",
                functools.partial(duplex_chunked, lab, nbytes, chunk, plan["repeats"]))


# ---- the run -------------------------------------------------------------------------------------------------

COLUMNS = {"remote": ["name", "pattern", "shape", "resident_ms", "remote_ms", "ratio", "GBps", "effective_link_passes",
                      "remote_ns_per_access", "remote_us_per_launch"],
           "kernel": ["name", "operand", "shape", "bytes", "resident_ms", "remote_ms", "ratio", "GBps",
                      "effective_link_passes"],
           "migration": ["name", "pattern", "shape", "cycle", "ms", "issue_ms", "GBps", "warmup_GBps", "d2h_GBps",
                         "h2d_GBps"],
           "gemm_tile": ["name", "shape", "bytes", "resident_ms", "remote_ms", "effective_link_passes"],
           "call_size": ["name", "pattern", "shape", "call_MiB", "calls", "ms", "issue_ms", "GBps", "d2h_GBps",
                         "h2d_GBps"]}


def print_table(rows: Rows) -> None:
    """The rows as one pandas table per group, then the errors and skips."""
    df = pd.DataFrame(rows)
    bad = df.reindex(columns=["error", "skipped"]).notna().any(axis=1)
    with pd.option_context("display.width", 250, "display.max_rows", 1000, "display.float_format", "{:.4g}".format):
        for group, cols in COLUMNS.items():
            part = df[~bad & (df["group"] == group)]
            if len(part):
                print(f"\n{group}\n{part.reindex(columns=cols).dropna(axis=1, how='all').to_string(index=False)}")
        if bad.any():
            print(f"\nerrors and skips\n{df[bad].reindex(columns=['group', 'name', 'error', 'skipped']).to_string()}")


def host_mem_total() -> int | None:
    """MemTotal of this machine (grows while a VM's memory is first used), or None where unreadable."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * KiB
    return None


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (< 30 s)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "uvm_primitives.json")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    from um_lab.cuda import driver

    driver.require_cuda(cupy=True)
    free, total = driver.mem_get_info(torch.cuda.current_device())
    budget = RunBudget(16 * GiB, free_bytes=free)
    print(f"{torch.cuda.get_device_name()}: {free / GiB:.1f} of {total / GiB:.1f} GiB free; managed memory limit "
          f"{budget.limit / GiB:.2f} GiB; {'quick' if args.quick else 'full'} run", flush=True)
    rec, t0, mem_total = Recorder(), time.perf_counter(), host_mem_total()
    sections = {"remote": remote_section, "kernel": kernel_section, "migration": migration_section,
                "gemm_tiles": gemm_tile_section, "call_size": call_size_section}
    with gpu_lab(budget) as lab:
        for group in args.sections:
            with rec.section(group, plan["budget_s"][group]):
                sections[group](rec, lab, plan)
        versions = {"cupy": lab.cp.__version__, "cuda_driver": lab.cp.cuda.runtime.driverGetVersion()}
    print_table(rec.rows)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, **versions, "quick": args.quick,
              "repeats": plan["repeats"], "link_GBps": LINK_GBPS, "managed_limit_bytes": budget.limit,
              "managed_live_after": budget.live, "free_bytes_at_start": free,
              "host_mem_total_bytes": [mem_total, host_mem_total()], "section_s": rec.seconds,
              "total_s": round(time.perf_counter() - t0, 1),
              "rows": [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
                       for row in rec.rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    errors = sum(bool(r.get("error")) for r in rec.rows)
    print(f"\n{len(rec.rows)} rows ({errors} errors) in {result['total_s']} s -> {args.out}; "
          f"managed bytes live after: {budget.live}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
