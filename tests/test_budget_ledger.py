"""The budget ledger and planner on synthetic orders: block accounting, Belady evictions, never above B."""

import math

import pytest

from um_lab import BudgetError, BudgetTooSmall, UmLabError
from um_lab.schedule.ledger import BLOCK, GPU, HOST, Ledger
from um_lab.schedule.order import Access, Order, covering_segments
from um_lab.schedule.plan import Scheduler, make_plan, new_ledger
from um_lab.types import DataType

MiB = 1 << 20
BASE = 1 << 40


def far(_block):
    return 0.0


def test_blocks_are_shared_by_small_tensors_and_a_segment_tail_counts_its_own_bytes():
    ledger = Ledger(64 * MiB)
    ledger.add_segment(BASE, 5 * MiB)  # blocks 0, 1 whole; block 2 holds 1 MiB
    assert ledger.total_bytes == 5 * MiB
    two_small = [(BASE + 100, 64), (BASE + 4096, 64)]
    assert len(ledger.blocks(two_small)) == 1
    tail = ledger.blocks([(BASE + 4 * MiB + 10, 100)])
    assert ledger.bytes_of(tail) == 1 * MiB
    moves = ledger.bring_in(ledger.blocks(two_small) | tail, far)
    assert ledger.resident_bytes == 2 * MiB + 1 * MiB
    assert [m.kind for m in moves] == ["prefetch"]
    assert moves[0].spans == ((BASE, 2 * MiB), (BASE + 4 * MiB, 1 * MiB))
    assert ledger.bytes_by_state() == {GPU: 3 * MiB, HOST: 2 * MiB}
    ledger.check()


def test_ranges_outside_segments_are_ignored_and_reported_unknown():
    ledger = Ledger(8 * MiB)
    ledger.add_segment(BASE, 2 * MiB)
    assert ledger.blocks([(BASE + 2 * MiB, 10)]) == set()
    assert ledger.unknown([(BASE, 10), (BASE + 2 * MiB - 5, 10)]) == [(BASE + 2 * MiB - 5, 10)]


def test_a_move_never_spans_two_segments():
    ledger = Ledger(64 * MiB)
    ledger.add_segment(BASE, 2 * MiB)
    ledger.add_segment(BASE + 2 * MiB, 2 * MiB)  # adjacent, separate allocations
    moves = ledger.bring_in(ledger.blocks([(BASE, 4 * MiB)]), far)
    assert moves[0].spans == ((BASE, 2 * MiB), (BASE + 2 * MiB, 2 * MiB))


def test_bring_in_evicts_the_highest_rank_first_and_never_exceeds_the_budget():
    ledger = Ledger(4 * BLOCK)
    for i in range(8):
        ledger.add_segment(BASE + i * BLOCK, BLOCK)
    blk = [BASE // BLOCK + i for i in range(8)]
    ledger.bring_in(blk[:4], far)
    next_use = {blk[0]: 5, blk[1]: 1, blk[2]: math.inf, blk[3]: 2}
    moves = ledger.bring_in(blk[4:6], lambda b: next_use.get(b, 0))
    assert [m.kind for m in moves] == ["evict", "prefetch"]
    assert set(moves[0].blocks) == {blk[2], blk[0]}  # never used again, then the furthest
    assert ledger.resident_blocks() == {blk[1], blk[3], blk[4], blk[5]}
    assert max(m.resident_after for m in ledger.moves) <= 4 * BLOCK == ledger.max_resident
    ledger.check()


def test_a_working_set_above_the_budget_is_refused_before_anything_moves():
    ledger = Ledger(2 * BLOCK)
    ledger.add_segment(BASE, 3 * BLOCK)
    blocks = ledger.blocks([(BASE, 3 * BLOCK)])
    ledger.bring_in(list(blocks)[:1], far)
    before = (ledger.resident_blocks(), list(ledger.moves))
    with pytest.raises(BudgetTooSmall) as info:
        ledger.bring_in(blocks, far, what="forward of h.0")
    err = info.value
    assert isinstance(err, UmLabError) and isinstance(err, BudgetError)
    assert (err.budget, err.needed) == (2 * BLOCK, 3 * BLOCK) and "forward of h.0" in str(err)
    assert (ledger.resident_blocks(), ledger.moves) == before


def test_lookahead_bring_in_gives_up_rather_than_evict_something_needed_sooner():
    ledger = Ledger(2 * BLOCK)
    ledger.add_segment(BASE, 3 * BLOCK)
    b0, b1, b2 = sorted(ledger.blocks([(BASE, 3 * BLOCK)]))
    ledger.bring_in([b0, b1], far)
    assert ledger.bring_in([b2], lambda b: 1.0, may_evict=lambda b: False) is None
    assert ledger.resident_blocks() == {b0, b1}


def test_touched_records_what_the_gpu_wrote_and_evicts_back_under_the_budget():
    ledger = Ledger(2 * BLOCK)
    ledger.add_segment(BASE, 3 * BLOCK)
    b0, b1, b2 = sorted(ledger.blocks([(BASE, 3 * BLOCK)]))
    ledger.bring_in([b0, b1], lambda b: float(b == b0))
    moves = ledger.touched([b2], lambda b: float(b == b0))
    assert [(m.kind, m.blocks) for m in moves] == [("touch", (b2,)), ("evict", (b0,))]
    assert ledger.resident_bytes == 2 * BLOCK and ledger.max_resident == 3 * BLOCK  # the touch is honest
    assert ledger.touched_bytes == BLOCK and ledger.evicted_bytes == BLOCK


def test_segments_register_and_leave():
    ledger = Ledger(8 * MiB)
    ledger.add_segment(BASE, 2 * MiB)
    ledger.add_segment(BASE, 2 * MiB)  # again: no change
    with pytest.raises(BudgetError):
        ledger.add_segment(BASE, 4 * MiB)
    with pytest.raises(BudgetError):
        ledger.add_segment(BASE + MiB, 2 * MiB)  # overlaps
    ledger.bring_in(ledger.blocks([(BASE, 1)]), far)
    ledger.remove_segment(BASE)
    assert ledger.total_bytes == 0 and ledger.resident_bytes == 0
    ledger.check()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1G", None])
def test_the_budget_must_be_a_positive_int(bad):
    with pytest.raises(BudgetError):
        Ledger(bad)


# ---- the planner ----


def layered_order(layers=6, param_blocks=3, act_blocks=2, optimizer=True):
    """A step of a layered model: forward, backward in reverse, optimizer; each array its own segment."""
    addr = [BASE]

    def seg(nblocks):
        a = addr[0]
        addr[0] += nblocks * BLOCK
        return (a, nblocks * BLOCK)

    arrays = [(seg(param_blocks), seg(param_blocks), seg(2 * param_blocks), seg(act_blocks)) for _ in range(layers)]
    acc = []
    for i, (p, _, _, a) in enumerate(arrays):
        acc += [Access("forward", f"l{i}", DataType.PARAM, (p,)), Access("forward", f"l{i}", DataType.ACT, (a,))]
    for i, (p, g, _, a) in reversed(list(enumerate(arrays))):
        acc += [Access("backward", f"l{i}", DataType.PARAM, (p,)), Access("backward", f"l{i}", DataType.GRAD, (g,)),
                Access("backward", f"l{i}", DataType.ACT, (a,))]
    if optimizer:
        for i, (p, g, o, _) in enumerate(arrays):
            acc += [Access("optimizer", f"l{i}", DataType.PARAM, (p,)),
                    Access("optimizer", f"l{i}", DataType.GRAD, (g,)),
                    Access("optimizer", f"l{i}", DataType.OPTIM, (o,))]
    return Order.from_accesses(acc, [s for arr in arrays for s in arr])


def replay(plan, order):
    """Carry out a plan's steady step from its starting state; check every invariant on the way."""
    ledger = new_ledger(order, plan.budget_bytes)
    ledger.bring_in(plan.start_resident, far)
    ledger.reset_counters()
    scheduler = Scheduler(ledger, order)
    start = ledger.resident_blocks()
    for i, moves in enumerate(plan.moves):
        for m in moves:
            if m.kind == "evict":
                assert set(m.blocks) <= ledger.resident_blocks()
                assert not set(m.blocks) & scheduler.blocks[i], "evicted what this position uses"
                ledger.evict(m.blocks)
            else:
                assert not set(m.blocks) & ledger.resident_blocks(), "prefetched what was resident"
                ledger.bring_in(m.blocks, far)
                assert ledger.resident_bytes == m.resident_after
            assert ledger.resident_bytes <= plan.budget_bytes
            by_state = ledger.bytes_by_state()
            assert by_state[GPU] + by_state[HOST] == ledger.total_bytes == plan.footprint_bytes
        assert scheduler.blocks[i] <= ledger.resident_blocks(), f"position {i} runs without its data"
    if plan.steady:  # the step leaves the state the next one starts from (else the executor realigns first)
        assert ledger.resident_blocks() == start
    assert ledger.prefetched_bytes == plan.prefetched_bytes and ledger.evicted_bytes == plan.evicted_bytes
    return ledger


@pytest.mark.parametrize("ratio", [1.5, 2, 3])
def test_plan_keeps_every_position_resident_and_never_exceeds_the_budget(ratio):
    order = layered_order()
    footprint = sum(n for _, n in order.segments)
    budget = int(footprint / ratio) // BLOCK * BLOCK
    plan = make_plan(order, budget)
    assert plan.steady and plan.footprint_bytes == footprint
    assert plan.max_resident <= budget
    assert plan.prefetched_bytes == plan.evicted_bytes > 0  # steady: what comes in goes out
    replay(plan, order)


def test_more_budget_moves_fewer_bytes_and_a_fitting_model_moves_none():
    order = layered_order()
    footprint = sum(n for _, n in order.segments)
    moved = [make_plan(order, int(footprint / r) // BLOCK * BLOCK).prefetched_bytes for r in (3, 2, 1.5, 1)]
    assert moved == sorted(moved, reverse=True) and moved[-1] == 0 and moved[0] > moved[2]


def test_evictions_follow_belady_on_the_cyclic_order():
    order = layered_order(layers=4, param_blocks=1, act_blocks=1, optimizer=False)
    plan = make_plan(order, 4 * BLOCK, lookahead=0)
    scheduler = Scheduler(new_ledger(order, plan.budget_bytes), order)
    ledger = new_ledger(order, plan.budget_bytes)
    ledger.bring_in(plan.start_resident, far)
    for i, moves in enumerate(plan.moves):
        for m in moves:
            if m.kind == "evict":
                resident = ledger.resident_blocks() - scheduler.blocks[i]
                assert min(scheduler.next_use(v, i) for v in m.blocks) >= max(
                    scheduler.next_use(b, i) for b in resident - set(m.blocks))
                ledger.evict(m.blocks)
            else:
                ledger.bring_in(m.blocks, far)


def test_lookahead_prefetches_ahead_when_there_is_room():
    order = layered_order()
    footprint = sum(n for _, n in order.segments)
    plan = make_plan(order, footprint // 2 // BLOCK * BLOCK, lookahead=2)
    ahead = [m for i, ms in enumerate(plan.moves) for m in ms if m.kind == "prefetch" and m.target != i]
    assert ahead and sum(m.nbytes for m in ahead) > plan.prefetched_bytes / 2
    replay(plan, order)


def test_a_budget_below_one_layer_is_refused_with_the_numbers():
    order = layered_order(param_blocks=3)
    # the optimizer position of one layer: params 3 + grads 3 + state 6 blocks
    with pytest.raises(BudgetTooSmall) as info:
        make_plan(order, 11 * BLOCK)
    assert info.value.needed == 12 * BLOCK and "optimizer of l" in str(info.value)
    assert make_plan(order, 12 * BLOCK).max_resident <= 12 * BLOCK


def test_order_round_trips_through_json_and_covering_segments_are_whole_blocks():
    order = layered_order(layers=2)
    again = Order.from_dict(order.to_dict())
    assert again.keys() == order.keys() and again.accesses() == order.accesses()
    assert covering_segments([(BASE + 10, 5), (BASE + BLOCK - 1, 2)]) == [(BASE, BLOCK), (BASE + BLOCK, BLOCK)]
    cpu_order = Order(order.positions)  # no segments recorded
    assert sum(n for _, n in cpu_order.managed_segments()) == sum(n for _, n in order.segments)


def test_a_segment_added_into_a_resident_block_raises_the_peak_too():
    ledger = Ledger(8 * MiB)
    ledger.add_segment(BASE, 1 * MiB)
    ledger.bring_in(ledger.blocks([(BASE, 1)]), far)
    assert ledger.max_resident == 1 * MiB
    ledger.add_segment(BASE + 1 * MiB, 1 * MiB)  # the block's other half: resident at once
    assert ledger.resident_bytes == 2 * MiB and ledger.max_resident == 2 * MiB
    ledger.remove_segment(BASE + 1 * MiB)
    assert ledger.resident_bytes == 1 * MiB and ledger.max_resident == 2 * MiB
    ledger.check()


def test_a_gpu_write_to_a_host_written_segment_leaves_it_on_the_host_until_a_prefetch():
    """A pool preferring the host (the budget's host advice): a kernel's write to a page that is not resident lands
    in host memory, mapped remotely. The ledger keeps such blocks on the host (counting the bytes), and only a
    bring-in makes them resident; a block shared with another segment counts resident when touched."""
    ledger = Ledger(64 * MiB)
    ledger.add_segment(BASE, 4 * MiB, host_written=True)  # blocks 0, 1
    ledger.add_segment(BASE + 4 * MiB, 1 * MiB, host_written=True)  # block 2, shared with
    ledger.add_segment(BASE + 5 * MiB, 1 * MiB)  # an ordinary segment
    host_only = ledger.blocks([(BASE, 4 * MiB)])
    assert ledger.touched(host_only, far) == []
    assert ledger.resident_bytes == 0 and ledger.host_touched_bytes == 4 * MiB
    assert all(ledger.where(b) == HOST and ledger.written_on_host(b) for b in host_only)
    shared = ledger.blocks([(BASE + 4 * MiB, 1)])
    assert not ledger.written_on_host(next(iter(shared)))
    assert [m.kind for m in ledger.touched(shared, far)] == ["touch"] and ledger.resident_bytes == 2 * MiB
    moves = ledger.bring_in(host_only, far)
    assert [m.kind for m in moves] == ["prefetch"] and ledger.resident_bytes == 6 * MiB
    ledger.reset_counters()
    assert ledger.host_touched_bytes == 0
    ledger.remove_segment(BASE + 5 * MiB)  # block 2 now holds only its host-written piece
    assert ledger.written_on_host(next(iter(shared)))


def test_a_gpu_write_to_a_discarded_host_written_block_makes_its_contents_live_again():
    """A discarded block written by a kernel while on the host holds data again: bringing it in must copy it
    (prefetch), never populate it (which would drop what was written)."""
    ledger = Ledger(64 * MiB)
    ledger.add_segment(BASE, 2 * MiB, host_written=True)
    block = ledger.blocks([(BASE, 2 * MiB)])
    ledger.bring_in(block, far)
    ledger.discard(sorted(block))
    assert ledger.is_dead(next(iter(block)))
    assert ledger.touched(block, far) == [] and not ledger.is_dead(next(iter(block)))
    assert [m.kind for m in ledger.bring_in(block, far)] == ["prefetch"]


def test_a_segments_host_written_flag_can_be_said_again_and_an_unknown_segment_is_refused():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(0, 2 * BLOCK, host_written=True)
    ledger.add_segment(2 * BLOCK, BLOCK // 2)
    ledger.add_segment(2 * BLOCK + BLOCK // 2, BLOCK // 2, host_written=True)  # shares block 2 with the one above
    assert ledger.written_on_host(0) and ledger.written_on_host(1) and not ledger.written_on_host(2)
    ledger.set_host_written(0, False)
    ledger.set_host_written(2 * BLOCK, True)
    assert not ledger.written_on_host(0) and not ledger.written_on_host(1) and ledger.written_on_host(2)
    ledger.set_host_written(2 * BLOCK, True)  # said twice: counted once
    ledger.remove_segment(2 * BLOCK + BLOCK // 2)
    assert ledger.written_on_host(2)
    with pytest.raises(BudgetError, match="no segment"):
        ledger.set_host_written(7 * BLOCK, True)
