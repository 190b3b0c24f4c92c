"""Diagnostic (GPU, issue 12): the host time of each piece um_lab adds to a training step.

``bench/diagnostics/kernel_gaps.py`` put um_lab's extra MLP step time in GPU idle gaps at three points: the
step's start (+66-74 us before the first kernel), the end of forward (+62-66 us before backward's first
kernel) and backward's first node (+32-34 us), with kernel durations equal to native. This times the host
pieces there, each alone in a loop (median of ``--reps``), in a real session on the GPU:

- ``route``: ``pools.route(ACT)`` entered and left with nothing inside (claim, begin, end, release);
- ``begin_end_release``: the three torch calls alone;
- ``route_backward``: the backward routing entered and left with no backward (hook registered and removed);
- ``event_record``: one CUDA event recorded (the step timer's start);
- ``refused`` / ``live_bytes``: the shim's counters (each routing reads ``refused``);
- and whole steps of a tiny model (one 64x64 Linear: launch-bound) in plain PyTorch and through
  ``Session.step`` with backward on autograd's device thread (``worker``) and on the caller, alternating.

    python bench/diagnostics/step_host_costs.py [--reps 2000] [--out step_host_costs.json]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def median_us(fn: Callable[[], object], reps: int) -> float:
    """Median host time of ``fn()`` in microseconds over ``reps`` calls (after 50 unmeasured)."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def piece_costs(reps: int) -> dict[str, float]:
    """Host time of each routing piece in an open session (module docstring)."""
    import torch

    from um_lab.cuda.session import Session
    from um_lab.types import DataType

    out: dict[str, float] = {}
    with Session("um-default") as lab:
        pools = lab._pools
        assert pools is not None
        pid = pools.pool_id(DataType.ACT)
        api, device = pools.api, pools.device

        def route() -> None:
            with pools.route(DataType.ACT):
                pass

        def begin_end_release() -> None:
            api.begin(device, pid)
            api.end(device, pid)
            api.release(device, pid)

        x = torch.ones(4, device="cuda", requires_grad=True)
        loss = (x * 2).sum()

        def route_backward() -> None:
            with pools.route_backward(DataType.ACT, loss):
                pass

        event = torch.cuda.Event(enable_timing=True)
        out["route"] = median_us(route, reps)
        out["begin_end_release"] = median_us(begin_end_release, reps)
        out["route_backward"] = median_us(route_backward, reps)
        out["event_record"] = median_us(event.record, reps)
        out["refused"] = median_us(pools.source.refused, reps)
        out["live_bytes"] = median_us(pools.source.live_bytes, reps)
        torch.cuda.synchronize()
    return out


def tiny_steps(reps: int, blocks: int) -> dict[str, Any]:
    """Host time per synchronised step of a launch-bound model: native and um_lab (worker, caller), alternating."""
    import torch

    from um_lab.cuda.session import Session

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x_cpu = torch.randn(32, 64)

    def timed(step: Callable[[], object]) -> float:
        def synced() -> None:
            step()
            torch.cuda.synchronize()
        return median_us(synced, reps)

    results: dict[str, list[float]] = {"native": [], "worker": [], "caller": []}
    for _ in range(blocks):
        x = x_cpu.cuda()

        def native(x: torch.Tensor = x) -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        results["native"].append(timed(native))
        for thread in ("worker", "caller"):
            with Session("um-default", backward_thread=thread) as lab:
                lab.place(model)
                lab.attach(model, opt)
                xi = lab.inputs(x_cpu)
                results[thread].append(timed(lambda lab=lab, xi=xi: lab.step(lambda: model(xi).sum(), opt)))
                del xi
    return {k: {"median_us": statistics.median(v), "blocks_us": [round(t, 1) for t in v]} for k, v in results.items()}


def main() -> None:
    """Measure, print, write the JSON."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--out", default="step_host_costs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    pieces = piece_costs(args.reps)
    steps = tiny_steps(max(200, args.reps // 10), args.blocks)
    for name, us in pieces.items():
        print(f"{name:18s} {us:8.2f} us")
    for name, row in steps.items():
        print(f"step {name:13s} {row['median_us']:8.1f} us  {row['blocks_us']}")
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "reps": args.reps,
                                          "pieces_us": pieces, "tiny_steps": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
