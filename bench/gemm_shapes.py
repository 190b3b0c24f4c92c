"""Benchmark (GPU, CPU for the list): a model's own GEMM shapes, timed alone with the weight remote, against the
shape model.

The simulator prices a 2-d GEMM's remote weight by :mod:`um_lab.sim.gemm_passes`, a power law fitted on a
160-kernel grid. cuBLAS picks its kernel per shape, and at shapes off the grid the law can be far off
(ViT-L/16 at M = 6,304: 0.78-1.82x on the H200). This script
lists the distinct weight GEMMs of a model's training step from the simulator's trace (layout, bias, M, K,
N, how many per step) and, on a GPU, times each alone with its weight in host memory read remotely
(zero-copy advice, as ``bench/uvm_primitives.py`` does), beside the law's passes. The results feed the
profile's per-shape table: ``profile.replace(gemm_shape_passes=load_gemm_shapes([...]))``
(:func:`um_lab.sim.gemm_passes.load_gemm_shapes`), which wins over the law at those shapes.

    python bench/gemm_shapes.py --model vit-l16 batch_size=16 --out bench/results/gemm_shapes/vit-l16_batch_size16.json
    python bench/gemm_shapes.py --model gpt2-small batch_size=2 --list                              # CPU

One JSON per model: ``{"date", "model", "kwargs", "device", "torch", "passes_at_GBps", "rows": [{"layout", "bias",
"M", "K", "N", "count", "model_passes", "resident_ms", "remote_ms", "passes", "weight_bytes",
"passes_over_model"}]}``; each weight GEMM is timed with CUDA events (median of ``--repeats`` after one warm-up),
resident and with the weight remote, its passes over the weight at the profile's remote read rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from um_lab.sim.ops import GEMM_XW, GEMM_XW_BIAS, GEMM_XWT, GEMM_XWT_BIAS  # noqa: E402

_LAYOUT = {GEMM_XWT: ("nt", False), GEMM_XWT_BIAS: ("nt", True), GEMM_XW: ("nn", False), GEMM_XW_BIAS: ("nn", True)}


def weight_gemms(trace: Any) -> list[dict[str, Any]]:
    """The distinct 2-d weight GEMMs of a traced step: ``{"layout", "bias", "M", "K", "N", "count"}``,
    most frequent first (``count``: reads per step of a weight in that shape)."""
    counts: Counter[tuple[str, bool, int, int, int]] = Counter()
    for cls, (layout, bias) in _LAYOUT.items():
        sel = np.flatnonzero(trace.acc_reread == cls)
        for i in sel:
            counts[(layout, bias, int(trace.acc_reuse[i]), int(trace.acc_gemm_k[i]), int(trace.acc_gemm_n[i]))] += 1
    return [{"layout": lay, "bias": b, "M": m, "K": k, "N": n, "count": c}
            for (lay, b, m, k, n), c in counts.most_common()]


def median_ms(launch: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median CUDA-event ms of ``launch`` (after one warm-up), running ``before`` untimed ahead of each repeat."""
    import torch

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
             link_bps: float) -> dict[str, Any]:
    """One GEMM shape: resident, remote warm, remote after each flush (``x @ W^T`` is an ``addmm`` with a
    bias and ``x @ W`` an ``mm`` unless ``bias`` says otherwise; passes at ``link_bps``)."""
    import torch
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
    ap.add_argument("--model", nargs="+", required=True, metavar=("NAME", "KEY=VALUE"),
                    help="a zoo model and its keyword arguments")
    ap.add_argument("--list", action="store_true", help="only list the shapes (no GPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-shapes", type=int, default=40, help="time at most this many shapes, most frequent first")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from um_lab.cli_args import parse_model_kwargs
    from um_lab.sim.gemm_passes import law_passes
    from um_lab.sim.profile import load_profile
    from um_lab.sim.replicas import model_case
    from um_lab.sim.trace import trace_step

    name, kwargs = args.model[0], parse_model_kwargs(args.model[1:])
    t0 = time.perf_counter()
    rows = weight_gemms(trace_step(model_case(name, **kwargs)))
    profile = load_profile("h200")
    for r, passes in zip(rows, law_passes(rows, profile), strict=True):
        r["model_passes"] = round(passes, 2)
    print(f"{name} {kwargs}: {len(rows)} weight GEMM shapes (traced in {time.perf_counter() - t0:.1f} s)", flush=True)
    if not args.list:
        rows = rows[:args.max_shapes]
        time_on_gpu(rows, args.repeats, profile.remote_GBps * 1e9)
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out is not None:
        import torch

        report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": name, "kwargs": kwargs,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "torch": torch.__version__, "passes_at_GBps": profile.remote_GBps, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def time_on_gpu(rows: list[dict[str, Any]], repeats: int, link_bps: float) -> None:
    """Fill each row's resident and remote times and measured passes (:func:`gemm_row`; managed bytes through a
    2 GiB counter far below the card)."""
    import torch
    from uvm_primitives import RunBudget

    from um_lab.basics import gpu_lab
    from um_lab.cuda import driver

    torch.backends.cuda.matmul.allow_tf32 = False
    free, _ = driver.mem_get_info(torch.cuda.current_device())
    with gpu_lab(RunBudget(2 << 30, free_bytes=free)) as lab:
        for r in rows:
            got = gemm_row(lab, f"{r['layout']}{'+b' if r['bias'] else ''}", r["M"], r["K"], r["N"], r["layout"],
                           repeats, {}, bias=r["bias"], link_bps=link_bps)
            r.update(resident_ms=got["resident_ms"], remote_ms=got["warm_ms"], passes=got["passes_warm"],
                     weight_bytes=got["weight_bytes"])
            r["passes_over_model"] = round(r["passes"] / r["model_passes"], 3)
            print(f"  {r['layout']} bias={r['bias']} M={r['M']} K={r['K']} N={r['N']}: {r['passes']} passes "
                  f"(model {r['model_passes']})", flush=True)


if __name__ == "__main__":
    main()
