"""UM basics on the simulator: each experiment shows the direction the teaching notebook explains."""

from __future__ import annotations

import pytest

from um_lab import UmLabError
from um_lab.teaching import basics
from um_lab.teaching.basics import MAX_ARRAY_BYTES, BasicsSafetyError, ManagedBudget

SIZE = 16  # MiB
MiB = 1 << 20


def rows(df):
    """(case, step) -> row dict (gpu_memory added to the key when present)."""
    key = ["case", "gpu_memory", "step"] if "gpu_memory" in df else ["case", "step"]
    return {tuple(r[k] for k in key): r for r in df.to_dict("records")}


def test_pick_backend_says_which_and_why():
    assert basics.pick_backend("sim") == ("sim", "the simulator (asked for), H200 profile")
    name, why = basics.pick_backend("auto")
    assert name in ("sim", "cuda") and why
    with pytest.raises(ValueError, match="backend must be one of"):
        basics.pick_backend("tpu")


def test_every_experiment_reports_the_simulator_and_its_size():
    for df in (basics.page_faults(SIZE, "sim"), basics.prefetch(SIZE, "sim"), basics.read_mostly(SIZE, "sim"),
               basics.zero_copy(SIZE, 2, "sim"), basics.preferred_location(SIZE, "sim")):
        assert df.attrs == {"backend": "sim", "size_mib": SIZE}
        assert {"case", "step", "time_ms", "GBps", "faults", "htod_MiB", "remote_MiB"} <= set(df.columns)
        assert (df["time_ms"] > 0).all()


def test_first_touch_faults_and_the_second_pass_is_free():
    r = rows(basics.page_faults(SIZE, "sim"))
    fresh1, fresh2 = r["fresh memory", "GPU write 1"], r["fresh memory", "GPU write 2"]
    host1, host2 = r["CPU-written data", "GPU read 1"], r["CPU-written data", "GPU read 2"]
    assert fresh1["faults"] > 0 and fresh1["htod_MiB"] == 0  # populated on the GPU: nothing to copy
    assert host1["faults"] > 0 and host1["htod_MiB"] == SIZE  # migrated from the host
    assert host1["on_gpu_MiB"] == SIZE
    for second, first in ((fresh2, fresh1), (host2, host1)):
        assert second["faults"] == 0 and second["htod_MiB"] == 0
        assert second["time_ms"] * 50 < first["time_ms"]  # resident: HBM speed
    assert 5 < host1["GBps"] < 20  # fault-driven migration: ~10 GB/s on the H200 profile


def test_prefetch_removes_the_faults_and_is_faster_in_total():
    r = rows(basics.prefetch(SIZE, "sim"))
    demand = r["demand faults", "GPU read"]
    pre, after = r["prefetch first", "prefetch to GPU"], r["prefetch first", "GPU read"]
    assert demand["faults"] > 0
    assert pre["faults"] == 0 and after["faults"] == 0
    assert pre["htod_MiB"] == SIZE and after["htod_MiB"] == 0  # the prefetch moved it all
    assert pre["time_ms"] + after["time_ms"] < demand["time_ms"]
    assert after["time_ms"] * 50 < demand["time_ms"]


def test_read_mostly_duplicates_on_read_and_a_write_collapses_the_copies_at_a_cost():
    r = rows(basics.read_mostly(SIZE, "sim"))
    assert r["read_mostly", "GPU read 1"]["duplicated_MiB"] == SIZE  # host copy kept
    assert r["no advice", "GPU read 1"]["duplicated_MiB"] == 0  # migrated: one copy only
    assert r["read_mostly", "GPU write"]["duplicated_MiB"] == 0
    rm_write, plain_write = r["read_mostly", "GPU write"]["time_ms"], r["no advice", "GPU write"]["time_ms"]
    assert rm_write > 100 * plain_write
    # reads cost the same either way
    assert r["read_mostly", "GPU read 2"]["time_ms"] == pytest.approx(r["no advice", "GPU read 2"]["time_ms"])


def test_zero_copy_reads_remotely_every_pass_and_migrates_nothing():
    df = basics.zero_copy(SIZE, 3, "sim")
    zc = df[df["case"] == "preferred cpu + accessed_by gpu"]
    plain = df[df["case"] == "no advice"]
    assert len(zc) == 3 and len(plain) == 3
    assert (zc["remote_MiB"] == SIZE).all() and (zc["htod_MiB"] == 0).all()
    assert (zc["faults"] == 0).all() and (zc["on_gpu_MiB"] == 0).all()
    assert zc["time_ms"].nunique() == 1  # every pass pays the host link again
    assert 30 < zc["GBps"].iloc[0] < 60  # the link, not HBM
    # no advice: one slow migrating pass, then resident
    assert plain["htod_MiB"].tolist() == [SIZE, 0, 0] and (plain["remote_MiB"] == 0).all()
    assert zc["time_ms"].iloc[0] < plain["time_ms"].iloc[0]  # once: remote beats fault + migrate
    assert zc["time_ms"].sum() > plain["time_ms"].iloc[1:].sum()  # repeated: resident wins


def test_preferred_gpu_is_like_no_advice_and_eviction_ignores_it():
    r = rows(basics.preferred_location(SIZE, "sim", ratio=2))
    over = "buffer / 2 (simulated)"
    for memory in ("fits", over):
        for step in ("GPU read 1", "GPU read 2"):
            none, gpu = r["no advice", memory, step], r["preferred gpu", memory, step]
            assert {k: gpu[k] for k in ("time_ms", "faults", "evictions", "htod_MiB")} == \
                   {k: none[k] for k in ("time_ms", "faults", "evictions", "htod_MiB")}
    assert r["preferred gpu", over, "GPU read 2"]["evictions"] > 0  # not protected from eviction
    assert r["preferred gpu", "fits", "GPU read 2"]["evictions"] == 0
    for memory in ("fits", over):
        cpu = r["preferred cpu", memory, "GPU read 2"]
        assert cpu["remote_MiB"] == SIZE and cpu["htod_MiB"] == 0 and cpu["evictions"] == 0


def test_sizes_are_refused_outside_the_limits():
    with pytest.raises(BasicsSafetyError, match="limit per buffer"):
        basics.page_faults(MAX_ARRAY_BYTES // MiB + 2, "sim")
    assert issubclass(BasicsSafetyError, UmLabError)
    with pytest.raises(ValueError, match="size_mib"):
        basics.prefetch(1, "sim")
    with pytest.raises(ValueError, match="passes"):
        basics.zero_copy(SIZE, 0, "sim")
    with pytest.raises(ValueError, match="ratio"):
        basics.preferred_location(SIZE, "sim", ratio=1)
    with pytest.raises(ValueError, match="below one 2 MiB chunk"):
        basics.preferred_location(2, "sim", ratio=4)


def test_budget_counts_and_refuses_far_below_the_card():
    budget = ManagedBudget(free_bytes=8 << 30)
    assert budget.limit == 1 << 30  # an eighth of the free memory, below the 2 GiB ceiling
    assert ManagedBudget(free_bytes=100 << 30).limit == 2 << 30
    for _ in range(4):
        budget.take(256 * MiB)
    assert budget.live == 1 << 30
    with pytest.raises(BasicsSafetyError, match="refused"):
        budget.take(2 * MiB)
    assert budget.live == 1 << 30  # a refusal counts nothing
    with pytest.raises(BasicsSafetyError, match="must hold"):
        ManagedBudget().take(MAX_ARRAY_BYTES + 1)
    budget.give(1 << 30)
    assert budget.live == 0


# ---- the fidelity results behind notebooks/05_sim_vs_gpu ----------------------------------------------

def test_fidelity_rows_fall_into_their_sets_and_match_the_committed_summaries():
    import json

    from um_lab.teaching import fidelity

    df = fidelity.load_fidelity()
    sets = [fidelity.heldout_label(h) for h in fidelity.HELDOUT]
    assert sets[0] == "held-out 2026-11-30 07:56" and fidelity.SETS == ("fitted", "hand-set", *sets)
    assert df["set"].value_counts().to_dict() == {"fitted": 12, "hand-set": 4, sets[0]: 4,
                                                   **{name: 8 for name in sets[1:-4]}, sets[-4]: 12,
                                                   sets[-3]: 12, sets[-2]: 12, sets[-1]: 12}
    assert df["measured_ms"].notna().all() and (df["ratio"] < 1).all()
    main = json.loads((fidelity.results_dir() / "sim_fidelity.json").read_text())["summary"]
    def held_out_summary(index):
        path = fidelity.results_dir() / fidelity.FILES[index]
        summary = json.loads(path.read_text())["summary"]
        return summary.get("new_held_out") or summary["held_out"]

    new = held_out_summary(len(fidelity.HELDOUT))
    s = fidelity.summary(df).set_index("set")
    assert s.loc["fitted", "median |error|"] == pytest.approx(main["in_sample"]["median_abs_error"], abs=1e-4)
    assert s.loc["hand-set", "worst |error|"] == pytest.approx(main["held_out"]["worst_abs_error"], abs=1e-4)
    assert s.loc[sets[-1], "median |error|"] == pytest.approx(new["median_abs_error"], abs=1e-4)
    for index, column in ((1, "worst |error|"), (2, "median |error|"), (3, "worst |error|"), (4, "median |error|"),
                          (5, "worst |error|")):
        expected = held_out_summary(index)["worst_abs_error" if column.startswith("worst") else "median_abs_error"]
        assert s.loc[sets[index - 1], column] == pytest.approx(expected, abs=1e-4)
    # the 2026-12-02 set's predictions were committed before measuring; the measured run re-simulates at the
    # capacity the GPU reported (a hair from the profile's), and the committed predictions alone meet the bar
    held = df[df["set"] == sets[-5]]
    assert ((held["committed_prediction_ms"] / held["simulated_ms"] - 1).abs() < 0.005).all()
    blind = (held["committed_prediction_ms"] / held["measured_ms"] - 1).abs()
    assert blind.max() <= 0.25 and blind.median() <= 0.15
    # the corpus set (models users bring) misses it, as docs/benchmarks.md reports: every row blind, all too fast
    corpus = df[df["set"] == sets[-4]]
    blind = corpus["committed_prediction_ms"] / corpus["measured_ms"] - 1
    assert corpus["committed_prediction_ms"].notna().all() and (blind < 0).all()
    assert blind.abs().median() == pytest.approx(0.217, abs=5e-4) and blind.abs().max() > 0.25
    # the next corpus set, measured on H100s against the H200's profile, misses it further, every row too fast
    later = df[df["set"] == sets[-3]]
    blind = later["committed_prediction_ms"] / later["measured_ms"] - 1
    assert later["committed_prediction_ms"].notna().all() and (blind < 0).all()
    assert len(later) == 12 and blind.abs().median() == pytest.approx(0.351, abs=5e-3) and blind.abs().max() > 0.7
    # the next misses it both ways: remote reads and budgets too fast, the small host-bound steps too slow
    both = df[df["set"] == sets[-2]]
    blind = both["committed_prediction_ms"] / both["measured_ms"] - 1
    assert both["committed_prediction_ms"].notna().all() and (blind < 0).sum() == 7 and (blind > 0.2).sum() == 3
    assert blind.abs().median() == pytest.approx(0.315, abs=5e-3) and blind.abs().max() > 0.4
    # the newest, with the hooks priced per tensor: three of its four budget rows within 15%, the bar still missed
    newest = df[df["set"] == sets[-1]]
    blind = newest["committed_prediction_ms"] / newest["measured_ms"] - 1
    budget = blind[newest["policy"] == "layer-ahead"].abs()
    assert len(budget) == 4 and (budget < 0.15).sum() == 3 and budget.max() > 0.5
    assert blind.abs().median() == pytest.approx(0.2935, abs=5e-3) and blind.abs().max() > 0.25
    table = fidelity.readable(df)
    assert table["error"].str.endswith("%").all() and "predicted before measuring, ms" in table


def test_fidelity_missing_results_and_the_newest_file_wins(tmp_path):
    import json

    from um_lab.teaching import fidelity

    with pytest.raises(fidelity.FidelityResultsMissing, match="sim_fidelity.json"):
        fidelity.load_fidelity(tmp_path)
    row = {"model": "mlp", "model_kwargs": {}, "policy": "um-default", "ratio": 0.02, "measured_ms": 10.0,
           "simulated_ms": 11.0, "fitted": True, "new_heldout": False}
    (tmp_path / "sim_fidelity.json").write_text(json.dumps({"date": "2026-01-01", "rows": [row]}))
    newer = {**row, "measured_ms": 20.0, "fitted": False, "new_heldout": True}
    newest = tmp_path / fidelity.FILES[-1]
    newest.parent.mkdir(parents=True)
    newest.write_text(json.dumps({"date": "2026-02-01", "rows": [newer]}))
    df = fidelity.load_fidelity(tmp_path)
    assert len(df) == 1 and df["measured_ms"].iloc[0] == 20.0
    assert df["set"].iloc[0] == fidelity.heldout_label(fidelity.HELDOUT[-1])
    assert df["error"].iloc[0] == pytest.approx(11 / 20 - 1)
