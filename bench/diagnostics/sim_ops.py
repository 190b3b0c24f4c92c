"""Diagnostic (CPU): simulated GPU time per aten op of one step, beside a measured per-op profile.

Runs the simulator for each configuration of a ``remote_ops.py`` result file (same model, shape and
policy, the H200 profile, the card's capacity) and prints, per op name, the measured self GPU time, the
simulated time and their ratio, so a remote-access model can be checked op class by op class:

    python bench/diagnostics/sim_ops.py bench/results/remote_ops.json [--policy act-remote]

(``bench/diagnostics/step_detail.py`` files work too: their per-shape entries are summed per op.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from um_lab.models import get_model
from um_lab.sim.backend import SimBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sim_fidelity import policy_named  # noqa: E402

#: Profiler names of the kernels CUDA runs -> the traced op they stand for (cuDNN and fused-attention ops
#: trace under their generic names on a CPU; in-place ReLU dispatches to clamp_min_).
MEASURED_AS_TRACED = {
    "aten::cudnn_convolution": "aten::convolution", "aten::cudnn_batch_norm": "aten::native_batch_norm",
    "aten::cudnn_batch_norm_backward": "aten::native_batch_norm_backward", "aten::clamp_min_": "aten::relu_",
    "aten::_efficient_attention_forward": "aten::_scaled_dot_product_efficient_attention",
    "aten::_efficient_attention_backward": "aten::_scaled_dot_product_efficient_attention_backward",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measured", type=Path, help="a bench/diagnostics/remote_ops.py result file")
    parser.add_argument("--policy", action="append", help="only these policies (repeatable)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    data = json.loads(args.measured.read_text())
    for cfg in data["configs"]:
        if "ops" not in cfg:
            continue
        if args.policy and cfg["policy"] not in args.policy:
            continue
        step_ms, traced = SimBackend("h200").op_ms(get_model(cfg["model"], **cfg["model_kwargs"]),
                                                   policy_named(cfg["policy"]))
        sim = {name.replace("aten.", "aten::"): v for name, v in traced.items()}
        measured: dict[str, tuple[int, float]] = {}
        for o in cfg["ops"]:  # a step_detail.py file has one entry per (op, input shapes)
            if o["op"].startswith("aten::") and o["self_device_ms"] > 0:
                name = MEASURED_AS_TRACED.get(o["op"], o["op"])
                n, ms = measured.get(name, (0, 0.0))
                measured[name] = (n + o["count"], ms + o["self_device_ms"])
        print(f"\n{cfg['model']} {cfg['model_kwargs']} {cfg['policy']}: measured {cfg['step_ms']:.1f} ms, "
              f"simulated {step_ms:.1f} ms")
        print(f"  {'op':44s} {'n meas':>6s} {'n sim':>6s} {'meas ms':>9s} {'sim ms':>9s} {'sim/meas':>8s}")
        names = sorted(set(measured) | set(sim), key=lambda k: -max(measured.get(k, (0, 0))[1], sim.get(k, (0, 0))[1]))
        for name in names[: args.top]:
            mc, mms = measured.get(name, (0, 0.0))
            sc, sms = sim.get(name, (0, 0.0))
            ratio = f"{sms / mms:8.2f}" if mms > 0 else "       -"
            print(f"  {name[:44]:44s} {mc:6d} {sc:6d} {mms:9.1f} {sms:9.1f} {ratio}")


if __name__ == "__main__":
    main()
