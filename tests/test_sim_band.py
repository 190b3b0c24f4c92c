"""Uncertainty bands over the profile constants' ranges (um_lab.sim.band)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from um_lab.sim import band
from um_lab.sim.backend import SimBackend
from um_lab.sim.profile import load_profile
from um_lab.sim.replicas import model_case
from um_lab.types import RunSpec

ROOT = Path(__file__).parents[1]
SMALL = {"n_layer": 2, "batch_size": 2, "seq_len": 128}


def test_measured_constants_carry_their_measured_ranges_and_the_rest_a_reason():
    ranges = band.profile_ranges("h200")
    provenance = json.loads((ROOT / "um_lab/sim/profiles/h200.json").read_text())["measured"]["primitives"]
    assert ranges["remote_GBps"] == tuple(provenance["remote_GBps"]["range"])
    assert ranges["evict_d2h_GBps"][0] == 3.65, "eviction spans the first-use rate up to the steady one"
    p = load_profile("h200")
    for name, (lo, hi) in ranges.items():
        assert lo <= getattr(p, name) <= hi, name
    assert all(why for _, _, why in band.UNMEASURED.values())


def test_corners_put_every_constant_at_its_fast_or_slow_end():
    fast, slow = band.corner_profiles("h200")
    assert fast.remote_GBps > slow.remote_GBps and fast.evict_d2h_GBps > slow.evict_d2h_GBps
    assert fast.fault_block_us < slow.fault_block_us and fast.cpu_op_us < slow.cpu_op_us
    with pytest.raises(ValueError, match="range of remote_GBps"):
        band.corner_profiles("h200", {"remote_GBps": (60.0, 50.0)})


@pytest.mark.parametrize("policy", ["um-default", "gpu-first", "zero-copy-params", "prefetch-all"])
def test_the_band_contains_the_nominal_step_time(policy):
    case = model_case("gpt2-small", **SMALL)
    spec = RunSpec(model="gpt2-small", backend="sim", steps=2, warmup_steps=1, oversubscription_ratio=1.5)
    nominal = [r.wall_ms for r in SimBackend().run(spec, case, policy) if not r.warmup][-1]
    fast, slow = band.band_ms(spec, case, policy)
    assert fast <= nominal * (1 + 1e-9) and nominal <= slow * (1 + 1e-9)
    assert slow > fast


def test_a_ranking_that_reverses_at_one_end_is_flagged():
    table = pd.DataFrame({
        "model": ["m"] * 3, "ratio": [1.5] * 3, "policy": ["um-default", "a", "b"],
        "median_ms": [100.0, 50.0, 60.0], "band_fast_ms": [90.0, 45.0, 55.0], "band_slow_ms": [300.0, 200.0, 150.0]})
    out = band.with_band(table, "um-default").set_index("policy")
    assert list(out["ranking_flips"]) == [False, True, True]  # a and b swap places at the slow end
    assert out.loc["a", "speedup_band_lo"] == pytest.approx(1.5)
    assert out.loc["a", "speedup_band_hi"] == pytest.approx(2.0)


def test_compare_with_a_band_on_the_simulator_and_refused_elsewhere(tmp_path):
    from um_lab.runs.sweep import compare

    with pytest.raises(ValueError, match="reports no uncertainty band"):
        compare(["mlp"], ["gpu-first"], [None], backend="cuda", band=True, out_dir=tmp_path)
    table = compare({"gpt2-small": SMALL}, ["gpu-first"], [0.8, 1.5], backend="sim", steps=2, band=True,
                    out_dir=tmp_path)
    assert {"band_fast_ms", "band_slow_ms", "speedup_band_lo", "speedup_band_hi", "ranking_flips"} <= set(table)
    assert (table["band_fast_ms"] <= table["median_ms"] + 1e-9).all()
    assert (table["speedup_band_lo"] <= table["speedup_vs_um-default"] + 1e-9).all()
