"""How large the intermediate-results pool stays when saved activations are staged (issue 13, a GPU probe).

Staging leaves that pool resident and fixed in the budget's ledger, so the scheduler only has room for the
other types if staging really shrinks it. For each model this trains a few steps without a budget (the pool as
training needs it) and with ``budget_stage_activations=True`` under a budget of twice the footprint, or half the
session's cap where that is smaller (little needs to move; the pool as staging leaves it), and prints the pool's
segment bytes per step with the stager's numbers (staged, kept on the GPU, views staged through their storage).

    python bench/diagnostics/staged_pool.py --models resnet50 gpt2-large --out staged_pool.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GiB = 1 << 30


def probe(name: str, steps: int, limit: int) -> dict[str, Any]:
    """The pool per step without a budget and with staging under a budget of twice the footprint (at most half
    the session's cap)."""
    import budget as bench  # bench/budget.py: the same sizes, safety counter and session options

    case = bench.build_case(name)
    plain = bench.run_session(case, steps, limit)
    footprint = max(sum(r.live_bytes.values()) for r in plain["records"])
    staged = bench.run_session(case, steps, limit, budget=min(2 * footprint, bench.session_cap(limit) // 2),
                               options=bench.RowOptions(stage=True))
    row = {"model": name, "footprint_bytes": footprint,
           "act_pool_bytes_plain": [r.live_bytes["act"] for r in plain["records"]],
           "act_pool_bytes_staged": [r.live_bytes["act"] for r in staged["records"]],
           "fixed_bytes": [r.extra["budget"].get("fixed_bytes") for r in staged["records"]],
           "staging": [r.extra["budget"].get("staging") for r in staged["records"]],
           "step_ms_plain": [r.wall_ms for r in plain["records"]],
           "step_ms_staged": [r.wall_ms for r in staged["records"]]}
    row["growth"] = forward_growth(case, limit)
    last = row["staging"][-1] or {}
    print(f"{name}: footprint {footprint / GiB:.2f} GiB; intermediate pool {row['act_pool_bytes_plain'][-1] / GiB:.2f} "
          f"GiB without a budget, {row['act_pool_bytes_staged'][-1] / GiB:.2f} GiB with staging (by step: "
          + ", ".join(f"{b / GiB:.2f}" for b in row["act_pool_bytes_staged"]) + "); staged "
          f"{last.get('staged_bytes', 0) / GiB:.2f} GiB, kept {last.get('kept_bytes', 0) / GiB:.2f} GiB, views "
          f"{last.get('view_tensors', 0)}, step {row['step_ms_staged'][-1]:.0f} ms "
          f"(plain {row['step_ms_plain'][-1]:.0f})",
          flush=True)
    return row


def forward_growth(case: Any, limit: int, steps: int = 2) -> list[dict[str, Any]]:
    """In the last of ``steps`` staged steps, after each module two levels down: bytes allocated to tensors (all
    pools) and the intermediate pool's segment bytes; allocated growing with depth means staged tensors stay alive,
    segments growing alone means freed blocks wait (copies still reading them) or fragment."""
    import budget as bench
    import torch

    from um_lab.cuda.session import Session

    cap = bench.session_cap(limit)
    torch.manual_seed(0)
    model = case.build_model()
    seen: list[dict[str, Any]] = []
    with Session("um-default", cap_bytes=cap, gpu_budget_bytes=cap // 2, budget_stage_activations=True,
                 evacuate_on_close=False) as lab:
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        recording = [False]

        def after(name: str) -> Any:
            def hook(*_: Any) -> None:
                if recording[0]:
                    seen.append({"module": name, "allocated": torch.cuda.memory_allocated(),
                                 "act_segments": lab.live_bytes()["act"]})
            return hook

        handles = [m.register_forward_hook(after(n)) for n, m in model.named_modules() if 0 < n.count(".") + 1 <= 2]
        for step in range(steps):
            recording[0] = step == steps - 1
            batch = lab.inputs(*case.batch(step))
            batch = batch if isinstance(batch, tuple) else (batch,)
            lab.step(lambda batch=batch, model=model: case.loss_fn(model, *batch), opt)
        for h in handles:
            h.remove()
        del opt, model, batch
    for point in seen[:: max(1, len(seen) // 12)]:
        print(f"    after {point['module']}: allocated {point['allocated'] / GiB:.2f} GiB, intermediate segments "
              f"{point['act_segments'] / GiB:.2f} GiB", flush=True)
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "gpt2-large"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import budget as bench
    import torch

    if not torch.cuda.is_available():
        print("staged_pool.py needs a CUDA GPU")
        return 2
    free, _ = bench.device_memory()
    limit = int(free * 0.5)
    rows = []
    for name in args.models:
        rows.append(probe(name, args.steps, limit))
        if args.out is not None:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
