"""Dashboard overhead: host time per training step with the live dashboard attached vs without.

Runs inside a real Jupyter kernel (started with jupyter_client), because that is where the dashboard
lives: its ``FigureWidget`` is displayed, so every redraw is serialised and sent over the kernel's
comm channel as it would be to JupyterLab. One dashboard serves every "on" run, reset before each,
as the lab panel reuses its own. In one kernel, ``--repeats`` pairs of runs alternate
off/on (order flipped every pair). Each run is a :class:`um_lab.runs.runner.Run` of the same spec on one
shared backend; the time per step is the host wall time between consecutive records (warm-up steps
left out): ``mean`` (total time / steps: what a user waits; the bar is on it) and ``median``.

    python bench/dashboard_overhead.py --config sim             # CPU: the quick start's model at 1.5x
    python bench/dashboard_overhead.py --config cuda            # GPU: ResNet-50 bs 128, um-default
    python bench/dashboard_overhead.py --config cuda-small      # GPU: short steps (GPT-2-small, 4 layers)

Prints a table and merges its row (one per config and kernel/no-kernel) into
bench/results/dashboard_overhead.json: ``{"date", "rows": [{"config", "backend", "device", "date", "off_ms",
"on_ms", "on_over_off", "pair_ratios", ...}]}``. Bar: on/off <= 1.02.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "dashboard_overhead.json"
CONFIGS = {  # name: (backend, RunSpec fields)
    "sim": ("sim", {"model": "gpt2-small", "model_kwargs": {"n_layer": 4, "batch_size": 4, "seq_len": 256},
                    "oversubscription_ratio": 1.5, "steps": 20000, "warmup_steps": 2}),
    "cuda": ("cuda", {"model": "resnet50", "model_kwargs": {"batch_size": 128}, "steps": 60, "warmup_steps": 5}),
    # short GPU steps, where Python on the host is a large part of a step (the quick start's model)
    "cuda-small": ("cuda", {"model": "gpt2-small", "model_kwargs": {"n_layer": 4, "batch_size": 4, "seq_len": 256},
                            "steps": 400, "warmup_steps": 5}),
}


def measure(config_name: str, repeats: int, steps: int | None, display_widget: bool = True) -> dict[str, Any]:
    """Alternate off/on runs in this process; returns per-run step times and the medians over repeats."""
    import numpy as np

    from um_lab.backend import get_backend
    from um_lab.runs.runner import Run
    from um_lab.types import RunSpec
    from um_lab.widgets import LiveDashboard

    backend, config = CONFIGS[config_name][0], dict(CONFIGS[config_name][1])
    if steps is not None:
        config["steps"] = steps
    spec = RunSpec(backend=backend, policy="um-default", **config)
    shared = get_backend(backend, telemetry="auto") if backend == "cuda" else get_backend(backend)
    runs: list[dict[str, Any]] = []
    shared_board = LiveDashboard()
    if display_widget:
        from IPython.display import display

        display(shared_board.widget)
    out_dir = Path("/tmp/um_lab_dashboard_bench")
    for pair in range(repeats + 1):  # pair 0 warms up (traces, cuDNN autotuning) and is dropped
        for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
            stamps: list[float] = []
            warm = [0]

            def stamp(record: Any, stamps: list[float] = stamps, warm: list[int] = warm) -> None:
                stamps.append(time.perf_counter())
                warm[0] += bool(record.warmup)

            active = Run(spec, out_dir=out_dir, backend=shared)
            active.add_listener(stamp)
            board = None
            if mode == "on":  # one board for all runs, reset before each, as the lab panel does
                board = shared_board
                board.reset()
                redraws_before, draw_s_before = board.redraws, board.draw_seconds
                board.attach(active)
            for _ in active:
                pass
            if board is not None:
                board.finish()
            gaps = np.diff(stamps[max(warm[0] - 1, 0):]) * 1e3
            if pair:
                runs.append({"pair": pair, "mode": mode, "mean_ms": float(gaps.mean()),
                             "median_ms": float(np.median(gaps)), "steps": int(len(gaps)),
                             "redraws": board.redraws - redraws_before if board else 0,
                             "draw_s": round(board.draw_seconds - draw_s_before, 4) if board else 0.0,
                             "status": active.status})
    result: dict[str, Any] = {"backend": backend, "config": config_name, "spec": spec.to_dict(), "runs": runs}
    for stat in ("mean_ms", "median_ms"):
        for mode in ("off", "on"):
            result[f"{mode}_{stat}"] = statistics.median(r[stat] for r in runs if r["mode"] == mode)
    by_pair = {(r["pair"], r["mode"]): r["mean_ms"] for r in runs}
    result["pair_ratios"] = [round(by_pair[(p, "on")] / by_pair[(p, "off")], 4) for p in range(1, repeats + 1)]
    return result


def in_kernel(config_name: str, repeats: int, steps: int | None, timeout: float) -> dict[str, Any]:
    """Run :func:`measure` inside a fresh Jupyter kernel (the dashboard's real home) and return its result."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    lines: list[str] = []
    errors: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            lines.append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))

    code = (f"import sys, json; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'bench')!r}]\n"
            "from dashboard_overhead import measure\n"
            f"print('RESULT ' + json.dumps(measure({config_name!r}, {repeats}, {steps!r})))\n")
    try:
        kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = "".join(lines)
    if errors or "RESULT " not in text:
        raise RuntimeError(f"the kernel run failed:\n{''.join(errors)}\n{text[-2000:]}")
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def device_name(backend: str) -> str:
    """The GPU's name (cuda), else the CPU's."""
    if backend == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU ({platform.node()})"


def main(argv: list[str] | None = None) -> int:
    """Measure one backend, print the table, merge the row into the results JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="sim",
                   help="sim (CPU), cuda (ResNet-50 bs 128) or cuda-small (GPT-2-small 4 layers: short steps)")
    p.add_argument("--repeats", type=int, default=4, help="off/on pairs (after one warm-up pair)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the backend's config)")
    p.add_argument("--no-kernel", action="store_true", help="measure in this process (no comm traffic)")
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started = time.time()
    if args.no_kernel:
        result = measure(args.config, args.repeats, args.steps, display_widget=False)
    else:
        result = in_kernel(args.config, args.repeats, args.steps, args.timeout)
    backend = result["backend"]
    row = {"config": args.config, "backend": backend, "device": device_name(backend), "model": result["spec"]["model"],
           "in_kernel": not args.no_kernel, "repeats": args.repeats,
           "steps": result["spec"]["steps"], "off_ms": round(result["off_mean_ms"], 4),
           "on_ms": round(result["on_mean_ms"], 4),
           "on_over_off": round(result["on_mean_ms"] / result["off_mean_ms"], 4),
           "off_median_ms": round(result["off_median_ms"], 4), "on_median_ms": round(result["on_median_ms"], 4),
           "median_on_over_off": round(result["on_median_ms"] / result["off_median_ms"], 4),
           "pair_ratios": result["pair_ratios"], "pair_ratio_median": statistics.median(result["pair_ratios"]),
           "redraws_per_on_run": [r["redraws"] for r in result["runs"] if r["mode"] == "on"],
           "python": platform.python_version(), "seconds": round(time.time() - started, 1),
           "date": datetime.date.today().isoformat()}
    print(f"{'config':10s} {'device':32s} {'off ms':>10s} {'on ms':>10s} {'on/off':>8s} {'median on/off':>14s}")
    print(f"{row['config']:10s} {row['device'][:32]:32s} {row['off_ms']:10.4f} {row['on_ms']:10.4f} "
          f"{row['on_over_off']:8.4f} {row['median_on_over_off']:14.4f}   (bar: on/off <= 1.02)")
    print(f"on/off per pair: {row['pair_ratios']}")
    data = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    data["date"] = datetime.date.today().isoformat()
    key = (args.config, row["in_kernel"])
    data["rows"] = [r for r in data.get("rows", []) if (r.get("config", r.get("backend")), r.get("in_kernel")) != key]
    data["rows"].append(row)
    data.setdefault("runs", {})[f"{args.config}{'' if row['in_kernel'] else '-no-kernel'}"] = result["runs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
