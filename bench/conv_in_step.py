"""Benchmark (GPU, then CPU): ResNet-50's convolutions inside a training step, activations remote.

Every distinct convolution of ResNet-50 (``um_lab.sim.conv_act.RESNET50_CONVS``) becomes a
one-convolution model (:func:`um_lab.sim.conv_act.conv_case`) trained through the real backend under
``um-default`` and ``act-remote`` (intermediate results in host memory, read and written remotely);
the PyTorch profiler gives the GPU time of the forward convolution and of its backward. This is the
in-step condition the kernel microbenchmarks (``bench/uvm_primitives.py``: one operand remote, workspace
resident) do not show: cuDNN's workspace lives in the activation pool too.

    python bench/conv_in_step.py --out bench/results/conv_in_step.json        # on the GPU
    python bench/conv_in_step.py --fit bench/results/conv_in_step.json        # on any CPU

``--fit`` fits the profile's ``tile_conv_igemm_kxk`` / ``_1x1`` (:func:`um_lab.sim.conv_act.fit_conv_tile`) and prints,
per op, the measured and the simulated time at it.
JSON: ``{"device", "torch", "date", "batch_size", "rows": [{"shape", "batch_size", "policy", "step_ms",
"op_ms": {op: self GPU ms}, "seconds"}]}``. Everything stays far below the card under the safety cap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from sim_fidelity import policy_named  # noqa: E402

from um_lab.models import ModelCase  # noqa: E402
from um_lab.sim.conv_act import RESNET50_CONVS, conv_case, conv_samples, fit_conv_tile  # noqa: E402

POLICIES = ("um-default", "act-remote")


def _device_ms(evt: Any, self_only: bool) -> float:
    name = "self_device_time_total" if self_only else "device_time_total"
    legacy = "self_cuda_time_total" if self_only else "cuda_time_total"
    return float(getattr(evt, name, getattr(evt, legacy, 0.0))) / 1e3


def profile_config(model: str, kwargs: dict[str, Any], policy_name: str, warmup: int = 2,
                   case: ModelCase | None = None) -> dict[str, Any]:
    """Run ``warmup`` steps, then profile one step; GPU time per op (``case``: instead of the named model)."""
    import gc
    import statistics

    import torch

    from um_lab.backend import get_backend
    from um_lab.models import get_model
    from um_lab.types import RunSpec

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


def measure(out: Path, batch_size: int) -> None:
    """Profile every shape under both policies; write the JSON after each row."""
    import torch

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "batch_size": batch_size, "rows": []}
    for shape in RESNET50_CONVS:
        for policy in POLICIES:
            t = time.perf_counter()
            row: dict[str, Any] = {"shape": shape.label, "batch_size": batch_size, "policy": policy}
            try:
                prof = profile_config(f"conv {shape.label}", {}, policy, case=conv_case(shape, batch_size))
                row["step_ms"] = prof["step_ms"]
                row["op_ms"] = {o["op"]: o["self_device_ms"] for o in prof["ops"]
                                if o["op"].startswith("aten::") and o["self_device_ms"] > 0}
                row["kernels"] = {o["op"][:120]: o["self_device_ms"] for o in prof["ops"]
                                  if not o["op"].startswith(("aten::", "autograd")) and o["self_device_ms"] > 0}
            except Exception as e:  # noqa: BLE001 - one failure must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
            row["seconds"] = round(time.perf_counter() - t, 1)
            result["rows"].append(row)
            print(shape.label, policy, row.get("step_ms"), row.get("error", ""), f"{row['seconds']} s", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")


def fit(path: Path) -> None:
    """Fit the tile; print measured vs simulated per op at it."""
    import dataclasses

    from um_lab.sim.profile import load_profile

    data = json.loads(path.read_text())
    profile = load_profile("h200")
    policy = policy_named("act-remote")
    fields, provenance = fit_conv_tile(data, profile, policy)
    print(f"{'shape':26s} {'dir':3s} {'measured ms':>11s} {'simulated':>9s} {'sim/meas':>8s}")
    for s in conv_samples(data["rows"], dataclasses.replace(profile, **fields), policy):
        print(f"{s['shape']:26s} {s['direction']:3s} {s['measured_ms']:11.2f} {s['simulated_ms']:9.2f} "
              f"{s['ratio']:8.2f}")
    for field, value in fields.items():
        print(f"{field} = {value}  (range {provenance[field]['range']}; {provenance[field]['source']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("conv_in_step.json"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fit", type=Path, help="fit the convolution tiles from this result file (CPU)")
    args = parser.parse_args()
    if args.fit is not None:
        fit(args.fit)
    else:
        measure(args.out, args.batch_size)


if __name__ == "__main__":
    main()
