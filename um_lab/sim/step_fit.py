"""Profile constants fitted on measured training steps of the *fit* models, op by op.

The input is a ``bench/step_detail.py`` result: tiny-batch steps (the GPU idles, so the step
time is the host's dispatch time) and per-(op, input shapes) GPU times of moderate steps. From it:

- :func:`fit_host_costs`: host time per kernel op (forward/optimizer, backward), per host-only op (views,
  reshapes) and per step, by least squares over the tiny-batch um-default steps;
- :func:`fit_gemm_rate`: the fp32 GEMM peak and half-size of ``peak * f / (f + f_half)`` over the
  GEMMs of the resident (um-default) steps;
- :func:`fit_attention_rate`: the same form for fused attention kernels;
- :func:`fit_resident_ops`: the HBM rate of elementwise kernels, batch norms' HBM passes and the
  convolution peak and half-size;
- :func:`fit_remote_elementwise`: ``remote_rw_GBps`` (elementwise kernels that read and write remote
  activations) and ``remote_colreduce_GBps`` (column sums of remote activations) from the act-remote steps.

Each returns ``(fields, provenance)``; the provenance (what was measured, the spread) goes into the
profile's ``measured.primitives`` and gives :mod:`um_lab.sim.band` its ranges. The models named here are
the fit set: a fidelity check must use others.
"""

from __future__ import annotations

import ast
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from um_lab.sim.ops import BATCH_NORM, BATCH_NORM_BWD, CONV_FORWARD
from um_lab.sim.profile import Profile
from um_lab.sim.replicas import model_case
from um_lab.sim.roofline import op_host_us
from um_lab.sim.trace import KIND_ATTENTION, StepTrace, cached_trace

GEMM_OPS = ("aten::mm", "aten::addmm")
#: elementwise ops whose every tensor operand is an activation (remote under act-remote)
_RW_OPS = ("aten::mul", "aten::add", "aten::add_")


def _configs(detail: Mapping[str, Any], kind: str, policy: str) -> list[Mapping[str, Any]]:
    """The configurations of one kind and policy (first measurements only: repeats show variance)."""
    return [c for c in detail["configs"] if c.get("kind") == kind and c.get("policy") == policy and "ops" in c
            and not c.get("repeat")]


HOST_FIELDS = ("cpu_op_us", "cpu_bwd_op_us", "cpu_view_op_us", "cpu_step_us")


def host_features(trace: StepTrace) -> list[float]:
    """The step's host time per unit of each of :data:`HOST_FIELDS` (the host model is linear in them):
    forward/optimizer kernel ops, backward kernel ops, host-only ops outside the backward, one step."""
    zero = Profile().replace(cpu_cudnn_call_us=0.0, cpu_foreach_tensor_us=0.0, **{f: 0.0 for f in HOST_FIELDS})
    return [float(op_host_us(trace, zero.replace(**{field: 1.0})).sum()) for field in HOST_FIELDS]


def fit_host_costs(detail: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Host costs from the tiny-batch (``kind == "host"``) um-default steps, least squares on step time.

    cuDNN and foreach per-call extras are set to zero: on these steps they are not separable from the
    per-op costs (the fit found no positive share for them). Ranges: leave-one-step-out refits.
    """
    rows = _configs(detail, "host", "um-default")
    if len(rows) < len(HOST_FIELDS):
        raise ValueError(f"fit_host_costs needs at least {len(HOST_FIELDS)} host steps, got {len(rows)}")
    x = np.array([host_features(cached_trace(model_case(c["model"], **c["model_kwargs"]))) for c in rows])
    y = np.array([float(c["step_ms"]) * 1e3 for c in rows])
    coef = _nonneg_lstsq(x, y)
    spans = [_nonneg_lstsq(np.delete(x, i, 0), np.delete(y, i, 0)) for i in range(len(rows))] if len(rows) > 4 else []
    fields = {name: round(float(v), 3) for name, v in zip(HOST_FIELDS, coef, strict=True)}
    fields.update(cpu_cudnn_call_us=0.0, cpu_foreach_tensor_us=0.0)
    provenance: dict[str, Any] = {}
    for k, name in enumerate(HOST_FIELDS):
        vals = [float(s[k]) for s in spans] or [float(coef[k])]
        provenance[name] = {
            "value": fields[name], "range": [round(min(vals + [coef[k]]), 3), round(max(vals + [coef[k]]), 3)],
            "source": "step_detail.json host rows (bench/step_detail.py): tiny-batch um-default "
                      "steps of " + ", ".join(sorted({c["model"] for c in rows})) + "; range: leave-one-out refits",
        }
    provenance["host_fit_rows"] = [{"model": c["model"], "model_kwargs": c["model_kwargs"],
                                    "measured_ms": c["step_ms"], "fitted_ms": round(float(xi @ coef) / 1e3, 3)}
                                   for c, xi in zip(rows, x, strict=True)]
    return fields, provenance


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative column and refit)."""
    active = list(range(x.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (c >= 0).all() or len(active) == 1:
            out = np.zeros(x.shape[1])
            out[active] = np.maximum(c, 0.0)
            return out
        del active[int(np.argmin(c))]


def gemm_shape(op: str, shapes: str) -> tuple[int, int, int] | None:
    """(M, K, N) of a profiled ``aten::mm`` / ``aten::addmm`` from its recorded input shapes."""
    try:
        sh = ast.literal_eval(shapes)
        a, b = (sh[0], sh[1]) if op == "aten::mm" else (sh[1], sh[2])
        (m, k), (k2, n) = a, b
    except (ValueError, SyntaxError, TypeError, IndexError):
        return None
    return (int(m), int(k), int(n)) if k == k2 else None


def resident_gemms(primitives: Mapping[str, Any]) -> list[tuple[float, float]]:
    """(GFLOP, us) of the resident linear-layer GEMMs of a ``bench/uvm_primitives.py`` result (one per
    shape and kernel)."""
    seen: dict[tuple[str, str], tuple[float, float]] = {}
    for row in primitives.get("rows", []):
        if row.get("group") != "kernel" or not str(row.get("name", "")).startswith("linear"):
            continue
        dims = dict(part.split("=") for part in str(row.get("shape", "")).split() if "=" in part)
        try:
            gflop = 2.0 * int(dims["M"]) * int(dims["K"]) * int(dims["N"]) / 1e9
        except (KeyError, ValueError):
            continue
        seen.setdefault((row["name"], row["shape"]), (gflop, float(row["resident_ms"]) * 1e3))
    return list(seen.values())


def fit_gemm_rate(detail: Mapping[str, Any],
                  extra: Sequence[tuple[float, float]] = ()) -> tuple[dict[str, float], dict[str, Any]]:
    """``matmul_tflops`` and ``matmul_half_gflop`` from the resident GEMMs of the ``shapes`` um-default steps
    (fp32, TF32 off) and ``extra`` (GFLOP, us) kernels (:func:`resident_gemms`: the large ones a training
    step of the fit models lacks), minimising squared log error of per-GEMM time; each training shape is
    weighted by its GEMM time, each extra kernel by the median weight."""
    samples = []  # (gflop per call, us per call, weight)
    for c in _configs(detail, "shapes", "um-default"):
        for o in c["ops"]:
            mkn = gemm_shape(o["op"], o["shapes"]) if o["op"] in GEMM_OPS else None
            if mkn is None or o["self_device_ms"] <= 0 or min(mkn) < 64:
                continue
            gflop = 2.0 * math.prod(mkn) / 1e9
            samples.append((gflop, o["self_device_ms"] * 1e3 / o["count"], o["self_device_ms"]))
    typical = statistics.median(w for _, _, w in samples) if samples else 1.0
    samples += [(g, us, typical) for g, us in extra]
    if len(samples) < 3:
        raise ValueError("fit_gemm_rate needs GEMMs of at least three shapes")
    f = np.array([s[0] for s in samples])
    t = np.array([s[1] for s in samples])
    w = np.array([s[2] for s in samples])

    def loss(peak: float, half: float) -> float:
        model = f * 1e3 / (peak * f / (f + half))  # us: f GFLOP at peak TFLOPS = f*1e3/peak us
        return float((w * np.log(model / t) ** 2).sum())

    grid = [(loss(p, h), p, h) for p in np.arange(30.0, 70.01, 0.25) for h in np.geomspace(0.01, 10.0, 121)]
    _, peak, half = min(grid)
    achieved = f * 1e3 / t
    fields = {"matmul_tflops": round(float(peak), 3), "matmul_half_gflop": round(float(half), 4)}
    provenance = {
        "matmul_tflops": {"value": fields["matmul_tflops"],
                          "range": [round(float(np.percentile(achieved, 10)), 2), round(float(achieved.max()), 2)],
                          "source": f"{len(samples) - len(extra)} GEMM shapes of resident training steps "
                                    "(step_detail.json, bench/step_detail.py) and "
                                    f"{len(extra)} resident linear kernels (uvm_primitives.json); range: 10th "
                                    "percentile to the best achieved TFLOPS"},
        "matmul_half_gflop": {"value": fields["matmul_half_gflop"], "range": _factor_two(half),
                              "source": "fitted with matmul_tflops on step_detail.json; range: a factor of 2"},
    }
    return fields, provenance


def fit_attention_rate(detail: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """``attention_tflops`` and ``attention_half_gflop`` (``peak * f / (f + f_half)`` per fused attention
    kernel, as for GEMMs) from the ``shapes`` um-default steps: the kernels' FLOPs in each step's trace
    against their measured GPU time (forward and backward together), squared log error over the steps."""
    steps = []  # (per-kernel GFLOP array, measured us)
    for c in _configs(detail, "shapes", "um-default"):
        ms = sum(o["self_device_ms"] for o in c["ops"] if "attention" in o["op"])
        if ms <= 0:
            continue
        trace = cached_trace(model_case(c["model"], **c["model_kwargs"]))
        gflop = trace.op_flops[trace.op_kind == KIND_ATTENTION] / 1e9
        if gflop.sum() > 0:
            steps.append((gflop, ms * 1e3))
    if not steps:
        raise ValueError("fit_attention_rate needs resident steps with fused attention")

    # fewer than three steps cannot pin two constants: the peak alone, at the default half-size
    halves = np.geomspace(0.01, 10.0, 61) if len(steps) >= 3 else [Profile().attention_half_gflop]
    peak, half = _fit_saturating(steps, np.arange(10.0, 60.01, 0.25), halves)
    rates = [float(g.sum()) * 1e3 / us for g, us in steps]
    fields = {"attention_tflops": round(float(peak), 3), "attention_half_gflop": round(float(half), 4)}
    src = (f"fused attention kernels of {len(steps)} resident training steps (step_detail.json, "
           "bench/step_detail.py)")
    return fields, {
        "attention_tflops": {"value": fields["attention_tflops"],
                             "range": [round(min(rates + [peak]), 3), round(max(rates + [peak]), 3)],
                             "source": src + "; range: the steps' achieved rates"},
        "attention_half_gflop": {"value": fields["attention_half_gflop"],
                                 "range": _factor_two(half),
                                 "source": "fitted with attention_tflops on step_detail.json; range: a factor of 2"}}


#: measured (profiler) op name -> traced op names, for the resident op classes fitted here
_ELEMENTWISE = {"aten::add": ("aten.add",), "aten::add_": ("aten.add_",), "aten::mul": ("aten.mul",),
                "aten::threshold_backward": ("aten.threshold_backward",), "aten::clamp_min_": ("aten.relu_",),
                "aten::gelu": ("aten.gelu",), "aten::gelu_backward": ("aten.gelu_backward",)}


#: traced op names -> the profiler name of the kernels measured for them (forward, backward)
_CONV_OPS: tuple[tuple[frozenset[str], str], ...] = (
    (CONV_FORWARD, "aten::cudnn_convolution"), (frozenset({"aten.convolution_backward"}), "aten::convolution_backward"))


def fit_resident_ops(detail: Mapping[str, Any], kernel_us: float) -> tuple[dict[str, float], dict[str, Any]]:
    """From the ``shapes`` um-default steps: ``hbm_GBps`` (elementwise kernels: traced bytes over measured
    time less ``kernel_us`` each), ``norm_fwd_hbm_passes`` / ``norm_bwd_hbm_passes`` (batch norms' measured
    time over their traced bytes at that rate) and ``conv_tflops`` / ``conv_half_gflop`` (convolution
    kernels, forward and backward apart, per step; squared log error)."""
    elem_bytes = elem_us = 0.0
    norm: dict[str, list[tuple[float, float]]] = {"fwd": [], "bwd": []}  # (traced bytes, measured us)
    convs: list[tuple[np.ndarray, float]] = []  # (per-kernel GFLOP, measured us)
    per_step_rates = []
    for c in _configs(detail, "shapes", "um-default"):
        trace = cached_trace(model_case(c["model"], **c["model_kwargs"]))
        names = np.array(trace.op_names)
        measured: dict[str, float] = {}
        for o in c["ops"]:
            measured[o["op"]] = measured.get(o["op"], 0.0) + o["self_device_ms"] * 1e3
        b = t = 0.0
        for op, traced in _ELEMENTWISE.items():
            sel = np.isin(names, traced)
            if sel.any() and measured.get(op, 0.0) > 0:
                b += float(trace.op_bytes[sel].sum())
                t += measured[op] - kernel_us * int(sel.sum())
        if b > 0 and t > 0:
            elem_bytes, elem_us = elem_bytes + b, elem_us + t
            per_step_rates.append(b / t / 1e3)
        for key, norm_names, op in (("fwd", BATCH_NORM, "aten::cudnn_batch_norm"),
                                    ("bwd", BATCH_NORM_BWD, "aten::cudnn_batch_norm_backward")):
            sel = np.isin(names, list(norm_names))
            if sel.any() and measured.get(op, 0.0) > 0:
                norm[key].append((float(trace.op_bytes[sel].sum()), measured[op] - kernel_us * int(sel.sum())))
        for conv_names, op in _CONV_OPS:
            sel = np.isin(names, list(conv_names))
            if sel.sum() >= 10 and measured.get(op, 0.0) > 0:  # CNNs (not a ViT's one patch projection)
                convs.append((trace.op_flops[sel] / 1e9, measured[op]))
    if not elem_bytes or not norm["fwd"] or not norm["bwd"] or len(convs) < 3:
        raise ValueError("fit_resident_ops needs resident steps with elementwise ops, batch norms and convolutions")
    hbm = elem_bytes / elem_us / 1e3
    fields: dict[str, float] = {"hbm_GBps": round(hbm, 1)}
    src = "resident training steps of the fit models (step_detail.json, bench/step_detail.py)"
    provenance: dict[str, Any] = {"hbm_GBps": {
        "value": fields["hbm_GBps"],
        "range": [round(min(per_step_rates + [hbm]), 1), round(max(per_step_rates + [hbm]), 1)],
        "source": f"elementwise kernels of {len(per_step_rates)} {src}; range: the steps' rates"}}
    for key, pairs in norm.items():
        passes = [us / (nb / (hbm * 1e3)) for nb, us in pairs]
        name = f"norm_{key}_hbm_passes"
        fields[name] = round(sum(us for _, us in pairs) / (sum(nb for nb, _ in pairs) / (hbm * 1e3)), 3)
        provenance[name] = {"value": fields[name], "range": [round(min(passes + [fields[name]]), 3),
                                                             round(max(passes + [fields[name]]), 3)],
                            "source": f"batch norms of {len(pairs)} {src}, at hbm_GBps"}

    peak, half = _fit_saturating(convs, np.arange(20.0, 600.01, 2.0), np.geomspace(0.01, 100.0, 81))
    rates = [float(g.sum()) * 1e3 / us for g, us in convs]
    fields.update(conv_tflops=float(peak), conv_half_gflop=round(float(half), 4))
    provenance["conv_tflops"] = {"value": fields["conv_tflops"], "range": [round(min(rates + [peak]), 2),
                                                                           round(max(rates + [peak]), 2)],
                                 "source": f"convolution kernels (forward, backward) of {len(convs) // 2} {src}"}
    provenance["conv_half_gflop"] = {"value": fields["conv_half_gflop"],
                                     "range": _factor_two(half),
                                     "source": "fitted with conv_tflops on step_detail.json; range: a factor of 2"}
    return fields, provenance


def _fit_saturating(steps: Sequence[tuple[np.ndarray, float]], peaks: Iterable[float],
                    halves: Iterable[float]) -> tuple[float, float]:
    """(peak TFLOPS, half-size GFLOP) of ``peak * f / (f + half)`` per kernel on a grid, minimising the squared
    log error of each step's summed kernel time (``steps``: per-kernel GFLOP, measured us)."""
    def loss(peak: float, half: float) -> float:
        return sum(math.log(float((g * 1e3 * (g + half) / (peak * g)).sum()) / us) ** 2 for g, us in steps)

    halves = list(halves)
    _, peak, half = min((loss(pk, h), pk, h) for pk in peaks for h in halves)
    return float(peak), float(half)


def _factor_two(value: float) -> list[float]:
    return [round(float(value) / 2, 4), round(float(value) * 2, 4)]


def _numel(shape: Any) -> int:
    return math.prod(shape) if isinstance(shape, list) and shape else 0


def fit_remote_elementwise(detail: Mapping[str, Any],
                           min_bytes: float = 4e6) -> tuple[dict[str, float], dict[str, Any]]:
    """``remote_rw_GBps`` and ``remote_colreduce_GBps`` from the act-remote ``shapes`` steps (fp32).

    Read-and-write rate: elementwise ``mul``/``add``/``add_`` on activation-shaped tensors (3-d and up, at
    least ``min_bytes``): bytes read plus bytes written over GPU time. Column reduction: ``sum`` of a 2-d
    tensor over its rows (a bias gradient): bytes read over GPU time.
    """
    rw, col = [], []
    for c in _configs(detail, "shapes", "act-remote"):
        for o in c["ops"]:
            if o["self_device_ms"] <= 0:
                continue
            try:
                sh = ast.literal_eval(o["shapes"])
            except (ValueError, SyntaxError):
                continue
            tensors = [s for s in sh if isinstance(s, list) and len(s) >= 3]
            seconds = o["self_device_ms"] / 1e3 / o["count"]
            if o["op"] in _RW_OPS and tensors and all(s == tensors[0] for s in tensors):
                nbytes = 4.0 * _numel(tensors[0])
                if nbytes >= min_bytes:
                    moved = nbytes * (len(tensors) + (0 if o["op"].endswith("_") else 1))
                    rw.append((moved / seconds / 1e9, o["self_device_ms"]))
            two_d = isinstance(sh[0], list) and len(sh[0]) == 2
            if o["op"] == "aten::sum" and two_d and 4.0 * _numel(sh[0]) >= min_bytes:
                col.append((4.0 * _numel(sh[0]) / seconds / 1e9, o["self_device_ms"]))
    if not rw or not col:
        raise ValueError("fit_remote_elementwise needs act-remote elementwise ops and column sums")
    fields = {"remote_rw_GBps": round(_weighted_median(rw), 2),
              "remote_colreduce_GBps": round(_weighted_median(col), 2)}
    src = "act-remote training steps of the fit models (step_detail.json, bench/step_detail.py)"
    provenance = {
        "remote_rw_GBps": {"value": fields["remote_rw_GBps"], "range": [round(min(g for g, _ in rw), 2),
                                                                        round(max(g for g, _ in rw), 2)],
                           "source": f"{len(rw)} elementwise ops reading and writing remote activations, {src}"},
        "remote_colreduce_GBps": {"value": fields["remote_colreduce_GBps"],
                                  "range": [round(min(g for g, _ in col), 2), round(max(g for g, _ in col), 2)],
                                  "source": f"{len(col)} column sums of remote activations, {src}"},
    }
    return fields, provenance


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """Median of values weighted by time (the ops that cost most decide)."""
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= total / 2:
            return value
    return statistics.median(v for v, _ in pairs)
