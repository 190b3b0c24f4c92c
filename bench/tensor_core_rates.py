"""Tensor-core rates of 16-bit training kernels on a CUDA GPU, for the simulator's mixed-precision steps.

For each kernel kind the simulator costs (GEMM, fused attention, convolution) and each dtype (fp32, bf16,
fp16), times a ladder of training-sized kernels (forward shapes of GPT-2 and ResNet-50 layers) with CUDA
events and fits the simulator's law, ``time = (flop + half) / peak`` (a kernel of ``half`` flop reaches half
the peak), by least squares. Writes ``bench/results/tensor_core_rates.json``;
``um_lab.sim.calibration.tensor_core_fields`` turns it into profile fields. Plain CUDA memory, under 2 GiB.

    python bench/tensor_core_rates.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (M, K, N): GPT-2 small..XL projections and MLPs at 1..8 x 1024 tokens, and small ones
GEMMS = [(m, k, n) for m in (512, 2048, 8192) for k, n in ((768, 2304), (1024, 4096), (1600, 6400), (4096, 1024))]
# (batch, heads, seq, head_dim)
ATTENTION = [(b, h, s, 64) for b, h, s in ((1, 12, 512), (2, 12, 1024), (4, 16, 1024), (8, 12, 1024), (2, 25, 1024))]
# (batch, in, out, size, kernel)
CONVS = [(n, c, k, hw, r) for n in (16, 64) for c, k, hw, r in ((64, 64, 56, 3), (128, 128, 28, 3), (256, 1024, 14, 1),
                                                                 (512, 512, 7, 3), (64, 256, 56, 1))]
LIMIT_BYTES = 2 << 30  # this script's own cap on what it allocates at once


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _checked(*shapes: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    size = sum(torch.Size(s).numel() for s in shapes) * torch.finfo(dtype).bits // 8
    if size > LIMIT_BYTES:
        raise RuntimeError(f"{shapes}: {size} B is over this probe's cap")
    return [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]


def probe(dtype: torch.dtype) -> dict[str, list[tuple[float, float]]]:
    """(flop, ms) per kernel kind."""
    out: dict[str, list[tuple[float, float]]] = {"matmul": [], "attention": [], "conv": []}
    for m, k, n in GEMMS:
        a, b = _checked((m, k), (k, n), dtype=dtype)
        out["matmul"].append((2.0 * m * k * n, _time_ms(lambda a=a, b=b: a @ b)))
    for b, h, s, d in ATTENTION:
        q, k_, v = _checked((b, h, s, d), (b, h, s, d), (b, h, s, d), dtype=dtype)
        flop = 4.0 * b * h * s * s * d / 2  # causal: half the score matrix
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            out["attention"].append((flop, _time_ms(
                lambda q=q, k_=k_, v=v: F.scaled_dot_product_attention(q, k_, v, is_causal=True))))
    for n, c, k, hw, r in CONVS:
        x, w = _checked((n, c, hw, hw), (k, c, r, r), dtype=dtype)
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        out["conv"].append((2.0 * n * k * hw * hw * c * r * r,
                            _time_ms(lambda x=x, w=w, r=r: F.conv2d(x, w, padding=r // 2))))
    return out


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Peak TFLOP/s and half-peak GFLOP of ``time = (flop + half) / peak`` by least squares."""
    f = torch.tensor([p[0] for p in points], dtype=torch.float64)
    t = torch.tensor([p[1] * 1e-3 for p in points], dtype=torch.float64)
    design = torch.stack([f, torch.ones_like(f)], 1)
    slope, intercept = torch.linalg.lstsq(design, t[:, None]).solution[:, 0].tolist()
    peak = 1.0 / slope
    return {"tflops": round(peak / 1e12, 2), "half_gflop": round(max(intercept * peak, 0.0) / 1e9, 4)}


def main() -> dict:
    """Probe, fit, write the JSON; returns it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    result: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "law": "time = (flop + half) / peak, least squares over the kernels", "kinds": {}}
    for name, dtype in DTYPES.items():
        points = probe(dtype)
        for kind, pts in points.items():
            result["kinds"].setdefault(kind, {})[name] = {**fit(pts), "points": [[p[0], round(p[1], 4)] for p in pts]}
            print(f"{kind:9s} {name}: {result['kinds'][kind][name]['tflops']:7.1f} TFLOP/s peak, "
                  f"half at {result['kinds'][kind][name]['half_gflop']:.3f} GFLOP", flush=True)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tensor_core_rates.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
