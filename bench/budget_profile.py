"""Issue 13 diagnostic: where a budget step's time goes (the PyTorch profiler on one step, on the H200).

    python bench/budget_profile.py --model gpt2-large --budget-gib 19.48 --out-dir /tmp/prof
    python bench/budget_profile.py --model gpt2-large --budget-gib 19.48 --telemetry   # CUPTI faults instead

A session with ``gpu_budget_bytes`` trains ``--steps`` steps (the first learns the order, the second
plans); the last step runs under ``torch.profiler`` (CPU and CUDA activity). Written: ``summary.json``
(each step's wall ms and budget counters; GPU busy time per stream, the top kernels and the top host ops by
self time; the step's span) and ``trace.json.gz`` (the Chrome trace). With ``--telemetry`` no profiler
runs (both would own CUPTI): the records' page faults and migrations per step are written instead.
Safety as in bench/budget.py: the session's cap is min(0.5 x free, the default cap) and this script's own
counter stops the run at 0.8 x that cap.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.budget import SAFETY_FRACTION, ManagedLimitExceeded, build_case, session_cap  # noqa: E402
from um_lab.cuda.session import Session  # noqa: E402
from um_lab.models import get_model  # noqa: E402

GiB = 1 << 30


class StackSampler:
    """Samples every other thread's Python stack every ``period_s`` (``sys._current_frames``): where each
    thread's wall time goes, waits included (a thread blocked in C shows its innermost Python frame)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.ours: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                self.samples[name] += 1
                code = frame.f_code
                self.leaf[name][f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}"] += 1
                f: Any = frame
                while f is not None and "um_lab" not in f.f_code.co_filename:
                    f = f.f_back
                if f is not None:
                    self.ours[name][f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno}"] += 1

    def summary(self, top: int = 20) -> dict[str, Any]:
        """Per thread: samples, the commonest innermost frames and innermost um_lab frames (share of samples)."""
        out = {}
        for name, n in self.samples.items():
            out[name] = {"samples": n, "period_ms": self.period_s * 1e3,
                         "leaf": [(k, round(c / n, 3)) for k, c in self.leaf[name].most_common(top)],
                         "um_lab": [(k, round(c / n, 3)) for k, c in self.ours[name].most_common(top)]}
        return out


def kernel_summary(prof: Any) -> dict[str, Any]:
    """GPU time per stream, the top kernels (by total ms) and the top host ops (by self ms) of a profile."""
    per_stream: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    first, last = float("inf"), 0.0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.elapsed_us() / 1e3
        per_stream[str(getattr(ev, "device_resource_id", "?"))] += dur
        k = kernels[ev.name[:90]]
        k[0] += 1
        k[1] += dur
        first, last = min(first, ev.time_range.start), max(last, ev.time_range.end)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:30]
    return {"gpu_ms_per_stream": {k: round(v, 2) for k, v in per_stream.items()},
            "gpu_span_ms": round((last - first) / 1e3, 2) if last else None,
            "top_gpu": [{"name": n, "count": int(c), "ms": round(ms, 2)} for n, (c, ms) in top],
            "top_host_self": [{"name": a.key[:90], "count": a.count, "self_ms": round(a.self_cpu_time_total / 1e3, 2),
                               "total_ms": round(a.cpu_time_total / 1e3, 2)} for a in host]}


def timeline(trace: dict[str, Any], bins: int) -> dict[str, Any]:
    """The profiled step's GPU work cut into ``bins`` equal time bins (a Chrome trace of torch.profiler): per
    bin, the busy ms of kernels per stream and the GB copied each way with their busy ms; per stream and
    direction, the copies' total GB, busy ms and GB/s while busy. Shows where copies run below the link's rate
    and whether compute waits for them."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur") is not None]
    if not gpu:
        return {}
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    if end <= start:
        return {}
    width = (end - start) / bins
    rows = [collections.defaultdict(float) for _ in range(bins)]
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for e in gpu:
        stream = str(e.get("args", {}).get("stream", e.get("tid", "?")))
        if e["cat"] == "gpu_memcpy":
            name = e.get("name", "")
            kind = "dtoh" if "DtoH" in name else "htod" if "HtoD" in name else "dtod"
            nbytes = float(e.get("args", {}).get("bytes", 0))
            key = f"{kind}@{stream}"
            t = totals[key]
            t[0] += nbytes
            t[1] += e["dur"]
            t[2] += 1
        else:
            key, nbytes = f"kernel@{stream}", 0.0
        a, b = e["ts"], e["ts"] + e["dur"]
        first, last = int((a - start) // width), min(bins - 1, int((b - start) // width))
        for i in range(max(0, first), last + 1):
            lo, hi = start + i * width, start + (i + 1) * width
            overlap = min(b, hi) - max(a, lo)
            if overlap <= 0:
                continue
            rows[i][key + "_ms"] += overlap / 1e3
            if nbytes:
                rows[i][key + "_GB"] += nbytes * overlap / max(e["dur"], 1e-9) / 1e9
    return {"span_ms": round((end - start) / 1e3, 2), "bin_ms": round(width / 1e3, 2),
            "copies": {k: {"GB": round(v[0] / 1e9, 3), "busy_ms": round(v[1] / 1e3, 2), "count": int(v[2]),
                           "GBps_busy": round(v[0] / max(v[1], 1e-9) / 1e3, 2)} for k, v in totals.items()
                       if not k.startswith("kernel")},
            "bins": [{k: round(v, 3) for k, v in sorted(r.items())} for r in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--budget-gib", type=float, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--telemetry", action="store_true")
    ap.add_argument("--sample", action="store_true",
                    help="sample every thread's Python stack in the last step instead of the PyTorch profiler")
    ap.add_argument("--batch-size", type=int, help="the model's batch size (default: bench/budget.py's)")
    ap.add_argument("--profile-too", action="store_true",
                    help="with --sample: sample the step before the last and profile the last")
    ap.add_argument("--stage", action="store_true", help="Session(budget_stage_activations=True)")
    ap.add_argument("--partial", action="store_true", help="with --stage: Session(budget_partial_staging=True)")
    ap.add_argument("--window-mib", type=int, help="with --stage: the stager's window (default: window_for_budget)")
    ap.add_argument("--bins", type=int, default=40, help="time bins of the profiled step's timeline")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results" / "budget_profile")
    args = ap.parse_args()
    if args.steps < 3 + int(args.profile_too):
        ap.error("--steps must be >= 3 (learn, plan, then a planned step), 4 with --profile-too")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    free, _ = torch.cuda.mem_get_info()
    cap = session_cap(int(free * 0.5))
    abort_at = int(SAFETY_FRACTION * cap)
    case = build_case(args.model) if args.batch_size is None else get_model(args.model, batch_size=args.batch_size)
    if args.window_mib:
        import um_lab.budget.stage as stage

        stage.window_for_budget = lambda budget: args.window_mib << 20  # the session imports it when it opens
    torch.manual_seed(0)
    model = case.build_model()
    lab = Session("um-default", cap_bytes=cap, gpu_budget_bytes=int(args.budget_gib * GiB), telemetry=args.telemetry,
                  evacuate_on_close=False, budget_stage_activations=args.stage,
                  budget_partial_staging=args.partial and args.stage)
    summary: dict[str, Any] = {"model": args.model, "budget_gib": args.budget_gib, "cap_bytes": cap,
                               "stage_activations": args.stage, "partial_staging": args.partial,
                               "window_mib": args.window_mib,
                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": torch.cuda.get_device_name(0), "steps": []}
    out = args.out_dir / "summary.json"
    lab.open()
    try:
        def guard(record: Any) -> None:
            live = int(lab.stats()["live_total"])
            if live > abort_at:
                raise ManagedLimitExceeded(f"live managed bytes {live} passed {abort_at}")

        lab.add_listener(guard)
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        for step in range(args.steps):
            batch = lab.inputs(*case.batch(step))
            batch = batch if isinstance(batch, tuple) else (batch,)
            last = step == args.steps - 1
            profiled = last and not args.telemetry and (not args.sample or args.profile_too)
            sampled = args.sample and step == args.steps - 1 - int(args.profile_too)
            t0 = time.perf_counter()
            if sampled:
                with StackSampler() as sampler:
                    rec = lab.step(lambda batch=batch, model=model: case.loss_fn(model, *batch), opt)
                    torch.cuda.synchronize()
                summary["stacks"] = sampler.summary()
            elif profiled:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    rec = lab.step(lambda batch=batch, model=model: case.loss_fn(model, *batch), opt)
                    torch.cuda.synchronize()
            else:
                rec = lab.step(lambda batch=batch, model=model: case.loss_fn(model, *batch), opt)
            host_s = time.perf_counter() - t0
            budget = {k: v for k, v in rec.extra.get("budget", {}).items() if not isinstance(v, dict | list)}
            summary["steps"].append({"step": step, "wall_ms": rec.wall_ms, "host_s": round(host_s, 3),
                                     "gpu_page_faults": rec.gpu_page_faults, "htod_bytes": rec.htod_bytes,
                                     "dtoh_bytes": rec.dtoh_bytes, "resident_bytes": rec.resident_bytes,
                                     "budget": budget})
            print(json.dumps(summary["steps"][-1]), flush=True)
            out.write_text(json.dumps(summary, indent=1) + "\n")
            if profiled:
                summary["profile"] = kernel_summary(prof)
                out.write_text(json.dumps(summary, indent=1) + "\n")
                raw = args.out_dir / "trace.json"
                prof.export_chrome_trace(str(raw))
                summary["timeline"] = timeline(json.loads(raw.read_text()), args.bins)
                out.write_text(json.dumps(summary, indent=1) + "\n")
                with raw.open("rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                raw.unlink()
        del opt, model, batch
    finally:
        left = lab.close()
    summary["managed_bytes_left"] = left
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary.get("profile", summary.get("stacks", {})), indent=1)[:8000])
    return 0 if left == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
