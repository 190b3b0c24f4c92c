"""The memory planner (um_lab.sim.planner) on the simulator: what it recomputes and moves within a budget."""

from __future__ import annotations

import json
import warnings

import pytest

from um_lab import RunSpec, get_model, run
from um_lab.errors import BudgetTooSmall, SpecError
from um_lab.sim.backend import SimBackend
from um_lab.sim.planner import plan_memory
from um_lab.training import with_training

GPT2 = {"batch_size": 4, "seq_len": 256, "n_layer": 4}


@pytest.fixture(scope="module")
def sim():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield SimBackend()


@pytest.fixture(scope="module")
def case():
    return get_model("gpt2-small", **GPT2)


def test_a_budget_the_model_fits_recomputes_nothing_and_moves_nothing(sim, case):
    room = int(1.05 * sim.prepare(case).footprint_bytes)  # a plan that fits leaves 1% of B free
    plan = plan_memory(case, room, backend=sim)
    assert plan.recompute == "none" and plan.crossing_bytes == 0 and plan.layers == 4
    assert plan.budget_bytes == room
    assert plan.footprint_bytes <= plan.fit_footprint_bytes  # the optimizer steps in chunks under a budget
    assert "nothing recomputed" in plan.describe() and "nothing moves" in plan.describe()


def test_a_tighter_budget_is_fit_by_the_least_recompute_that_fits_else_the_least_predicted_step(sim, case):
    plan = plan_memory(case, "0.6x", backend=sim)
    feasible = [c for c in plan.candidates if c.step_ms is not None]
    fits = [c for c in feasible if c.footprint_bytes <= plan.budget_bytes]
    assert plan.step_ms == min(c.step_ms for c in (fits or feasible))
    if fits:  # the scheduler will idle: nothing moves
        assert plan.footprint_bytes <= plan.budget_bytes and plan.crossing_bytes == 0
    assert plan.budget_bytes == int(0.6 * plan.fit_footprint_bytes)
    assert plan.recompute != "none" or plan.crossing_bytes > 0  # it had to recompute or move something
    fitting = [c for c in plan.candidates if c.footprint_bytes <= plan.budget_bytes]
    if fitting:  # the least recompute that fits B was found and weighed
        least = min(c.recompute_layers for c in fitting)
        assert all(c.footprint_bytes > plan.budget_bytes for c in plan.candidates if c.recompute_layers < least)
    # recompute trades memory for time: more layers, less footprint
    by_layers = sorted({c.recompute_layers: c.footprint_bytes for c in plan.candidates}.items())
    assert [f for _, f in by_layers] == sorted((f for _, f in by_layers), reverse=True)
    assert json.loads(json.dumps(plan.to_dict()))["candidates"]


def test_a_plan_that_fits_is_priced_as_the_plain_recompute_step_without_the_schedulers_hooks(sim, case):
    """An idle scheduler runs no hooks: the fitting plan's step is the plain step of the case with that
    recompute; a plan the scheduler follows pays the profile's host time per position."""
    import dataclasses

    from um_lab.sim.budget import simulate_budget

    plan = plan_memory(case, "0.85x", backend=sim)
    chosen = [c for c in plan.candidates if c.footprint_bytes <= plan.budget_bytes * 0.99]
    assert chosen and plan.crossing_bytes == 0
    k = plan.recompute if isinstance(plan.recompute, int) else {"none": 0, "every-layer": plan.layers}[plan.recompute]
    plain = with_training(case, "fp32", k if k else "none")
    records = list(sim.run(RunSpec(model="mlp", steps=4, warmup_steps=0), plain, "um-default"))
    assert plan.step_ms == pytest.approx(records[-1].wall_ms) and 0 < k < plan.layers
    prepared = sim.prepare(plain)
    costly = dataclasses.replace(sim.profile, scheduler_hook_us=sim.profile.scheduler_hook_us + 1000.0,
                                 scheduler_tensor_us=sim.profile.scheduler_tensor_us + 1000.0)
    followed = simulate_budget(prepared.trace, prepared.placement.final, sim.profile, plan.budget_bytes)
    slower = simulate_budget(prepared.trace, prepared.placement.final, costly, plan.budget_bytes)
    assert slower.step.wall_us > followed.step.wall_us + 500.0 * len(followed.derived.order.positions)


def test_where_no_candidate_fits_the_least_predicted_step_moves_data(sim, case):
    plan = plan_memory(case, "0.3x", backend=sim)
    feasible = [c for c in plan.candidates if c.step_ms is not None]
    assert all(c.footprint_bytes > plan.budget_bytes for c in plan.candidates)
    assert plan.step_ms == min(c.step_ms for c in feasible) and plan.crossing_bytes > 0


def test_a_budget_below_any_candidate_is_refused(sim, case):
    with pytest.raises(BudgetTooSmall):
        plan_memory(case, 4 << 20, backend=sim)


def test_the_planner_wants_the_case_with_nothing_recomputed(sim, case):
    with pytest.raises(SpecError, match="nothing recomputed"):
        plan_memory(with_training(case, "fp32", "every-layer"), "0.5x", backend=sim)
    with pytest.raises(SpecError, match="precision"):
        plan_memory(case, "0.5x", precision="fp64", backend=sim)


def test_auto_recompute_needs_a_budget_and_is_never_built_directly(case):
    with pytest.raises(SpecError, match="budget"):
        RunSpec(recompute="auto")
    with pytest.raises(SpecError, match="planner"):
        with_training(case, "fp32", "auto")


def test_a_run_with_auto_recompute_trains_as_planned_and_keeps_the_plan(tmp_path):
    loaded = run(RunSpec(model="gpt2-small", backend="sim", steps=2, warmup_steps=1, model_kwargs=GPT2,
                         recompute="auto", budget="0.6x"), out_dir=tmp_path)
    assert loaded.complete
    plan = loaded.model["plan"]
    assert loaded.spec.recompute == plan["recompute"] and loaded.spec.budget.bytes == plan["budget_bytes"]
    assert loaded.spec.budget.stage_activations == plan["stage_activations"]
    steps = [r.wall_ms for r in loaded.records() if not r.warmup]
    assert steps[-1] == pytest.approx(plan["step_ms"], rel=1e-6)  # the simulator runs what it predicted


def _small_cnn():
    from torch import nn

    blocks = [nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()) for _ in range(6)]
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


def _cnn_case():
    import torch

    from um_lab.model_cases import custom

    return custom("small-cnn", _small_cnn, lambda g: (torch.randn(64, 3, 64, 64, generator=g),
                                                      torch.randint(0, 10, (64,), generator=g)))


def test_only_overlapping_dense_convolutions_inside_layers_count_as_workspace_users():
    from torch import nn

    from um_lab.sim.workspaces import layers_convolve

    assert layers_convolve(_small_cnn())
    patches = nn.Sequential(nn.Conv2d(3, 32, 16, stride=16), nn.Flatten(2),
                            *[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])  # a ViT's patch embedding
    depthwise = nn.Sequential(*[nn.Sequential(nn.Conv2d(32, 32, 7, padding=3, groups=32), nn.ReLU()) for _ in range(3)])
    assert not layers_convolve(patches) and not layers_convolve(depthwise)
    assert not layers_convolve(get_model("gpt2-small", **GPT2).build_model())


def test_a_model_whose_layers_convolve_counts_cudnn_workspaces_in_every_candidates_footprint(sim):
    """cuDNN's workspaces are invisible to the CPU trace: each candidate of a model whose layers convolve carries the
    profile's share of its intermediate results as room, so a plan called fitting leaves that room, and a plan that
    moves data is simulated under B less it; a run of the plan on the simulator steps as predicted."""
    from um_lab.sim.budget import simulate_budget
    from um_lab.sim.planner import price_plan
    from um_lab.sim.workspaces import workspace_bytes
    from um_lab.types import DataType

    cnn = _cnn_case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = SimBackend(sim.profile.replace(conv_pool_slack=0.0))
    for ratio in ("0.8x", "0.6x"):
        with_room, without = plan_memory(cnn, ratio, backend=sim), plan_memory(cnn, ratio, backend=bare)
        assert with_room.budget_bytes == without.budget_bytes and without.workspace_bytes == 0
        rooms = {}
        for c in with_room.candidates:
            p = sim.prepare(with_training(cnn, "fp32", c.recompute_layers or "none"))
            rooms[c.recompute_layers] = room = workspace_bytes(cnn, p, sim.profile)
            assert room == int(sim.profile.conv_pool_slack * p.placement.final.segment_bytes[DataType.ACT]) > 0
        plain = {(c.recompute_layers, c.staged): c.footprint_bytes for c in without.candidates}
        for c in with_room.candidates:
            if (c.recompute_layers, c.staged) in plain:
                assert c.footprint_bytes == plain[c.recompute_layers, c.staged] + rooms[c.recompute_layers]
        chosen = {"none": 0, "every-layer": with_room.layers}.get(str(with_room.recompute), with_room.recompute)
        assert with_room.workspace_bytes == rooms[chosen] and "cuDNN's workspaces" in with_room.describe()
        if with_room.crossing_bytes == 0:  # it calls the plan fitting: with the workspaces' room left
            assert with_room.footprint_bytes <= with_room.budget_bytes
        moving = [c for c in with_room.candidates if not c.staged and c.step_ms is not None and c.crossing_bytes > 0]
        assert moving
        c = moving[0]
        p = sim.prepare(with_training(cnn, "fp32", c.recompute_layers or "none"))
        b = simulate_budget(p.trace, p.placement.final, sim.profile, with_room.budget_bytes - rooms[c.recompute_layers])
        assert c.step_ms == pytest.approx(b.step.wall_us / 1e3)
        assert price_plan(cnn, with_room, sim) == pytest.approx(with_room.step_ms, rel=1e-9)
        assert "cuDNN" not in without.describe()


def test_a_planned_run_of_a_convolving_model_on_the_simulator_steps_as_predicted(tmp_path):
    """The simulator's run of a planned budget leaves the same room for the workspaces as the planner did."""
    cnn = _cnn_case()
    from um_lab.runs.runner import Run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = Run(RunSpec(model="mlp", backend="sim", steps=2, warmup_steps=1, recompute="auto", budget="0.6x"),
                case=cnn, out_dir=tmp_path)
        records = list(r)
    plan = r.plan
    assert plan is not None and plan.crossing_bytes > 0 and plan.workspace_bytes > 0  # a plan that moves data
    steady = [x for x in records if not x.warmup]
    assert steady[-1].wall_ms == pytest.approx(plan.step_ms, rel=1e-6)
    assert steady[-1].extra["budget"]["workspace_bytes"] == plan.workspace_bytes


def test_a_plan_is_priced_again_on_a_profile_fitted_to_the_machine_that_runs_it(sim, case):
    """price_plan keeps the plan's choice and re-prices it: on the planner's own profile it is the plan's step; on
    a GPU 1.5x slower every kernel takes longer, so the plan's step does too, and by no more than 1.5x."""
    from um_lab.sim.machine_calibration import with_scale
    from um_lab.sim.planner import price_plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slower = SimBackend(with_scale(sim.profile, "gpu", 1.5))
    plans = [plan_memory(case, ratio, backend=sim) for ratio in ("0.9x", "0.6x", "0.35x")]
    assert {p.crossing_bytes > 0 for p in plans} == {False, True}  # a plan that idles, and one that moves data
    for ratio, plan in zip(("0.9x", "0.6x", "0.35x"), plans, strict=True):
        assert price_plan(case, plan, sim) == pytest.approx(plan.step_ms, rel=1e-9)
        repriced = price_plan(case, plan, slower)
        assert repriced is not None and plan.step_ms < repriced <= 1.5 * plan.step_ms + 1e-6, (ratio, repriced)
