"""Benchmark (GPU): where one training step's time goes, host and GPU, op by op and shape by shape.

Two kinds of configuration, each through the real backend under the safety cap (far below the card):

- ``host``: tiny batches, so the GPU idles and the step time is the host's dispatch time. Gives the
  simulator's host constants (``cpu_op_us`` ...) a measurement of their own.
- ``shapes``: moderate batches of the models the simulator's per-op constants are fitted on, with
  the profiler's input shapes kept, so a remote-access model can be checked per op *and* shape.

For each configuration: the median step time of ``--steps`` unprofiled steps, then one profiled step:
GPU busy time (sum of kernel durations), and per ``(op, input shapes)`` its count, self GPU time and
self host time. The result is an input of the simulator's calibration (:mod:`um_lab.sim.step_fit`: host costs,
GEMM / attention / convolution / HBM rates, batch-norm passes, remote elementwise rates).

    python bench/step_detail.py --out bench/results/step_detail.json [--kind host|shapes]

JSON: ``{"device", "torch", "date", "configs": [{"kind", "model", "model_kwargs", "policy", "step_ms",
"gpu_busy_ms", "host_span_ms", "ops": [...], "seconds"}]}``, rewritten after each configuration.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sim_fidelity import policy_named  # noqa: E402

from um_lab.backend import get_backend  # noqa: E402
from um_lab.models import get_model  # noqa: E402
from um_lab.types import RunSpec  # noqa: E402

#: (kind, model, knobs, policy). The ``host`` rows use the models the host constants are fitted on.
CONFIGS: list[tuple[str, str, dict[str, Any], str]] = [
    ("host", "resnet50", {"batch_size": 1, "image_size": 64}, "um-default"),
    ("host", "resnet50", {"batch_size": 1, "image_size": 64}, "offload-optimizer"),
    ("host", "resnet50", {"batch_size": 1, "image_size": 64}, "act-remote"),
    ("host", "resnet50", {"batch_size": 1, "image_size": 64}, "zero-copy-params"),
    ("host", "gpt2-small", {"batch_size": 1, "seq_len": 32}, "um-default"),
    ("host", "gpt2-small", {"batch_size": 1, "seq_len": 32}, "offload-optimizer"),
    ("host", "gpt2-small", {"batch_size": 1, "seq_len": 32}, "act-remote"),
    ("host", "vit-b16", {"batch_size": 1, "image_size": 64}, "um-default"),
    ("host", "mlp", {"batch_size": 8, "width": 256, "depth": 8}, "um-default"),
    ("host", "mlp", {"batch_size": 8, "width": 256, "depth": 64}, "um-default"),
    ("shapes", "resnet50", {"batch_size": 32}, "act-remote"),
    ("shapes", "gpt2-small", {"batch_size": 4, "seq_len": 512}, "act-remote"),
    ("shapes", "gpt2-small", {"batch_size": 4, "seq_len": 512}, "zero-copy-params"),
    ("shapes", "gpt2-small", {"batch_size": 4, "seq_len": 512}, "um-default"),
    ("shapes", "vit-b16", {"batch_size": 16}, "um-default"),
    # the resident step-time targets of um_lab.sim.calibration.PROBE_STEPS, op by op
    ("shapes", "mlp", {}, "um-default"),
    ("shapes", "resnet50", {"batch_size": 128}, "um-default"),
    ("shapes", "gpt2-medium", {"batch_size": 8, "seq_len": 1024}, "um-default"),
    # ResNet-50 at the batches between its host-bound and GPU-bound steps; offloaded optimizer state
    ("shapes", "resnet50", {"batch_size": 32}, "um-default"),
    ("shapes", "resnet50", {"batch_size": 64}, "um-default"),
    ("shapes", "resnet50", {"batch_size": 32}, "zero-copy-params"),
    ("shapes", "resnet50", {"batch_size": 32}, "offload-optimizer"),
    ("shapes", "gpt2-small", {"batch_size": 4, "seq_len": 512}, "offload-optimizer"),
]


def new_result() -> dict[str, Any]:
    """``{"device", "torch", "date", "configs": []}`` for this GPU, with TF32 off for matmuls (as measured)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "configs": []}


def run_config(result: dict[str, Any], out: str, row: dict[str, Any],
               measure: Callable[[], dict[str, Any]], show: tuple[str, ...] = ("step_ms",)) -> None:
    """Fill ``row`` with ``measure()`` (or the error it raised) and its duration, append it to ``result``,
    print it and rewrite ``out`` (a failure or a timeout never loses the configurations already measured)."""
    t = time.perf_counter()
    try:
        row.update(measure())
    except Exception as e:  # noqa: BLE001 - one failure must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t, 1)
    result["configs"].append(row)
    print(row["model"], row.get("model_kwargs"), row["policy"], *(row.get(k) for k in show), row.get("error", ""),
          f"{row['seconds']} s", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def _kernel_us(prof: Any) -> float:
    """Sum of GPU kernel and memcpy durations in a profile (microseconds)."""
    total = 0.0
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total += evt.time_range.elapsed_us()
    return total


def _host_span_ms(prof: Any) -> float:
    """Wall span of the profiled step's host-side aten ops (first start to last end), syncs excluded."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")]
    return (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e3 if spans else 0.0


def detail(model: str, knobs: dict[str, Any], policy_name: str, steps: int, warmup: int = 3) -> dict[str, Any]:
    """Median step time, then one profiled step's GPU busy time and per-(op, shapes) times."""
    backend = get_backend("cuda", telemetry=False)
    case = get_model(model, **knobs)
    spec = RunSpec(model=model, backend="cuda", steps=warmup + steps + 1, warmup_steps=warmup)
    records = backend.run(spec, case, policy_named(policy_name))
    for _ in range(warmup):
        next(records)
    wall = [next(records).wall_ms for _ in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        profiled_ms = next(records).wall_ms
        torch.cuda.synchronize()
    for _ in records:
        pass
    ops = []
    for evt in prof.key_averages(group_by_input_shape=True):
        if not evt.key.startswith("aten::"):
            continue
        gpu = float(getattr(evt, "self_device_time_total", 0.0)) / 1e3
        cpu = float(evt.self_cpu_time_total) / 1e3
        if gpu >= 0.02 or cpu >= 0.05:
            ops.append({"op": evt.key, "shapes": str(evt.input_shapes), "count": int(evt.count),
                        "self_device_ms": round(gpu, 4), "self_cpu_ms": round(cpu, 4)})
    ops.sort(key=lambda o: -o["self_device_ms"])
    del records, case
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_ms": round(statistics.median(wall), 3), "step_ms_all": [round(w, 3) for w in wall],
            "profiled_step_ms": round(profiled_ms, 3), "gpu_busy_ms": round(_kernel_us(prof) / 1e3, 3),
            "host_span_ms": round(_host_span_ms(prof), 3),
            "ops": ops}


def main() -> None:
    """Run the chosen configurations; write the JSON after each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="step_detail.json")
    ap.add_argument("--kind", choices=["host", "shapes"], action="append")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--models", nargs="+", help="only these models' configurations")
    ap.add_argument("--configs", nargs="+", type=int, help="only these configurations (indices into CONFIGS)")
    args = ap.parse_args()
    result = new_result()
    for i, (kind, model, knobs, policy) in enumerate(CONFIGS):
        if ((args.kind and kind not in args.kind) or (args.models and model not in args.models)
                or (args.configs and i not in args.configs)):
            continue
        row: dict[str, Any] = {"kind": kind, "model": model, "model_kwargs": knobs, "policy": policy}
        run_config(result, args.out, row, functools.partial(detail, model, knobs, policy, args.steps),
                   show=("step_ms", "gpu_busy_ms"))


if __name__ == "__main__":
    main()
