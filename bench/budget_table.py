"""The budget table: merge bench/budget.py runs (one JSON each) and the FSDP2 peer's lines into one results
file, and print the table (markdown).

    python bench/budget_table.py RUN.json [RUN.json ...] --fsdp2 PEER.jsonl \\
        --predicted bench/results/budget_predicted.json --note "..." --out bench/results/budget.json
    python bench/budget_table.py OLD.json@gpt2-large:1.5,gpt2-xl:1.5 NEW.json ...   # some rows of a run only
    python bench/budget_table.py PLANNED.json ... --planner --predicted bench/results/budget_predicted.json \
        --out bench/results/budget.json       # rows of bench/budget.py --recompute auto --peers into its key planner

Each row keeps its run's file (``source``). ``fsdp2_step_ms`` / ``fsdp2_peak_bytes`` come from the peer's
line for the same model (same model and batch, its own process; ``fsdp2_source``
names the file) where the run did not measure them itself (older runs; bench/peers.py measures every peer in
the run now). ``predicted_step_ms``: the pre-registered
simulator prediction for the row's model and ratio, where the predictions file has one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

GiB = 1 << 30


def relative(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies inside it, else as given."""
    return str(path.resolve().relative_to(root.resolve())) if path.resolve().is_relative_to(root.resolve()) \
        else str(path)


def run_spec(spec: str) -> tuple[Path, set[tuple[str, float]] | None]:
    """``RUN.json`` (every row) or ``RUN.json@model:ratio,model:ratio`` (those rows only)."""
    path, _, chosen = spec.partition("@")
    if not chosen:
        return Path(path), None
    picks = set()
    for item in chosen.split(","):
        model, _, ratio = item.rpartition(":")
        picks.add((model, float(ratio)))
    return Path(path), picks


def load_rows(specs: list[str], root: Path) -> tuple[list[dict[str, Any]], str]:
    """The rows of every run (:func:`run_spec`; with ``source``: the file relative to ``root``) and the runs'
    device."""
    rows, devices = [], set()
    for spec in specs:
        path, picks = run_spec(spec)
        run = json.loads(path.read_text())
        devices.add(run.get("device", "?"))
        rows += [{**row, "source": relative(path, root)} for row in run["rows"]
                 if picks is None or (row.get("model"), float(row.get("ratio", 0))) in picks]
    return rows, " / ".join(sorted(devices))


def add_fsdp2(rows: list[dict[str, Any]], peer_lines: list[dict[str, Any]], source: str) -> None:
    """Fill the peer's columns of rows that lack them from its line for the same model."""
    by_model = {line["model"]: line for line in peer_lines}
    for row in rows:
        peer = by_model.get(row.get("model"))
        if peer is not None and row.get("fsdp2_step_ms") is None:
            row.update(fsdp2_step_ms=peer["fsdp2_step_ms"], fsdp2_peak_bytes=peer["fsdp2_peak_bytes"],
                       fsdp2_source=source)


#: settings a prediction may name: it then goes to rows run with that setting only (a row's default when absent)
SETTINGS = {"remote_optimizer": False, "device_activations": False, "partial_staging": False}


def add_predictions(rows: list[dict[str, Any]], predicted: dict[str, Any], source_prefix: str = "") -> None:
    """``predicted_step_ms`` (the simulator's step) and ``predicted_range_ms`` (a hand range) registered for the
    row's model and ratio, for rows whose ``source`` starts with ``source_prefix``. A prediction naming one of
    :data:`SETTINGS` or ``telemetry`` goes to rows with that setting only (telemetry off where it names none); the
    one naming the most of them wins."""
    sim = predicted.get("sim")  # a section of rows, or (in older files) a line saying how they were made
    sim_rows = sim.get("rows", []) if isinstance(sim, dict) else []
    candidates = [p for p in [*predicted.get("rows", []), *sim_rows]  # a file's simulator section ("sim") too
                  if "ratio" in p and (p.get("sim_step_ms") is not None or p.get("predicted_step_ms") is not None)]
    for row in rows:
        if not str(row.get("source", "")).startswith(source_prefix):
            continue
        # remote state updated in place takes only a prediction that says it simulated that (older ones weighed the
        # copies), and state copied only one that does not say it was updated in place
        remote = bool(row.get("remote_bytes"))
        in_place, copying = remote and row.get("remote_copies") is False, remote and bool(row.get("remote_copies"))
        telemetry = bool(row.get("telemetry") or row.get("max_resident_cupti") is not None)
        matches = [p for p in candidates
                   if p["model"] == row.get("model") and float(p["ratio"]) == float(row.get("ratio", 0))
                   and bool(p.get("telemetry")) == telemetry
                   and all(bool(row.get(k, d)) == bool(p[k]) for k, d in SETTINGS.items() if k in p)
                   and (not in_place or p.get("remote_copies") is False)
                   and (not copying or p.get("remote_copies") is not False)]
        sims = [p for p in matches if p.get("sim_step_ms") is not None]
        hands = [p for p in matches
                 if isinstance(p.get("predicted_step_ms"), list) and len(p["predicted_step_ms"]) == 2]
        if sims:  # the simulator's step and the hand range each from its own most specific prediction
            row["predicted_step_ms"] = _most_specific(sims)["sim_step_ms"]
        if hands:
            row["predicted_range_ms"] = _most_specific(hands)["predicted_step_ms"]


def fill_sim_from_predictions(rows: list[dict[str, Any]]) -> None:
    """The ``sim_step_ms`` of a row its run did not simulate (``--no-sim``): its pre-registered prediction,
    marked ``sim_step_source: "prediction"`` (a run's own simulation, at its measured footprint, is kept)."""
    for row in rows:
        if row.get("sim_error") or row.get("error"):
            continue  # the run's own simulation failed, or the row did not run: not hidden behind a prediction
        if row.get("sim_step_ms") is None and row.get("predicted_step_ms") is not None:
            row["sim_step_ms"] = row["predicted_step_ms"]
            row["sim_step_source"] = "prediction"


def _most_specific(predictions: list[dict[str, Any]]) -> dict[str, Any]:
    """The last of the predictions naming the most of :data:`SETTINGS`."""
    return max(reversed(predictions), key=lambda p: sum(k in p for k in SETTINGS))


#: what a planner row keeps of its run's row (the per-step lists that judge it included)
PLANNER_FIELDS = ("model", "precision", "ratio", "advice", "footprint_bytes", "budget_bytes", "fit_step_ms", "plan",
                  "step_ms", "step_ms_all", "measured_from_step", "crossing_bytes", "bound_ms", "over_bound",
                  "max_resident_ledger", "over_budget_steps", "followed_plan", "idle_steps", "held_bytes_all",
                  "peers", "best_peer", "best_peer_ms", "over_best_peer", "sim_step_ms", "machine_calibrated_ms")


def planner_rows(runs: list[tuple[dict[str, Any], str]], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``bench/budget.py --recompute auto --peers`` runs (each with its file), beside the planner's
    committed prediction for the same model, precision and ratio (``predicted["planned"]``): ``over_fit_step``,
    ``sim_error`` (against the prediction at the measured B), ``committed_prediction`` and ``committed_error``
    (at the simulated footprint / ratio), ``machine_calibrated_error`` (against the plan priced on the profile
    fitted to the run's machine, ``--machine-calibrate``), the run's ``device`` and ``date``."""
    committed = {(r["model"], r["precision"], float(r["ratio"])): r["step_ms"]
                 for r in (predicted.get("planned") or {}).get("rows", [])}
    out = []
    for run, source in runs:
        for r in run["rows"]:
            if "plan" not in r or (r.get("step_ms") is None and not r.get("error")):
                continue
            row = {k: r.get(k) for k in PLANNER_FIELDS}
            c = committed.get((r["model"], r["precision"], float(r["ratio"])))
            row.update(committed_prediction=c, device=run.get("device", "?"), date=str(run.get("date", ""))[:10],
                       source=source)
            if r.get("step_ms") is None:  # the plan was refused on the GPU: the row keeps why
                row.update(error=r["error"], over_fit_step=None, sim_error=None, committed_error=None,
                           machine_calibrated_error=None)
            else:
                row.update(over_fit_step=r["step_ms"] / r["fit_step_ms"],
                           sim_error=r["step_ms"] / r["sim_step_ms"] - 1 if r.get("sim_step_ms") else None,
                           committed_error=r["step_ms"] / c - 1 if c else None,
                           machine_calibrated_error=(r["step_ms"] / r["machine_calibrated_ms"] - 1
                                                     if r.get("machine_calibrated_ms") else None))
            out.append(row)
    return out


def merge_planner(results: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``results`` (budget.json) with ``rows`` in its key ``planner``: a row replaces the one of the same model,
    precision, ratio and device; the others stay."""
    section = dict(results.get("planner") or {})
    new = {(r["model"], r["precision"], r["ratio"], r["device"]) for r in rows}
    kept = [r for r in section.get("rows", [])
            if (r["model"], r["precision"], r["ratio"], r.get("device")) not in new]
    section.update(rows=kept + rows, date=datetime.date.today().isoformat(), device="per row")
    return {**results, "planner": section}


def staging_cell(row: dict[str, Any]) -> str:
    """The staging column: off, on (intermediate pool managed) or on with that pool in device memory; and the
    optimizer state left in host memory (``Session(budget_remote_optimizer=True)``) where a row had some."""
    how = " copied" if row.get("remote_copied_bytes") else " in place"  # older runs: always in place
    remote = f"; optimizer state remote {row['remote_bytes'] / GiB:.1f} GiB{how}" if row.get("remote_bytes") else ""
    if row.get("remote_optimizer") is False and row.get("prefetched_bytes"):
        remote = "; optimizer state moved"
    if not row.get("stage_activations"):
        return "off" + remote
    tail = f", last {row['tail_kept_bytes'] / GiB:.2f} GiB kept" if row.get("tail_kept_bytes") else ""
    return ("on, device pool" if row.get("device_activations") else "on, managed pool") + tail + remote


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README's table: one line per measured row."""
    head = ("| model | ratio | advice | staging | CUPTI | step ms | fits ms | crossing / step | × bound | "
            "ledger max / B | CUPTI max | FSDP2 ms (peak GiB) | predicted ms | run |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        run = r.get("source", "")
        if r.get("step_ms") is None:
            lines.append(f"| {r.get('model')} | {r.get('ratio')} | | | | error: {r.get('error', '?')} | | | | | | | | "
                         f"{run} |")
            continue
        cupti = f"{r['max_resident_cupti'] / GiB:.2f} GiB" if r.get("max_resident_cupti") else ""
        telemetry = "on" if r.get("telemetry") or r.get("max_resident_cupti") else "off"
        fsdp2 = (f"{r['fsdp2_step_ms']:,.0f} ({r['fsdp2_peak_bytes'] / GiB:.1f})"
                 if r.get("fsdp2_step_ms") is not None else "")
        hand = r.get("predicted_range_ms")
        predicted = " / ".join(
            ([f"{r['predicted_step_ms']:,.0f} (sim)"] if r.get("predicted_step_ms") is not None else [])
            + ([f"{hand[0]:,}–{hand[1]:,}"] if hand else []))
        lines.append(
            f"| {r['model']} | {r['ratio']:g} | {r.get('advice', 'host')} | "
            f"{staging_cell(r)} | {telemetry} | "
            f"{r['step_ms']:,.0f} | {r['fit_step_ms']:,.0f} | {r['crossing_bytes'] / GiB:.1f} GiB | "
            f"{r['over_bound']:.2f} | {r['max_resident_ledger'] / GiB:.2f} / {r['budget_bytes'] / GiB:.2f} GiB | "
            f"{cupti} | {fsdp2} | {predicted} | {run} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench/budget.py result files, each as FILE or FILE@model:ratio,...")
    ap.add_argument("--fsdp2", type=Path, help="bench/fsdp2_peer.py output lines (JSONL)")
    ap.add_argument("--predicted", action="append", default=[],
                    help="pre-registered predictions (bench/budget.py --predict), as FILE or FILE@SOURCE_PREFIX (for "
                         "the rows of runs whose path relative to bench/results starts with it); may be repeated")
    ap.add_argument("--note", default="", help="what the rows are (kept in the file)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--planner", action="store_true",
                    help="the runs are the memory planner's (--recompute auto --peers): merge them into --out's key "
                         "planner beside the committed predictions (the first --predicted file)")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1] / "bench" / "results"
    predictions = [(Path(f), prefix) for f, _, prefix in (spec.partition("@") for spec in args.predicted)]
    missing = [p for p in [*(run_spec(r)[0] for r in args.runs), args.fsdp2, *(f for f, _ in predictions)]
               if p is not None and not p.exists()]
    if missing:
        print(f"no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    if args.planner:
        runs = [(json.loads(path.read_text()), relative(path, root)) for path in (run_spec(r)[0] for r in args.runs)]
        predicted = json.loads(predictions[0][0].read_text()) if predictions else {}
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged = merge_planner(results, planner_rows(runs, predicted))
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
        for r in merged["planner"]["rows"]:
            step = f"{r['step_ms']:.1f} ms" if r.get("step_ms") is not None else f"refused ({r.get('error')})"[:160]
            print(f"{r['model']} {r['precision']} at {r['ratio']}: {step}, best peer "
                  f"{r.get('best_peer')} {r.get('best_peer_ms') or float('nan'):.1f} ms, {r.get('device')}")
        return 0
    rows, device = load_rows(args.runs, root)
    if args.fsdp2 is not None:
        lines = [json.loads(line) for line in args.fsdp2.read_text().splitlines() if line.strip()]
        add_fsdp2(rows, lines, relative(args.fsdp2, root))
    for path, prefix in predictions:
        add_predictions(rows, json.loads(path.read_text()), prefix)
    fill_sim_from_predictions(rows)
    result = {"date": datetime.date.today().isoformat(), "device": device, "link_bytes_per_s": 47e9,
              "note": args.note, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
