"""Remote optimizer state (``Session(remote_optimizer=True)``): optimizer state that a plan would bring
in for the optimizer and push out again stays in host memory, where the optimizer's kernels update it. The
plan then moves no optimizer state, never makes those blocks resident, stays under B, and the executor never
prefetches them; a session trains exactly as without a budget."""

import pytest
from fakes import FakeRuntime
from test_budget_executor import drive
from test_budget_ledger import layered_order
from test_budget_session import make_session, model_and_data, train

from um_lab.cuda.allocator import Segment
from um_lab.schedule.ledger import BLOCK, blocks_of_span
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.schedule.order import Access, Order
from um_lab.schedule.plan import make_plan, optimizer_only_blocks
from um_lab.types import DataType

LAYER_TYPES = (DataType.PARAM, DataType.GRAD, DataType.OPTIM, DataType.ACT)  # layered_order's arrays, per layer


def optim_blocks(order):
    return {b for p in order.positions for s in p.spans(DataType.OPTIM) for b in blocks_of_span(*s)}


def moved(plan):
    return {b for ms in plan.moves for m in ms if m.kind in ("prefetch", "evict") for b in m.blocks}


def test_optimizer_only_blocks_are_the_optimizer_state_no_other_position_or_type_uses():
    order = layered_order(layers=3, param_blocks=2)
    assert optimizer_only_blocks(order) == optim_blocks(order)
    shared = order.segments[0]  # layer 0's parameters: also read by forward and backward
    order.positions.append(order.positions[-1].__class__("optimizer", "extra"))
    order.positions[-1].accesses.append(Access("optimizer", "extra", DataType.OPTIM, (shared,)))
    assert not optimizer_only_blocks(order) & set(blocks_of_span(*shared))


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.7])
def test_a_remote_plan_moves_no_optimizer_state_stays_under_b_and_never_makes_it_resident(fraction):
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    footprint = sum(n for _, n in order.segments)
    budget = int(footprint * fraction) // BLOCK * BLOCK
    plain = make_plan(order, budget)
    assert moved(plain) & optim_blocks(order), "the test needs a budget at which optimizer state moves"
    plan = make_plan(order, budget, remote_optimizer=True)
    remote = plan.remote_blocks
    assert remote and remote <= optimizer_only_blocks(order)
    assert plan.remote_bytes == len(remote) * BLOCK
    assert not moved(plan) & optim_blocks(order)  # what would move stays on the host; the rest stays resident
    assert not moved(plan) & remote and not plan.start_resident & remote
    assert plan.max_resident <= budget and plan.steady
    assert plan.prefetched_bytes + plan.evicted_bytes < plain.prefetched_bytes + plain.evicted_bytes
    assert plan.summary()["remote_bytes"] == plan.remote_bytes


def test_with_room_for_everything_a_remote_plan_is_the_plain_plan():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    budget = sum(n for _, n in order.segments)
    plain, remote = make_plan(order, budget), make_plan(order, budget, remote_optimizer=True)
    assert remote.remote_blocks == frozenset() and remote.remote_bytes == 0
    assert remote.moves == plain.moves and remote.start_resident == plain.start_resident


class TypedWorld:
    """layered_order's segments with their data types, as a session's segment source lists them."""

    def __init__(self, order):
        self.live = [Segment(p, n, LAYER_TYPES[k % 4]) for k, (p, n) in enumerate(order.segments)]

    def segments(self):
        return list(self.live)

    def generation(self):
        return 0


def executor(order, budget, **kw):
    world, runtime = TypedWorld(order), FakeRuntime()
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation, **kw)
    ex.refresh_segments()
    drive(ex, order)
    ex.set_order(order)
    drive(ex, order)
    return ex, runtime


def test_the_executor_never_prefetches_remote_optimizer_state_and_reports_its_bytes():
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    budget = int(sum(n for _, n in order.segments) * 0.5) // BLOCK * BLOCK
    ex, runtime = executor(order, budget, remote_optimizer=True, host_written_types=[DataType.OPTIM])
    assert ex.remote_optimizer and ex.plan is not None and ex.plan.remote_blocks
    remote = ex.plan.remote_blocks
    for _ in range(2):
        runtime.prefetched.clear()
        stats = drive(ex, order)
        assert stats["followed_plan"] and stats["unforeseen_bytes"] == 0
        assert stats["remote_bytes"] == ex.plan.remote_bytes > 0
        assert stats["max_resident_ledger"] <= budget
        hit = {b for ptr, n, *_ in runtime.prefetched for b in blocks_of_span(ptr, n)} & remote
        assert not hit, "a remote block was moved"
        assert not ex.ledger.resident_blocks() & remote
        ex.ledger.check()


def test_the_executor_keeps_optimizer_state_moving_where_the_pool_is_not_written_on_the_host():
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    budget = int(sum(n for _, n in order.segments) * 0.5) // BLOCK * BLOCK
    ex, runtime = executor(order, budget, remote_optimizer=True)  # no host advice: a GPU access would fault it in
    assert not ex.remote_optimizer and ex.plan is not None and not ex.plan.remote_blocks
    runtime.prefetched.clear()
    stats = drive(ex, order)
    assert stats["remote_bytes"] == 0
    assert {b for ptr, n, *_ in runtime.prefetched for b in blocks_of_span(ptr, n)} & optim_blocks(order)


def test_a_session_with_remote_optimizer_state_trains_exactly_as_without_a_budget(env):
    model, batches = model_and_data()
    twin, third = model_and_data()[0], model_and_data()[0]
    budget = 48 << 20  # the model, gradients and AdamW state are ~120 MiB
    with make_session(env, budget=budget) as lab:
        records = train(lab, model, batches)
        assert lab.budget is not None and lab.budget.executor.remote_optimizer
    with make_session(env, budget=budget, remote_optimizer=False) as lab:
        moving = train(lab, third, batches)
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected] == [r.loss for r in moving]
    late = [r.extra["budget"] for r in records[2:]]
    assert all(b["remote_optimizer"] and b["remote_bytes"] > 0 for b in late)
    assert all(not b["remote_optimizer"] and b["remote_bytes"] == 0 for b in (r.extra["budget"] for r in moving))
    # the plans (the fake's tensors take new addresses every step, so the steps' own moves vary): one leaves state
    # in host memory, the other moves it
    assert records[-1].extra["budget"]["plan"]["remote_bytes"] > 0
    moving_plan = moving[-1].extra["budget"]["plan"]
    assert moving_plan["remote_bytes"] == 0 and moving_plan["evicted_bytes"] > 0


def test_an_order_without_optimizer_positions_has_nothing_remote():
    order = layered_order(layers=4, param_blocks=2, optimizer=False)
    budget = int(sum(n for _, n in order.segments) * 0.5) // BLOCK * BLOCK
    plan = make_plan(order, budget, remote_optimizer=True)
    assert plan.remote_blocks == frozenset() and isinstance(order, Order)


# ---- on the simulator (um_lab.sim.remote_optim) ----


def test_a_storage_partly_remote_costs_its_share_of_the_time_and_link_bytes():
    from um_lab.sim.remote_optim import remote_extra_us, remote_state_bytes

    costs = [(), ((100, 4, 80.0, 4e6, 8 << 20), (200, 1, 10.0, 1e6, 1 << 20))]
    extra, link = remote_extra_us(costs, {101, 102, 7}, 2)
    assert extra == [0.0, 40.0] and link == 2e6
    assert remote_extra_us(costs, set(), 2) == ([0.0, 0.0], 0.0)
    extra, link = remote_extra_us(costs, {100, 101, 102, 103, 200}, 2)
    assert extra == [0.0, 90.0] and link == 5e6
    assert remote_state_bytes(costs, {101, 102, 7}, 2) == [0, 4 << 20]  # copied for the step: its own bytes' share


def test_the_simulator_moves_no_optimizer_state_with_remote_on_and_prices_its_updates_over_the_link():
    from um_lab import get_model
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.budget import derive_order, plan_budget, replay_plan

    sim = SimBackend()
    prep = sim.prepare(get_model("mlp", width=1024, depth=3, batch_size=64))
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    budget = prep.footprint_bytes // 2
    moving = plan_budget(derived, budget)
    remote = plan_budget(derived, budget, remote_optimizer=True)
    optim = optim_blocks(derived.order)
    assert moved(moving) & optim and not moved(remote) & optim and remote.remote_blocks <= optim
    assert sum(len(c) for c in derived.remote_costs) > 0  # every optimizer position has its state's costs
    step_moving, step_remote = replay_plan(derived, moving, sim.profile), replay_plan(derived, remote, sim.profile)
    assert step_moving.remote_us == 0 and step_remote.remote_us > 0
    # AdamW's foreach step reads the state several times: more link bytes than one read and one write
    assert step_remote.remote_link_bytes > 2 * remote.remote_bytes * 0.9
    # copied for their steps instead (the session with staged activations): each remote block in once, out once,
    # and no in-place GPU time; the copies' clocks still delay the step past the moving plan's compute
    copied = replay_plan(derived, remote, sim.profile, remote_copies=True)
    assert copied.remote_us == 0 and 0 < copied.remote_link_bytes <= 2 * remote.remote_bytes
    assert copied.wall_us > sum(derived.compute_us)



def test_new_host_written_types_reach_every_segments_ledger_flag_and_remote_state_and_replan():
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    budget = int(sum(n for _, n in order.segments) * 0.5) // BLOCK * BLOCK
    ex, _ = executor(order, budget, remote_optimizer=True, host_written_types=[DataType.OPTIM])
    optim = optim_blocks(order)
    assert ex.remote_optimizer and ex.plan.remote_blocks
    assert all(ex.ledger.written_on_host(b) for b in optim)
    assert ex.set_host_written_types([DataType.PARAM]) is True  # optimizer state now prefers the GPU
    assert not ex.remote_optimizer and not ex.plan.remote_blocks
    assert not any(ex.ledger.written_on_host(b) for b in optim)
    stats = drive(ex, order)
    assert stats["followed_plan"] and stats["remote_bytes"] == 0 and stats["max_resident_ledger"] <= budget
    assert ex.set_host_written_types([DataType.PARAM]) is False  # the same again: nothing to do
    ex.set_host_written_types([DataType.OPTIM])
    assert ex.remote_optimizer and ex.plan.remote_blocks and all(ex.ledger.written_on_host(b) for b in optim)


def test_set_policy_under_a_budget_follows_with_the_schedulers_host_written_pools(env):
    model, batches = model_and_data()
    twin = model_and_data()[0]
    with make_session(env, budget=48 << 20) as lab:
        first = train(lab, model, batches[:3])
        executor = lab.budget.executor
        assert DataType.OPTIM in executor.host_written_types and executor.remote_optimizer
        lab.set_policy("gpu-first")  # every pool now prefers the GPU: a kernel's write faults pages in
        assert executor.host_written_types == frozenset() and not executor.remote_optimizer
        assert not executor.plan.remote_blocks
        second = train(lab, model, batches[3:])
        lab.set_policy("um-default")  # back to the budget's host advice for every pool
        assert DataType.OPTIM in executor.host_written_types and executor.remote_optimizer
    with make_session(env) as plain:  # train() attaches a new optimizer each time: so here too
        expected = train(plain, twin, batches[:3]) + train(plain, twin, batches[3:])
    assert [r.loss for r in first + second] == [r.loss for r in expected]
