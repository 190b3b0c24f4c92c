"""Profiles (JSON round trip, packaged H200) and calibration fits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from um_lab.models import get_model
from um_lab.sim.calibration import (
    current_step_ms,
    fit_roofline,
    measure_on_gpu,
    probe_targets,
    profile_from_bandwidths,
)
from um_lab.sim.profile import Profile, load_profile
from um_lab.sim.roofline import native_step_ms, queue_time_us
from um_lab.sim.trace import cached_trace


def test_packaged_h200_profile_carries_the_measured_primitives() -> None:
    """Host-link and migration constants come from bench/results/uvm_primitives.json, with provenance."""
    import json
    from pathlib import Path

    from um_lab.sim.primitives import fit_primitives, load_primitives

    p = load_profile("h200")
    assert p.name == "h200" and "H200" in p.source and "uvm_primitives" in p.source
    assert p.gpu_memory_bytes == 150109880320
    root = Path(__file__).parents[1]
    fields, why = fit_primitives(load_primitives(root / "bench" / "results" / "uvm_primitives.json"))
    for name, value in fields.items():
        assert getattr(p, name) == pytest.approx(value), name
    packaged = json.loads((root / "um_lab" / "sim" / "profiles" / "h200.json").read_text())
    conv_fields = {"tile_conv_igemm_kxk", "tile_conv_igemm_1x1"}
    step_fields = {"cpu_op_us", "cpu_bwd_op_us", "cpu_view_op_us", "cpu_step_us", "host_fit_rows",
                   "matmul_tflops", "matmul_half_gflop", "attention_tflops", "attention_half_gflop",
                   "remote_rw_GBps", "remote_colreduce_GBps", "conv_tflops", "conv_half_gflop", "hbm_GBps",
                   "norm_fwd_hbm_passes", "norm_bwd_hbm_passes"}
    gemm_fields = {"gemm_nt_passes", "gemm_nn_passes", "gemm_small_m_ctas"}  # tests/test_sim_gemm_passes.py
    shape_fields = {"gemm_shape_files", "gemm_law_factor"}  # bench/gemm_shapes.py results: the table and its band
    scheduler_fields = {"scheduler_h2d_GBps", "scheduler_d2h_GBps"}  # bench/budget.py --time-moves rows
    sixteen_bit = {"matmul_16bit_tflops", "attention_16bit_tflops", "conv_16bit_tflops"}  # gemm_shapes --tensor-cores
    assert set(packaged["measured"]["primitives"]) == (set(why) | conv_fields | step_fields | gemm_fields
                                                       | shape_fields | scheduler_fields | sixteen_bit)
    for name in sixteen_bit:  # the 16-bit peak: the fitted fp32 peak times the measured 16-bit / fp32 ratio
        assert getattr(p, name) > getattr(p, name.replace("_16bit", "")) and "bf16" in \
            packaged["measured"]["primitives"][name]["from"]
    for name in scheduler_fields:  # slower than a lone prefetch in the same direction, inside the measured range
        info = packaged["measured"]["primitives"][name]
        assert "budget.py --time-moves" in info["from"] and info["range"][0] <= getattr(p, name) <= info["range"][1]
    assert p.scheduler_h2d_GBps < p.prefetch_h2d_GBps and p.scheduler_d2h_GBps < p.prefetch_d2h_GBps
    files = packaged["measured"]["primitives"]["gemm_shape_files"]
    assert files["shapes"] == len(p.gemm_shape_passes) and len(files["files"]) == len(list(
        (root / "bench" / "results" / "gemm_shapes").glob("*.json")))
    lo, hi = packaged["measured"]["primitives"]["gemm_law_factor"]["range"]
    assert lo < p.gemm_law_factor == 1.0 < hi
    for name in step_fields - {"host_fit_rows"}:  # fitted on per-op training steps, each with its range
        info = packaged["measured"]["primitives"][name]
        assert "step_detail" in info["source"] and info["range"][0] <= getattr(p, name) <= info["range"][1], name
    for name in conv_fields:
        conv = packaged["measured"]["primitives"][name]
        assert "conv_in_step" in conv["source"] and conv["range"][0] < getattr(p, name) < conv["range"][1]
    assert 45 < p.remote_GBps < 60 and 10 < p.evict_d2h_GBps < 25
    # demand faults: 2 MiB per (overhead + transfer) reproduces the measured median fault-driven rate
    per_block_us = p.fault_block_us + (2 << 20) / (p.fault_xfer_GBps * 1e3)
    assert 9.5 < (2 << 20) / (per_block_us * 1e3) < 12.5


ROOT = Path(__file__).parents[1]


def packaged_h200() -> Profile:
    """The packaged file's constants, read directly (not through load_profile)."""
    return Profile.from_dict(json.loads((ROOT / "um_lab" / "sim" / "profiles" / "h200.json").read_text()))


def assert_h200_means_the_packaged_file(profile: Profile, what: str) -> None:
    """A profile called ``h200`` must have exactly the packaged file's constants."""
    if profile.name != "h200":
        return
    differ = sorted(k for k, v in dataclasses.asdict(profile).items() if v != getattr(packaged_h200(), k))
    assert not differ, f"{what} is named 'h200' but differs from um_lab/sim/profiles/h200.json in {differ}"


def test_only_the_packaged_h200_profile_is_named_h200() -> None:
    """Profile() holds starting values, not the calibrated card: it must not carry the card's name (and a
    rename to 'h200' fails here, since its values differ); every way to get 'h200' gives the file."""
    from um_lab.sim import SimBackend
    from um_lab.sim.band import corner_profiles

    assert packaged_h200().name == "h200"
    assert Profile() != packaged_h200()
    assert_h200_means_the_packaged_file(Profile(), "Profile()")
    fast, slow = corner_profiles()
    for what, profile in [("load_profile()", load_profile()), ("load_profile('h200')", load_profile("h200")),
                          ("SimBackend().profile", SimBackend().profile), ("band fast", fast), ("band slow", slow)]:
        assert_h200_means_the_packaged_file(profile, what)
    assert load_profile("h200") == packaged_h200()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:um_lab.sim.trace. aten.select_backward:UserWarning")
def test_rebuilding_the_h200_profile_gives_the_packaged_file() -> None:
    """build_h200_profile (the calibration docstring's rebuild) makes a profile named 'h200': it must be the
    packaged one (about 30 s: it traces the fit models and fits every constant again)."""
    from um_lab.sim.calibration import build_h200_profile

    results = ROOT / "bench" / "results"
    rebuilt = build_h200_profile(ROOT / "calibration" / "h200-probe.json",
                                 fidelity_path=results / "sim_fidelity.json",
                                 primitives_path=results / "uvm_primitives.json",
                                 conv_path=results / "conv_in_step.json",
                                 step_detail_path=results / "step_detail.json",
                                 gemm_tiles_path=results / "gemm_tiles.json",
                                 gemm_shapes_paths=sorted((results / "gemm_shapes").glob("*.json")),
                                 scheduler_paths=[results / "scheduler_moves.json"],
                                 tensor_core_path=results / "tensor_core_rates.json")
    assert rebuilt.name == "h200"
    packaged = dataclasses.asdict(packaged_h200())
    for key, value in dataclasses.asdict(rebuilt).items():
        exact = isinstance(value, (str, tuple))  # names, sources, the per-shape table
        assert value == (packaged[key] if exact else pytest.approx(packaged[key], rel=1e-9)), key


def test_profile_json_round_trip_and_rejects_bad_fields(tmp_path) -> None:
    p = dataclasses.replace(Profile(), name="mine", matmul_tflops=12.5)
    path = p.save(tmp_path / "mine.json", measured={"x": 1})
    assert load_profile(str(path)) == p
    data = json.loads(path.read_text())
    data["bogus"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown profile fields"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="positive"):
        Profile.from_dict({"hbm_GBps": -1})
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-card")


def test_profile_from_bandwidths() -> None:
    p = profile_from_bandwidths({"prefetch_h2d_GBps": 20.0, "fault_h2d_GBps": 5.0, "remote_read_GBps": 9.0})
    assert p.prefetch_h2d_GBps == 20.0 and p.remote_GBps == 9.0
    assert p.fault_block_us == pytest.approx((2 << 20) / 5e3 - (2 << 20) / 20e3)


def test_queue_time_is_gpu_or_host_bound() -> None:
    assert queue_time_us(torch.tensor([100.0, 100.0]).numpy(), 1.0) == pytest.approx(201.0)
    assert queue_time_us(torch.tensor([1.0, 1.0]).numpy(), 50.0) == pytest.approx(101.0)


def test_fit_roofline_recovers_a_known_gemm_peak() -> None:
    case = get_model("mlp", width=1024, depth=3, batch_size=512)
    truth = dataclasses.replace(Profile(), matmul_tflops=20.0, matmul_half_gflop=0.05)
    measured = native_step_ms(cached_trace(case), truth)
    start = dataclasses.replace(Profile(), matmul_tflops=80.0, matmul_half_gflop=0.05)
    target = [{"model": "mlp", "model_kwargs": {"width": 1024, "depth": 3, "batch_size": 512},
               "policy": "um-default", "ms": measured}]
    fitted = fit_roofline(start, target)
    assert native_step_ms(cached_trace(case), fitted) == pytest.approx(measured, rel=0.01)


def test_link_constants_come_from_the_primitives_not_from_step_times() -> None:
    """A synthetic primitives result: the fit recovers its streaming rate and GEMM tile, and the
    eviction rate carries the first-use range."""
    from um_lab.sim.primitives import fit_primitives

    def linear(name: str, operand: str, m: int, k: int, n: int, passes: float) -> dict:
        return {"group": "kernel", "name": name, "operand": operand, "shape": f"M={m} K={k} N={n}",
                "effective_link_passes": passes}

    rows = [{"group": "remote", "name": "raw access", "pattern": "streaming read", "GBps": 50.0},
            {"group": "remote", "name": "raw access", "pattern": "streaming write", "GBps": 52.0},
            {"group": "migration", "name": "prefetch D2H fresh", "GBps": 17.0},
            {"group": "migration", "name": "prefetch D2H reused", "GBps": 19.0}]
    # passes reported at link 40 GB/s; at the measured 50 GB/s they are 1.25x: tile = 4096 / (64 * 1.25)
    rows += [linear("linear fwd y=x@W^T", "x", m, 4096, 4096, 64.0) for m in (512, 2048)]
    fields, why = fit_primitives({"link_GBps": 40.0, "rows": rows})
    assert fields["remote_GBps"] == 50.0 and fields["remote_write_GBps"] == 52.0
    assert fields["tile_gemm_a"] == pytest.approx(4096 / 80, rel=1e-3)
    assert fields["evict_d2h_GBps"] == 18.0 and why["evict_d2h_GBps"]["range"] == [3.65, 19.0]


def test_step_targets_come_from_the_probe_file() -> None:
    """The whole-step fit's targets are read from the probe (none are written in code), one per probe entry."""
    probe = json.loads((ROOT / "calibration" / "h200-probe.json").read_text())
    targets = probe_targets(probe)
    assert {t["model"] for t in targets} == {"mlp", "resnet50", "gpt2-medium"}
    assert targets[0]["ms"] == probe["training_steps"]["mlp_managed_default"]["median_ms"]
    del probe["training_steps"]["gpt2m_params_readmostly"]
    with pytest.raises(ValueError, match="gpt2m_params_readmostly"):
        probe_targets(probe)


def test_current_step_reads_step_detail() -> None:
    detail = json.loads((ROOT / "bench" / "results" / "step_detail.json").read_text())
    ms = current_step_ms(detail, "mlp", {}, "um-default")
    assert ms is not None and 5 < ms < 20
    assert current_step_ms(detail, "mlp", {"width": 3}, "um-default") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_measure_on_gpu_needs_cuda() -> None:
    from um_lab.errors import CudaUnavailableError

    with pytest.raises(CudaUnavailableError):
        measure_on_gpu()


def test_queue_time_takes_per_op_host_costs() -> None:
    gpu = torch.tensor([1.0, 100.0, 1.0]).numpy()
    assert queue_time_us(gpu, torch.tensor([50.0, 1.0, 1.0]).numpy()) == pytest.approx(152.0)


def test_host_cost_per_op_class() -> None:
    """Backward ops (C++ engine) are cheaper than Python-issued ones; cuDNN calls and foreach tensor
    lists add host time; the batch copy is issued before the timer."""
    from um_lab.sim.replicas import resnet_replica
    from um_lab.sim.roofline import op_host_us

    p = dataclasses.replace(Profile(), cpu_op_us=20.0, cpu_bwd_op_us=5.0, cpu_cudnn_call_us=30.0,
                            cpu_foreach_tensor_us=2.0)
    tr = cached_trace(resnet_replica(18, batch_size=2, image_size=32, classes=10))
    host = op_host_us(tr, p)
    names = tr.op_names
    assert host[0] == 0.0  # the input copy
    i_conv = names.index("aten.convolution")
    i_cbwd = names.index("aten.convolution_backward")
    i_relu_bwd = names.index("aten.threshold_backward")
    i_foreach = names.index("aten._foreach_lerp_")
    assert host[i_conv] == pytest.approx(20.0 + 30.0)
    assert host[i_cbwd] == pytest.approx(5.0 + 2 * 30.0)  # data and filter gradients: two cuDNN calls
    assert host[i_relu_bwd] == pytest.approx(5.0)
    n_args = tr.acc_ptr[i_foreach + 1] - tr.acc_ptr[i_foreach]
    assert host[i_foreach] == pytest.approx(20.0 + 2.0 * n_args) and n_args > 10
    # a host-bound case gets slower with host costs, a GPU-bound one does not
    fast = dataclasses.replace(p, cpu_op_us=1.0, cpu_bwd_op_us=1.0, cpu_cudnn_call_us=0.1,
                               cpu_foreach_tensor_us=0.01)
    assert native_step_ms(tr, p) > 2 * native_step_ms(tr, fast)


def test_the_scheduler_rates_are_the_medians_of_the_timed_budget_rows(tmp_path) -> None:
    from um_lab.sim.primitives import fit_scheduler_rates

    def timed(h2d, d2h):
        return {"move_timing": {"to_gpu": {"GBps": h2d}, "to_host": {"GBps": d2h}}}

    (tmp_path / "a.json").write_text(json.dumps({"rows": [timed(30.0, 8.0), timed(40.0, 12.0), {"step_ms": 1.0}]}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": [timed(50.0, 10.0)]}))
    (tmp_path / "untimed.json").write_text(json.dumps({"rows": [{"step_ms": 2.0}, timed(float("nan"), 0.0)]}))
    fields, why = fit_scheduler_rates(sorted(tmp_path.glob("*.json")))
    assert fields == {"scheduler_h2d_GBps": 40.0, "scheduler_d2h_GBps": 10.0}
    assert why["scheduler_d2h_GBps"]["range"] == [8.0, 12.0] and "a.json, b.json (" in why["scheduler_h2d_GBps"]["from"]
    assert fit_scheduler_rates([tmp_path / "untimed.json"]) == ({}, {})
    assert packaged_h200().scheduler_d2h_GBps > 0  # the packaged profile has them: sim.budget prices moves there


def test_the_host_scale_fitted_to_host_bound_steps_is_recovered() -> None:
    """A host 1.6x slower than the profile's: the fit finds 1.6 and the scaled profile reproduces the steps."""
    from um_lab.sim.calibration import simulate_ms
    from um_lab.sim.machine_calibration import HOST_FIELDS, fit_host_scale, with_host_scale
    from um_lab.sim.profile import load_profile

    profile = load_profile("h200")
    probes = [{"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 16}, "policy": "um-default"}]
    measured = [{**p, "ms": 1.6 * simulate_ms(with_host_scale(profile, 1.0), p)} for p in probes]
    fitted, scale = fit_host_scale(profile, measured)
    assert scale == pytest.approx(1.6, rel=0.03)
    assert fitted.cpu_op_us == pytest.approx(profile.cpu_op_us * scale)
    assert all(getattr(fitted, f) == pytest.approx(getattr(profile, f) * scale) for f in HOST_FIELDS)
    assert simulate_ms(fitted, probes[0]) == pytest.approx(measured[0]["ms"], rel=0.03)
    assert fitted.matmul_tflops == profile.matmul_tflops  # only the host side moves
    with pytest.raises(ValueError):
        with_host_scale(profile, 0.0)


def test_a_machine_fit_recovers_each_kind_of_factor_from_its_probes() -> None:
    """Probes timed on a machine whose host is 1.3x slower, GPU 1.25x slower, link 1.6x slower and the scheduler's
    hooks 1.4x the profile's: the fit finds each factor, and the fitted profile reproduces every probe."""
    from um_lab.sim.calibration import simulate_ms
    from um_lab.sim.machine_calibration import KINDS, fit_machine, with_scale
    from um_lab.sim.profile import load_profile

    profile = load_profile("h200")
    small = {"batch_size": 64, "width": 2048, "depth": 4}
    probes = {
        "host": {"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 16}, "policy": "um-default"},
        "gpu": {"model": "mlp", "model_kwargs": {"batch_size": 4096, "width": 4096, "depth": 2},
                "policy": "um-default"},
        "link": {"model": "mlp", "model_kwargs": small, "policy": "zero-copy-params"},
        "scheduler": {"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 32},
                      "policy": "layer-ahead", "budget": "0.6x"},
    }
    assert list(probes) == list(KINDS)
    truth = {"host": 1.3, "gpu": 1.25, "link": 1.6, "scheduler": 1.4}
    machine = profile
    for kind, scale in truth.items():
        machine = with_scale(machine, kind, scale)
    measured = [{**p, "kind": kind, "ms": simulate_ms(machine, p)} for kind, p in probes.items()]
    fit = fit_machine(profile, measured)
    assert fit.scales == pytest.approx(truth, rel=0.05)
    assert [p["fitted_ms"] for p in fit.probes] == pytest.approx([m["ms"] for m in measured], rel=0.03)
    assert fit.profile.cpu_op_us == pytest.approx(profile.cpu_op_us * fit.scales["host"], rel=1e-3)
    assert fit.profile.hbm_GBps == pytest.approx(profile.hbm_GBps / fit.scales["gpu"], rel=1e-3)
    assert fit.profile.remote_GBps == pytest.approx(profile.remote_GBps / fit.scales["link"], rel=1e-3)
    assert fit.profile.remote_update_ms_per_GB == pytest.approx(
        profile.remote_update_ms_per_GB * fit.scales["link"], rel=1e-3)
    assert fit.profile.scheduler_hook_us == pytest.approx(profile.scheduler_hook_us * fit.scales["scheduler"], rel=1e-3)
    fields = [f for _, kind_fields in KINDS.values() for f in kind_fields]
    assert len(set(fields)) == len(fields)  # each constant belongs to one kind
    assert fit.profile.fault_block_us == profile.fault_block_us  # nothing outside the kinds moves
    with pytest.raises(ValueError, match="kind"):
        fit_machine(profile, [{**probes["host"], "ms": 1.0}])


def test_each_machine_probe_is_bound_by_what_its_kind_scales() -> None:
    """Doubling a kind's constants lengthens its own probe by at least half (the probe measures that kind), so a
    budgeted step's link time is not fitted as the scheduler's, nor the reverse."""
    from um_lab.sim.calibration import simulate_ms
    from um_lab.sim.machine_calibration import KINDS, with_scale
    from um_lab.sim.profile import load_profile

    profile = load_profile("h200")
    for kind in ("link", "scheduler"):
        for probe in KINDS[kind][0]:
            assert simulate_ms(with_scale(profile, kind, 2.0), probe) > 1.5 * simulate_ms(profile, probe), probe
