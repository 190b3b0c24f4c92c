"""How many times a cuBLAS GEMM reads its remote weight over the host link, by layout and shape.

``y = x @ W^T`` (nn.Linear's forward; cuBLAS "tn") and ``y = x @ W`` (the input gradient ``gy @ W`` of
nn.Linear, GPT-2's Conv1D forward; cuBLAS "nn"), x of M rows, W of K x N: the kernel tiles the output
and re-reads W once per tile of M rows, so the passes are about ``M / tile`` -- but cuBLAS picks the tile
per shape (its kernel names in a ViT-B/16 step: 64x128, 128x128, 128x64 for one layer's four forward
GEMMs) and remote reads of W's panels run at their own efficiency. No rule reproduces cuBLAS's choices
(nor split-K), so the passes are a power law in the shape fitted per layout on a grid of 160 kernels
measured on the H200 with the weight remote (``bench/uvm_primitives.py --sections gemm_tiles``,
``bench/results/gemm_tiles.json``: M 512-12,608, K and N 768-4,096, with and without a bias)::

    x @ W^T:  passes = c_nt * (M/4096)^a_nt * (4096/N)^b_nt * (bias_nt if a bias is fused)
    x @ W:    passes = c_nn * (M/4096)^a_nn * (4096/N)^b_nn * (bias_nn if a bias is fused)
              with K <= small_k: a_nn_small_k for the exponent and a factor small_k_nn

(least squares on log passes; K has no measurable effect on x @ W^T; for x @ W cuBLAS takes 64-row
tiles at K = 768 and M up to ~3,000 where it takes 128 or 256 rows at larger K, hence the K class).
Where cuBLAS differs from a tile model: x @ W^T at large M reads W *more* often than once per 128 rows
(e.g. 245 passes at M = 12,608, K = 3,072, N = 768: its scattered 32-byte panel reads run below the
streaming rate), and a fused bias moves some shapes to half the tile.

Below the grid's smallest M, x @ W^T follows cuBLAS's need for enough thread blocks: it shrinks the row
tile so that about ``small_m_ctas`` blocks of 128 columns run, i.e. ``passes = min(M / 32, small_m_ctas *
128 / N)`` (32 rows: its smallest tile); ``small_m_ctas`` is fitted on the grid's smallest-M rows of the
widest N (4,096), where passes were 8-9.3 whatever K. x @ W keeps the power law there (its grid rows at
M = 512, N = 4,096 took 1.7-3.7 passes: 256-row tiles with split-K, no such shrinking).

Every result is clamped to ``[1, M / 32]``. The fit sees the grid only; per-op profiles of training steps
(``step_detail.json``, a per-kernel profile of ViT-B/16) and the fidelity rows are checks.

Checks. GPT-2-small bs 4 x 512 with zero-copy parameters (M = 2,048, ``step_detail.json``): its ten
weight-reading GEMM shapes, the tied 50,257-column head included, read 0-17% more than the model's passes
(mean 8%).
ViT-B/16 bs 64 (M = 12,608, per cuBLAS kernel, H200, 2026-12-01): its forward GEMMs took 1.19x and
its input-gradient GEMMs 1.13x the time the *grid itself* gives for the same shapes, and ViT step times
say more (bs 32, M = 6,304: ~1.5x). So a ViT step's GEMMs read their remote weights more often than the
same shapes do alone, which no fit on the grid can show; GPT-2 and BERT steps (M = 8,192) do not. Not
modelled: the cause is not known (candidates: the weights' placement inside the pool's segments, the
kernels cuBLAS picks for M = batch x 197 rows). Not warm caches: ViT-L/16's weight GEMMs at M = 6,304
took the same time within 3% back to back and after a 2 GiB device write or a 256 MiB remote read between
repeats (H200, 2026-12-01).
Alone, those seven shapes read W 0.78-1.82x the passes this model gives (N = 1,024 forward and K = 1,024
input-gradient shapes 1.66-1.82x; 1.24x the model's link bytes over the seven). So the excess is mostly in
the shapes themselves, which the grid (no M = 6,304) and a power law in M cannot give: cuBLAS's kernel
choice per M.
Also seen and not adopted: a factor for M not a multiple
of 128 (the grid's x @ W rows at M = 3,152 and 12,608 read ~25% more than at 2,048 and 8,192) improved
the leave-one-out error of x @ W by 0.01 only and of x @ W^T not at all, and moved GPT-2-medium's
zero-copy step from -11% to -18% while ViT gained 4-5 points.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from um_lab.sim.profile import read_measurements

#: The reference shape of the power laws (rows and columns).
REF = 4096.0
#: cuBLAS's smallest row tile for fp32 GEMMs: no kernel reads W more than once per 32 rows of x.
MIN_TILE = 32.0
#: Columns per thread block in the thread-block count of small-M GEMMs.
BLOCK_COLS = 128.0


def passes_nt(m: np.ndarray, n: np.ndarray, bias: np.ndarray, p: Any) -> np.ndarray:
    """Link passes over the remote W of ``x @ W^T`` (x: m rows; W^T: n columns)."""
    m = np.asarray(m, float)
    n = np.maximum(np.asarray(n, float), 1.0)
    law = (p.gemm_nt_passes * (m / REF) ** p.gemm_nt_m_exp * (REF / n) ** p.gemm_nt_inv_n_exp
           * np.where(bias, p.gemm_nt_bias_factor, 1.0))
    few_rows = np.minimum(m / MIN_TILE, p.gemm_small_m_ctas * BLOCK_COLS / n)
    passes = np.where(m < p.gemm_fit_min_rows, few_rows, law) * p.gemm_law_factor
    return np.clip(passes, 1.0, np.maximum(1.0, m / MIN_TILE))


def passes_nn(m: np.ndarray, k: np.ndarray, n: np.ndarray, bias: np.ndarray, p: Any) -> np.ndarray:
    """Link passes over the remote W of ``x @ W`` (x: m rows, k columns; W: n columns)."""
    m = np.asarray(m, float)
    n = np.maximum(np.asarray(n, float), 1.0)
    small_k = np.asarray(k, float) <= p.gemm_nn_small_k
    exponent = np.where(small_k, p.gemm_nn_m_exp_small_k, p.gemm_nn_m_exp)
    passes = (p.gemm_nn_passes * (m / REF) ** exponent * (REF / n) ** p.gemm_nn_inv_n_exp
              * np.where(small_k, p.gemm_nn_small_k_factor, 1.0) * np.where(bias, p.gemm_nn_bias_factor, 1.0)
              * p.gemm_law_factor)
    return np.clip(passes, 1.0, np.maximum(1.0, m / MIN_TILE))


# ------------------------------------------------------------------------------------------------- fit


def grid_rows(data: Mapping[str, Any], stream_GBps: float) -> list[dict[str, Any]]:
    """The grid's kernels as ``{"layout": "nt" | "nn", "bias", "M", "K", "N", "passes"}``, passes rescaled
    from the rate the script assumed (``link_GBps``) to the streaming rate ``stream_GBps``."""
    link = float(data.get("link_GBps", 47.77))
    out = []
    for r in data["rows"]:
        if r.get("group") != "gemm_tile" or r.get("operand") != "W" or not r.get("effective_link_passes"):
            continue
        dims = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", r["shape"])}
        out.append({"layout": "nt" if r["name"].startswith("nt") else "nn", "bias": r["name"].endswith("+b"),
                    "M": dims["M"], "K": dims["K"], "N": dims["N"],
                    "passes": float(r["effective_link_passes"]) * stream_GBps / link})
    return out


def _features(rows: Iterable[Mapping[str, Any]], layout: str, small_k: float) -> np.ndarray:
    x = []
    for r in rows:
        lm, ln = math.log(r["M"] / REF), math.log(REF / r["N"])
        if layout == "nt":
            x.append([1.0, lm, ln, float(r["bias"])])
        else:
            small = r["K"] <= small_k
            x.append([1.0, 0.0 if small else lm, lm if small else 0.0, ln, float(small), float(r["bias"])])
    return np.array(x)


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(x, y, rcond=None)[0]


def fit_gemm_passes(data: Mapping[str, Any], stream_GBps: float,
                    small_k: float = 768.0) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(profile fields, provenance) of the passes model from a ``gemm_tiles`` result (see module doc).

    Each scale constant's range is the middle half (25th-75th percentile) of the kernels' measured /
    modelled passes around it: what one kernel may deviate by (a step's sum of many deviates less).
    """
    rows = grid_rows(data, stream_GBps)
    fields: dict[str, float] = {}
    why: dict[str, dict[str, Any]] = {}
    src = "bench/results/gemm_tiles.json (bench/uvm_primitives.py --sections gemm_tiles, weight remote)"
    for layout in ("nt", "nn"):
        sel = [r for r in rows if r["layout"] == layout]
        if len(sel) < 8:
            raise ValueError(f"too few {layout} kernels in the GEMM grid ({len(sel)}) to fit the passes model")
        x = _features(sel, layout, small_k)
        y = np.log([r["passes"] for r in sel])
        coef = _lstsq(x, y)
        resid = y - x @ coef
        loo = [abs(float(y[i] - x[i] @ _lstsq(np.delete(x, i, 0), np.delete(y, i)))) for i in range(len(sel))]
        lo, hi = (float(math.exp(q)) for q in np.quantile(resid, [0.25, 0.75]))
        scale = round(float(math.exp(coef[0])), 3)
        if layout == "nt":
            names = {"gemm_nt_passes": scale, "gemm_nt_m_exp": coef[1], "gemm_nt_inv_n_exp": coef[2],
                     "gemm_nt_bias_factor": math.exp(coef[3])}
        else:
            names = {"gemm_nn_passes": scale, "gemm_nn_m_exp": coef[1], "gemm_nn_m_exp_small_k": coef[2],
                     "gemm_nn_inv_n_exp": coef[3], "gemm_nn_small_k_factor": math.exp(coef[4]),
                     "gemm_nn_bias_factor": math.exp(coef[5])}
        for name, value in names.items():
            fields[name] = round(float(value), 3)
        what = "x @ W^T" if layout == "nt" else "x @ W"
        why[f"gemm_{layout}_passes"] = {
            "from": f"{len(sel)} {what} kernels of {src}: least squares on log passes (module um_lab.sim.gemm_passes); "
                    f"per-kernel scatter mean |log| {statistics.fmean(abs(v) for v in resid):.3f}, leave-one-out "
                    f"{statistics.fmean(loo):.3f}; range: middle half of measured / modelled",
            "range": [round(scale * lo, 3), round(scale * hi, 3)]}
    fields["gemm_nn_small_k"] = small_k
    widest = max(r["N"] for r in rows)
    fewest = min(r["M"] for r in rows)
    corner = [r["passes"] * r["N"] / BLOCK_COLS for r in rows
              if r["layout"] == "nt" and r["M"] == fewest and r["N"] == widest]
    if corner:
        fields["gemm_small_m_ctas"] = round(math.exp(statistics.fmean(math.log(v) for v in corner)), 1)
        why["gemm_small_m_ctas"] = {
            "from": f"x @ W^T at M = {fewest}, N = {widest} ({len(corner)} kernels): passes * N / 128, "
                    "geometric mean (thread blocks cuBLAS keeps running when M is small)",
            "range": [round(min(corner), 1), round(max(corner), 1)]}
    fields["gemm_fit_min_rows"] = float(fewest)
    return fields, why


def load_gemm_tiles(path: str | Path) -> dict[str, Any]:
    """Read a ``bench/uvm_primitives.py --sections gemm_tiles`` result."""
    return read_measurements(path)


def law_passes(rows: Iterable[Mapping[str, Any]], profile: Any) -> list[float]:
    """The law's link passes for GEMM rows ``{"layout": "nt"|"nn", "bias", "M", "K", "N"}`` (the shape lists
    of ``bench/gemm_shapes.py``), under ``profile``."""
    out = []
    for r in rows:
        m, k, n, b = (np.array([r[key]]) for key in ("M", "K", "N", "bias"))
        out.append(float((passes_nt(m, n, b, profile) if r["layout"] == "nt" else passes_nn(m, k, n, b, profile))[0]))
    return out


def _measured_passes(row: dict[str, Any], data: dict[str, Any], rate: float) -> float:
    """A timed row's passes at the link rate ``rate`` (results record theirs as ``passes_at_GBps``), >= 1."""
    return max(1.0, round(float(row["passes"]) * rate / float(data.get("passes_at_GBps", rate)), 4))


def load_gemm_shapes(paths: Iterable[str | Path],
                     rate: float | None = None) -> tuple[tuple[str, int, int, int, int, float], ...]:
    """The per-shape table (:attr:`um_lab.sim.profile.Profile.gemm_shape_passes`) from ``bench/gemm_shapes.py``
    results: each timed row's measured passes, rescaled to the rate the table is read at (``rate``: the
    profile's ``remote_GBps``; default the h200 profile's). A shape measured twice keeps the mean."""
    from um_lab.sim.profile import gemm_shape_table, load_profile

    rate = load_profile("h200").remote_GBps if rate is None else rate
    seen: dict[tuple[str, int, int, int, int], list[float]] = {}
    for path in paths:
        data = read_measurements(path)
        for r in data["rows"]:
            if r.get("passes") is None:
                continue
            key = (r["layout"], int(bool(r["bias"])), int(r["M"]), int(r["K"]), int(r["N"]))
            seen.setdefault(key, []).append(_measured_passes(r, data, rate))
    return gemm_shape_table([[*key, statistics.fmean(v)] for key, v in seen.items()])


def law_spread(paths: Iterable[str | Path], profile: Any = None) -> dict[str, Any]:
    """How far the law is from ``bench/gemm_shapes.py`` results, model by model: each model's measured link
    bytes over the law's (passes x weight bytes x reads per step, summed over its timed shapes), and their
    range, the band of :attr:`um_lab.sim.profile.Profile.gemm_law_factor` (a whole step's GEMMs err together
    in that model's way, so the band spans models, not single shapes). The law is ``profile``'s at factor 1
    (default: the passes the results recorded beside their measurements), the measurements are read as the
    table reads them (:func:`load_gemm_shapes`)."""
    from um_lab.sim.profile import load_profile

    base = load_profile("h200") if profile is None else profile
    rate = base.remote_GBps
    per_model: dict[str, float] = {}
    for path in paths:
        data = read_measurements(path)
        rows = [r for r in data["rows"] if r.get("passes") is not None and r.get("weight_bytes")]
        if profile is not None:
            laws = law_passes(rows, base.replace(gemm_law_factor=1.0))
        else:
            laws = [float(r["model_passes"]) for r in rows]
        law = sum(lp * r["count"] * r["weight_bytes"] for lp, r in zip(laws, rows, strict=True))
        if law > 0:
            label = f"{data['model']} " + " ".join(f"{k}={v}" for k, v in data.get("kwargs", {}).items())
            got = sum(_measured_passes(r, data, rate) * r["count"] * r["weight_bytes"] for r in rows)
            per_model[label.strip()] = round(got / law, 3)
    if not per_model:
        raise ValueError("no timed GEMM shapes in the given bench/gemm_shapes.py results")
    return {"range": [min(per_model.values()), max(per_model.values())], "per_model": per_model,
            "source": "bench/gemm_shapes.py: measured / law link bytes per model"}
