"""Fixed segments: data the budget scheduler leaves on the GPU (the intermediate-results pool while saved
activations are staged through pinned host memory). They count as resident from registration on, are never a
victim, never moved by a plan or an executor, and the ledger stays under B around them."""

import pytest
import torch
from fakes import FakeRuntime
from test_budget_executor import drive as _drive
from test_budget_ledger import layered_order

from um_lab import BudgetError, BudgetTooSmall
from um_lab.cuda.allocator import Segment
from um_lab.schedule.ledger import BLOCK, GPU, Ledger
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.schedule.order import Order, Position
from um_lab.schedule.plan import make_plan
from um_lab.schedule.stats import BudgetStats
from um_lab.types import DataType

BASE = 1 << 40


def far(_block):
    return 0.0


def test_a_fixed_segment_is_resident_at_once_and_never_a_victim():
    ledger = Ledger(4 * BLOCK)
    ledger.add_segment(BASE, 2 * BLOCK, fixed=True)
    for i in range(2, 6):
        ledger.add_segment(BASE + i * BLOCK, BLOCK)
    fixed = {BASE // BLOCK, BASE // BLOCK + 1}
    assert ledger.resident_bytes == 2 * BLOCK and ledger.fixed_blocks() == fixed and ledger.fixed_bytes == 2 * BLOCK
    others = [BASE // BLOCK + i for i in range(2, 6)]
    ledger.bring_in(others[:2], far)
    moves = ledger.bring_in(others[2:], lambda b: 100.0 if b in fixed else 1.0)  # fixed ranked first: skipped
    evicted = {b for m in moves if m.kind == "evict" for b in m.blocks}
    assert evicted == set(others[:2]) and not evicted & fixed
    assert ledger.evict(fixed) == [] and ledger.discard(fixed) == []
    ledger.evict_everything()
    assert ledger.resident_blocks() == fixed and ledger.resident_bytes == 2 * BLOCK
    ledger.check()


def test_a_position_that_fits_only_without_the_fixed_blocks_is_refused_before_anything_moves():
    ledger = Ledger(4 * BLOCK)
    ledger.add_segment(BASE, 2 * BLOCK, fixed=True)
    ledger.add_segment(BASE + 2 * BLOCK, 3 * BLOCK)
    wanted = ledger.blocks([(BASE + 2 * BLOCK, 3 * BLOCK)])
    with pytest.raises(BudgetTooSmall):
        ledger.bring_in(wanted, far)
    assert ledger.resident_bytes == 2 * BLOCK and ledger.moves == []


def test_a_new_fixed_segment_over_the_budget_is_made_room_for_by_evicting_others():
    ledger = Ledger(4 * BLOCK)
    for i in range(4):
        ledger.add_segment(BASE + i * BLOCK, BLOCK)
    ledger.bring_in([BASE // BLOCK + i for i in range(4)], far)
    ledger.reset_counters()
    ledger.add_segment(BASE + 8 * BLOCK, BLOCK, fixed=True)
    assert ledger.resident_bytes == 5 * BLOCK and ledger.max_resident == 5 * BLOCK  # recorded, not hidden
    moves = ledger.make_room(0, far)
    assert [m.kind for m in moves] == ["evict"] and ledger.resident_bytes == 4 * BLOCK
    assert ledger.where(BASE // BLOCK + 8) == GPU


def test_removing_a_fixed_segment_frees_its_blocks_and_a_shared_block_becomes_an_ordinary_victim():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(BASE, BLOCK + BLOCK // 2, fixed=True)  # its tail shares block 1
    ledger.add_segment(BASE + BLOCK + BLOCK // 2, BLOCK // 2)
    shared = BASE // BLOCK + 1
    assert ledger.resident_bytes == 2 * BLOCK and shared in ledger.fixed_blocks()
    ledger.remove_segment(BASE)
    assert ledger.fixed_blocks() == frozenset() and ledger.resident_bytes == BLOCK // 2
    assert [m.kind for m in ledger.evict([shared])] == ["evict"] and ledger.resident_bytes == 0
    ledger.check()


def test_a_segment_cannot_change_between_fixed_and_not():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(BASE, BLOCK, fixed=True)
    ledger.add_segment(BASE, BLOCK, fixed=True)  # the same registration again: nothing changes
    with pytest.raises(BudgetError):
        ledger.add_segment(BASE, BLOCK)


def _act_segments(order):
    return {ptr for p in order.positions for a in p.accesses if a.data_type is DataType.ACT for ptr, _ in a.spans}


def test_a_plan_with_fixed_activations_never_moves_them_and_stays_under_b():
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    acts = _act_segments(order)
    act_bytes = len(acts) * 2 * BLOCK
    budget = act_bytes + 16 * BLOCK  # every activation plus a few layers' parameters and state
    plan = make_plan(order, budget, fixed_segments=acts)
    fixed_blocks = {b for ptr in acts for b in range(ptr // BLOCK, ptr // BLOCK + 2)}
    moved = [m for ms in plan.moves for m in ms if m.kind in ("prefetch", "evict")]
    assert moved and not any(set(m.blocks) & fixed_blocks for m in moved)
    assert plan.max_resident <= budget and plan.steady
    assert plan.largest_working_set >= act_bytes  # the fixed blocks count in every position's working set
    with pytest.raises(BudgetTooSmall):  # room for the activations but not for one layer beside them
        make_plan(order, act_bytes + 2 * BLOCK, fixed_segments=acts)


class World:
    """Live segments of several types and a generation counter, as the session's segment source gives them."""

    def __init__(self, typed):
        self.live = [Segment(p, n, t) for p, n, t in typed]
        self.gen = 0

    def segments(self):
        return list(self.live)

    def generation(self):
        return self.gen

    def add(self, ptr, nbytes, data_type):
        self.live.append(Segment(ptr, nbytes, data_type))
        self.gen += 1


def _typed(order):
    acts = _act_segments(order)
    types = {}
    for p in order.positions:
        for a in p.accesses:
            for ptr, _ in a.spans:
                types[ptr] = a.data_type
    return [(ptr, n, DataType.ACT if ptr in acts else types.get(ptr, DataType.PARAM)) for ptr, n in order.segments]


def _inside(calls, spans):
    return [c for c in calls if any(p <= c[0] < p + n for p, n in spans)]


def test_an_executor_with_fixed_activations_never_issues_a_call_on_them_and_keeps_the_ledger_under_b():
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    world = World(_typed(order))
    act_spans = [(s.ptr, s.size) for s in world.live if s.data_type is DataType.ACT]
    budget = sum(n for _, n in act_spans) + 16 * BLOCK
    runtime = FakeRuntime()
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation,
                        fixed_types=[DataType.ACT])
    ex.refresh_segments()
    assert ex.ledger.fixed_bytes == sum(n for _, n in act_spans)
    _drive(ex, order)
    ex.set_order(order)
    steps = [_drive(ex, order) for _ in range(3)]
    assert runtime.prefetched and not _inside(runtime.prefetched, act_spans)
    for s in steps:
        assert s["followed_plan"] and s["max_resident_ledger"] <= budget and not s["over_budget"], s
        assert s["fixed_bytes"] == sum(n for _, n in act_spans) and s["evicted_bytes"] > 0


def _fixed_executor(room_blocks=16):
    """A six-layer order, its typed segments, B = every activation + ``room_blocks`` blocks, an executor pinning
    activations."""
    order = layered_order(layers=6, param_blocks=3, act_blocks=2)
    world = World(_typed(order))
    budget = sum(s.size for s in world.live if s.data_type is DataType.ACT) + room_blocks * BLOCK
    ex = BudgetExecutor(budget, FakeRuntime(), 0, RecordingStreams(), world.segments, generation=world.generation,
                        fixed_types=[DataType.ACT])
    ex.refresh_segments()
    return order, world, budget, ex


def test_an_activation_segment_that_appears_mid_step_is_made_room_for_at_the_next_position():
    order, world, budget, ex = _fixed_executor()
    _drive(ex, order)
    ex.set_order(order)
    _drive(ex, order)
    fresh = (BASE + (1 << 36), 4 * BLOCK)  # the caching allocator grew the pool by a new segment
    extra = Position("forward", "l3", order.positions[3].accesses)
    grown = Order(order.positions[:3] + [extra] + order.positions[4:], order.segments)

    def grow(i):
        if i == 3:
            world.add(*fresh, DataType.ACT)
            ex.touched(2, DataType.ACT, [fresh])  # the kernels of position 2 wrote into it

    stats = _drive(ex, grown, between=grow)
    assert ex.ledger.is_fixed_segment(fresh[0]) and ex.ledger.fixed_bytes == budget - 16 * BLOCK + fresh[1]
    assert ex.ledger.resident_bytes <= budget  # room was made by evicting parameters and state, not activations
    assert stats["max_resident_ledger"] <= budget + fresh[1], stats  # above B only until the next move


def test_a_pool_grown_since_the_plan_trims_the_starting_set_instead_of_failing_the_step():
    """The plan's starting set filled B beside the fixed pool it knew; the pool grew between steps (a new
    segment of the caching allocator): the step starts with the soonest-used part of that set, stays under B,
    and the plan records the fixed bytes it assumed (the session re-plans when the pool outgrew them)."""
    order, world, budget, ex = _fixed_executor()
    _drive(ex, order)
    plan = ex.set_order(order)
    assert plan.fixed_bytes == ex.ledger.fixed_bytes == budget - 16 * BLOCK
    _drive(ex, order)
    world.add(BASE + (1 << 36), 4 * BLOCK, DataType.ACT)  # between steps: the pool grew by 4 blocks
    grown = _drive(ex, order)  # without trimming: BudgetTooSmall at the starting set
    assert ex.ledger.fixed_bytes == plan.fixed_bytes + 4 * BLOCK
    assert grown["max_resident_ledger"] <= budget + 4 * BLOCK and grown["realign_bytes"] > 0, grown  # the new blocks
    after = _drive(ex, order)
    assert after["max_resident_ledger"] <= budget and not after["over_budget"], after


def test_trimming_the_starting_set_keeps_what_the_first_positions_use_position_0_included():
    order, world, budget, ex = _fixed_executor()
    _drive(ex, order)
    plan = ex.set_order(order)
    world.add(BASE + (1 << 36), 7 * BLOCK, DataType.ACT)  # room for 9 of the starting set's 16 blocks
    ex.refresh_segments()
    trimmed = ex._starting_set(plan)
    start = set(plan.start_resident)
    first = ex.ledger.blocks(order.positions[0].spans()) & start - ex.ledger.fixed_blocks()
    assert first and first <= trimmed < start  # what position 0 uses stays; the latest-used blocks go
    assert ex.ledger.bytes_of(trimmed - ex.ledger.fixed_blocks()) <= budget - ex.ledger.fixed_bytes


def test_a_session_re_plans_once_the_fixed_pool_outgrew_the_plan():
    from um_lab.schedule.live.control import BudgetControl

    order = layered_order(layers=4, param_blocks=3, act_blocks=2)
    world = World(_typed(order))
    budget = sum(s.size for s in world.live if s.data_type is DataType.ACT) + 16 * BLOCK
    control = BudgetControl(budget, FakeRuntime(), 0, RecordingStreams(), world.segments, issue="inline",
                            generation=world.generation, fixed_types=[DataType.ACT])
    control.executor.refresh_segments()
    control.executor.set_order(order)
    followed = BudgetStats(followed_plan=True, unforeseen_bytes=0)
    assert control._replan(order, followed) == (False, "")
    world.add(BASE + (1 << 36), 2 * BLOCK, DataType.ACT)
    control.executor.refresh_segments()
    assert control._replan(order, followed) == (True, "fixed pool grew")
    ex = control.executor
    assert ex.plan is not None and ex.plan.fixed_bytes == ex.ledger.fixed_bytes
    assert control._replan(order, followed) == (False, "")  # the new plan knows the pool
    control.close()


def test_a_planned_bring_in_that_no_longer_fits_beside_a_grown_pool_is_skipped_when_the_position_fits():
    """The plan brings each optimizer position's parameters, gradients and state in (12 blocks); the fixed pool
    then grew so that only 10 fit beside it, and this step's optimizer positions touch parameters and gradients
    only (6 blocks): the planned bring-ins are skipped and the step runs under B."""
    order, world, budget, ex = _fixed_executor()
    _drive(ex, order)
    ex.set_order(order)
    _drive(ex, order)
    world.add(BASE + (1 << 36), 6 * BLOCK, DataType.ACT)
    lean = Order([Position(p.phase, p.layer, [a for a in p.accesses if a.data_type is not DataType.OPTIM])
                  if p.phase == "optimizer" else p for p in order.positions], order.segments)
    stats = _drive(ex, lean)
    assert stats["skipped_ahead"] > 0 and stats["followed_plan"], stats
    after = _drive(ex, lean)
    assert after["max_resident_ledger"] <= budget, after


def test_a_chunk_whose_state_exists_steps_in_the_intermediate_pool():
    """The optimizer's temporaries (AdamW's sqrt(v) + eps, one chunk's size) go to the intermediate-results pool,
    empty after backward: in the optimizer-state pool they stayed cached beside the state. A chunk whose state is
    still to be created steps in the optimizer-state pool (the state must land there), with or without staging."""
    from um_lab.schedule.live.control import BudgetControl
    from um_lab.schedule.live.stage import new_stager

    def control(stager):
        return BudgetControl(1 << 30, FakeRuntime(), 0, RecordingStreams(), lambda: [], issue="inline",
                             stager=stager)

    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters())
    params = list(layer.parameters())
    stager = new_stager(None, None)  # a CPU stager: only whether there is one matters here
    staged, plain = control(stager), control(None)
    assert staged._optimizer_pool(opt, params) is DataType.OPTIM  # no state yet
    layer(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert staged._optimizer_pool(opt, params) is DataType.ACT
    assert staged._optimizer_pool(opt, params + [torch.nn.Parameter(torch.ones(2))]) is DataType.OPTIM
    assert plain._optimizer_pool(opt, params) is DataType.ACT
    assert plain._optimizer_pool(opt, params + [torch.nn.Parameter(torch.ones(2))]) is DataType.OPTIM
    staged.close()
    plain.close()


def test_after_the_fixed_pool_grew_the_plan_leaves_room_for_it_to_grow_again_and_the_ledger_stays_under_b():
    """A new fixed segment is resident at once, before evictions can make room. After the pool grew once, a
    re-plan keeps that much room free, so a second growth of the same size leaves the ledger under B (H200,
    GPT-2-large at ratio 3 passed B by one segment when its pool grew under a plan)."""
    order, world, budget, ex = _fixed_executor(room_blocks=28)
    _drive(ex, order)
    plan = ex.set_order(order)
    world.add(BASE + (1 << 36), 4 * BLOCK, DataType.ACT)
    _drive(ex, order)
    replanned = ex.set_order(order)
    assert ex.fixed_reserve == 4 * BLOCK and replanned.budget_bytes == budget - 4 * BLOCK
    assert replanned.fixed_bytes == plan.fixed_bytes + 4 * BLOCK
    _drive(ex, order)
    world.add(BASE + (1 << 37), 4 * BLOCK, DataType.ACT)  # grows again under the new plan
    again = _drive(ex, order)
    assert again["max_resident_ledger"] <= budget and not again["over_budget"], again
    assert again["fixed_reserve_bytes"] == 4 * BLOCK


def test_growth_announced_in_advance_is_planned_for_and_not_taken_for_unforeseen_growth():
    """Partial staging keeps saves on the GPU on purpose: the executor is told first (expect_fixed_growth), the plan
    leaves the room at once, and when the pool grows by that much no reserve for further growth is kept."""
    order, world, budget, ex = _fixed_executor(room_blocks=28)
    _drive(ex, order)
    ex.set_order(order)
    ex.expect_fixed_growth(4 * BLOCK)
    ahead = ex.set_order(order)
    assert ahead.budget_bytes == budget - 4 * BLOCK and ex.expected_growth == 4 * BLOCK
    # the kept saves come during the next step's forward (a new segment of the pool, resident at once)
    def grow(i):
        if i == 2:
            world.add(BASE + (1 << 36), 4 * BLOCK, DataType.ACT)

    grown = _drive(ex, order, between=grow)
    assert grown["max_resident_ledger"] <= budget and not grown["over_budget"], grown
    after = ex.set_order(order)
    assert ex.fixed_reserve == 0 and ex.expected_growth == 0 and after.budget_bytes == budget
    world.add(BASE + (1 << 37), 2 * BLOCK, DataType.ACT)  # growth nobody announced: reserved for as before
    _drive(ex, order)
    ex.set_order(order)
    assert ex.fixed_reserve == 2 * BLOCK
