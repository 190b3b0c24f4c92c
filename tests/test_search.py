"""Policy search on the simulator (um_lab.sim.search): input checks, optimality against the presets,
option merging and its check at the result, the three-type space, workers and the time budget."""

import math

import pytest

from um_lab.models import get_model
from um_lab.policy import presets
from um_lab.sim import search
from um_lab.sim.backend import SimBackend
from um_lab.sim.search import OPTIONS, SearchError, option_label, search_policy
from um_lab.summary import summarize
from um_lab.teaching.paper import GROUPS
from um_lab.types import DATA_TYPES, RunSpec

TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "batch_size": 2, "seq_len": 32}
RATIO = 1.5


def _search(**kwargs):
    args = {"model_kwargs": TINY_GPT2, "workers": 1, "progress": False, **kwargs}
    return search_policy("gpt2-small", RATIO, **args)


def _median_ms(policy, capacity: int) -> float:
    """The policy's median step on the same simulated GPU, run directly through SimBackend."""
    spec = RunSpec(model="gpt2-small", backend="sim", steps=4, warmup_steps=2, capacity_bytes=capacity)
    return summarize(SimBackend().run(spec, get_model("gpt2-small", **TINY_GPT2), policy))["median_ms"]


@pytest.fixture(scope="module")
def found():
    return _search()


def test_the_space_is_every_valid_option():
    assert len(OPTIONS) == len(set(OPTIONS)) == 36
    assert OPTIONS[0].is_default and option_label(OPTIONS[0]) == "none"
    assert len({option_label(o) for o in OPTIONS}) == 36


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "nope", "ratio": 1.5}, "unknown model"),
    ({"ratio": 1.5, "capacity": 2**30}, "exactly one"),
    ({}, "exactly one"),
    ({"ratio": 0}, "positive finite"),
    ({"ratio": -1.0}, "positive finite"),
    ({"ratio": math.nan}, "positive finite"),
    ({"ratio": True}, "positive finite"),
    ({"capacity": 1024}, "2 MiB"),
    ({"ratio": 1.5, "space": "four-type"}, "unknown space"),
    ({"ratio": 1.5, "workers": 0}, "workers"),
    ({"ratio": 1.5, "steps": 0}, "steps"),
    ({"ratio": 1.5, "budget_s": 0}, "budget_s"),
    ({"ratio": 1.5, "prune_factor": 0.5}, "prune_factor"),
    ({"ratio": 1.5, "model_kwargs": {"colour": 1}}, "colour"),
    ({"ratio": 1.5, "model_kwargs": [1]}, "mapping"),
    ({"ratio": 1.5, "profile": "no-such-profile"}, "unknown profile"),
])
def test_bad_input_raises_before_any_work(monkeypatch, kwargs, match):
    def no_work(*args, **kw):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(search, "_build_workloads", no_work)
    args = {"model": "gpt2-small", "model_kwargs": TINY_GPT2, **kwargs}
    with pytest.raises(SearchError, match=match):
        search_policy(args.pop("model"), args.pop("ratio", None), args.pop("capacity", None), progress=False, **args)


def test_finds_a_policy_at_least_as_good_as_every_preset(found):
    assert found.complete and found.sweeps >= 1 and found.evaluations == len(found.ranking)
    base = _median_ms(presets["um-default"], found.capacity_bytes)
    assert found.baseline_ms == pytest.approx(base, rel=1e-12)
    for preset in presets.values():
        assert found.best_ms <= _median_ms(preset, found.capacity_bytes) * (1 + 1e-12), preset.name
    # the returned policy itself (not its class representatives) runs as fast as reported
    assert _median_ms(found.policy, found.capacity_bytes) == pytest.approx(found.best_ms, rel=1e-12)
    assert found.speedup == pytest.approx(base / found.best_ms) and found.speedup > 1
    top = found.ranking.iloc[0]
    assert top["median_ms"] == found.best_ms
    assert [top[t.value] for t in DATA_TYPES] == [option_label(found.policy[t]) for t in DATA_TYPES]


def test_equivalent_options_collapsed_correctly(found):
    """Members of a class run identically on the probe workload at both probe ratios; classes differ."""
    probe_name, probe_knobs = search.PROBE_MODEL
    case = get_model(probe_name, **probe_knobs)
    footprint = SimBackend().prepare(case).footprint_bytes
    specs = [RunSpec(model=probe_name, backend="sim", steps=4, warmup_steps=2,
                     capacity_bytes=int(footprint / (found.ratio * factor)))
             for factor in (1.0, search.PROBE_RATIO_FACTOR)]
    by_label = {option_label(o): o for o in OPTIONS}

    def steps(option):
        policy = presets["um-default"].replace("probe", act=by_label[option])
        return repr([[(r.wall_ms, r.htod_bytes, r.dtoh_bytes, r.resident_bytes, r.gpu_page_faults, r.evictions,
                       r.remote_bytes)
                      for r in SimBackend().run(spec, case, policy)] for spec in specs])

    classes = found.classes["act"]
    assert sorted(o for c in classes for o in c) == sorted(by_label)  # a partition of the 36 options
    assert any(len(c) > 1 for c in classes)
    for members in classes:
        assert {steps(m) for m in members} == {steps(members[0])}, members
    assert len({steps(c[0]) for c in classes}) == len(classes)


def test_a_wrong_merge_is_caught_at_the_result(monkeypatch, found):
    """With every option of act and input merged into one class, the check at the result splits off
    what the model itself tells apart, and the descent still beats every preset."""
    probed = search._probe

    def merged(ev, space, capacities):
        classes, slow = probed(ev, space, capacities)
        for coordinate in (3, 4):  # act, input
            classes[coordinate] = [list(range(len(OPTIONS)))]
        return classes, slow

    monkeypatch.setattr(search, "_probe", merged)
    wrong = _search()
    assert wrong.complete
    assert len(wrong.classes["act"]) > 1 and len(wrong.classes["input"]) > 1
    assert wrong.classes["param"] == found.classes["param"]
    for preset in presets.values():
        assert wrong.best_ms <= _median_ms(preset, wrong.capacity_bytes) * (1 + 1e-12), preset.name


def test_three_type_space_follows_the_paper_grouping():
    found = _search(space="three-type")
    assert list(found.classes) == list(GROUPS)
    assert found.policy["grad"] == found.policy["param"] and found.policy["optim"] == found.policy["param"]
    assert list(found.ranking.columns[:3]) == list(GROUPS)
    for preset in ("um-default", "gpu-first", "prefetch-all", "paper-3type"):
        assert found.best_ms <= _median_ms(presets[preset], found.capacity_bytes) * (1 + 1e-12), preset


def test_worker_processes_find_the_same_policy(found):
    parallel = _search(workers=2)
    assert parallel.best_ms == found.best_ms and parallel.policy.advice == found.policy.advice
    assert parallel.evaluations == found.evaluations


def test_the_time_budget_stops_the_descent_with_the_best_so_far(found):
    cut = _search(budget_s=1e-6)
    assert not cut.complete and cut.evaluations < found.evaluations
    assert cut.best_ms <= _median_ms(presets["paper-3type"], cut.capacity_bytes) * (1 + 1e-12)
    assert "stopped by the time budget" in repr(cut)
