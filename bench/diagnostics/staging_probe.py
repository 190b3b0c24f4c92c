"""Probe: copies between managed memory and pinned host memory (issue 13's staging path).

``Session(budget_stage_activations=True)`` copies saved activations from managed blocks to pinned host
memory and back (``cudaMemcpyAsync``) instead of prefetching managed pages to the host, whose rate is
10-16 GB/s on the H200. This times, on one managed buffer (default 1 GiB, far below the card): copies to
and from pinned memory with the managed pages GPU-resident, with the budget's host advice
(preferred location host, accessed by the GPU) and pages prefetched to the GPU, into host-resident pages,
both directions at once on two streams, and the same copies with ordinary device memory for reference.

Usage (GPU machine): ``python bench/diagnostics/staging_probe.py --out $OUT/staging_probe.json``
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "diagnostics"))
sys.path.insert(0, str(ROOT))

from discard_probe import GiB, Managed, check, probe_arguments  # noqa: E402

COPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def main() -> None:
    args = probe_arguments(__doc__)
    import torch

    from um_lab.cuda import driver

    torch.cuda.init()
    rt = driver.runtime_library()
    n = int(args.gib * GiB)
    free0 = torch.cuda.mem_get_info()[0]
    if 3 * n > free0 // 4:
        raise SystemExit(f"buffers of {n} B too large for {free0} free bytes")
    mem = Managed(rt)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    results: dict[str, list[float]] = {}

    def copy(dst: int, src: int, stream: torch.cuda.Stream) -> None:
        check(rt.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n),
                                 ctypes.c_int(COPY_DEFAULT), ctypes.c_void_p(stream.cuda_stream)), "cudaMemcpyAsync")

    def timed(name: str, fn) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        results.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    def to_gpu(ptr: int) -> None:
        driver.prefetch(ptr, n, "gpu", 0, s1.cuda_stream)

    def to_host(ptr: int) -> None:
        driver.prefetch(ptr, n, "cpu", 0, s1.cuda_stream)

    a = mem.alloc(n)
    b = mem.alloc(n)
    h, h2, d = pinned.data_ptr(), pinned2.data_ptr(), device.data_ptr()
    errors: list[str] = []
    try:
        check(rt.cudaMemset(ctypes.c_void_p(a), 1, ctypes.c_size_t(n)), "memset")
        check(rt.cudaMemset(ctypes.c_void_p(b), 2, ctypes.c_size_t(n)), "memset")
        for _ in range(args.repeats):
            timed("device memory -> pinned", lambda: copy(h, d, s1))
            timed("pinned -> device memory", lambda: copy(d, h, s1))
            timed("device <-> pinned, both at once (two streams)", lambda: (copy(h, d, s1), copy(d, h2, s2)))
            to_gpu(a)
            torch.cuda.synchronize()
            timed("managed, GPU-resident -> pinned", lambda: copy(h, a, s1))
            timed("pinned -> managed, GPU-resident", lambda: copy(a, h, s1))
            to_gpu(b)
            timed("managed <-> pinned, both at once (two streams)", lambda: (copy(h, a, s1), copy(b, h2, s2)))
            timed("prefetch managed to host (reference)", lambda: to_host(a))
            timed("pinned -> managed, host-resident pages", lambda: copy(a, h, s1))
            to_gpu(a)
        driver.advise(a, n, "SetPreferredLocation", "cpu", 0)
        driver.advise(a, n, "SetAccessedBy", "gpu", 0)
        for _ in range(args.repeats):
            to_gpu(a)
            torch.cuda.synchronize()
            timed("host-advised managed, prefetched to GPU -> pinned", lambda: copy(h, a, s1))
            timed("pinned -> host-advised managed, prefetched to GPU", lambda: copy(a, h, s1))
            to_host(a)
            timed("pinned -> host-advised managed, host-resident", lambda: copy(a, h, s1))
    except Exception as e:  # noqa: BLE001 - recorded
        errors.append(repr(e))
    finally:
        torch.cuda.synchronize()
        mem.free_all()
    rows = [{"name": k, "median_ms": round(statistics.median(v), 3), "runs_ms": [round(x, 3) for x in v],
             "GBps": round(n / (statistics.median(v) * 1e-3) / 1e9, 2)} for k, v in results.items()]
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "runtime": driver.runtime_version(), "bytes": n, "errors": errors,
              "rows": rows, "free_at_start": free0,
              "note": "both-at-once rows: GBps is per direction (n bytes each way in the time shown)"}
    args.out.write_text(json.dumps(report, indent=1))
    for r in rows:
        print(f"{r['name']:55s} {r['median_ms']:9.3f} ms  {r['GBps']:8.2f} GB/s  {r['runs_ms']}")
    print("errors:", errors)


if __name__ == "__main__":
    main()
