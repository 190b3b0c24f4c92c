"""The paper's three data types on the simulator: every advice mapping x ratio x model; the best mapping.

    python bench/paper_three_types.py [--models gpt2-medium bert-large resnet50] [--ratios 0.8 1.25 1.5 2]
                                      [--steps 4] [--warmup 2] [--profile h200] [--merge] [--out PATH]

Runs :func:`um_lab.teaching.paper.run_grid` over :func:`um_lab.teaching.paper.mappings` (the candidate options per paper
group, ``um_lab.teaching.paper.GROUP_OPTIONS``), prints the best mapping per (model, ratio) and the top of the
ranking by geometric-mean speed-up over ``um-default``, and writes bench/results/paper_three_types.json
(date, machine, profile name and SHA-256, um_lab version, options, every row, the
choice). A model that cannot be built here (ResNet without torchvision) is skipped with a note;
``--merge`` keeps the other models' rows of an existing JSON made with the same profile, so a machine
with torchvision can add ResNet later (``--models resnet50 --merge``); ``--rechoose`` only recomputes
the choice from the stored rows; ``--sensitivity 3.65`` re-runs the stored experiment with evictions at
3.65 GB/s (the profile's 18 GB/s is the measured steady GPU->host prefetch rate; 3.65 GB/s was a first
GPU->host move after a machine started, bench/results/uvm_primitives.json) and adds the rankings to the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

import um_lab  # noqa: E402
from um_lab.models import get_model  # noqa: E402
from um_lab.sim.backend import SimBackend  # noqa: E402
from um_lab.sim.profile import profile_sha256  # noqa: E402
from um_lab.teaching import paper  # noqa: E402

#: Model sizes: the project's standard GPU-benchmark shapes (README), 15-35 GiB of managed data each.
MODEL_KNOBS = {
    "gpt2-medium": {"batch_size": 8, "seq_len": 1024},
    "bert-large": {"batch_size": 16, "seq_len": 512},
    "resnet50": {"batch_size": 128},
}
RATIOS = (0.8, 1.25, 1.5, 2.0)


def machine() -> str:
    """A short description of this machine."""
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}"


def buildable(backend: SimBackend, name: str, knobs: dict) -> str | None:
    """None when the model traces here, else why not (printed, and the model is skipped)."""
    try:
        backend.prepare(get_model(name, **knobs))
    except ImportError as e:
        return str(e)
    return None


def summarise(choice: paper.Choice) -> dict:
    """The JSON's ``choice`` part."""
    best = choice.best
    return {
        "rule": ("highest geometric-mean speed-up over um-default across every (model, ratio) cell; "
                 f"scores within {paper.TIE_TOLERANCE:.1%} tie and go to the mapping with fewer advice settings"),
        "best_overall": {"mapping": paper.PaperMapping.parse(best["mapping"]).to_dict(), "name": best["mapping"],
                         **{k: float(best[k]) for k in ("geomean_speedup", "time_saved", "oversubscribed_speedup",
                                                        "fits_speedup", "worst_speedup", "best_speedup")}},
        "paper_time_saved": paper.PAPER_TIME_SAVED,
        "per_cell": json.loads(choice.per_cell.to_json(orient="records")),
        "ranking_top": json.loads(choice.ranking.head(20).to_json(orient="records")),
    }


def print_report(choice: paper.Choice) -> None:
    """Print the best per cell and the top of the ranking."""
    pd.set_option("display.width", 160)
    cell = choice.per_cell.copy()
    cell["time_saved"] = (100 * cell["time_saved"]).round(1).astype(str) + "%"
    print("\nBest mapping per (model, ratio)  [params / act / input]")
    print(cell.round({"median_ms": 1, "um_default_ms": 1, "speedup": 3}).to_string(index=False))
    top = choice.ranking.head(10)[["mapping", "geomean_speedup", "time_saved", "oversubscribed_speedup",
                                   "fits_speedup", "worst_speedup"]].copy()
    print("\nTop 10 mappings by geometric-mean speed-up over um-default")
    print(top.round(3).to_string(index=False))
    b = choice.best
    print(f"\nBest overall: {b['mapping']}  geomean speed-up {b['geomean_speedup']:.3f}"
          f" (time saved {b['time_saved']:.1%}; paper: {paper.PAPER_TIME_SAVED:.1%}),"
          f" above ratio 1: {b['oversubscribed_speedup']:.3f}, at or below: {b['fits_speedup']:.3f}")


def dumps(result: dict) -> str:
    """The result as JSON: the header indented, each run on one line of ``rows.data``."""
    rows = result["rows"]
    text = json.dumps({**result, "rows": {"columns": rows["columns"], "data": "@ROWS@"}}, indent=1)
    lines = ",\n".join("   " + json.dumps(r) for r in rows["data"])
    return text.replace('"@ROWS@"', "[\n" + lines + "\n  ]") + "\n"


def rechoose(path: Path) -> dict:
    """Recompute ``choice`` of an existing results JSON from its rows (after a change to the choice rule)."""
    result = json.loads(path.read_text())
    choice = paper.choose(paper.rows_from_json(result["rows"]))
    print_report(choice)
    result["choice"] = summarise(choice)
    path.write_text(dumps(result))  # a "sensitivity" part stays as it was
    print(f"\nre-chose from {len(result['rows']['data'])} stored runs; wrote {path}")
    return result


def sensitivity(path: Path, profile: str, gbps: float) -> dict:
    """Re-run the stored experiment with evictions (GPU -> host) at ``gbps`` GB/s instead of the profile's
    value and store the outcome as ``sensitivity`` in the JSON (the rankings, not the runs)."""
    result = json.loads(path.read_text())
    backend = SimBackend(profile)
    if result.get("profile_sha256") != profile_sha256(backend.profile):
        raise SystemExit(f"{path} was made with another profile; re-run the experiment first")
    t0 = time.perf_counter()
    what_if = dataclasses.replace(backend.profile, name=f"{backend.profile.name}-evict-{gbps:g}",
                                  evict_d2h_GBps=gbps)
    print(f"what if evictions ran at {gbps:g} GB/s (profile: {backend.profile.evict_d2h_GBps:g})", flush=True)
    table = paper.run_grid(result["models"], result["ratios"], paper.mappings(result["group_options"]),
                           steps=result["steps"], warmup_steps=result["warmup_steps"], backend=SimBackend(what_if),
                           progress=True)
    choice = paper.choose(table)
    print_report(choice)
    chosen = result["choice"]["best_overall"]["name"]
    rank = choice.ranking.reset_index(drop=True)
    position = int(rank.index[rank["mapping"] == chosen][0])
    score = float(rank.loc[position, "geomean_speedup"])
    place = 1 + int((rank["geomean_speedup"] > score * (1 + paper.TIE_TOLERANCE)).sum())  # ties share a place
    cols = ["mapping", "geomean_speedup", "oversubscribed_speedup", "fits_speedup"]
    result["sensitivity"] = {
        "changed": "evict_d2h_GBps", "value": gbps, "profile_value": backend.profile.evict_d2h_GBps,
        "why": ("eviction is not measured (nothing is oversubscribed here): the profile prices it at the measured"
                " GPU->host prefetch rate, which spans 3.65 GB/s (a first GPU->host move after a machine starts) to"
                " 18.3 GB/s (repeated cycles), bench/results/uvm_primitives.json"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "best_overall": choice.best["mapping"],
        "chosen_mapping": chosen, "chosen_mapping_place": place, "n_mappings": len(rank),
        "chosen_mapping_geomean_speedup": score,
        "per_cell": json.loads(choice.per_cell.to_json(orient="records")),
        "ranking": {"columns": cols, "data": rank[cols].round(4).astype(object).to_numpy().tolist()},
    }
    print(f"\nthe chosen mapping {chosen} places {place} of {len(rank)} under the what-if ({score:.3f}x;"
          f" ties within {paper.TIE_TOLERANCE:.1%} share a place); best: {choice.best['mapping']}")
    path.write_text(dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment, print the tables, write the JSON; returns the result dict."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_KNOBS), choices=list(MODEL_KNOBS))
    ap.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--merge", action="store_true", help="keep other models' rows of an existing JSON")
    ap.add_argument("--rechoose", action="store_true", help="only recompute the choice of an existing JSON")
    ap.add_argument("--sensitivity", type=float, metavar="GBPS",
                    help="re-run the stored experiment with evictions at GBPS GB/s; add it to the existing JSON")
    ap.add_argument("--out", default=str(paper.results_path(ROOT)))
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.rechoose:
        return rechoose(out)
    if args.sensitivity is not None:
        return sensitivity(out, args.profile, args.sensitivity)

    t0 = time.perf_counter()
    backend = SimBackend(args.profile)
    profile_hash = profile_sha256(backend.profile)
    models, skipped = {}, {}
    for name in args.models:
        why = buildable(backend, name, MODEL_KNOBS[name])
        if why is None:
            models[name] = MODEL_KNOBS[name]
        else:
            skipped[name] = why
            print(f"NOTE: skipping {name}: it cannot be built on this machine ({why})", flush=True)
    grid = paper.mappings()
    print(f"{len(grid)} mappings x {len(args.ratios)} ratios x {len(models)} models"
          f" ({', '.join(models) or 'none'}), {args.warmup} warm-up + {args.steps} steps each", flush=True)
    table = (paper.run_grid(models, args.ratios, grid, steps=args.steps, warmup_steps=args.warmup,
                            backend=backend, progress=True) if models else pd.DataFrame())
    if args.merge and out.is_file():
        old = json.loads(out.read_text())
        if old.get("profile_sha256") != profile_hash:
            raise SystemExit(f"--merge: {out} was made with another profile ({old.get('profile_sha256')}); re-run all")
        kept = paper.rows_from_json(old["rows"])
        kept = kept[~kept["model"].isin(list(models))]
        table = pd.concat([kept, table], ignore_index=True) if len(table) else kept
        models = {**old.get("models", {}), **models}
        skipped = {k: v for k, v in skipped.items() if k not in models}
    if table.empty:
        raise SystemExit("no model could be built here; nothing to write")
    rows = paper.rows_to_json(table)
    choice = paper.choose(paper.rows_from_json(rows))  # exactly what a reader of the JSON re-derives
    print_report(choice)
    elapsed = time.perf_counter() - t0
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "profile": backend.profile.name,
        "profile_sha256": profile_hash,
        "sim_source_sha256": paper.sim_source_sha256(),
        "um_lab_version": um_lab.__version__,
        "paper": paper.PAPER,
        "models": models,
        "skipped_models": skipped,
        "ratios": sorted({float(r) for r in table["ratio"]}),
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "options": {k: v.to_dict() for k, v in paper.OPTIONS.items()},
        "group_options": {g: list(o) for g, o in paper.GROUP_OPTIONS.items()},
        "left_out": {f"{g}: {o}": why for (g, o), why in paper.LEFT_OUT.items()},
        "n_mappings": len(grid),
        "elapsed_s": round(elapsed, 1),
        "choice": summarise(choice),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result))
    print(f"\n{len(table)} runs in {elapsed:.0f} s; wrote {out}")
    return result


if __name__ == "__main__":
    main()
