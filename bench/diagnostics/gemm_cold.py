"""Probe (issue 10): are GEMMs with a remote weight slower inside a training step than timed alone?

Fidelity round 6 missed on ViT-L/16 zero-copy rows: in the step, its GEMMs re-read the remote weight
1.1-1.5x more than the same shapes timed alone (``gemm_tiles``, back-to-back repeats). Hypothesis: the
alone timings run warm (GPU TLB entries and L2 lines for the weight's host pages survive from the previous
repeat), a step runs them cold (other kernels touched gigabytes in between). This times each ViT-L/16
GEMM (M = batch x 197 tokens) with W remote three ways: back to back (as ``gemm_tiles``), after a
kernel that writes a 2 GiB device buffer (evicts L2, cycles device TLB entries), and after a kernel that
reads a different 256 MiB remote buffer (cycles the host-page TLB entries), plus the resident baseline.

Usage (GPU machine): ``python bench/diagnostics/gemm_cold.py --out $OUT/gemm_cold.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GiB = 1 << 30
MiB = 1 << 20
LINK_BPS = 50.5e9  # streaming remote read on the H200 (bench/results/uvm_primitives.json)


def shapes(tokens: int, width: int, hidden: int) -> list[tuple[str, int, int, int, str]]:
    """(name, M, K, N, layout) of a ViT block's weight GEMMs, forward and input-gradient."""
    m = tokens
    return [("qkv fwd", m, width, 3 * width, "nt"), ("proj fwd", m, width, width, "nt"),
            ("fc1 fwd", m, width, hidden, "nt"), ("fc2 fwd", m, hidden, width, "nt"),
            ("qkv dgrad", m, 3 * width, width, "nn"), ("fc1 dgrad", m, hidden, width, "nn"),
            ("fc2 dgrad", m, width, hidden, "nn")]


def median_ms(launch: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median CUDA-event ms of ``launch`` (after one warm-up), running ``before`` untimed ahead of each repeat."""
    launch()
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def gemm_row(lab: Any, name: str, m: int, k: int, n: int, layout: str, repeats: int,
             flushes: dict[str, Callable[[], object]], *, bias: bool | None = None,
             link_bps: float = LINK_BPS) -> dict[str, Any]:
    """One GEMM shape: resident, remote warm, remote after each flush (``x @ W^T`` is an ``addmm`` with a
    bias and ``x @ W`` an ``mm`` unless ``bias`` says otherwise; passes at ``link_bps``)."""
    from uvm_primitives import remote_copy

    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") if layout == "nt" else torch.randn(k, n, device="cuda")
    b = torch.randn(n, device="cuda")

    fused = layout == "nt" if bias is None else bias

    def run(weight: torch.Tensor) -> Callable[[], object]:
        w = weight.t() if layout == "nt" else weight
        if fused:
            return lambda: torch.addmm(b, x, w)
        return lambda: torch.mm(x, w)

    resident = median_ms(run(w), repeats)
    times = {}
    with remote_copy(lab, w) as far:
        times["warm"] = median_ms(run(far), repeats)
        for label, flush in flushes.items():
            times[label] = median_ms(run(far), repeats, flush)
    wbytes = w.numel() * 4
    row: dict[str, Any] = {"name": name, "M": m, "K": k, "N": n, "layout": layout, "weight_bytes": wbytes,
                           "resident_ms": round(resident, 3)}
    for label, ms in times.items():
        row[f"{label}_ms"] = round(ms, 3)
        row[f"passes_{label}"] = round((ms - resident) * 1e-3 * link_bps / wbytes, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from uvm_primitives import RunBudget, remote_copy

    from um_lab.basics import gpu_lab
    from um_lab.cuda import driver

    torch.backends.cuda.matmul.allow_tf32 = False
    free, _ = driver.mem_get_info(torch.cuda.current_device())
    budget = RunBudget(2 * GiB, free_bytes=free)
    flush_dev = torch.empty(2 * GiB // 4, device="cuda")
    rows = []
    t0 = time.perf_counter()
    with gpu_lab(budget) as lab, remote_copy(lab, torch.zeros(256 * MiB // 4, device="cuda")) as far_other:
        flushes: dict[str, Callable[[], object]] = {"after_device_flush": lambda: flush_dev.fill_(1.0),
                                                    "after_remote_read": lambda: far_other.sum()}
        for name, m, k, n, layout in shapes(args.batch * 197, 1024, 4096):
            rows.append(gemm_row(lab, name, m, k, n, layout, args.repeats, flushes))
            print(json.dumps(rows[-1]), flush=True)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "batch": args.batch, "repeats": args.repeats, "rows": rows,
              "link_Bps": LINK_BPS, "seconds": round(time.perf_counter() - t0, 1), "managed_live_after": budget.live}
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
