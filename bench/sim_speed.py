"""Simulator speed on this (CPU) machine: one GPT-2-medium step, and an 8 policies x 4 ratios sweep.

    python bench/sim_speed.py [--steps 3] [--out bench/results]

``gpt2_medium_step_s``: the slowest over the 8 policies at ratio 1.5 of a one-step run (a fresh
simulated GPU, no warm-up; the trace is prepared once beforehand). ``sweep_8x4_s``: 8 policies x
ratios 0.5, 1.0, 1.5, 2.0 on GPT-2-medium (bs 8 x 1024), 1 warm-up + ``--steps`` steps each,
including the one-off trace; ``band_over_plain``: the cost of that sweep's uncertainty band (each run
again at both ends of the profile constants' ranges, um_lab.sim.band) over the plain sweep's
(``sweep_with_band_over_plain``: both together). Targets: <= 0.5 s, <= 60 s and <= 2.
Writes bench/results/sim_speed.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from um_lab.models import get_model  # noqa: E402
from um_lab.policy import Advice, presets  # noqa: E402
from um_lab.sim.backend import SimBackend  # noqa: E402
from um_lab.sim.band import band_ms  # noqa: E402
from um_lab.sim.trace import clear_trace_cache  # noqa: E402
from um_lab.types import RunSpec  # noqa: E402

RATIOS = (0.5, 1.0, 1.5, 2.0)
MODEL_KWARGS = {"batch_size": 8, "seq_len": 1024}


def policies() -> list:
    """The 7 presets plus parameters prefetched before use: 8 policies."""
    extra = presets["um-default"].replace("prefetch-params", param=Advice(prefetch="to-gpu-before-use"))
    return [*presets.values(), extra]


def machine() -> str:
    """A short description of this machine."""
    return (f"{platform.node()} {platform.machine()} {os.cpu_count()} cores,"
            f" Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write the JSON; returns the result dict."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    pols = policies()
    assert len(pols) == 8

    clear_trace_cache()
    t0 = time.perf_counter()
    backend = SimBackend()
    case = get_model("gpt2-medium", **MODEL_KWARGS)
    backend.prepare(case)
    prepare_s = time.perf_counter() - t0
    rows = []
    for policy in pols:
        for ratio in RATIOS:
            spec = RunSpec(model="gpt2-medium", backend="sim", steps=args.steps, warmup_steps=1,
                           oversubscription_ratio=ratio)
            t = time.perf_counter()
            recs = list(backend.run(spec, case, policy))
            rows.append({"policy": policy.name, "ratio": ratio, "run_s": time.perf_counter() - t,
                         "step_ms": recs[-1].wall_ms, "evictions": recs[-1].evictions})
    sweep_s = time.perf_counter() - t0

    # the same sweep's uncertainty band: every run again at both ends of the profile constants' ranges
    t = time.perf_counter()
    for policy in pols:
        for ratio in RATIOS:
            spec = RunSpec(model="gpt2-medium", backend="sim", steps=args.steps, warmup_steps=1,
                           oversubscription_ratio=ratio)
            fast_ms, slow_ms = band_ms(spec, case, policy)
            row = next(r for r in rows if r["policy"] == policy.name and r["ratio"] == ratio)
            row.update(band_fast_ms=fast_ms, band_slow_ms=slow_ms)
    band_s = time.perf_counter() - t

    one_step = []
    for policy in pols:
        spec = RunSpec(model="gpt2-medium", backend="sim", steps=1, warmup_steps=0,
                       oversubscription_ratio=1.5)
        t = time.perf_counter()
        list(backend.run(spec, case, policy))
        one_step.append((time.perf_counter() - t, policy.name))
    step_s, slowest = max(one_step)

    print(f"{'policy':20s} " + " ".join(f"{'r=' + str(r):>22s}" for r in RATIOS))
    for policy in pols:
        cells = [r for r in rows if r["policy"] == policy.name]
        print(f"{policy.name:20s} " + " ".join(f"{c['step_ms']:11.1f} ms {c['run_s']:6.2f} s" for c in cells))
    print(f"\ntrace + placement (once): {prepare_s:.2f} s")
    print(f"one GPT-2-medium step (slowest policy, {slowest}, ratio 1.5): {step_s:.3f} s  (target <= 0.5 s)")
    print(f"sweep 8 policies x 4 ratios, {1 + args.steps} steps each, trace included: {sweep_s:.1f} s"
          "  (target <= 60 s)")
    print(f"uncertainty band of that sweep (2 more runs each, corner profiles prepared once): {band_s:.1f} s ="
          f" {band_s / sweep_s:.2f}x the plain sweep (target <= 2); sweep and band together"
          f" {(sweep_s + band_s) / sweep_s:.2f}x")
    result = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpt2_medium_step_s": round(step_s, 4),
        "sweep_8x4_s": round(sweep_s, 2),
        "trace_s": round(prepare_s, 2),
        "band_s": round(band_s, 2),
        "band_over_plain": round(band_s / sweep_s, 3),
        "sweep_with_band_over_plain": round((sweep_s + band_s) / sweep_s, 3),
        "steps_per_config": 1 + args.steps,
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
