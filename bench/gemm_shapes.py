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

With ``--tensor-cores`` it fits instead the rates of 16-bit training kernels for the simulator's mixed-precision
steps: for GEMM, fused attention and convolution in fp32, bf16 and fp16, a ladder of training-sized kernels
(GPT-2 and ResNet-50 layer shapes) timed with CUDA events, fitted to the simulator's law ``time = (flop + half) /
peak`` by least squares (plain CUDA memory, under 2 GiB); ``um_lab.sim.calibration.tensor_core_fields`` turns the
JSON into profile fields:

    python bench/gemm_shapes.py --tensor-cores --out bench/results/tensor_core_rates.json
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


#: the dtypes probed, by the name precision takes, and torch's name
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TENSOR_CORE_REPEATS = 20
# (M, K, N): GPT-2 small..XL projections and MLPs at 1..8 x 1024 tokens, and small ones
GEMMS = [(m, k, n) for m in (512, 2048, 8192) for k, n in ((768, 2304), (1024, 4096), (1600, 6400), (4096, 1024))]
# (batch, heads, seq, head_dim)
ATTENTION = [(b, h, s, 64) for b, h, s in ((1, 12, 512), (2, 12, 1024), (4, 16, 1024), (8, 12, 1024), (2, 25, 1024))]
# (batch, in, out, size, kernel)
CONVS = [(n, c, k, hw, r) for n in (16, 64) for c, k, hw, r in ((64, 64, 56, 3), (128, 128, 28, 3), (256, 1024, 14, 1),
                                                                 (512, 512, 7, 3), (64, 256, 56, 1))]
TENSOR_CORE_LIMIT_BYTES = 2 << 30  # the tensor-core probe's own cap on what it allocates at once


def _checked(*shapes: tuple[int, ...], dtype: Any) -> list[Any]:
    import torch

    size = sum(torch.Size(s).numel() for s in shapes) * torch.finfo(dtype).bits // 8
    if size > TENSOR_CORE_LIMIT_BYTES:
        raise RuntimeError(f"{shapes}: {size} B is over this probe's cap")
    return [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]


def tensor_core_probe(dtype: Any) -> dict[str, list[tuple[float, float]]]:
    """(flop, ms) per kernel kind."""
    import torch
    import torch.nn.functional as F

    out: dict[str, list[tuple[float, float]]] = {"matmul": [], "attention": [], "conv": []}
    for m, k, n in GEMMS:
        a, b = _checked((m, k), (k, n), dtype=dtype)
        out["matmul"].append((2.0 * m * k * n, median_ms(lambda a=a, b=b: a @ b, TENSOR_CORE_REPEATS)))
    for b, h, s, d in ATTENTION:
        q, k_, v = _checked((b, h, s, d), (b, h, s, d), (b, h, s, d), dtype=dtype)
        flop = 4.0 * b * h * s * s * d / 2  # causal: half the score matrix
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            out["attention"].append((flop, median_ms(
                lambda q=q, k_=k_, v=v: F.scaled_dot_product_attention(q, k_, v, is_causal=True), TENSOR_CORE_REPEATS)))
    for n, c, k, hw, r in CONVS:
        x, w = _checked((n, c, hw, hw), (k, c, r, r), dtype=dtype)
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        out["conv"].append((2.0 * n * k * hw * hw * c * r * r,
                            median_ms(lambda x=x, w=w, r=r: F.conv2d(x, w, padding=r // 2), TENSOR_CORE_REPEATS)))
    return out


def fit_peak(points: list[tuple[float, float]]) -> dict[str, float]:
    """Peak TFLOP/s and half-peak GFLOP of ``time = (flop + half) / peak`` by least squares."""
    import torch

    f = torch.tensor([p[0] for p in points], dtype=torch.float64)
    t = torch.tensor([p[1] * 1e-3 for p in points], dtype=torch.float64)
    design = torch.stack([f, torch.ones_like(f)], 1)
    slope, intercept = torch.linalg.lstsq(design, t[:, None]).solution[:, 0].tolist()
    peak = 1.0 / slope
    return {"tflops": round(peak / 1e12, 2), "half_gflop": round(max(intercept * peak, 0.0) / 1e9, 4)}


def tensor_core_rates(out: Path | None) -> dict[str, Any]:
    """Probe every kernel kind in every dtype, fit the law, write ``out`` (JSON); returns it."""
    import torch

    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__,
                              "law": "time = (flop + half) / peak, least squares over the kernels", "kinds": {}}
    for name, torch_name in DTYPES.items():
        points = tensor_core_probe(getattr(torch, torch_name))
        for kind, pts in points.items():
            row = {**fit_peak(pts), "points": [[p[0], round(p[1], 4)] for p in pts]}
            result["kinds"].setdefault(kind, {})[name] = row
            print(f"{kind:9s} {name}: {row['tflops']:7.1f} TFLOP/s peak, half at {row['half_gflop']:.3f} GFLOP",
                  flush=True)
        torch.cuda.empty_cache()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model", nargs="+", metavar=("NAME", "KEY=VALUE"), help="a zoo model and its keyword arguments")
    mode.add_argument("--tensor-cores", action="store_true",
                      help="fit the 16-bit (and fp32) peaks of GEMM, attention and convolution instead")
    ap.add_argument("--list", action="store_true", help="only list the shapes (no GPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-shapes", type=int, default=40, help="time at most this many shapes, most frequent first")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tensor_cores:
        tensor_core_rates(args.out)
        return
    from um_lab.app.cli_args import parse_model_kwargs
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

    from um_lab.cuda import driver
    from um_lab.teaching.basics import gpu_lab

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
