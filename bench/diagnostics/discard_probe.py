"""Probe: what ``cudaMemDiscardBatchAsync`` (CUDA 13) buys a GPU-budget scheduler (issue 13).

Data whose contents are dead (gradients about to be zeroed, freed activation blocks) need not be written
back to the host when the scheduler makes room: discarding it drops the GPU pages with no transfer. This
probe times, on one managed buffer (default 1 GiB, far below the card), each primitive the scheduler would
use: prefetch GPU->host of dirty pages, prefetch host->GPU, discard, prefetch to host after a discard, GPU
writes (memset) to discarded / host-resident / GPU-resident pages, and discard-and-prefetch to the GPU.
Free GPU memory (``cudaMemGetInfo``) is read after each step as a residency hint.

Usage (GPU machine): ``python bench/diagnostics/discard_probe.py --out $OUT/discard_probe.json``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
LIMIT = 8 * GiB  # this script's own cap on live managed bytes (far below the card's free memory)


class Managed:
    """Live managed bytes allocated by this script; refuses anything past LIMIT."""

    def __init__(self, rt: ctypes.CDLL) -> None:
        self.rt, self.live = rt, 0
        self.ptrs: list[tuple[int, int]] = []

    def alloc(self, nbytes: int) -> int:
        if self.live + nbytes > LIMIT:
            raise SystemExit(f"refusing {nbytes} managed bytes: {self.live} live, limit {LIMIT}")
        p = ctypes.c_void_p()
        check(self.rt.cudaMallocManaged(ctypes.byref(p), ctypes.c_size_t(nbytes), 1), "cudaMallocManaged")
        self.live += nbytes
        ptr = int(p.value or 0)
        self.ptrs.append((ptr, nbytes))
        return ptr

    def free_all(self) -> None:
        for ptr, n in self.ptrs:
            self.rt.cudaFree(ctypes.c_void_p(ptr))
            self.live -= n
        self.ptrs.clear()


def check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed with cudaError {err}")


def probe_arguments(description: str) -> argparse.Namespace:
    """The probes' command line: buffer size in GiB, repeats, output file."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args()


def main() -> None:
    args = probe_arguments(__doc__)
    import torch

    sys.path.insert(0, str(ROOT))
    from um_lab.cuda import driver

    torch.cuda.init()
    rt = driver.runtime_library()
    n = int(args.gib * GiB)
    mem = Managed(rt)
    side = torch.cuda.Stream()  # the batch APIs refuse the legacy default stream (cudaErrorInvalidValue)
    stream = side.cuda_stream
    results: dict[str, list[float]] = {}
    free_log: list[tuple[str, int]] = []
    has = {name: hasattr(rt, name) for name in ("cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync",
                                                "cudaMemPrefetchBatchAsync")}

    def sync() -> None:
        check(rt.cudaStreamSynchronize(ctypes.c_void_p(stream)), "sync")

    def timed(name: str, fn) -> None:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        results.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        free_log.append((name, torch.cuda.mem_get_info()[0]))

    def prefetch(ptr: int, where: str) -> None:
        driver.prefetch(ptr, n, where, 0, stream)

    def memset(ptr: int) -> None:
        check(rt.cudaMemsetAsync(ctypes.c_void_p(ptr), 1, ctypes.c_size_t(n), ctypes.c_void_p(stream)), "memset")

    def discard(ptr: int) -> None:
        driver.discard_raw(ptr, n, stream)

    def discard_prefetch_gpu(ptr: int) -> None:
        driver.discard_and_prefetch_raw(ptr, n, 0, stream)

    free0 = torch.cuda.mem_get_info()[0]
    if n * 2 > free0 // 4:
        raise SystemExit(f"buffer {n} too large for {free0} free bytes")
    a = mem.alloc(n)
    errors: list[str] = []
    try:
        timed("memset, first touch on GPU", lambda: memset(a))
        for _ in range(args.repeats):
            timed("memset, GPU-resident pages", lambda: memset(a))
            timed("prefetch to host, dirty pages", lambda: prefetch(a, "cpu"))
            timed("memset on GPU, host-resident pages (faults)", lambda: memset(a))
            timed("prefetch to host, dirty pages (2)", lambda: prefetch(a, "cpu"))
            timed("prefetch to GPU", lambda: prefetch(a, "gpu"))
            if has["cudaMemDiscardBatchAsync"]:
                timed("discard GPU-resident pages", lambda: discard(a))
                timed("prefetch to host after discard", lambda: prefetch(a, "cpu"))
                timed("memset on GPU after discard + host prefetch", lambda: memset(a))
                timed("discard GPU-resident pages (2)", lambda: discard(a))
                timed("memset on GPU right after discard", lambda: memset(a))
            if has["cudaMemDiscardAndPrefetchBatchAsync"]:
                timed("prefetch to host, dirty pages (3)", lambda: prefetch(a, "cpu"))
                timed("discard and prefetch to GPU, host-resident pages", lambda: discard_prefetch_gpu(a))
                timed("memset on GPU after discard-and-prefetch", lambda: memset(a))
    except Exception as e:  # noqa: BLE001 - recorded
        errors.append(repr(e))
    finally:
        sync()
        mem.free_all()
    rows = [{"name": k, "median_ms": round(statistics.median(v), 3), "runs_ms": [round(x, 3) for x in v],
             "GBps": round(n / (statistics.median(v) * 1e-3) / 1e9, 2)} for k, v in results.items()]
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "runtime": driver.runtime_version(), "bytes": n, "has": has,
              "errors": errors, "rows": rows, "free_bytes_log": free_log, "free_at_start": free0}
    args.out.write_text(json.dumps(report, indent=1))
    for r in rows:
        print(f"{r['name']:55s} {r['median_ms']:9.3f} ms  {r['GBps']:8.2f} GB/s  {r['runs_ms']}")
    print("has:", has, "errors:", errors)


if __name__ == "__main__":
    main()
