"""Staging with the fixed intermediate-results pool on the simulator (um_lab.sim.staged): what is staged, the
fixed pool's size, a plan that never moves intermediates, and a step no faster than its copies allow."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from um_lab import get_model
from um_lab.errors import BudgetTooSmall
from um_lab.schedule.ledger import BLOCK
from um_lab.sim.backend import SimBackend
from um_lab.sim.budget import replay_plan
from um_lab.sim.staged import fixed_pool_bytes, simulate_staged, staged_storages
from um_lab.sim.trace import PHASE_BWD, PHASE_FWD
from um_lab.types import DATA_TYPES, DataType

MiB = 1 << 20
MLP = {"width": 2048, "depth": 4, "batch_size": 512}  # 4 MiB activations: staged
ACT = DATA_TYPES.index(DataType.ACT)


@pytest.fixture(scope="module")
def prepared():
    sim = SimBackend()
    return sim, sim.prepare(get_model("mlp", **MLP))


def _phases_touching(trace, s):
    return {int(trace.op_phase[op]) for op in range(trace.n_ops)
            if s in trace.acc_storage[trace.acc_ptr[op]:trace.acc_ptr[op + 1]].tolist()}


def test_staged_storages_are_large_intermediates_written_in_forward_and_read_in_backward(prepared):
    _, prep = prepared
    trace = prep.trace
    staged = staged_storages(trace)
    assert len(staged) >= MLP["depth"]  # at least each Linear's saved input
    for s in staged.tolist():
        assert trace.st_type[s] == ACT and trace.st_nbytes[s] >= MiB and not trace.st_persistent[s]
        assert trace.op_phase[trace.st_alloc[s]] == PHASE_FWD
        assert {PHASE_FWD, PHASE_BWD} <= _phases_touching(trace, s)
    assert len(staged_storages(trace, min_bytes=1 << 40)) == 0


def test_the_fixed_pool_is_smaller_with_staging_plus_its_window_but_never_above_the_pool_without(prepared):
    _, prep = prepared
    trace = prep.trace
    staged = staged_storages(trace)
    none = fixed_pool_bytes(trace, np.array([], dtype=np.int64), window=0)
    some = fixed_pool_bytes(trace, staged, window=0)
    assert 0 < some < none and some % BLOCK == 0
    # a window of copies out still in flight when backward starts, and a window of copies back brought ahead
    window = 8 * MiB
    assert min(some + 2 * window, none) <= fixed_pool_bytes(trace, staged, window=window) \
        < min(some + 2 * window + BLOCK, none + BLOCK)
    assert fixed_pool_bytes(trace, staged, window=1 << 40) == none  # never above the pool without staging


def test_the_plan_never_moves_intermediates_and_the_step_is_bounded_by_its_copies(prepared):
    sim, prep = prepared
    layout = prep.placement.final
    result = simulate_staged(prep.trace, layout, sim.profile, prep.footprint_bytes // 2)
    moved = [m for ms in result.plan.moves for m in ms if m.kind in ("prefetch", "evict")]
    assert moved, "half the footprint: parameters, gradients or optimizer state must move"
    assert not any(int(layout.block_type[b]) == ACT for m in moved for b in m.blocks)
    assert result.plan.max_resident + result.fixed_bytes <= prep.footprint_bytes // 2
    copies = result.copies
    assert copies.staged_bytes == sum(copies.in_bytes) > 0
    floor_us = 2 * copies.staged_bytes / (copies.GBps * 1e3)  # out and back on one copy stream
    assert result.step.wall_us >= max(floor_us, result.step.compute_us)
    slower = replay_plan(result.derived, result.plan, sim.profile, staging=dataclasses.replace(copies, GBps=5.0))
    assert slower.wall_us > result.step.wall_us


def test_a_budget_below_the_fixed_pool_is_refused(prepared):
    sim, prep = prepared
    result = simulate_staged(prep.trace, prep.placement.final, sim.profile, prep.footprint_bytes)
    with pytest.raises(BudgetTooSmall):
        simulate_staged(prep.trace, prep.placement.final, sim.profile, result.fixed_bytes)


def test_the_policy_layer_ahead_staged_runs_on_the_simulator_with_staged_copies_in_its_records(tmp_path):
    """``layer-ahead-staged`` is a scheduled policy: a run on sim simulates the staged step (sim.staged); its records
    carry the fixed pool and the staged bytes, the intermediate type's residency includes the fixed pool, and
    the step is no faster than its copies. Plain ``layer-ahead`` at the same budget stages nothing."""
    from um_lab import RunSpec, run
    from um_lab.policy import LAYER_AHEAD_STAGED, is_scheduled, named_policies, stages_activations

    assert LAYER_AHEAD_STAGED in named_policies() and is_scheduled(LAYER_AHEAD_STAGED)
    assert stages_activations(LAYER_AHEAD_STAGED) and not stages_activations("layer-ahead")
    spec = dict(model="mlp", model_kwargs=MLP, backend="sim", steps=2, warmup_steps=0, budget=0.5)
    staged = list(run(RunSpec(policy=LAYER_AHEAD_STAGED, **spec), out_dir=tmp_path).records())
    plain = list(run(RunSpec(policy="layer-ahead", **spec), out_dir=tmp_path).records())
    b = staged[-1].extra["budget"]
    assert b["staged_bytes"] > 0 and b["fixed_bytes"] > 0 and not b["over_budget"], b
    assert staged[-1].resident_bytes["act"] >= b["fixed_bytes"]
    assert staged[-1].htod_bytes["act"] >= b["staged_bytes"]
    assert staged[-1].wall_ms * 1e3 >= 2 * b["staged_bytes"] / 51.0e3  # out and back at <= 51 GB/s (bytes per us)
    assert "staged_bytes" not in plain[-1].extra["budget"]


def test_a_budget_the_staged_model_refuses_is_refused_before_the_run_folder(tmp_path):
    """The simulator's check before a run uses the model the run will use: a budget the staged plan cannot hold
    (below its fixed pool) is refused for layer-ahead-staged before anything is written, even where the unstaged
    plan would fit it."""
    from um_lab import RunSpec, run

    spec = RunSpec(model="mlp", model_kwargs=MLP, backend="sim", steps=1, warmup_steps=0, budget=0.27,
                   policy="layer-ahead-staged")
    with pytest.raises(BudgetTooSmall):
        run(spec, out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_staged_simulation_is_planned_once_for_a_preflight_and_its_run(prepared):
    """simulate_staged is memoised per trace, profile, budget, look-ahead and window: the same result object
    comes back, and another budget is simulated afresh."""
    sim, prep = prepared
    layout = prep.placement.final
    first = simulate_staged(prep.trace, layout, sim.profile, prep.footprint_bytes // 2)
    assert simulate_staged(prep.trace, layout, sim.profile, prep.footprint_bytes // 2) is first
    assert simulate_staged(prep.trace, layout, sim.profile, prep.footprint_bytes // 2 + (64 << 20)) is not first


def test_kept_tail_is_forwards_last_saves_from_where_the_rest_fits_the_bytes_kept(prepared):
    from um_lab.sim.staged import kept_tail

    _, prep = prepared
    trace = prep.trace
    staged = staged_storages(trace)
    sizes = trace.st_nbytes[staged]
    assert len(kept_tail(trace, staged, 0)) == 0
    assert set(kept_tail(trace, staged, int(sizes.sum()))) == set(staged.tolist())
    last = staged[np.argmax(trace.st_alloc[staged])]
    one = kept_tail(trace, staged, 1)  # a straddling save is kept: the last one alone
    assert one.tolist() == [last]
    kept = kept_tail(trace, staged, int(trace.st_nbytes[last]) + 1)
    assert len(kept) == 2 and all(trace.st_alloc[k] >= trace.st_alloc[staged].max() - trace.n_ops for k in kept)


def test_partial_staging_keeps_the_room_the_plan_leaves_and_copies_less(prepared):
    sim, prep = prepared
    trace, layout = prep.trace, prep.placement.final
    budget = int(prep.footprint_bytes * 1.2)  # room beyond everything but the staged saves' copies in flight
    full = simulate_staged(trace, layout, sim.profile, budget)
    partial = simulate_staged(trace, layout, sim.profile, budget, partial=True)
    assert full.copies.staged_bytes > 0 and partial.copies.staged_bytes < full.copies.staged_bytes
    assert partial.fixed_bytes >= full.fixed_bytes
    assert partial.plan.max_resident + partial.fixed_bytes <= budget
    assert partial.step.wall_us <= full.step.wall_us
    tight = int(prep.footprint_bytes * 0.45)  # no room: the same as full staging
    assert simulate_staged(trace, layout, sim.profile, tight, partial=True).copies.staged_bytes == \
        simulate_staged(trace, layout, sim.profile, tight).copies.staged_bytes


def test_remote_state_takes_its_copy_slots_off_the_plan_as_the_session_announces_them(prepared):
    from um_lab.schedule.live.remote_state import SLOTS

    sim = prepared[0]
    prep = sim.prepare(get_model("mlp", width=1024, depth=24, batch_size=256))  # slots worth their room at 0.7
    layout = prep.placement.final
    budget = int(prep.footprint_bytes * 0.7)
    remote = simulate_staged(prep.trace, layout, sim.profile, budget, remote_copies=True)
    moving = simulate_staged(prep.trace, layout, sim.profile, budget, remote_optimizer=False)
    in_place = simulate_staged(prep.trace, layout, sim.profile, budget)  # the session's default
    assert in_place.fixed_bytes == moving.fixed_bytes and in_place.step.remote_us > 0
    assert remote.plan.remote_blocks, "some optimizer state must stay remote"
    state = max(sum(n for _, n in p.spans(DataType.OPTIM)) for p in remote.derived.order.positions
                if p.phase == "optimizer")
    slots = SLOTS * -(-state // (2 * MiB)) * (2 * MiB)
    assert remote.fixed_bytes - moving.fixed_bytes == slots > 0
    assert remote.plan.max_resident + remote.fixed_bytes <= budget
    assert remote.step.remote_us == 0 and 0 < remote.step.remote_link_bytes <= 2 * remote.plan.remote_bytes


def test_copies_back_start_after_forwards_last_copy_out_as_the_session_starts_them():
    from um_lab.sim.budget import restore_start

    backward = [False] * 5 + [True] * 5
    assert restore_start(backward, [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]) == 3  # a kept tail: at its first position
    assert restore_start(backward, [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]) == 5  # all staged: backward's first position
    assert restore_start(backward, [0] * 10) == 5  # nothing staged
    assert restore_start([False] * 3, [1, 0, 0]) == 1


def test_the_copies_back_run_under_forwards_last_positions(prepared):
    sim, prep = prepared
    trace, layout = prep.trace, prep.placement.final
    # without the hooks' host time the GPU, not the host, sets forward's pace: what this test is about
    profile = dataclasses.replace(sim.profile, scheduler_hook_us=0.0, scheduler_tensor_us=0.0)
    staged = simulate_staged(trace, layout, profile, int(prep.footprint_bytes * 0.6), partial=True)
    derived, copies = staged.derived, staged.copies
    start = next(i for i, p in enumerate(derived.order.positions) if p.phase == "backward")
    last_out = max(i for i in range(start) if copies.out_bytes[i])
    tail = list(range(last_out + 1, start))
    assert tail and copies.staged_bytes > 0, "forward's last position saves nothing staged"
    # slow the host over forward's last positions by as much as the copies back take: they run under it
    back_us = copies.staged_bytes / (copies.GBps * 1e3)
    slow_host = list(derived.host_us)
    for i in tail:
        slow_host[i] += back_us / len(tail)
    slowed = replay_plan(dataclasses.replace(derived, host_us=slow_host), staged.plan, profile, staging=copies)
    # (copies out still in flight hide some of it either way: started at backward, the step took 0.81 of it longer)
    assert slowed.wall_us < staged.step.wall_us + 0.7 * back_us
