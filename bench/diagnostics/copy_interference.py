"""Probe (issue 13, session 16's lead): do copies between managed memory and pinned host memory slow the
kernels running beside them?

Under staging, GPT-2-large's forward GEMMs ran 2.1x and its forward attention 4x their unstaged times while
the copy engine read their pool (managed memory) out to the host; backward kernels, beside copies into that
pool, did not slow (docs/benchmarks.md, session 16). This times a loop of fp32 GEMMs whose operands lie in
managed memory (GPU-resident) or ordinary device memory, alone and with a side stream copying a buffer to
pinned host memory (or back) the whole time, the buffer itself managed or device memory. Each configuration's
GEMM time is a median over ``--repeats``, interleaved; ``slowdown`` is its ratio to the same operands alone.

Usage (GPU machine): ``python bench/diagnostics/copy_interference.py --out $OUT/copy_interference.json``
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "diagnostics"))
sys.path.insert(0, str(ROOT))

from discard_probe import GiB, Managed, probe_arguments  # noqa: E402

GEMM_N = 8192  #: square fp32 GEMMs: 256 MiB per operand
GEMMS = 20  #: GEMMs timed per measurement (~0.35 s of fp32 CUDA-core work on an H200)
COPIES = 24  #: copies of the buffer queued on the side stream per measurement: ~0.5 s at 52 GB/s for 1 GiB
COPY_MODES = ("none", "device->host", "managed->host", "host->device", "host->managed")


def slowdowns(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median ms per ``operands|copy`` key and its ratio to ``operands|none`` (the same operands, no copy)."""
    out: dict[str, dict[str, float]] = {}
    for key, values in times.items():
        operands, _ = key.split("|")
        median = statistics.median(values)
        alone = statistics.median(times[f"{operands}|none"])
        out[key] = {"ms": round(median, 3), "slowdown": round(median / alone, 3), "n": len(values)}
    return out


def main() -> None:
    args = probe_arguments(__doc__)
    import torch

    from um_lab.cuda import driver

    torch.cuda.init()
    torch.backends.cuda.matmul.allow_tf32 = False  # as the budget runs measured (CUDA-core fp32 GEMMs)
    rt = driver.runtime_library()
    n = int(args.gib * GiB)
    gemm_bytes = GEMM_N * GEMM_N * 4
    free0 = torch.cuda.mem_get_info()[0]
    if 2 * n + 6 * gemm_bytes > free0 // 4:
        raise SystemExit(f"buffers too large for {free0} free bytes")
    mem = Managed(rt)  # this script's own counter of live managed bytes (refuses past discard_probe.LIMIT)

    def managed_tensor(nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _wrap(mem.alloc(nbytes), nbytes, dtype).view(shape)

    operands: dict[str, list[torch.Tensor]] = {}
    managed_ops: list[torch.Tensor] = []
    buffers: dict[str, torch.Tensor] = {}
    try:
        operands["device"] = [torch.randn(GEMM_N, GEMM_N, device="cuda") for _ in range(3)]
        managed_ops += [managed_tensor(gemm_bytes, (GEMM_N, GEMM_N), torch.float32) for _ in range(3)]
        for m, d in zip(managed_ops, operands["device"], strict=True):
            m.copy_(d)  # first touch on the GPU: resident there (no advice)
        operands["managed"] = managed_ops
        buffers.update(device=torch.empty(n, dtype=torch.uint8, device="cuda"),
                       managed=managed_tensor(n, (n,), torch.uint8))
        for b in buffers.values():
            b.fill_(1)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        side = torch.cuda.Stream()
        times: dict[str, list[float]] = {}

        def measure(ops: list[torch.Tensor], copy: str) -> float:
            a, b, c = ops
            torch.cuda.synchronize()
            if copy != "none":
                src_dst = copy.split("->")
                buf = buffers["device" if "device" in src_dst else "managed"]
                dst, src = (pinned, buf) if src_dst[1] == "host" else (buf, pinned)
                with torch.cuda.stream(side):
                    for _ in range(COPIES):
                        dst.copy_(src, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(GEMMS):
                torch.mm(a, b, out=c)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        for ops in operands.values():
            measure(ops, "none")  # warm-up: cuBLAS handles, clocks
        for _ in range(args.repeats):
            for name, ops in operands.items():
                for copy in COPY_MODES:
                    times.setdefault(f"{name}|{copy}", []).append(measure(ops, copy))
        result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gemm_n": GEMM_N,
                                  "gemms": GEMMS, "copy_bytes": n, "times_ms": times, "summary": slowdowns(times)}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        for key, row in result["summary"].items():
            print(f"{key:28s} {row['ms']:9.2f} ms  x{row['slowdown']:.3f}")
    finally:
        torch.cuda.synchronize()
        operands.clear()  # no tensor over the managed ranges outlives them
        managed_ops.clear()
        buffers.clear()
        mem.free_all()


def _wrap(ptr: int, nbytes: int, dtype: Any) -> Any:
    """A 1-D CUDA tensor of ``dtype`` over ``[ptr, ptr + nbytes)`` that does not own the memory (the CUDA array
    interface, read by ``torch.as_tensor`` without a copy)."""
    import types

    import torch

    itemsize = torch.tensor([], dtype=dtype).element_size()
    typestr = {torch.float32: "<f4", torch.uint8: "|u1"}[dtype]
    array = types.SimpleNamespace(__cuda_array_interface__={
        "shape": (nbytes // itemsize,), "typestr": typestr, "data": (ptr, False), "version": 3, "strides": None})
    return torch.as_tensor(array, device="cuda")


if __name__ == "__main__":
    main()
