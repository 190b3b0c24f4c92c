"""The paper experiment (um_lab.teaching.paper): grid and choice logic, committed results, the preset's provenance."""

import math

import pandas as pd
import pytest

from um_lab.policy import presets
from um_lab.sim.profile import profile_sha256
from um_lab.teaching import paper
from um_lab.teaching.paper import GROUPS, PaperExperimentError, PaperMapping
from um_lab.types import PAPER_GROUPS, DataType

# ------------------------------------------------------------------------------------ grid logic


def test_grid_is_every_combination_with_the_baseline_first():
    grid = paper.mappings()
    sizes = [len(paper.GROUP_OPTIONS[g]) for g in GROUPS]
    assert len(grid) == math.prod(sizes) == len(set(grid))
    assert grid[0] == PaperMapping("none", "none", "none")
    small = paper.mappings({"model parameters": ["none", "pin-gpu"], "input data": ["prefetch"]})
    assert small == [PaperMapping(), PaperMapping("none", "none", "prefetch"),
                     PaperMapping("pin-gpu", "none", "prefetch")]


def test_read_mostly_only_for_input_data():
    for group in GROUPS:
        has_rm = any(paper.OPTIONS[o].read_mostly for o in paper.GROUP_OPTIONS[group])
        assert has_rm == (group == "input data"), group
        if group != "input data":
            assert (group, "read-mostly+prefetch") in paper.LEFT_OUT


def test_grid_rejects_unknown_groups_options_and_empty_groups():
    with pytest.raises(PaperExperimentError, match="unknown group"):
        paper.mappings({"weights": ["none"]})
    with pytest.raises(PaperExperimentError, match="unknown option"):
        PaperMapping("pinned", "none", "none")
    with pytest.raises(PaperExperimentError, match="at least one option"):
        paper.mappings({"input data": []})


def test_mapping_names_round_trip_and_policy_follows_the_paper_groups():
    m = PaperMapping("pin-gpu+prefetch", "zero-copy", "read-mostly+prefetch")
    assert PaperMapping.parse(m.name) == m
    assert PaperMapping.from_dict(m.to_dict()) == m
    with pytest.raises(PaperExperimentError):
        PaperMapping.parse("pin-gpu / none")
    policy = m.policy()
    for group, option in zip(GROUPS, m.options, strict=True):
        for dtype in PAPER_GROUPS[group]:
            assert policy[dtype] == paper.OPTIONS[option], (group, dtype)
    assert PaperMapping().policy() is presets["um-default"]
    assert m.complexity == 3 + 2 + 2  # preferred+accessed+prefetch, preferred+accessed, read_mostly+prefetch


def neighbourhood(center: PaperMapping) -> list[PaperMapping]:
    """``center``, the baseline, and every mapping that changes one group of ``center`` to another option
    of :data:`um_lab.teaching.paper.GROUP_OPTIONS`: the reduced experiment the preset must still win."""
    out = [center, PaperMapping()]
    for i, group in enumerate(GROUPS):
        for option in paper.GROUP_OPTIONS[group]:
            changed = list(center.options)
            changed[i] = option
            out.append(PaperMapping(*changed))
    return list(dict.fromkeys(out))


def test_neighbourhood_changes_one_group_at_a_time():
    center = PaperMapping("pin-gpu", "pin-gpu", "none")
    near = neighbourhood(center)
    assert near[0] == center and PaperMapping() in near
    for m in near[2:]:
        assert sum(a != b for a, b in zip(m.options, center.options, strict=True)) <= 1
    expected = 1 + sum(len(paper.GROUP_OPTIONS[g]) - 1 for g in GROUPS) + 1  # + the baseline
    assert len(near) == expected


# ------------------------------------------------------------------------------------ choice logic


def _table(times: dict[tuple[str, float], dict[str, float]]) -> pd.DataFrame:
    rows = [{"model": model, "ratio": ratio, "mapping": name, "median_ms": ms}
            for (model, ratio), per in times.items() for name, ms in per.items()]
    return paper.add_speedup(pd.DataFrame(rows))


BASE = PaperMapping().name
A = "pin-gpu / none / none"
B = "none / pin-gpu / none"
C = "pin-gpu+prefetch / pin-gpu+prefetch / read-mostly+prefetch"


def test_speedup_and_time_saved_are_against_the_baseline_of_the_same_cell():
    t = _table({("m", 1.5): {BASE: 100.0, A: 50.0}, ("m", 0.8): {BASE: 10.0, A: 20.0}})
    row = t[(t["mapping"] == A) & (t["ratio"] == 1.5)].iloc[0]
    assert row["speedup"] == pytest.approx(2.0) and row["time_saved"] == pytest.approx(0.5)
    row = t[(t["mapping"] == A) & (t["ratio"] == 0.8)].iloc[0]
    assert row["speedup"] == pytest.approx(0.5) and row["time_saved"] == pytest.approx(-1.0)
    with pytest.raises(PaperExperimentError, match="no um-default row"):
        paper.add_speedup(pd.DataFrame([{"model": "m", "ratio": 1.5, "mapping": A, "median_ms": 1.0}]))


def test_ranking_is_by_geometric_mean_and_splits_the_regimes():
    t = _table({("m", 0.8): {BASE: 10.0, A: 20.0, B: 10.0},
                ("m", 2.0): {BASE: 100.0, A: 12.5, B: 50.0}})
    rank = paper.ranking(t)
    assert list(rank["mapping"]) == [A, B, BASE]
    a = rank.iloc[0]
    assert a["geomean_speedup"] == pytest.approx(2.0)  # sqrt(0.5 * 8)
    assert a["time_saved"] == pytest.approx(0.5)
    assert a["fits_speedup"] == pytest.approx(0.5) and a["oversubscribed_speedup"] == pytest.approx(8.0)
    assert a["worst_speedup"] == pytest.approx(0.5)
    assert paper.best_overall(t)["mapping"] == A


def test_ties_go_to_the_simpler_mapping():
    # C is 0.05% faster than A in every cell: inside the tie tolerance, and A makes fewer advice settings
    t = _table({("m", 1.5): {BASE: 100.0, C: 49.975, A: 50.0}})
    assert PaperMapping.parse(A).complexity < PaperMapping.parse(C).complexity
    assert paper.best_overall(t)["mapping"] == A
    cell = paper.best_per_cell(t).iloc[0]
    assert cell["best_mapping"] == A and cell["tied"] == 2
    assert cell["um_default_ms"] == pytest.approx(100.0)
    # outside the tolerance the faster one wins
    t = _table({("m", 1.5): {BASE: 100.0, C: 49.0, A: 50.0}})
    assert paper.best_overall(t)["mapping"] == C
    assert paper.choose(t).mapping == PaperMapping.parse(C)


def test_ranking_refuses_a_mapping_missing_cells():
    t = _table({("m", 1.5): {BASE: 100.0, A: 50.0}, ("m", 2.0): {BASE: 100.0}})
    with pytest.raises(PaperExperimentError, match="cells"):
        paper.ranking(t)


# ------------------------------------------------------------------------------------ provenance


def test_preset_is_the_mapping_its_provenance_names():
    chosen = PaperMapping.from_dict(paper.PRESET_PROVENANCE["mapping"])
    preset = presets["paper-3type"]
    for dtype in DataType:
        assert preset[dtype] == chosen.policy()[dtype], dtype
    assert "simulat" in preset.description and paper.PRESET_PROVENANCE["date"][:10] in preset.description


def test_committed_results_chose_the_preset_and_match_the_current_profile():
    results = paper.load_results()
    assert results is not None, f"{paper.RESULTS_JSON} is missing: run bench/paper_three_types.py"
    prov = paper.PRESET_PROVENANCE
    assert results["profile"] == prov["profile"]
    assert results["profile_sha256"] == prov["profile_sha256"]
    # a recalibrated profile invalidates the experiment: re-run it and re-set the preset
    assert results["profile_sha256"] == profile_sha256(prov["profile"]), (
        "the simulator profile changed since the paper experiment ran: run bench/paper_three_types.py again")
    assert results["choice"]["best_overall"]["mapping"] == prov["mapping"]
    assert results["date"] == prov["date"] and "git_commit" not in results
    # the stored rows re-derive the stored choice
    assert paper.choose(results["table"]).best["mapping"] == results["choice"]["best_overall"]["name"]


def test_profile_hash_follows_the_constants():
    from um_lab.sim.profile import load_profile

    base = load_profile("h200")
    assert profile_sha256(base) == profile_sha256("h200")
    import dataclasses

    changed = dataclasses.replace(base, evict_d2h_GBps=base.evict_d2h_GBps * 1.01)
    assert profile_sha256(changed) != profile_sha256(base)


def test_missing_results_file_is_none(tmp_path):
    assert paper.load_results(tmp_path / "absent.json") is None


# ------------------------------------------------------------------------------------ the preset still wins

#: A small configuration of the experiment: BERT with 4 layers, batch 8 x 512 (3.8 GiB managed), at the full
#: run's four ratios. A few seconds on the 2-core CI machine.
SMALL_MODEL = {"bert-base": {"num_hidden_layers": 4, "batch_size": 8, "seq_len": 512}}
SMALL_RATIOS = (0.8, 1.25, 1.5, 2.0)
STILL_WINS_TOLERANCE = 0.02


def test_preset_still_wins_a_reduced_version_of_its_own_experiment():
    """The rule: every mapping that differs from the preset in one paper group (17, plus um-default) is
    simulated on SMALL_MODEL at SMALL_RATIOS; the preset's geometric-mean speed-up over um-default must be
    within 2% of the best of them, and at least 1.05x. (With profile v2 a neighbour, parameters "prefetch",
    came about 1% ahead of the preset on this small model while trailing it in the full experiment.) A
    simulator change that makes another neighbour clearly better, or the preset no better than plain UM,
    fails here: re-run the experiment."""
    from um_lab.sim import SimBackend

    center = PaperMapping.from_dict(paper.PRESET_PROVENANCE["mapping"])
    table = paper.run_grid(SMALL_MODEL, SMALL_RATIOS, neighbourhood(center), steps=3, warmup_steps=2,
                           backend=SimBackend(paper.PRESET_PROVENANCE["profile"]))
    rank = paper.ranking(table).set_index("mapping")
    preset_score = rank.loc[center.name, "geomean_speedup"]
    best = rank["geomean_speedup"].idxmax()
    assert preset_score >= rank.loc[best, "geomean_speedup"] * (1 - STILL_WINS_TOLERANCE), (
        f"{best} now beats the paper-3type preset ({center.name}): "
        f"{rank.loc[best, 'geomean_speedup']:.3f}x vs {preset_score:.3f}x")
    assert preset_score >= 1.05
