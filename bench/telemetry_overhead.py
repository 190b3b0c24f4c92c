"""Telemetry overhead on a real GPU: median step time with CUPTI telemetry on vs off (um-default).

Each (model, mode) runs in a fresh process (CUPTI state is process-wide). Every step copies the batch
to the GPU (input pool), runs forward, backward and the AdamW step inside ``lab.step``; the timed
region is the whole ``lab.step`` call with a synchronise on each side, so the "on" time includes the
telemetry work done on the training thread after the step's CUDA-event timing (attribution; with
``flush=step`` also the CUPTI flush and the NVML sample).

    python bench/telemetry_overhead.py [--steps 20] [--warmup 5] [--models resnet50 gpt2-medium]

Prints a table and writes bench/results/telemetry_overhead.json. Bar: on / off <= 1.05. A row whose
"on" run could not enable CUPTI says so in ``telemetry`` (its ratio then measures nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"resnet50": {"batch_size": 128}, "gpt2-medium": {"batch_size": 8, "seq_len": 1024}}
WORKER_TIMEOUT_S = 100
PARTS = ("telemetry_ms", "telemetry_flush_ms", "telemetry_attribution_ms", "telemetry_nvml_ms")


def _flush_through_cupti_python(telemetry) -> None:
    """Comparison variant: flush through cupti-python's own wrapper instead of ctypes."""
    source = telemetry._source
    original_start = source.start

    def start(device: int) -> None:
        original_start(device)
        source._flush_all, source.flush_via = source._cupti.activity_flush_all, "cupti-python"

    source.start = start


def worker(mode: str, model_name: str, steps: int, warmup: int) -> dict:
    """Train ``model_name`` in this process with telemetry ``mode`` ("on"/"off"); median step times."""
    import torch

    sys.path.insert(0, str(ROOT))
    from um_lab.cuda.session import Session
    from um_lab.models import get_model

    case = get_model(model_name, **MODELS[model_name])
    torch.manual_seed(0)
    model = case.build_model()
    batch_cpu = case.batch(0)
    wall, event = [], []
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    telemetry: object = False
    if mode.startswith("on"):
        from um_lab.cuda.telemetry import Telemetry

        options = dict(part.split("=") for part in mode.split(":")[1:])  # e.g. on:flush=step:period=20
        telemetry = Telemetry(buffer_bytes=int(options.get("buffer", 8 << 20)),
                              flush=options.get("flush", "background"),
                              flush_period_ms=float(options.get("period", 20)),
                              nvml=options.get("nvml", "1") != "0")
        if options.get("via") == "cupti":
            _flush_through_cupti_python(telemetry)
    with Session("um-default", evacuate_on_close=False, telemetry=telemetry) as lab:
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        rec = None
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = lab.inputs(*batch_cpu)
            batch = batch if isinstance(batch, tuple) else (batch,)
            rec = lab.step(lambda b=batch: case.loss_fn(model, *b), opt)
            torch.cuda.synchronize()
            if i >= warmup:
                wall.append((time.perf_counter() - t0) * 1e3)
                event.append(rec.wall_ms)
                for k in PARTS:
                    if k in rec.extra:
                        parts[k].append(rec.extra[k])
            batch = None
        assert rec is not None
        out = {
            "mode": mode, "model": model_name, "median_ms": statistics.median(wall),
            "median_event_ms": statistics.median(event), "telemetry": rec.telemetry,
            "median_telemetry_ms": statistics.median(parts["telemetry_ms"]) if parts["telemetry_ms"] else None,
            "median_parts_ms": {k: round(statistics.median(v), 3) for k, v in parts.items() if v},
            "live_GiB": round(sum(rec.live_bytes.values()) / 2**30, 3),
            "resident_GiB": None if rec.resident_bytes is None else round(sum(rec.resident_bytes.values()) / 2**30, 3),
            "last_step_gpu_page_faults": rec.gpu_page_faults,
            "last_step_um_records": rec.extra.get("um_records"),
            "versions": _versions(),
        }
        model = opt = None
    return out


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(0)}
    for dist in ("cupti-python", "nvidia-cuda-cupti", "cuda-bindings", "nvidia-ml-py"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "telemetry_overhead.json")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="extra telemetry settings to time, e.g. on:flush=step on:period=10 on:nvml=0 "
                             "on:via=cupti")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 20:
        parser.error("--steps must be >= 20")
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps, args.warmup)), flush=True)
        return
    results: dict[str, dict[str, dict]] = {}
    info: dict = {}
    for model_name in args.models:
        results[model_name] = {}
        for mode in ("off", "on", *args.variants):
            cmd = [sys.executable, __file__, "--worker", mode, model_name, "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{mode} {model_name} took over {WORKER_TIMEOUT_S} s") from None
            if out.returncode != 0:
                raise SystemExit(f"{mode} {model_name} failed:\n{out.stderr[-3000:]}")
            res = results[model_name][mode] = json.loads(out.stdout.strip().splitlines()[-1])
            info = res.pop("versions")
            print(f"  {model_name:12s} {mode:18s} {res['median_ms']:9.2f} ms  parts={res['median_parts_ms']}  "
                  f"telemetry={res['telemetry']}", flush=True)
            _write(args, info, results)  # after every worker: a run cut short keeps what it measured
    rows = _write(args, info, results)
    print(f"\n{'model':12s} {'off ms':>9s} {'on ms':>9s} {'on/off':>7s} {'tel. ms':>8s}  telemetry")
    for r in rows:
        tel = "-" if r.get("on_telemetry_ms") is None else f"{r['on_telemetry_ms']:.2f}"
        print(f"{r['model']:12s} {r['off_ms']:9.2f} {r['on_ms']:9.2f} {r['on_over_off']:7.4f} {tel:>8s}  "
              f"{r['telemetry']}")
        for name, v in r["variants"].items():
            print(f"  {name:22s} {v['on_ms']:9.2f} {v['on_over_off']:7.4f}  {v['parts_ms']}")
    print(f"wrote {args.out}")


def _row(model_name: str, by_mode: dict[str, dict], variants: list[str]) -> dict:
    off, on = by_mode["off"], by_mode["on"]
    return {
        "model": model_name,
        "off_ms": round(off["median_ms"], 3),
        "on_ms": round(on["median_ms"], 3),
        "on_over_off": round(on["median_ms"] / off["median_ms"], 4),
        "off_event_ms": round(off["median_event_ms"], 3),
        "on_event_ms": round(on["median_event_ms"], 3),
        "on_telemetry_ms": None if on["median_telemetry_ms"] is None else round(on["median_telemetry_ms"], 3),
        "on_parts_ms": on["median_parts_ms"],
        "telemetry": on["telemetry"],
        "live_GiB": on["live_GiB"],
        "resident_GiB": on["resident_GiB"],
        "last_step_gpu_page_faults": on["last_step_gpu_page_faults"],
        "last_step_um_records": on["last_step_um_records"],
        "variants": {v: {"on_ms": round(by_mode[v]["median_ms"], 3),
                         "on_over_off": round(by_mode[v]["median_ms"] / off["median_ms"], 4),
                         "telemetry_ms": by_mode[v]["median_telemetry_ms"],
                         "parts_ms": by_mode[v]["median_parts_ms"]} for v in variants if v in by_mode},
    }


def _write(args: argparse.Namespace, info: dict, results: dict[str, dict[str, dict]]) -> list[dict]:
    rows = [_row(m, by_mode, args.variants) for m, by_mode in results.items() if {"off", "on"} <= set(by_mode)]
    report = {
        "device": info.get("device"),
        "versions": {k: v for k, v in info.items() if k != "device"},
        "date": datetime.date.today().isoformat(),
        "steps": args.steps,
        "warmup": args.warmup,
        "timed": "whole lab.step incl. batch copy and telemetry work after it (synchronised); "
                 "*_event_ms: CUDA events around the step's GPU work",
        "on": "Telemetry() defaults: background flush thread every 20 ms (CUPTI flush through ctypes), "
              "NVML sampled on the same thread",
        "rows": rows,
        "complete": all(len(by_mode) == 2 + len(args.variants) for by_mode in results.values())
                    and len(results) == len(args.models),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return rows

if __name__ == "__main__":
    main()
