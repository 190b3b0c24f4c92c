"""Diagnostic (GPU): GPU time per aten op of one training step, by policy, with the PyTorch profiler.

Shows which ops slow down when a data type lives in host memory (zero-copy parameters, remote
activations) against the same step with plain UM, so the simulator's remote model can be checked per
op class. Every configuration runs through the real backend under the safety cap, far below the card.

    python bench/diagnostics/remote_ops.py --out remote_ops.json

Writes ``{"device", "date", "configs": [{"model", "model_kwargs", "policy", "step_ms", "ops": [{"op",
"count", "device_ms", "self_device_ms"}]}]}`` (ops with at least 0.05 ms of GPU time).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from um_lab.backend import get_backend
from um_lab.models import ModelCase, get_model
from um_lab.types import RunSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiled_runs import new_result, run_config  # noqa: E402
from sim_fidelity import policy_named  # noqa: E402  (presets and the held-out rows' "act-remote")

CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("resnet50", {"batch_size": 32}, "um-default"),
    ("resnet50", {"batch_size": 32}, "act-remote"),
    ("resnet50", {"batch_size": 32}, "zero-copy-params"),
    ("gpt2-small", {"batch_size": 4, "seq_len": 512}, "um-default"),
    ("gpt2-small", {"batch_size": 4, "seq_len": 512}, "act-remote"),
    ("gpt2-small", {"batch_size": 4, "seq_len": 512}, "zero-copy-params"),
    ("vit-b16", {"batch_size": 64}, "um-default"),
    ("vit-b16", {"batch_size": 64}, "act-remote"),
    ("vit-b16", {"batch_size": 64}, "zero-copy-params"),
    # fidelity round 4's rows (all simulated too fast); configuration 0 is the reference
    ("vit-l16", {"batch_size": 16}, "um-default"),
    ("resnet101", {"batch_size": 16}, "offload-optimizer"),
    ("resnet34", {"batch_size": 32}, "zero-copy-params"),
    ("bert-base", {"batch_size": 8, "seq_len": 512}, "act-remote"),
    ("resnet152", {"batch_size": 16}, "act-remote"),
]


def _device_ms(evt: Any, self_only: bool) -> float:
    name = "self_device_time_total" if self_only else "device_time_total"
    legacy = "self_cuda_time_total" if self_only else "cuda_time_total"
    return float(getattr(evt, name, getattr(evt, legacy, 0.0))) / 1e3


def profile_config(model: str, kwargs: dict[str, Any], policy_name: str, warmup: int = 2,
                   case: ModelCase | None = None) -> dict[str, Any]:
    """Run ``warmup`` steps, then profile one step; GPU time per op (``case``: instead of the named model)."""
    policy = policy_named(policy_name)
    backend = get_backend("cuda", telemetry=False)
    case = case if case is not None else get_model(model, **kwargs)
    spec = RunSpec(model=model, backend="cuda", steps=2, warmup_steps=warmup)
    records = backend.run(spec, case, policy)
    step_ms = []
    for _ in range(warmup + 1):
        step_ms.append(next(records).wall_ms)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step_ms.append(next(records).wall_ms)
        torch.cuda.synchronize()
    for _ in records:  # let the run end cleanly (pools released)
        pass
    ops = []
    for evt in prof.key_averages():
        total, own = _device_ms(evt, False), _device_ms(evt, True)
        if total >= 0.05 or own >= 0.05:
            ops.append({"op": evt.key, "count": int(evt.count), "device_ms": round(total, 3),
                        "self_device_ms": round(own, 3)})
    ops.sort(key=lambda o: -o["device_ms"])
    del records, case
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": model, "model_kwargs": kwargs, "policy": policy_name,
            "step_ms": round(statistics.median(step_ms[warmup:]), 3), "ops": ops}


def main() -> None:
    """Profile every configuration; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="remote_ops.json")
    ap.add_argument("--models", nargs="+", help="only these models' configurations")
    ap.add_argument("--configs", nargs="+", type=int, help="only these configurations (indices into CONFIGS)")
    args = ap.parse_args()
    result = new_result()
    for i, (model, kwargs, policy) in enumerate(CONFIGS):
        if (args.models and model not in args.models) or (args.configs and i not in args.configs):
            continue
        row = {"model": model, "model_kwargs": kwargs, "policy": policy}
        run_config(result, args.out, row, functools.partial(profile_config, model, kwargs, policy))

if __name__ == "__main__":
    main()
