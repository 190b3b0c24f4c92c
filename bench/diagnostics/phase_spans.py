"""Issue 12: which phase of the step holds um_lab's MLP gap? GPU time per phase, native vs um_lab.

The MLP's kernels run equally fast in both modes (``kernel_diff.py``), yet um_lab's step span is 2-4%
longer: the GPU waits somewhere. Identical hooks in both modes record a CUDA event at each phase
boundary on the stream doing the work: step start (before any um_lab call), first forward kernel (pre-hook
on the first module), forward end (hook on the last module), backward end (tensor hook on the first layer's
weight gradient), optimizer start and end (optimizer step hooks), step end (after zero_grad, before the
session's record). Each mode runs in fresh processes, interleaved; medians per phase.

    python bench/diagnostics/phase_spans.py --model mlp --repeats 4 --out $OUT/phase_spans.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKS = ("start", "forward_first", "forward_end", "backward_end", "optimizer_start", "optimizer_end", "end")


def prefetch_whole_segments(lab: Any) -> None:
    """Prefetch every managed segment whole to the GPU once (variant ``um_lab_prefetched``): segments first
    touched piecemeal by kernels may be mapped with small pages; a whole-segment prefetch maps whole 2 MiB
    blocks. Tests whether the forward/backward gap is a page-size (TLB) effect. The session's own populator
    (``Session(populate_segments=True)`` runs it after each step that allocates) does the prefetching."""
    import torch

    from um_lab.cuda.populate import SegmentPopulator

    SegmentPopulator(lab._pools).populate(lab.policy)
    torch.cuda.synchronize()


def worker(mode: str, model_name: str, steps: int, warmup: int) -> dict[str, Any]:
    """One process: ``steps`` timed steps with events at each mark; per-phase median ms."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from allocator_overhead import build_bench_case

    case, model, batch_cpu = build_bench_case(model_name)
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    def mark(name: str) -> None:
        if name not in current:  # the first time per step
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            current[name] = ev

    def install(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        mods = [m for m in model.modules() if not list(m.children())]
        mods[0].register_forward_pre_hook(lambda *a: mark("forward_first"))
        mods[-1].register_forward_hook(lambda *a: mark("forward_end"))
        first_weight = next(p for p in mods[0].parameters())
        first_weight.register_hook(lambda g: mark("backward_end"))  # the last gradient backward makes
        opt.register_step_pre_hook(lambda *a: mark("optimizer_start"))
        opt.register_step_post_hook(lambda *a: mark("optimizer_end"))

    def finish(step: int) -> None:
        torch.cuda.synchronize()
        if step >= warmup:
            events.append({k: current[k] for k in MARKS if k in current})
        current.clear()

    if mode.startswith("um_lab"):
        from um_lab.cuda.session import Session

        with Session("um-default", evacuate_on_close=False) as lab:
            model = lab.place(model)
            opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
            install(model, opt)
            batch = lab.inputs(*batch_cpu)
            batch = batch if isinstance(batch, tuple) else (batch,)
            from um_lab.cuda import session as session_module

            original_stop = session_module._StepTimer.stop

            def stop(self: Any, loss: Any) -> tuple[float, float]:
                mark("end")
                return original_stop(self, loss)

            session_module._StepTimer.stop = stop  # type: ignore[method-assign]
            for i in range(warmup + steps):
                if i == warmup - 1 and mode == "um_lab_prefetched":
                    prefetch_whole_segments(lab)
                torch.cuda.synchronize()
                mark("start")
                lab.step(lambda: case.loss_fn(model, *batch), opt)
                finish(i)
    else:
        model = model.cuda()
        opt = case.make_optimizer(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        install(model, opt)
        batch = tuple(t.cuda() for t in batch_cpu)
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            mark("start")
            loss = case.loss_fn(model, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            mark("end")
            float(loss)
            finish(i)
    phases: dict[str, float] = {}
    for a, b in zip(MARKS, MARKS[1:], strict=False):
        vals = [ev[a].elapsed_time(ev[b]) for ev in events if a in ev and b in ev]
        if vals:
            phases[f"{a}->{b}"] = statistics.median(vals)
    phases["span"] = statistics.median(ev["start"].elapsed_time(ev["end"]) for ev in events)
    return {"mode": mode, "phases_ms": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", nargs="+", default=["native", "um_lab"],
                    choices=["native", "um_lab", "um_lab_prefetched"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.steps, args.warmup)), flush=True)
        return
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", args.model, "--steps",
                                  str(args.steps), "--warmup", str(args.warmup), "--out", str(args.out)],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1])["phases_ms"])
            print(mode, json.dumps({k: round(v, 3) for k, v in runs[mode][-1].items()}), flush=True)
    keys = list(runs["native"][0])
    table = {k: {m: round(statistics.median(r[k] for r in rs), 4) for m, rs in runs.items()} for k in keys}
    for k, v in table.items():
        for m in [m for m in runs if m != "native" and "native" in runs]:
            v[f"{m}_minus_native"] = round(v[m] - v["native"], 4)
        print(f"{k:34s} " + "  ".join(f"{m} {v[m]:8.3f}" for m in runs)
              + "".join(f"  {m}-native {v[f'{m}_minus_native']:+.3f}" for m in runs if m != "native"))
    import torch

    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": torch.cuda.get_device_name(),
                                    "model": args.model, "steps": args.steps, "repeats": args.repeats,
                                    "phases_ms": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
