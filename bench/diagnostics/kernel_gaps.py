"""Diagnostic (GPU, issue 12): where on the GPU timeline um_lab's extra step time sits, kernel by kernel.

Native and um_lab (um-default) blocks alternate in one process on one model and optimizer, as
``bench/allocator_overhead.py --alternate`` does (each um_lab block opens a session, places, attaches,
closes and so moves the model back). Each step of a block is synchronised before it starts, like the
benchmark's, and begins with a marker kernel (``torch.cuda._sleep(1)``) so the PyTorch profiler's CUDA
trace can be cut into steps. For every step it takes:

- ``span``: from the marker's end to the step's last GPU event (the GPU span of the step);
- ``busy``: the union of all kernels and copies in that span; ``idle = span - busy``;
- ``lead``: from the marker's end to the first kernel or copy (host work before the GPU gets any);
- per kernel position (the same kernel sequence in both modes): its duration and the idle gap before it.

Adjacent native / um_lab blocks form pairs; the report gives, per pair, um_lab minus native for span,
busy, idle and lead, and the kernel positions whose gap or duration grew most (median over pairs). If the
kernel sequences differ (um_lab adds a copy, say) only copies differ; kernels are compared by position.

    python bench/diagnostics/kernel_gaps.py --model mlp --blocks 6 --steps 30 [--fixed-batch] --out gaps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MARKER = "spin_kernel"  #: the kernel torch.cuda._sleep launches
COPY_PREFIXES = ("Memcpy", "Memset")


def step_timelines(events: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """Cut a profiled block's GPU events ``(name, start_us, end_us)`` into steps at each marker kernel.

    Each step's list starts with its marker; events before the first marker are dropped."""
    steps: list[list[tuple[str, float, float]]] = []
    for event in sorted(events, key=lambda e: e[1]):
        if MARKER in event[0]:
            steps.append([event])
        elif steps:
            steps[-1].append(event)
    return steps


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def step_summary(step: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Span, busy, idle and lead (us) of one step's timeline, and each kernel's (name, gap before, duration)."""
    marker, work = step[0], step[1:]
    if not work:
        return {"span": 0.0, "busy": 0.0, "idle": 0.0, "lead": 0.0, "kernels": []}
    origin = marker[2]
    span = max(e[2] for e in work) - origin
    busy = union_us([(max(e[1], origin), e[2]) for e in work])
    kernels = []
    frontier = origin
    for name, start, end in work:
        if not name.startswith(COPY_PREFIXES):
            kernels.append((name, max(0.0, start - frontier), end - start))
        frontier = max(frontier, end)
    return {"span": span, "busy": busy, "idle": span - busy, "lead": max(0.0, work[0][1] - origin),
            "kernels": kernels}


def block_summary(steps: list[list[tuple[str, float, float]]]) -> dict[str, Any]:
    """Medians over a block's steps, and per kernel position the median gap and duration (us)."""
    summaries = [step_summary(s) for s in steps]
    names = [tuple(k[0] for k in s["kernels"]) for s in summaries]
    sequence = max(set(names), key=names.count)
    same = [s for s, n in zip(summaries, names, strict=True) if n == sequence]
    positions = [{"kernel": sequence[i],
                  "gap": statistics.median(s["kernels"][i][1] for s in same),
                  "dur": statistics.median(s["kernels"][i][2] for s in same)} for i in range(len(sequence))]
    out = {key: statistics.median(s[key] for s in summaries) for key in ("span", "busy", "idle", "lead")}
    return {**out, "steps": len(summaries), "steps_with_common_sequence": len(same), "positions": positions}


def compare_blocks(native: dict[str, Any], um_lab: dict[str, Any]) -> dict[str, Any]:
    """um_lab minus native for one adjacent pair: totals, and per kernel position when the sequences match."""
    out: dict[str, Any] = {f"d_{k}": um_lab[k] - native[k] for k in ("span", "busy", "idle", "lead")}
    a, b = native["positions"], um_lab["positions"]
    out["same_kernels"] = [p["kernel"] for p in a] == [p["kernel"] for p in b]
    if out["same_kernels"]:
        out["d_gap"] = [q["gap"] - p["gap"] for p, q in zip(a, b, strict=True)]
        out["d_dur"] = [q["dur"] - p["dur"] for p, q in zip(a, b, strict=True)]
    return out


def _profiled_steps(step: Any, steps: int, warmup: int) -> tuple[list[tuple[str, float, float]], list[float]]:
    """Run ``warmup`` then ``steps`` synchronised steps with a marker kernel first; the GPU events and walls."""
    import torch

    for _ in range(warmup):
        torch.cuda.synchronize()
        torch.cuda._sleep(1)
        step()
    torch.cuda.synchronize()
    walls = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(1)
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    prof.stop()
    events = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
              if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return events, walls


def worker(model_name: str, blocks: int, steps: int, warmup: int, fixed_batch: bool,
           backward_thread: str = "caller") -> dict[str, Any]:
    """Alternating native / um_lab blocks in this process; each block's summary and each pair's differences."""
    from allocator_overhead import _native_setup, build_bench_case

    from um_lab.cuda.session import Session

    case, model, batch_cpu = build_bench_case(model_name)
    model, opt = _native_setup(case, model)
    per_mode: dict[str, list[dict[str, Any]]] = {"native": [], "um_lab": []}
    for block in range(blocks):
        for mode in (("native", "um_lab") if block % 2 == 0 else ("um_lab", "native")):
            if mode == "native":
                fixed = tuple(t.cuda() for t in batch_cpu)

                def native_step(fixed: tuple = fixed) -> None:
                    batch = fixed if fixed_batch else tuple(t.cuda() for t in batch_cpu)
                    loss = case.loss_fn(model, *batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=False)
                    float(loss)

                events, walls = _profiled_steps(native_step, steps, warmup)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", RuntimeWarning)
                    with Session("um-default", backward_thread=backward_thread) as lab:
                        lab.place(model)
                        lab.attach(model, opt)
                        fixed_in = lab.inputs(*batch_cpu) if fixed_batch else None

                        def um_lab_step(lab: Any = lab, fixed_in: Any = fixed_in) -> None:
                            batch = fixed_in if fixed_batch else lab.inputs(*batch_cpu)
                            batch = batch if isinstance(batch, tuple) else (batch,)
                            lab.step(lambda: case.loss_fn(model, *batch), opt)

                        events, walls = _profiled_steps(um_lab_step, steps, warmup)
                        del fixed_in
            summary = block_summary(step_timelines(events))
            summary["wall_ms"] = statistics.median(walls)
            per_mode[mode].append(summary)
    pairs = [compare_blocks(n, u) for n, u in zip(per_mode["native"], per_mode["um_lab"], strict=True)]
    return {"model": model_name, "fixed_batch": fixed_batch, "backward_thread": backward_thread,
            "blocks": per_mode, "pairs": pairs}


def report(result: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """Medians over pairs, and the kernel positions whose gap or duration grew most; printed and returned."""
    pairs = result["pairs"]
    native, um_lab = result["blocks"]["native"], result["blocks"]["um_lab"]
    med = {k: statistics.median(p[f"d_{k}"] for p in pairs) for k in ("span", "busy", "idle", "lead")}
    wall = statistics.median(u["wall_ms"] - n["wall_ms"] for n, u in zip(native, um_lab, strict=True))
    summary: dict[str, Any] = {
        "native_span_us": statistics.median(b["span"] for b in native),
        "native_busy_us": statistics.median(b["busy"] for b in native),
        "native_wall_ms": statistics.median(b["wall_ms"] for b in native),
        "d_wall_ms": wall, **{f"d_{k}_us": v for k, v in med.items()},
        "pairs": len(pairs), "pairs_same_kernels": sum(p["same_kernels"] for p in pairs)}
    print(f"{result['model']} ({'batch copied once' if result['fixed_batch'] else 'batch copied every step'}), "
          f"{len(pairs)} pairs; native span {summary['native_span_us']:.1f} us, busy {summary['native_busy_us']:.1f}")
    print(f"  um_lab - native (median over pairs): wall {wall * 1e3:+.1f} us, span {med['span']:+.1f}, "
          f"busy {med['busy']:+.1f}, idle {med['idle']:+.1f}, lead {med['lead']:+.1f}")
    same = [p for p in pairs if p["same_kernels"]]
    if same:
        names = [p["kernel"] for p in native[0]["positions"]]
        gaps = [statistics.median(p["d_gap"][i] for p in same) for i in range(len(names))]
        durs = [statistics.median(p["d_dur"][i] for p in same) for i in range(len(names))]
        summary["sum_d_gap_us"], summary["sum_d_dur_us"] = sum(gaps), sum(durs)
        ranked = sorted(range(len(names)), key=lambda i: -gaps[i])[:top]
        summary["top_gap_positions"] = [{"position": i, "of": len(names), "kernel": names[i][:120],
                                         "d_gap_us": round(gaps[i], 2), "native_gap_us":
                                         round(native[0]["positions"][i]["gap"], 2)} for i in ranked]
        ranked = sorted(range(len(names)), key=lambda i: -abs(durs[i]))[:top]
        summary["top_dur_positions"] = [{"position": i, "kernel": names[i][:120], "d_dur_us": round(durs[i], 2),
                                         "native_dur_us": round(native[0]["positions"][i]["dur"], 2)}
                                        for i in ranked]
        print(f"  sum over kernel positions: gaps {summary['sum_d_gap_us']:+.1f} us, "
              f"durations {summary['sum_d_dur_us']:+.1f} us ({len(names)} kernels per step)")
        for row in summary["top_gap_positions"]:
            print(f"    gap {row['d_gap_us']:+7.2f} us at {row['position']:4d}/{row['of']} "
                  f"(native {row['native_gap_us']:.2f}) {row['kernel'][:70]}")
    return summary


def main() -> None:
    """Run the worker in a fresh process per ``--processes``, print the report, write the JSON."""
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--fixed-batch", action="store_true")
    ap.add_argument("--backward-thread", choices=["worker", "caller"], default="caller",
                    help="um_lab's Session(backward_thread=...); caller is the session's default (session 14's "
                         "runs, before that change, were worker)")
    ap.add_argument("--out", default="kernel_gaps.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.blocks, args.steps, args.warmup, args.fixed_batch,
                                args.backward_thread)))
        return
    runs = []
    for _ in range(args.processes):
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--blocks", str(args.blocks),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--backward-thread", args.backward_thread]
        cmd += ["--fixed-batch"] if args.fixed_batch else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"worker failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["summary"] = report(result)
        for mode in result["blocks"].values():  # per-position lists stay in the summary only
            for block in mode:
                block["positions"] = len(block["positions"])
        for pair in result["pairs"]:
            pair.pop("d_gap", None)
            pair.pop("d_dur", None)
        runs.append(result)
    Path(args.out).write_text(json.dumps({"model": args.model, "fixed_batch": args.fixed_batch,
                                          "backward_thread": args.backward_thread,
                                          "blocks": args.blocks, "steps": args.steps, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
