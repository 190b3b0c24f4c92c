"""Calibrate a simulator :class:`~um_lab.sim.profile.Profile` from measurements on a real GPU.

Two kinds of input, both plain dicts (JSON-ready):

* ``bandwidth_GBps``: microbenchmark bandwidths with the keys of the project's
  ``calibration/h200-probe.json`` (``pinned_copy_h2d``, ``prefetch_h2d_GBps``, ``fault_h2d_GBps``,
  ``gpu_first_touch_GBps``, ``prefetch_d2h_GBps``, ``remote_read_GBps``, ``resident_read_GBps``);
  turned into model constants by :func:`profile_from_bandwidths`.
* ``targets``: measured median step times, ``[{"model", "model_kwargs", "policy", "ms"}, ...]``;
  :func:`calibrate` fits the roofline (GEMM and convolution peaks) to the ``um-default`` targets, the
  read_mostly write-fault cost to read_mostly targets and
  the host cost of a prefetch call to prefetch-policy targets (all-resident prefetches cost only that).

:func:`measure_on_gpu` collects both on the local GPU (it needs CUDA and the real backend); without
CUDA it raises :class:`um_lab.errors.CudaUnavailableError`. ``um_lab/sim/profiles/h200.json`` was
made by :func:`build_h200_profile` from the H200 probe (2026-11-30), the UM primitives, the in-step
convolutions and the per-op training steps of ``bench/step_detail.py``
(:mod:`um_lab.sim.step_fit`: host costs, GEMM / attention / convolution / HBM rates and remote
elementwise rates are fitted op by op there; whole step times then fit only what is left). To rebuild::

    build_h200_profile("calibration/h200-probe.json", "um_lab/sim/profiles/h200.json",
                       fidelity_path="bench/results/sim_fidelity.json",
                       primitives_path="bench/results/uvm_primitives.json",
                       conv_path="bench/results/conv_in_step.json",
                       step_detail_path="bench/results/step_detail.json",
                       gemm_tiles_path="bench/results/gemm_tiles.json",
                       gemm_shapes_paths=sorted(Path("bench/results/gemm_shapes").glob("*.json")),
                       scheduler_paths=[Path("bench/results/scheduler_moves.json")],
                       tensor_core_path="bench/results/tensor_core_rates.json")
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from um_lab.policy import Policy, get_policy
from um_lab.sim.placement import BLOCK
from um_lab.sim.primitives import fit_primitives, fit_scheduler_rates, load_primitives
from um_lab.sim.profile import Profile, read_measurements
from um_lab.sim.replicas import model_case
from um_lab.sim.roofline import native_step_ms
from um_lab.sim.trace import KIND_ATTENTION, KIND_CONV, KIND_MATMUL, cached_trace
from um_lab.types import RunSpec

#: The probe's training steps that the whole-step fit targets (``training_steps`` of ``calibration/h200-probe.json``,
#: torch 2.11, fp32): each probe entry's name and the run it timed (model, its knobs, policy).
PROBE_STEPS: tuple[tuple[str, str, dict[str, Any], str | dict[str, Any]], ...] = (
    ("mlp_managed_default", "mlp", {}, "um-default"),
    ("resnet50_managed_default", "resnet50", {"batch_size": 128}, "um-default"),
    ("gpt2m_managed_default", "gpt2-medium", {"batch_size": 8, "seq_len": 1024}, "um-default"),
    ("mlp_params_cpu_remote", "mlp", {}, "zero-copy-params"),
    ("gpt2m_params_cpu_remote", "gpt2-medium", {"batch_size": 8, "seq_len": 1024}, "zero-copy-params"),
    ("mlp_params_readmostly", "mlp", {}, {"name": "params-read-mostly", "advice": {"param": {"read_mostly": True}}}),
    ("gpt2m_params_readmostly", "gpt2-medium", {"batch_size": 8, "seq_len": 1024},
     {"name": "params-read-mostly", "advice": {"param": {"read_mostly": True}}}),
)
#: The runs :func:`measure_on_gpu` times by default: the resident and zero-copy ones of :data:`PROBE_STEPS`.
DEFAULT_STEP_RUNS: tuple[dict[str, Any], ...] = tuple(
    {"model": m, "model_kwargs": kw, "policy": p} for _, m, kw, p in PROBE_STEPS[:5])


def probe_targets(probe: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The step-time targets of a probe file (:data:`PROBE_STEPS`): ``[{"model", "model_kwargs", "policy", "ms"}]``
    with each entry's measured median."""
    steps = probe.get("training_steps", {})
    missing = [key for key, *_ in PROBE_STEPS if "median_ms" not in steps.get(key, {})]
    if missing:
        raise ValueError(f"the probe has no training_steps median for {missing}")
    return [{"model": m, "model_kwargs": dict(kw), "policy": p, "ms": float(steps[key]["median_ms"])}
            for key, m, kw, p in PROBE_STEPS]


def current_step_ms(step_detail: Mapping[str, Any], model: str, model_kwargs: Mapping[str, Any],
                    policy: str) -> float | None:
    """The step time ``bench/step_detail.py`` measured for one run at its real shapes, or None where it has none."""
    for config in step_detail.get("configs", []):
        if (config.get("kind") == "shapes" and config["model"] == model and config["policy"] == policy
                and config["model_kwargs"] == dict(model_kwargs)):
            return float(config["step_ms"])
    return None


def profile_from_bandwidths(bw: Mapping[str, float], base: Profile | None = None, **fields: Any) -> Profile:
    """Model constants from microbenchmark bandwidths (GB/s); keys as in h200-probe.json.

    Demand faults: a fully faulted 2 MiB block costs ``BLOCK / fault_h2d``; the part not explained by
    the transfer at prefetch speed is the per-block servicing overhead. First touch: ``BLOCK /
    first_touch`` per block, no transfer.
    """
    base = base or Profile()
    prefetch = bw.get("prefetch_h2d_GBps", base.prefetch_h2d_GBps)
    block_us = lambda gbps: BLOCK / (gbps * 1e3)  # noqa: E731
    values = dict(
        pinned_h2d_GBps=bw.get("pinned_copy_h2d", base.pinned_h2d_GBps),
        prefetch_h2d_GBps=prefetch,
        fault_xfer_GBps=prefetch,
        prefetch_d2h_GBps=bw.get("prefetch_d2h_GBps", base.prefetch_d2h_GBps),
        evict_d2h_GBps=bw.get("prefetch_d2h_GBps", base.evict_d2h_GBps),
        remote_GBps=bw.get("remote_read_GBps", base.remote_GBps),
        remote_write_GBps=bw.get("pinned_copy_d2h", base.remote_write_GBps),  # GPU -> host direction
    )
    if "fault_h2d_GBps" in bw:
        values["fault_block_us"] = max(1.0, block_us(bw["fault_h2d_GBps"]) - block_us(prefetch))
    if "gpu_first_touch_GBps" in bw:
        values["populate_block_us"] = block_us(bw["gpu_first_touch_GBps"])
    if "resident_read_GBps" in bw:
        values["hbm_GBps"] = 0.85 * bw["resident_read_GBps"]  # elementwise kernels read and write
    values.update(fields)
    return base.replace(**values)


def _policy(p: str | Mapping[str, Any] | Policy) -> Policy:
    return Policy.from_dict(p) if isinstance(p, Mapping) else get_policy(p)


def simulate_ms(profile: Profile, target: Mapping[str, Any], steps: int = 3) -> float:
    """Median simulated step time (ms) of one target configuration (after one warm-up step)."""
    from um_lab.sim.backend import SimBackend

    case = model_case(target["model"], **dict(target.get("model_kwargs", {})))
    spec = RunSpec(model=target["model"], backend="sim", steps=steps, warmup_steps=1,
                   oversubscription_ratio=target.get("ratio"), budget=target.get("budget"))
    recs = SimBackend(profile).run(spec, case, _policy(target["policy"]))
    return statistics.median(r.wall_ms for r in recs if not r.warmup)


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 40) -> float:
    """Minimise ``f`` over [lo, hi] in log space (golden-section search)."""
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if fc <= fd:  # ties (a flat, host-bound plateau at high values): keep the low side
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)


def _log_err(sim: float, measured: float) -> float:
    return math.log(sim / measured) ** 2


def _loss_at(loss: Callable[[Profile], float], profile: Profile, field: str, value: float) -> float:
    return loss(profile.replace(**{field: value}))


def fit_roofline(profile: Profile, targets: Iterable[Mapping[str, Any]], rounds: int = 6,
                 fixed: Collection[str] = ()) -> Profile:
    """Fit the GEMM, attention and convolution peaks to resident (um-default) step times.

    ``matmul_half_gflop`` (the size at which a GEMM reaches half its peak) is kept: three resident
    targets cannot pin four constants. Peaks named in ``fixed`` (measured otherwise) are kept too.
    """
    pairs = []
    for t in targets:
        if _policy(t["policy"]).name != "um-default" or t.get("ratio"):
            continue
        trace = cached_trace(model_case(t["model"], **dict(t.get("model_kwargs", {}))))
        pairs.append((trace, float(t["ms"])))
    if not pairs:
        return profile
    has_conv = any((tr.op_kind == KIND_CONV).any() for tr, _ in pairs)
    has_mm = any((tr.op_kind == KIND_MATMUL).any() for tr, _ in pairs)
    has_attention = any((tr.op_kind == KIND_ATTENTION).any() for tr, _ in pairs)

    def loss(p: Profile) -> float:
        return sum(_log_err(native_step_ms(tr, p), ms) for tr, ms in pairs)

    fields = [("matmul_tflops", 5.0, 500.0)] if has_mm else []
    fields += [("attention_tflops", 1.0, 500.0)] if has_attention else []
    fields += [("conv_tflops", 5.0, 2000.0)] if has_conv else []
    fields = [f for f in fields if f[0] not in fixed]
    for _ in range(rounds):
        for name, lo, hi in fields:
            best = _golden(functools.partial(_loss_at, loss, profile, name), lo, hi)
            profile = profile.replace(**{name: best})
    return profile


def fit_field(profile: Profile, targets: Iterable[Mapping[str, Any]], field: str, lo: float, hi: float,
              iters: int = 16) -> Profile:
    """Fit one profile field by running the simulator on ``targets`` (squared log error)."""
    targets = list(targets)
    if not targets:
        return profile

    def loss(v: float) -> float:
        p = profile.replace(**{field: v})
        return sum(_log_err(simulate_ms(p, t), float(t["ms"])) for t in targets)

    return profile.replace(**{field: _golden(loss, lo, hi, iters)})


def calibrate(targets: Iterable[Mapping[str, Any]],
              bandwidth_GBps: Mapping[str, float] | None = None,
              base: Profile | None = None, fixed: Collection[str] = (), **fields: Any) -> Profile:
    """A profile fitted to measured step times (and bandwidths, when given): see module doc. Peaks named in
    ``fixed`` keep their value from ``fields``."""
    targets = list(targets)
    profile = profile_from_bandwidths(bandwidth_GBps or {}, base or Profile(), **fields)
    profile = fit_roofline(profile, targets, fixed=fixed)
    names = [(t, _policy(t["policy"])) for t in targets]
    read_mostly = [t for t, p in names
                   if any(a.read_mostly for a in p.advice.values()) and p.name != "input-read-mostly"]
    prefetching = [t for t, p in names if any(a.prefetch != "none" for a in p.advice.values())
                   and not any(a.read_mostly or a.preferred_location == "cpu" for a in p.advice.values())]
    profile = fit_field(profile, read_mostly, "readmostly_write_fault_us", 1.0, 1000.0)
    for _ in range(2):  # prefetch calls: a cost per call (segment) and per 2 MiB block it walks
        profile = fit_field(profile, prefetching, "prefetch_call_us", 0.1, 1000.0)
        profile = fit_field(profile, prefetching, "prefetch_call_us_per_block", 0.01, 100.0)
    return profile


def fidelity_targets(path: str | Path, fitted_only: bool = True) -> list[dict[str, Any]]:
    """Step-time targets from a ``bench/sim_fidelity.py`` result: its measured rows (only those marked
    ``"fitted": true`` by default, so the others stay held out)."""
    data = read_measurements(path)
    return [{"model": r["model"], "model_kwargs": r.get("model_kwargs", {}), "policy": r["policy"],
             "ms": float(r["measured_ms"])}
            for r in data["rows"] if r.get("measured_ms") and (r.get("fitted") or not fitted_only)]


def build_h200_profile(probe_path: str | Path, out: str | Path | None = None,
                       fidelity_path: str | Path | None = None,
                       primitives_path: str | Path | None = None,
                       conv_path: str | Path | None = None,
                       step_detail_path: str | Path | None = None,
                       gemm_tiles_path: str | Path | None = None,
                       gemm_shapes_paths: Iterable[str | Path] = (),
                       scheduler_paths: Iterable[str | Path] = (),
                       tensor_core_path: str | Path | None = None) -> Profile:
    """Make the packaged H200 profile from the probe JSON (``calibration/h200-probe.json``), when given
    the rows of a fidelity measurement marked ``"fitted"`` (the others stay held out), the UM
    primitives of ``bench/uvm_primitives.py``, which set the host-link and migration constants
    (:mod:`um_lab.sim.primitives`; they override the probe's), and the in-step convolutions of
    ``bench/conv_in_step.py``, which set ``tile_conv_igemm_kxk`` / ``_1x1`` (:mod:`um_lab.sim.conv_act`), and
    the per-op training steps of ``bench/step_detail.py``, which set the host costs, the GEMM,
    attention, convolution and HBM rates, the batch-norm passes and the remote elementwise rates
    (:mod:`um_lab.sim.step_fit`); the whole-step fit then keeps those peaks fixed; and the GEMM grid of
    ``bench/uvm_primitives.py --sections gemm_tiles``, which sets the link passes over a GEMM's remote weight
    by layout and shape (:mod:`um_lab.sim.gemm_passes`); and ``bench/gemm_shapes.py`` results, the passes of
    models' own weight GEMMs timed alone, which replace that law at exactly those shapes; and ``bench/budget.py
    --time-moves`` results, the layer-ahead scheduler's side-stream rates in training
    (:func:`um_lab.sim.primitives.fit_scheduler_rates`); and ``bench/gemm_shapes.py --tensor-cores`` results, the
    16-bit peaks (:func:`tensor_core_fields`)."""
    probe = read_measurements(probe_path)
    bw = probe["bandwidth_GBps"]
    gpu_total = int(probe["environment"]["memGetInfo"][1])
    targets = probe_targets(probe)
    if fidelity_path is not None:
        targets += fidelity_targets(fidelity_path)
    link: dict[str, float] = {}
    provenance: dict[str, Any] = {}
    if primitives_path is not None:
        link, provenance = fit_primitives(load_primitives(primitives_path))
    source = f"{probe['what']}; fitted by um_lab.sim.calibration.build_h200_profile"
    if primitives_path is not None:
        source += f"; host link and migration from {Path(primitives_path).name} (bench/uvm_primitives.py)"
    if gemm_tiles_path is not None:
        from um_lab.sim.gemm_passes import fit_gemm_passes, load_gemm_tiles

        stream = link.get("remote_GBps", Profile().remote_GBps)
        gemm_fields, gemm_provenance = fit_gemm_passes(load_gemm_tiles(gemm_tiles_path), stream)
        link.update(gemm_fields)
        provenance.update(gemm_provenance)
        source += f"; GEMM weight passes by layout and shape from {Path(gemm_tiles_path).name} (gemm_tiles)"
    fixed: tuple[str, ...] = ()
    if step_detail_path is not None:
        from um_lab.sim.step_fit import (
            fit_attention_rate,
            fit_gemm_rate,
            fit_host_costs,
            fit_remote_elementwise,
            fit_resident_ops,
            resident_gemms,
        )

        detail = read_measurements(step_detail_path)
        kernels = resident_gemms(read_measurements(primitives_path)) if primitives_path else []
        fits = (fit_host_costs, functools.partial(fit_gemm_rate, extra=kernels), fit_attention_rate,
                functools.partial(fit_resident_ops, kernel_us=Profile().kernel_us), fit_remote_elementwise)
        for fit in fits:
            step_fields, step_provenance = fit(detail)
            link.update(step_fields)
            provenance.update(step_provenance)
        fixed = ("matmul_tflops", "attention_tflops", "conv_tflops")
        # the MLP's probe step came from an early single-pool prototype; um_lab's own per-step host work is now
        # part of the host model (cpu_step_us), so the fit takes the step that step_detail measured today
        mlp_now = current_step_ms(detail, "mlp", {}, "um-default")
        targets = [dict(t, ms=mlp_now) if mlp_now and t["model"] == "mlp" and t["policy"] == "um-default" and
                   not t["model_kwargs"] else t for t in targets]
        source += (f"; host costs, GEMM, attention, convolution and HBM rates, batch-norm passes and remote "
                   f"elementwise rates from {Path(step_detail_path).name} "
                   "(bench/step_detail.py)")
    profile = calibrate(targets, bw, Profile(), name="h200", gpu_memory_bytes=gpu_total, source=source,
                        fixed=fixed, **link)
    if conv_path is not None:
        from um_lab.sim.conv_act import ACT_REMOTE, fit_conv_tile

        conv_fields, conv_provenance = fit_conv_tile(read_measurements(conv_path), profile, ACT_REMOTE)
        profile = profile.replace(source=profile.source + f"; convolution tile from "
                                      f"{Path(conv_path).name} (bench/conv_in_step.py)", **conv_fields)
        provenance.update(conv_provenance)
    shape_paths = [Path(p) for p in gemm_shapes_paths]
    if shape_paths:
        from um_lab.sim.gemm_passes import law_spread, load_gemm_shapes

        table = load_gemm_shapes(shape_paths, rate=profile.remote_GBps)
        profile = profile.replace(gemm_shape_passes=table, source=profile.source + f"; {len(table)} GEMM shapes' "
                                  f"weight passes from bench/gemm_shapes.py ({len(shape_paths)} models)")
        provenance["gemm_shape_files"] = {"files": [p.name for p in shape_paths], "shapes": len(table)}
        provenance["gemm_law_factor"] = law_spread(shape_paths, profile)
    scheduler_fields, scheduler_provenance = fit_scheduler_rates(scheduler_paths)
    if scheduler_fields:
        profile = profile.replace(source=profile.source + "; the scheduler's side-stream rates from bench/budget.py "
                                  "--time-moves", **scheduler_fields)
        provenance.update(scheduler_provenance)
    if tensor_core_path is not None:
        tc_fields, tc_provenance = tensor_core_fields(read_measurements(tensor_core_path), profile)
        profile = profile.replace(source=profile.source + f"; 16-bit tensor-core peaks from "
                                  f"{Path(tensor_core_path).name} (bench/gemm_shapes.py --tensor-cores)", **tc_fields)
        provenance.update(tc_provenance)
    if out is not None:
        measured = {"bandwidth_GBps": bw, "step_ms_targets": targets,
                    "environment": {k: probe["environment"][k] for k in ("torch", "cuda", "gpu", "driver")}}
        if provenance:
            measured["primitives"] = provenance
        profile.save(out, measured=measured)
    return profile


def measure_on_gpu(targets: Iterable[Mapping[str, Any]] = DEFAULT_STEP_RUNS, steps: int = 8,
                   warmup: int = 3) -> dict[str, Any]:
    """Measure bandwidths and step times on the local GPU (needs CUDA and the real backend).

    Returns ``{"bandwidth_GBps": {...}, "targets": [...]}`` for :func:`calibrate`.
    """
    import torch

    from um_lab.errors import CudaUnavailableError

    if not torch.cuda.is_available():
        raise CudaUnavailableError("measure_on_gpu needs a CUDA GPU")
    from um_lab.backend import get_backend

    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dev.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    bw = {"pinned_copy_h2d": n / (start.elapsed_time(end) * 1e6)}
    del host, dev
    return {"bandwidth_GBps": bw, "targets": measure_steps(targets, get_backend("cuda"), steps, warmup)}


def measure_steps(targets: Iterable[Mapping[str, Any]], backend: Any, steps: int = 8,
                  warmup: int = 3) -> list[dict[str, Any]]:
    """Each target (``{"model", "model_kwargs", "policy"}``) trained on this machine's GPU through ``backend`` (the
    real one), as the simulator's replica of the model: the target with its median step time added (``ms``)."""
    measured = []
    for t in targets:
        case = model_case(t["model"], **dict(t.get("model_kwargs", {})))
        spec = RunSpec(model=t["model"], backend="cuda", steps=steps, warmup_steps=warmup, budget=t.get("budget"))
        times = [r.wall_ms for r in backend.run(spec, case, _policy(t["policy"])) if not r.warmup]
        measured.append({**t, "ms": statistics.median(times)})
    return measured


def tensor_core_fields(rates: Mapping[str, Any], profile: Profile) -> tuple[dict[str, float], dict[str, Any]]:
    """The 16-bit peaks (``*_16bit_tflops``) from ``bench/gemm_shapes.py --tensor-cores`` results and their
    provenance: each kind's fitted fp32 peak in ``profile`` times the kernels' measured bf16 / fp32 speed-up
    (isolated kernels set the ratio; the training steps already set the fp32 peak)."""
    fields: dict[str, float] = {}
    provenance: dict[str, Any] = {}
    for kind in ("matmul", "attention", "conv"):
        measured = rates.get("kinds", {}).get(kind, {})
        if "bf16" not in measured or "fp32" not in measured:
            continue
        speedup = measured["bf16"]["tflops"] / measured["fp32"]["tflops"]
        value = round(getattr(profile, f"{kind}_tflops") * speedup, 2)
        fields[f"{kind}_16bit_tflops"] = value
        provenance[f"{kind}_16bit_tflops"] = {
            "value": value, "from": f"{kind} kernels alone on {rates.get('device', '?')} ({rates.get('date', '?')}): "
            f"bf16 {measured['bf16']['tflops']} / fp32 {measured['fp32']['tflops']} TFLOP/s = {speedup:.2f}x the "
            f"fitted fp32 peak; fp16 {measured.get('fp16', {}).get('tflops', '?')} TFLOP/s"}
    return fields, provenance
