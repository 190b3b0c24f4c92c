"""Fit the simulator's host-link and migration constants from the UM primitives measured on a GPU.

Input: the JSON of ``bench/uvm_primitives.py`` (``bench/results/uvm_primitives.json`` on the H200).
Output: profile fields plus, for each, where it came from and the range the measurements span (the
range is what an uncertainty band over the profile would use). The fit uses the microbenchmarks only;
the step-time fidelity rows (``bench/sim_fidelity.py``) stay a check, never an input.

Remote operands: a row's ``effective_link_passes`` counts passes at ``link_GBps`` (the rate the script
assumed); here they are rescaled to the streaming rate measured in the same run. A tiled kernel's
*tile* is ``reuse / passes``, ``reuse`` being the output dimension the operand is re-read along (see
:func:`um_lab.sim.ops.remote_reads`); a class's tile is the geometric mean over its rows (which
minimises the mean log error of the passes).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from um_lab.sim.placement import BLOCK
from um_lab.sim.profile import read_measurements


def _numbers(shape: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", shape)}


def _conv_shape(shape: str) -> tuple[int, int, int, int, int]:
    """(batch, c_in, c_out, pixels per image, kernel size) of ``"N=128 64->256 56x56 1x1"``."""
    m = re.match(r"N=(\d+) (\d+)->(\d+) (\d+)x(\d+) (\d+)x\d+", shape)
    if m is None:
        raise ValueError(f"not a convolution shape: {shape!r}")
    n, cin, cout, h, w, k = map(int, m.groups())
    return n, cin, cout, h * w, k


def tile_samples(rows: Iterable[Mapping[str, Any]], stream_GBps: float) -> dict[str, list[float]]:
    """Implied tiles per re-read class from the ``kernel`` rows (passes rescaled to ``stream_GBps``)."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get("group") != "kernel" or r.get("effective_link_passes") is None:
            continue
        passes = r["effective_link_passes"] * stream_GBps / r["link_GBps"]
        name, op = r["name"], r["operand"]
        cls = reuse = None
        if name.startswith("linear"):
            d = _numbers(r["shape"])
            m, k, n = d["M"], d["K"], d["N"]
            cls, reuse = {("fwd", "x"): ("gemm_a", n), ("fwd", "W"): ("gemm_nt_b", m),
                          ("grad_x", "W"): ("gemm_nn", m), ("grad_W", "x"): ("gemm_tn", n),
                          ("grad_W", "gy"): ("gemm_tn", k)}.get(
                ("fwd" if "fwd" in name else "grad_x" if "grad_x" in name else "grad_W", op), (None, None))
        elif name.startswith("conv"):
            batch, cin, cout, pixels, ksize = _conv_shape(r["shape"])
            if ksize == 1:
                cls, reuse = {("conv fwd", "x"): ("conv_1x1", cout),
                              ("conv fwd", "w"): ("conv_1x1", batch * pixels),
                              ("conv bwd input grad", "gy"): ("conv_1x1", cin),
                              ("conv bwd input grad", "w"): ("conv_1x1_bwd_filter", batch * pixels)}.get(
                    (name, op), (None, None))
        if cls is not None and reuse is not None and passes >= 1.5:  # a pass or less says nothing of the tile
            out.setdefault(cls, []).append(reuse / passes)
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _median(rows: list[Mapping[str, Any]], key: str = "GBps") -> float:
    if not rows:
        raise ValueError("no measurement rows for a field the fit needs")
    return float(statistics.median(r[key] for r in rows))


def fit_primitives(data: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(profile fields, provenance per field: value, range, rows used, what it means) from a primitives JSON."""
    rows = data["rows"]
    link = float(data.get("link_GBps", 47.77))
    rows = [{**r, "link_GBps": link} for r in rows]
    remote = [r for r in rows if r["group"] == "remote" and r["name"] == "raw access"]
    reads = [r for r in remote if r["pattern"] == "streaming read"]
    writes = [r for r in remote if r["pattern"] == "streaming write"]
    mig = [r for r in rows if r["group"] == "migration"]
    d2h = [r for r in mig if r["name"].startswith("prefetch D2H")]
    h2d = [r for r in mig if r["name"] == "prefetch H2D"]
    faults = [r for r in mig if r["name"].startswith("fault H2D")]
    touch = [r for r in mig if r["name"].startswith("GPU first touch")]
    inplace = [r for r in remote if r["pattern"].startswith("read+write")]
    stream = _median(reads)
    fields: dict[str, float] = {"remote_GBps": stream, "remote_write_GBps": _median(writes)}
    if inplace:
        fields["remote_inplace_GBps"] = _median(inplace)
    why: dict[str, dict[str, Any]] = {
        "remote_GBps": {"from": "streaming read of host-resident managed memory (zero-copy), median",
                        "range": [min(r["GBps"] for r in reads), max(r["GBps"] for r in reads)]},
        "remote_write_GBps": {"from": "streaming write to host-resident managed memory, median",
                              "range": [min(r["GBps"] for r in writes), max(r["GBps"] for r in writes)]},
    }
    if inplace:
        why["remote_inplace_GBps"] = {"from": "in-place read+write (axpy) of host-resident managed memory, bytes read "
                                              "plus written per second, median",
                                      "range": [min(r["GBps"] for r in inplace), max(r["GBps"] for r in inplace)]}
    tiles = tile_samples(rows, stream)
    nt_b = tiles.pop("gemm_nt_b", [])
    names = {"gemm_a": "tile_gemm_a", "gemm_nn": "tile_gemm_nn", "gemm_tn": "tile_gemm_tn",
             "conv_1x1": "tile_conv_1x1", "conv_1x1_bwd_filter": "tile_conv_1x1_bwd_filter"}
    for cls, field in names.items():
        samples = tiles.get(cls, [])
        if samples:
            fields[field] = round(_geomean(samples), 1)
            why[field] = {"from": f"{len(samples)} kernels with a remote operand ({cls}): reuse / link passes, "
                                  "geometric mean", "range": [round(min(samples), 1), round(max(samples), 1)]}
    if nt_b:
        low = sorted(nt_b)[: max(1, len(nt_b) // 2)]
        fields["tile_gemm_nt_b_min"] = round(_geomean(low), 1)
        fields["tile_gemm_nt_b_max"] = round(max(nt_b), 1)
        why["tile_gemm_nt_b_min"] = {"from": "forward GEMMs, weight remote: smaller half of the implied tiles",
                                     "range": [round(min(nt_b), 1), round(max(nt_b), 1)]}
        why["tile_gemm_nt_b_max"] = {"from": "forward GEMMs, weight remote: largest implied tile",
                                     "range": [round(min(nt_b), 1), round(max(nt_b), 1)]}
    norm = [r for r in rows if r["group"] == "kernel" and r["name"].startswith("batch_norm") and r["operand"] == "x"]
    if norm:
        fields["norm_input_passes"] = round(_median(norm, "effective_link_passes") * stream / link, 2)
        why["norm_input_passes"] = {"from": "training-mode batch norm with its input remote"}
    if d2h:
        fields["prefetch_d2h_GBps"] = fields["evict_d2h_GBps"] = _median(d2h)
        span = [min(r["GBps"] for r in d2h), max(r["GBps"] for r in d2h)]
        cold = [r.get("warmup_GBps") for r in d2h if r.get("warmup_GBps")]
        note = ("prefetch GPU->host of GPU-resident pages, fresh and reused, median; eviction is not measured "
                "(nothing is oversubscribed here) and uses this rate. The first GPU->host move after a machine "
                "starts ran at 3.65-5.4 GB/s (calibration/h200-probe.json and bench/uvm_primitives.py): a first use of "
                "host memory, not a steady rate")
        why["prefetch_d2h_GBps"] = why["evict_d2h_GBps"] = {"from": note, "range": [3.65, span[1]],
                                                             "steady_range": span, "warm_up_min": min(cold or span)}
    if h2d:
        fields["prefetch_h2d_GBps"] = fields["fault_xfer_GBps"] = _median(h2d)
        why["prefetch_h2d_GBps"] = {"from": "prefetch host->GPU, median",
                                    "range": [min(r["GBps"] for r in h2d), max(r["GBps"] for r in h2d)]}
    block_us = lambda gbps: BLOCK / (gbps * 1e3)  # noqa: E731
    if faults and h2d:
        gbps = _median(faults)
        fields["fault_block_us"] = round(max(1.0, block_us(gbps) - block_us(fields["prefetch_h2d_GBps"])), 1)
        why["fault_block_us"] = {"from": f"fault-driven host->GPU at {gbps:.1f} GB/s (median) less the transfer "
                                         "at prefetch speed, per 2 MiB block",
                                 "range_GBps": [min(r["GBps"] for r in faults), max(r["GBps"] for r in faults)]}
    if touch:
        gbps = _median(touch)
        fields["populate_block_us"] = round(block_us(gbps), 1)
        why["populate_block_us"] = {"from": f"GPU first touch of never-populated memory at {gbps:.1f} GB/s "
                                            "(median), per 2 MiB block",
                                    "range_GBps": [min(r["GBps"] for r in touch), max(r["GBps"] for r in touch)]}
    return fields, why


def load_primitives(path: str | Path) -> dict[str, Any]:
    """Read a ``bench/uvm_primitives.py`` result."""
    return read_measurements(path)


def fit_scheduler_rates(paths: Iterable[str | Path]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """``scheduler_h2d_GBps`` / ``scheduler_d2h_GBps`` and their provenance from ``bench/budget.py
    --time-moves`` results: the medians over every row's side-stream rate per direction (``move_timing``),
    the layer-ahead scheduler's moves timed in training. Files without such rows add nothing; none at all:
    no fields (the simulator then prices the scheduler at the prefetch rates)."""
    rates: dict[str, list[float]] = {"to_gpu": [], "to_host": []}
    files = []
    for path in paths:
        used = False
        for row in read_measurements(path).get("rows", []):
            for direction, samples in rates.items():
                rate = (row.get("move_timing") or {}).get(direction, {}).get("GBps")
                if isinstance(rate, int | float) and math.isfinite(rate) and rate > 0:  # NaN: no move timed
                    samples.append(float(rate))
                    used = True
        if used:
            files.append(Path(path).name)
    if not rates["to_gpu"] or not rates["to_host"]:
        return {}, {}
    why = (f"the layer-ahead scheduler's side-stream moves in training, timed per step with CUDA events "
           f"(bench/budget.py --time-moves): median of {len(rates['to_gpu'])} runs in {', '.join(files)} "
           "(whatever the rows' scheduler options; their step times are then priced in sample). Below a lone "
           "prefetch's rate: the moves share the link and the host with compute, in calls of ~25 MB")
    fields, provenance = {}, {}
    for field, direction in (("scheduler_h2d_GBps", "to_gpu"), ("scheduler_d2h_GBps", "to_host")):
        fields[field] = round(statistics.median(rates[direction]), 1)  # their spread is +-30%: 0.1 GB/s is plenty
        provenance[field] = {"from": why, "range": [min(rates[direction]), max(rates[direction])]}
    return fields, provenance
