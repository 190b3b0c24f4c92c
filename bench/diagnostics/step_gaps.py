"""Diagnostic (GPU, issue 12): where the GPU waits inside a training step, native PyTorch vs um_lab.

Each mode runs in a fresh process (the allocator_overhead loop: batch copied every step, AdamW,
``zero_grad(set_to_none=False)``), warms up, then profiles ``--steps`` steps with the PyTorch profiler
(CPU and CUDA activity) and writes the Chrome trace. :func:`analyse` reads a trace back and reports, per
step: the GPU span, the GPU busy time, the idle gaps inside the span (each charged to the host op that
launched the work after it, and to the one before it), and the CUDA runtime/driver calls the host made,
by name. The kernels of the two modes match (``kernel_diff.py``), so the gap is host work that starves
the GPU; this names it.

    python bench/diagnostics/step_gaps.py [--model mlp] [--modes native um_lab] [--steps 6] [--out DIR]
    python bench/diagnostics/step_gaps.py --analyse DIR/mlp-native.json DIR/mlp-um_lab.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEP_MARK = "um_lab_step"
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_API_CATS = frozenset({"cuda_runtime", "cuda_driver"})
MIN_GAP_US = 3.0  # GPU idle shorter than this is launch jitter, not a stall


def make_step(mode: str, model_name: str, enter: Callable[[Any], Any]) -> Callable[[], None]:
    """One training step of ``mode`` (``native``, ``um_lab`` or ``um_lab+variant+...``, variants as in
    ``allocator_overhead.VARIANTS``); ``enter`` enters a context
    manager for the caller's lifetime."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from allocator_overhead import BEFORE_PLACE, apply_variants, build_bench_case

    case, model, batch_cpu = build_bench_case(model_name)
    if mode == "native":
        model = model.cuda()
        opt = case.make_optimizer(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def native_step() -> None:
            batch = tuple(t.cuda() for t in batch_cpu)
            loss = case.loss_fn(model, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            float(loss)

        return native_step
    from um_lab.cuda.session import Session

    base, *variants = mode.split("+")
    lab = enter(Session("um-default", evacuate_on_close=False,
                        backward_thread="caller" if "caller" in variants else "worker"))
    apply_variants(lab, [v for v in variants if v in BEFORE_PLACE])
    model = lab.place(model)
    opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
    apply_variants(lab, [v for v in variants if v not in BEFORE_PLACE])

    def um_lab_step() -> None:
        batch = lab.inputs(*batch_cpu)
        batch = batch if isinstance(batch, tuple) else (batch,)
        lab.step(lambda: case.loss_fn(model, *batch), opt)

    return um_lab_step


def profile_mode(mode: str, model_name: str, steps: int, trace_path: str, warmup: int = 5) -> dict[str, Any]:
    """Profile ``steps`` steps of ``mode`` after ``warmup``, each in a ``um_lab_step`` range, and write
    the Chrome trace; returns the trace's analysis."""
    import contextlib
    import time

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    with contextlib.ExitStack() as stack:
        step = make_step(mode, model_name, stack.enter_context)
        walls = []
        for i in range(warmup + 20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if i >= warmup:
                walls.append((time.perf_counter() - t0) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                torch.cuda.synchronize()
                with torch.profiler.record_function(STEP_MARK):
                    step()
                torch.cuda.synchronize()
        prof.export_chrome_trace(trace_path)
    result = analyse(trace_path)
    walls.sort()
    result.update(mode=mode, model=model_name, unprofiled_wall_ms_median=round(walls[len(walls) // 2], 4))
    return result


def host_profile(mode: str, model_name: str, steps: int = 50, warmup: int = 10, top: int = 25) -> dict[str, Any]:
    """cProfile of ``steps`` unprofiled-by-torch steps: the Python functions with the most own time, and
    um_lab's own functions by cumulative time, in microseconds per step."""
    import contextlib
    import cProfile
    import pstats

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    with contextlib.ExitStack() as stack:
        step = make_step(mode, model_name, stack.enter_context)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [(f"{Path(file).name}:{line}({name})", tt / steps * 1e6, ct / steps * 1e6, nc / steps)
            for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.items()]
    own = sorted(rows, key=lambda r: -r[1])[:top]
    ours = sorted((r for r, key in zip(rows, stats, strict=True) if "um_lab" in key[0]), key=lambda r: -r[2])[:top]
    fmt = [{"function": r[0], "own_us": round(r[1], 1), "cum_us": round(r[2], 1), "calls": round(r[3], 2)}
           for r in own]
    return {"mode": mode, "model": model_name, "steps": steps, "by_own_time": fmt,
            "um_lab_by_cumulative_time": [{"function": r[0], "own_us": round(r[1], 1), "cum_us": round(r[2], 1),
                                           "calls": round(r[3], 2)} for r in ours]}


def analyse(trace_path: str | Path, top: int = 12) -> dict[str, Any]:
    """Per-step GPU span, busy time, idle gaps (charged to the ops around them) and host CUDA calls."""
    data = json.loads(Path(trace_path).read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name") == STEP_MARK)
    if not steps:
        raise ValueError(f"{trace_path}: no {STEP_MARK!r} ranges")
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    api = [e for e in events if e.get("cat") in HOST_API_CATS]
    launch_of = {e["args"]["correlation"]: e for e in api if "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "python_function")),
                 key=lambda e: float(e["ts"]))
    op_starts = [float(e["ts"]) for e in ops]

    def op_at(ts: float, tid: Any) -> str:
        """The innermost host op on thread ``tid`` running at ``ts``."""
        best = "?"
        i = bisect.bisect_right(op_starts, ts)
        for e in reversed(ops[max(0, i - 400):i]):
            if e.get("tid") == tid and float(e["ts"]) <= ts <= float(e["ts"]) + float(e.get("dur", 0)):
                return str(e["name"])
        return best

    per_step = []
    gap_by_next: collections.Counter[str] = collections.Counter()
    gap_by_pair: collections.Counter[str] = collections.Counter()
    api_time: collections.Counter[str] = collections.Counter()
    api_calls: collections.Counter[str] = collections.Counter()
    for s0, s1 in steps:
        work = []
        for e in gpu:
            launch = launch_of.get(e.get("args", {}).get("correlation"))
            if launch is not None and s0 <= float(launch["ts"]) <= s1:
                work.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e, launch))
        work.sort(key=lambda w: w[0])
        for e in api:
            if s0 <= float(e["ts"]) <= s1:
                api_calls[e["name"]] += 1
                api_time[e["name"]] += float(e.get("dur", 0))
        if not work:
            continue
        busy = 0.0
        idle = 0.0
        end = work[0][0]
        prev_name = "(step start)"
        for start, stop, _item, launch in work:
            if start - end > MIN_GAP_US:
                nxt = op_at(float(launch["ts"]), launch.get("tid"))
                idle += start - end
                gap_by_next[nxt] += start - end
                gap_by_pair[f"{prev_name} -> {nxt}"] += start - end
            if stop > end:
                busy += stop - max(start, end)
                end = stop
            prev_name = op_at(float(launch["ts"]), launch.get("tid"))
        per_step.append({"host_ms": (s1 - s0) / 1e3, "gpu_span_ms": (end - work[0][0]) / 1e3,
                         "gpu_busy_ms": busy / 1e3, "gpu_idle_in_span_ms": idle / 1e3,
                         "first_gpu_after_start_ms": (work[0][0] - s0) / 1e3, "gpu_items": len(work)})
    n = len(per_step)

    def mean(key: str) -> float:
        return round(sum(p[key] for p in per_step) / max(n, 1), 4)

    def table(counter: collections.Counter[str], scale: float) -> list[tuple[str, float]]:
        return [(k, round(v / scale / max(n, 1), 4)) for k, v in counter.most_common(top)]

    return {"steps": n, **{k: mean(k) for k in ("host_ms", "gpu_span_ms", "gpu_busy_ms", "gpu_idle_in_span_ms",
                                                   "first_gpu_after_start_ms", "gpu_items")},
            "idle_ms_by_next_op": table(gap_by_next, 1e3),
            "idle_ms_by_op_pair": table(gap_by_pair, 1e3),
            "api_ms_per_step": table(api_time, 1e3),
            "api_calls_per_step": [(k, round(v / max(n, 1), 2)) for k, v in api_calls.most_common(top * 2)]}


def show(result: dict[str, Any]) -> None:
    """Print one mode's analysis."""
    head = {k: result.get(k) for k in ("mode", "model", "unprofiled_wall_ms_median", "host_ms", "gpu_span_ms",
                                       "gpu_busy_ms", "gpu_idle_in_span_ms", "first_gpu_after_start_ms",
                                       "gpu_items")}
    print(json.dumps(head))
    for key in ("idle_ms_by_next_op", "idle_ms_by_op_pair", "api_ms_per_step", "api_calls_per_step"):
        print(f"  {key}:")
        for name, value in result[key]:
            print(f"    {value:9.4f}  {name[:120]}")


def main() -> None:
    """Profile each mode in a fresh process (or analyse traces already written) and print the analyses."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--modes", nargs="+", default=["native", "um_lab"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="step_gaps")
    ap.add_argument("--analyse", nargs="+", metavar="TRACE")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the host side instead (no torch profiler)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.analyse:
        for path in args.analyse:
            print(path)
            show(analyse(path))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        if args.cprofile:
            result = host_profile(args.worker, args.model)
            (out / f"{args.model}-{args.worker}.cprofile.json").write_text(json.dumps(result, indent=1) + "\n")
            for key in ("by_own_time", "um_lab_by_cumulative_time"):
                print(f"{args.worker} {key}:", flush=True)
                for r in result[key]:
                    print(f"  own {r['own_us']:8.1f} us  cum {r['cum_us']:8.1f} us  {r['calls']:6.2f}x  "
                          f"{r['function']}")
            return
        trace = out / f"{args.model}-{args.worker}.trace.json"
        print(json.dumps(profile_mode(args.worker, args.model, args.steps, str(trace))), flush=True)
        return
    results = []
    for mode in args.modes:
        proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", args.model,
                               "--steps", str(args.steps), "--out", str(out)] + ["--cprofile"] * args.cprofile,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{mode} failed:\n{proc.stderr[-3000:]}", flush=True)
            continue
        if args.cprofile:
            print(proc.stdout, flush=True)
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        show(results[-1])
        (out / f"{args.model}-summary.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
