"""Diagnostic (GPU, issue 12): GPU time per kernel of the same training steps, native PyTorch vs um_lab.

Each mode runs in a fresh process (the allocator_overhead loop: batch copied every step, AdamW,
``zero_grad(set_to_none=False)``), warms up, then profiles ``--steps`` steps with the PyTorch profiler and
sums device time per kernel name. The table lists the kernels whose time differs most between the modes,
so a gap of a few percent can be pinned on the kernels that carry it.

    python bench/diagnostics/kernel_diff.py [--model mlp] [--steps 10] [--out kernel_diff.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def profile_mode(mode: str, model_name: str, steps: int, warmup: int = 5) -> dict[str, Any]:
    """Kernel name -> (calls, device ms) over ``steps`` profiled steps of ``mode`` (native or um_lab)."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from allocator_overhead import MODELS

    from um_lab.models import get_model

    torch.backends.cuda.matmul.allow_tf32 = False
    case = get_model(model_name, **MODELS[model_name])
    torch.manual_seed(0)
    model = case.build_model()
    batch_cpu = case.batch(0)

    def run(step: Any, n: int) -> None:
        for _ in range(n):
            step()
        torch.cuda.synchronize()

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])  # started after the warm-up
    if mode == "um_lab":
        from um_lab.cuda.session import Session

        with Session("um-default", evacuate_on_close=False) as lab:
            model = lab.place(model)
            opt = lab.attach(model, case.make_optimizer(list(model.parameters())))

            def step() -> None:
                batch = lab.inputs(*batch_cpu)
                batch = batch if isinstance(batch, tuple) else (batch,)
                lab.step(lambda: case.loss_fn(model, *batch), opt)

            run(step, warmup)
            prof.start()
            run(step, steps)
            prof.stop()
            del model, opt
    else:
        model = model.cuda()
        opt = case.make_optimizer(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

        def step() -> None:
            batch = tuple(t.cuda() for t in batch_cpu)
            case.loss_fn(model, *batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        run(step, warmup)
        prof.start()
        run(step, steps)
        prof.stop()
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0, 0.0])
            entry[0] += 1
            entry[1] += evt.time_range.elapsed_us() / 1e3
    return {"mode": mode, "model": model_name, "steps": steps,
            "kernels": {k: {"calls": int(v[0]), "ms": round(v[1], 4)} for k, v in kernels.items()}}


def main() -> None:
    """Profile both modes in fresh processes, print the kernels that differ most, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="kernel_diff.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(profile_mode(args.worker, args.model, args.steps)), flush=True)
        return
    modes = {}
    for mode in ("native", "um_lab"):
        out = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", args.model,
                              "--steps", str(args.steps)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        modes[mode] = json.loads(out.stdout.strip().splitlines()[-1])["kernels"]
    names = set(modes["native"]) | set(modes["um_lab"])
    rows = []
    for name in names:
        a, b = modes["native"].get(name, {"calls": 0, "ms": 0.0}), modes["um_lab"].get(name, {"calls": 0, "ms": 0.0})
        rows.append({"kernel": name, "native_calls": a["calls"], "um_lab_calls": b["calls"],
                     "native_ms_per_step": round(a["ms"] / args.steps, 4),
                     "um_lab_ms_per_step": round(b["ms"] / args.steps, 4)})
    rows.sort(key=lambda r: -abs(r["um_lab_ms_per_step"] - r["native_ms_per_step"]))
    totals = {m: round(sum(k["ms"] for k in modes[m].values()) / args.steps, 4) for m in modes}
    print(f"{args.model}: GPU ms per step, native {totals['native']}, um_lab {totals['um_lab']}")
    for r in rows[: args.top]:
        print(f"  {r['um_lab_ms_per_step'] - r['native_ms_per_step']:+8.4f} ms  native {r['native_ms_per_step']:8.4f} "
              f"({r['native_calls']:5d})  um_lab {r['um_lab_ms_per_step']:8.4f} ({r['um_lab_calls']:5d})  "
              f"{r['kernel'][:90]}")
    Path(args.out).write_text(json.dumps({"model": args.model, "steps": args.steps, "totals_ms_per_step": totals,
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
