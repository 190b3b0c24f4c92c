"""The budget scheduler on a smaller GPU, simulated: the layer-ahead scheduler against the driver's demand
paging under real oversubscription (the shared H200 must never be oversubscribed, so this runs on the simulator
only).

    python bench/budget_vs_paging.py                                  # GPT-2-large and GPT-2-XL at 1.5, 2, 3
    python bench/budget_vs_paging.py --models gpt2-large --ratios 2 --no-band --out /tmp/paging.json

Each model runs on a simulated card whose capacity is its footprint / ratio: ``um-default`` (Unified Memory as the
driver pages it, faults and evictions on demand) beside ``layer-ahead`` and ``layer-ahead-staged`` (the scheduler,
with B = the capacity, and with activations staged through pinned memory) through :func:`um_lab.compare`, with the
simulator's uncertainty band (every profile constant at the fast and the slow end of its measured or stated range:
the eviction rate alone spans 3.65-18.3 GB/s). Prints a table and writes JSON (``bench/results/budget_vs_paging.json``).
The batch sizes are bench/budget.py's, so the scheduler's rows are the ones its predictions hold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from um_lab import compare  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {  # bench/budget.py's batches
    "gpt2-large": {"batch_size": 4, "seq_len": 1024},
    "gpt2-xl": {"batch_size": 2, "seq_len": 1024},
}
POLICIES = ("um-default", "layer-ahead", "layer-ahead-staged")
COLUMNS = ("model", "policy", "ratio", "steps", "median_ms", "band_fast_ms", "band_slow_ms", "speedup_vs_um-default",
           "speedup_band_lo", "speedup_band_hi", "migrated_bytes", "gpu_page_faults", "status")


def run(models: list[str], ratios: list[float], steps: int, band: bool) -> list[dict[str, Any]]:
    """One :func:`um_lab.compare` per model: its rows (the columns above, where the table has them)."""
    rows: list[dict[str, Any]] = []
    for name in models:
        kwargs = dict(MODELS.get(name, {}))
        batch = kwargs.pop("batch_size", None)
        began = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # staging's "experimental" warning, once per run
            table = compare(models=(name,), policies=POLICIES, ratios=ratios, backend="sim", steps=steps,
                            warmup_steps=1, batch_size=batch, model_kwargs=kwargs or None, band=band,
                            keep_going=True)
        for record in table.to_dict("records"):
            rows.append({k: _plain(record[k]) for k in COLUMNS if k in record})
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
    return rows


def _plain(value: Any) -> Any:
    """A JSON-able number or string (numpy scalars and NaN out)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README's table: step and speed-up over demand paging, with the band where there is one."""
    lines = ["| model | ratio | policy | step ms (band) | × um-default (band) | migrated GB / step | faults / step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "complete" or r.get("median_ms") is None:
            lines.append(f"| {r['model']} | {r['ratio']:g} | {r['policy']} | {r.get('status')} | | | |")
            continue
        steps = max(1, int(r.get("steps") or 1))  # the table's byte and fault columns are totals over them
        ends = sorted((r["band_fast_ms"], r["band_slow_ms"])) if r.get("band_fast_ms") is not None else None
        step_band = f" ({ends[0]:,.0f}–{ends[1]:,.0f})" if ends else ""  # the fast end is not always the faster step
        speed_band = (f" ({r['speedup_band_lo']:.2f}–{r['speedup_band_hi']:.2f})"
                      if r.get("speedup_band_lo") is not None else "")
        lines.append(f"| {r['model']} | {r['ratio']:g} | {r['policy']} | {r['median_ms']:,.0f}{step_band} | "
                     f"{r['speedup_vs_um-default']:.2f}{speed_band} | "
                     f"{(r.get('migrated_bytes') or 0) / steps / 1e9:,.0f} | "
                     f"{(r.get('gpu_page_faults') or 0) // steps:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--ratios", nargs="+", type=float, default=[1.5, 2.0, 3.0])
    ap.add_argument("--steps", type=int, default=3, help="simulated steps per run (steady after the first)")
    ap.add_argument("--no-band", action="store_true", help="skip the uncertainty band (three times faster)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget_vs_paging.json")
    ap.add_argument("--table", type=Path, help="print the table of a results file written before, and stop")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())["rows"]))
        return 0
    if any(r <= 1 for r in args.ratios):
        ap.error("--ratios must be above 1: the card is oversubscribed by that much")
    rows = run(args.models, args.ratios, args.steps, not args.no_band)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "backend": "sim (h200 profile)",
                                    "band": not args.no_band, "rows": rows}, indent=1) + "\n")
    print(markdown(rows))
    print(f"wrote {args.out}")
    return 0 if all(r.get("status") == "complete" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
