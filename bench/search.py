"""Policy search (um_lab.sim.search) against a plain greedy coordinate search, on the simulator.

    python bench/search.py [--cases gpt2-medium:1.5 bert-large:2.0] [--workers 2] [--out PATH]

For each model and ratio, first ``search_policy(workers=2)``, then the baseline: a plain greedy
coordinate search as one would write it from outside — one process, starting from ``um-default``, each
data type in turn tries all 36 options (:data:`um_lab.sim.search.OPTIONS`) with the other types fixed
and keeps the fastest (only when strictly faster), sweeps repeat until one changes nothing, and every
candidate is simulated afresh through ``SimBackend.run`` (no cache, no parallelism). Its count is
1 + 180 per sweep (541 evaluations are three sweeps). One process because that is how a
script "run from outside" drives the simulator; "2 cores" describes the machine it ran on. Both score a
candidate by the median of 4 measured steps after 2 warm-up steps and both start with an empty trace
cache, so each pays its own tracing.

Bars: the search's speed-up within 2% of the greedy's, in at most a quarter of its time and
under 2 minutes. Writes bench/results/search.json: ``{"rows": [{"model", "ratio", "speedup", "seconds",
"greedy_speedup", "greedy_seconds", "evaluations", "greedy_evaluations", ...}], ...}``.
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
sys.path.insert(0, str(ROOT / "bench"))

from paper_three_types import MODEL_KNOBS  # noqa: E402  (the project's standard shapes)

from um_lab.models import get_model  # noqa: E402
from um_lab.policy import Policy, presets  # noqa: E402
from um_lab.sim.backend import SimBackend  # noqa: E402
from um_lab.sim.profile import profile_sha256  # noqa: E402
from um_lab.sim.search import OPTIONS, option_label, search_policy  # noqa: E402
from um_lab.sim.trace import clear_trace_cache  # noqa: E402
from um_lab.summary import summarize  # noqa: E402
from um_lab.teaching import paper  # noqa: E402
from um_lab.types import DATA_TYPES, RunSpec  # noqa: E402

CASES = ("gpt2-medium:1.5", "bert-large:2.0")
STEPS, WARMUP = 4, 2
WITHIN, TIME_FRACTION, TIME_LIMIT_S = 0.02, 0.25, 120.0


def greedy(model: str, ratio: float, profile: str = "h200") -> dict:
    """The plain greedy coordinate search described in the module doc; returns its outcome."""
    start = time.perf_counter()
    backend = SimBackend(profile)
    case = get_model(model, **MODEL_KNOBS[model])
    spec = RunSpec(model=model, backend="sim", steps=STEPS, warmup_steps=WARMUP, oversubscription_ratio=ratio)

    def median_ms(policy: Policy) -> float:
        return summarize(backend.run(spec, case, policy))["median_ms"]

    best = presets["um-default"]
    baseline_ms = best_ms = median_ms(best)
    evaluations, sweeps, changed = 1, 0, True
    while changed:
        changed, sweeps = False, sweeps + 1
        for dtype in DATA_TYPES:
            choice = best[dtype]
            for option in OPTIONS:
                ms = median_ms(best.replace("greedy", **{dtype.value: option}))
                evaluations += 1
                if ms < best_ms:
                    best_ms, choice = ms, option
            if choice != best[dtype]:
                best, changed = best.replace("greedy", **{dtype.value: choice}), True
        print(f"  greedy sweep {sweeps}: {baseline_ms / best_ms:.3f}x, {evaluations} evaluations,"
              f" {time.perf_counter() - start:.0f} s", flush=True)
    return {"speedup": baseline_ms / best_ms, "seconds": time.perf_counter() - start, "evaluations": evaluations,
            "sweeps": sweeps, "policy": {t.value: option_label(best[t]) for t in DATA_TYPES}}


def run_case(model: str, ratio: float, workers: int) -> dict:
    """Search, then greedy, on one model and ratio; one result row."""
    clear_trace_cache()
    found = search_policy(model, ratio, model_kwargs=MODEL_KNOBS[model], workers=workers, steps=STEPS,
                          warmup_steps=WARMUP, progress=False)
    print(f"  {found!r}", flush=True)
    clear_trace_cache()
    base = greedy(model, ratio)
    return {
        "model": model, "ratio": ratio, "model_kwargs": MODEL_KNOBS[model],
        "speedup": round(found.speedup, 4), "seconds": round(found.seconds, 1),
        "greedy_speedup": round(base["speedup"], 4), "greedy_seconds": round(base["seconds"], 1),
        "evaluations": found.evaluations, "greedy_evaluations": base["evaluations"],
        "probe_evaluations": found.probe_evaluations, "sweeps": found.sweeps, "greedy_sweeps": base["sweeps"],
        "speedup_vs_greedy": round(found.speedup / base["speedup"], 4),
        "time_vs_greedy": round(found.seconds / base["seconds"], 3),
        "policy": {t.value: option_label(found.policy[t]) for t in DATA_TYPES}, "greedy_policy": base["policy"],
        "top5": found.ranking.head(5).round(4).to_dict(orient="records"),
    }


def meets(row: dict) -> bool:
    """The issue's bars for one row."""
    return (row["speedup"] >= (1 - WITHIN) * row["greedy_speedup"]
            and row["seconds"] <= TIME_FRACTION * row["greedy_seconds"] and row["seconds"] < TIME_LIMIT_S)


def main(argv: list[str] | None = None) -> dict:
    """Run every case, print the table, write the JSON; returns the result dict."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="model:ratio pairs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "search.json"))
    args = ap.parse_args(argv)
    rows = []
    for item in args.cases:
        model, ratio = item.split(":")
        print(f"{model} at {float(ratio)}x", flush=True)
        rows.append(run_case(model, float(ratio), args.workers))
    print(f"\n{'model':12s} {'ratio':>5s} {'search':>8s} {'s':>6s} {'evals':>6s} {'greedy':>8s} {'s':>6s}"
          f" {'evals':>6s} {'quality':>8s} {'time':>6s}  bars")
    for r in rows:
        print(f"{r['model']:12s} {r['ratio']:5.2f} {r['speedup']:7.3f}x {r['seconds']:6.1f} {r['evaluations']:6d}"
              f" {r['greedy_speedup']:7.3f}x {r['greedy_seconds']:6.1f} {r['greedy_evaluations']:6d}"
              f" {r['speedup_vs_greedy']:8.4f} {r['time_vs_greedy']:6.3f}  {'met' if meets(r) else 'MISSED'}")
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "profile": "h200", "profile_sha256": profile_sha256("h200"),
        "sim_source_sha256": paper.sim_source_sha256(),
        "workers": args.workers, "steps": STEPS, "warmup_steps": WARMUP,
        "bars": {"within": WITHIN, "time_fraction": TIME_FRACTION, "time_limit_s": TIME_LIMIT_S},
        "all_bars_met": all(meets(r) for r in rows),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
