"""Issue 13's table: merge bench/budget.py runs (one JSON each) and the FSDP2 peer's lines into one results
file, and print the README's table.

    python bench/budget_table.py RUN.json [RUN.json ...] --fsdp2 PEER.jsonl \\
        --predicted bench/results/budget_predicted_session12.json --note "..." --out bench/results/budget.json

Each row keeps its run's file (``source``). ``fsdp2_step_ms`` / ``fsdp2_peak_bytes`` come from the peer's
line for the same model (``bench/fsdp2_peer.py``: same model and batch, its own process; ``fsdp2_source``
names the file) where the run did not measure them itself. ``predicted_step_ms``: the pre-registered
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


def load_rows(paths: list[Path], root: Path) -> tuple[list[dict[str, Any]], str]:
    """Every row of every run (with ``source``: the file relative to ``root``) and the runs' device."""
    rows, devices = [], set()
    for path in paths:
        run = json.loads(path.read_text())
        devices.add(run.get("device", "?"))
        rows += [{**row, "source": relative(path, root)} for row in run["rows"]]
    return rows, " / ".join(sorted(devices))


def add_fsdp2(rows: list[dict[str, Any]], peer_lines: list[dict[str, Any]], source: str) -> None:
    """Fill the peer's columns of rows that lack them from its line for the same model."""
    by_model = {line["model"]: line for line in peer_lines}
    for row in rows:
        peer = by_model.get(row.get("model"))
        if peer is not None and row.get("fsdp2_step_ms") is None:
            row.update(fsdp2_step_ms=peer["fsdp2_step_ms"], fsdp2_peak_bytes=peer["fsdp2_peak_bytes"],
                       fsdp2_source=source)


def add_predictions(rows: list[dict[str, Any]], predicted: dict[str, Any]) -> None:
    """``predicted_step_ms``: the pre-registered step for the row's (model, ratio), when there is one."""
    sim = predicted.get("sim")  # a section of rows, or (session 17's files) a line saying how they were made
    sim_rows = sim.get("rows", []) if isinstance(sim, dict) else []
    rows_with_sim = [p for p in [*predicted.get("rows", []), *sim_rows]
                     if p.get("sim_step_ms") is not None]  # a file's simulator section ("sim") too
    table = {(p["model"], float(p["ratio"])): p for p in rows_with_sim if "remote_optimizer" not in p}
    # a prediction for one setting of Session(budget_remote_optimizer=...) goes to the rows with that setting only
    table.update({(p["model"], float(p["ratio"]), bool(p["remote_optimizer"])): p
                  for p in rows_with_sim if "remote_optimizer" in p})
    for row in rows:
        key = (row.get("model"), float(row.get("ratio", 0)))
        p = table.get((*key, bool(row.get("remote_optimizer", False)))) or table.get(key)
        if p is not None:
            row["predicted_step_ms"] = p.get("sim_step_ms")


def staging_cell(row: dict[str, Any]) -> str:
    """The staging column: off, on (intermediate pool managed) or on with that pool in device memory; and the
    optimizer state left in host memory (``Session(budget_remote_optimizer=True)``) where a row had some."""
    remote = f"; optimizer state remote {row['remote_bytes'] / GiB:.1f} GiB" if row.get("remote_bytes") else ""
    if not row.get("stage_activations"):
        return "off" + remote
    return ("on, device pool" if row.get("device_activations") else "on, managed pool") + remote


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
        predicted = f"{r['predicted_step_ms']:,.0f}" if r.get("predicted_step_ms") is not None else ""
        lines.append(
            f"| {r['model']} | {r['ratio']:g} | {r.get('advice', 'host')} | "
            f"{staging_cell(r)} | {telemetry} | "
            f"{r['step_ms']:,.0f} | {r['fit_step_ms']:,.0f} | {r['crossing_bytes'] / GiB:.1f} GiB | "
            f"{r['over_bound']:.2f} | {r['max_resident_ledger'] / GiB:.2f} / {r['budget_bytes'] / GiB:.2f} GiB | "
            f"{cupti} | {fsdp2} | {predicted} | {run} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench/budget.py result files")
    ap.add_argument("--fsdp2", type=Path, help="bench/fsdp2_peer.py output lines (JSONL)")
    ap.add_argument("--predicted", type=Path, help="pre-registered predictions (bench/budget.py --predict)")
    ap.add_argument("--note", default="", help="what the rows are (kept in the file)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1] / "bench" / "results"
    missing = [p for p in [*args.runs, args.fsdp2, args.predicted] if p is not None and not p.exists()]
    if missing:
        print(f"no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    rows, device = load_rows(args.runs, root)
    if args.fsdp2 is not None:
        lines = [json.loads(line) for line in args.fsdp2.read_text().splitlines() if line.strip()]
        add_fsdp2(rows, lines, relative(args.fsdp2, root))
    if args.predicted is not None:
        add_predictions(rows, json.loads(args.predicted.read_text()))
    result = {"date": datetime.date.today().isoformat(), "device": device, "link_bytes_per_s": 47e9,
              "note": args.note, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
