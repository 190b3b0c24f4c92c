"""The simulator's fidelity results (``bench/results/sim_fidelity*.json``) as tables.

Each measured row is put in one of three sets, as ``bench/sim_fidelity.py`` and the README define them:

* ``fitted``: the H200 profile's constants were fitted on these rows (MLP, GPT-2 small/medium): in-sample.
* ``hand-set``: ResNet-50 bs 32; host costs and the convolution tile were once set by hand after seeing
  them, and ResNet-50 is one of the models the per-op fits (:mod:`um_lab.sim.step_fit`) use: not a test.
* ``held-out 2026-11-30 07:56`` and on: the held-out checks, oldest first, each named by when its predictions
  were written and kept in ``sim_fidelity_heldout/<that time>/``: ``predicted.json`` committed before the rows
  were measured; once measured, ``measured.json`` holds the measurements (re-simulated since with later profiles
  for the older ones, so no longer blind) and those predictions under ``predictions``. :data:`HELDOUT` lists the
  checks measured (the corpus check of 2026-12-06 on the H200, its first measurement, on an H100, beside; the corpus
  check of 2026-12-07 on an H100 alone, with the profile fitted to that machine's probes beside the blind H200 one).

error = simulated / measured - 1.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from um_lab.errors import UmLabError

#: the held-out checks, oldest first: folders of ``sim_fidelity_heldout/`` named by when the predictions were written
HELDOUT = ("2026-11-30T0756", "2026-12-01T0344", "2026-12-01T0545", "2026-12-01T0602", "2026-12-01T0959",
           "2026-12-01T2124", "2026-12-02T0134", "2026-12-06T0710", "2026-12-07T1730", "2026-12-08T0014",
           "2026-12-08T0038")


def heldout_label(folder: str) -> str:
    """The set name of a held-out check from its folder, e.g. ``held-out 2026-12-01 03:44``."""
    day, _, time = folder.partition("T")
    return f"held-out {day} {time[:2]}:{time[2:4]}" if len(time) >= 4 else f"held-out {folder}"


SETS = ("fitted", "hand-set", *(heldout_label(h) for h in HELDOUT))  #: every set, in the order tables show them
FILES = ("sim_fidelity.json", *(f"sim_fidelity_heldout/{h}/measured.json" for h in HELDOUT))
PREDICTED = tuple(f"sim_fidelity_heldout/{h}/predicted.json" for h in HELDOUT)  #: a set not yet measured
BAND = 0.15  #: the bar on the median |error|; also the band drawn around y = x


class FidelityResultsMissing(UmLabError, FileNotFoundError):
    """The fidelity JSON files are not where they should be (e.g. an installed package without bench/)."""


def results_dir() -> Path:
    """``bench/results`` of the source tree um_lab was imported from."""
    import um_lab

    return Path(um_lab.__file__).resolve().parents[1] / "bench" / "results"


def config_label(kwargs: dict[str, Any]) -> str:
    """A short label for a model's size knobs, e.g. ``bs 8 × 1024`` or ``width 8192``."""
    kw = dict(kwargs or {})
    parts = []
    if "batch_size" in kw:
        seq = kw.pop("seq_len", None)
        parts.append(f"bs {kw.pop('batch_size')}" + (f" × {seq}" if seq else ""))
    parts += [f"{k} {v}" for k, v in sorted(kw.items())]
    return ", ".join(parts) or "default"


def _set_of(row: dict[str, Any], folder: str | None) -> str:
    """The set of a measured row: the held-out check whose folder it was read from, else its ``heldout_set``,
    else fitted or hand-set."""
    if folder is not None:
        return heldout_label(folder)
    if row.get("heldout_set"):
        return heldout_label(row["heldout_set"])
    return "fitted" if row.get("fitted") else "hand-set"


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["model"], json.dumps(row.get("model_kwargs") or {}, sort_keys=True), row["policy"]


def load_fidelity(folder: str | Path | None = None) -> pd.DataFrame:
    """Every measured row of the fidelity files, one per configuration (the newest file wins).

    Columns: set, model, config, policy, ratio, measured_ms, simulated_ms, error, abs_error,
    committed_prediction_ms (the prediction written before measuring, held-out rows), the simulator's
    counters of a timed step (sim_faults, sim_evictions, sim_htod_GB, sim_remote_GB), label, short_label,
    source, date.
    Raises :class:`FidelityResultsMissing` when ``sim_fidelity.json`` is absent.
    """
    folder = Path(folder) if folder is not None else results_dir()
    if not (folder / FILES[0]).is_file():
        raise FidelityResultsMissing(f"no {FILES[0]} in {folder}: the fidelity results live in the source tree's "
                                     "bench/results/ (run bench/sim_fidelity.py on a GPU to make them)")
    predicted: dict[tuple[str, str, str], float] = {}
    for name in (*PREDICTED, *FILES[1:]):
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            for r in (data.get("predictions") or {}).get("rows", []) if name in FILES else data["rows"]:
                predicted[_key(r)] = r["simulated_ms"]
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name, held in zip(FILES, (None, *HELDOUT), strict=True):
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for r in data["rows"]:
            if r.get("measured_ms") is None:
                continue
            sim = r.get("sim") or {}
            row = {"set": _set_of(r, held), "model": r["model"], "config": config_label(r.get("model_kwargs")),
                   "policy": r["policy"], "ratio": r.get("ratio"), "measured_ms": r["measured_ms"],
                   "simulated_ms": r["simulated_ms"], "error": r["simulated_ms"] / r["measured_ms"] - 1,
                   "committed_prediction_ms": (predicted.get(_key(r)) if held or r.get("heldout_set") else None),
                   "sim_faults": sim.get("faults"), "sim_evictions": sim.get("evictions"),
                   "sim_htod_GB": sim.get("htod_GB"), "sim_remote_GB": sim.get("remote_GB"),
                   "source": name, "date": data.get("date", "")}
            old = best.get(_key(r))
            if old is None or row["date"] >= old["date"]:
                best[_key(r)] = row
    df = pd.DataFrame(list(best.values()))
    df["abs_error"] = df["error"].abs()
    df["label"] = df["model"] + " " + df["config"] + " · " + df["policy"]
    several = (df.groupby("model")["config"].transform("nunique") > 1) & (df["config"] != "default")
    df["short_label"] = df["model"] + (" " + df["config"]).where(several, "") + " " + df["policy"]
    order = {s: i for i, s in enumerate(SETS)}
    return df.sort_values(["set", "model", "config", "policy"], key=lambda c: c.map(order) if c.name == "set"
                          else c).reset_index(drop=True)


def summary(df: pd.DataFrame, band: float = BAND) -> pd.DataFrame:
    """Per set and for all rows: count, median and worst |error|, zero-copy worst, share within ±band,
    largest oversubscription ratio measured."""
    out = []
    groups = [(s, df[df["set"] == s]) for s in SETS if (df["set"] == s).any()] + [("all", df)]
    for name, g in groups:
        zc = g.loc[g["policy"] == "zero-copy-params", "abs_error"]
        out.append({"set": name, "rows": len(g), "median |error|": statistics.median(g["abs_error"]),
                    "worst |error|": g["abs_error"].max(), "zero-copy worst": zc.max() if len(zc) else None,
                    f"within ±{band:.0%}": f"{int((g['abs_error'] <= band).sum())} of {len(g)}",
                    "largest ratio": g["ratio"].max()})
    return pd.DataFrame(out)


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """The rows for reading: milliseconds to 1 decimal, errors in percent, no internal columns."""
    t = pd.DataFrame({
        "set": df["set"], "model": df["model"], "config": df["config"], "policy": df["policy"],
        "ratio": df["ratio"].map("{:.3f}".format),
        "measured ms": df["measured_ms"].map("{:,.1f}".format),
        "simulated ms": df["simulated_ms"].map("{:,.1f}".format),
        "error": df["error"].map("{:+.1%}".format),
    })
    committed = df["committed_prediction_ms"]
    if committed.notna().any():
        t["predicted before measuring, ms"] = committed.map(lambda v: "" if pd.isna(v) else f"{v:,.1f}")
    return t


def readable_summary(s: pd.DataFrame) -> pd.DataFrame:
    """:func:`summary` with percentages and ratios formatted."""
    t = s.copy()
    for col in ("median |error|", "worst |error|", "zero-copy worst"):
        t[col] = t[col].map(lambda v: "–" if v is None or pd.isna(v) else f"{v:.1%}")
    t["largest ratio"] = t["largest ratio"].map("{:.3f}".format)
    return t
