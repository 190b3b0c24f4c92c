"""Blocks the caching allocator holds no tensor in are discarded and populated, never copied
(``Session(discard_free=True)``, um_lab/schedule/free.py): which blocks count as free, the ledger's
accounting, that those calls are ordered with compute (never on the side stream), that a block written
again since its discard is prefetched like live data, and that the budget holds."""

import pytest
from test_budget_discard import DiscardingRuntime
from test_budget_executor import World, drive
from test_budget_ledger import layered_order

from um_lab.schedule.ledger import BLOCK, Ledger
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.free import FreeRanges, split_free
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.types import DataType


def far(_block):
    return 0.0


def test_free_ranges_merge_and_cover_only_whole_spans():
    free = FreeRanges([(10, 5), (0, 10), (30, 4)])
    assert len(free) == 2
    assert free.covers(0, 15) and free.covers(30, 4)
    assert not free.covers(12, 10) and not free.covers(29, 2) and not free.covers(40, 1)
    assert not FreeRanges([]).covers(0, 1)


def test_a_block_is_free_only_when_every_managed_byte_in_it_is():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(0, BLOCK + BLOCK // 2)  # block 1 holds half a block of this segment
    ledger.add_segment(BLOCK + BLOCK // 2, BLOCK // 2)  # and half of this one
    assert FreeRanges([(0, BLOCK)]).free_blocks(ledger, [0, 1]) == [0]
    assert FreeRanges([(0, BLOCK + BLOCK // 2)]).free_blocks(ledger, [0, 1]) == [0]
    assert FreeRanges([(0, 2 * BLOCK)]).free_blocks(ledger, [0, 1]) == [0, 1]


def test_evicting_a_free_block_discards_it_and_bringing_it_back_free_populates():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(0, 4 * BLOCK)
    ledger.bring_in([0, 1, 2], far)
    ledger.reset_counters()
    discarded: set[int] = set()
    free = FreeRanges([(BLOCK, 2 * BLOCK)])  # blocks 1 and 2
    side, ordered, turned = split_free(ledger.evict([0, 1, 2]), ledger, free, discarded)
    assert [(m.kind, m.blocks) for m in side] == [("evict", (0,))]
    assert ordered == [(BLOCK, 2 * BLOCK, "discard")]
    assert turned["free_discard_bytes"] == 2 * BLOCK
    assert ledger.evicted_bytes == BLOCK and ledger.discarded_bytes == 2 * BLOCK
    assert discarded == {1, 2} and ledger.is_dead(1) and ledger.resident_bytes == 0
    # block 1 is still free when it is brought back: populated in order; block 2 was handed out and
    # written since: its pages hold live data, so it is prefetched; block 3 (never discarded) is free
    side, ordered, turned = split_free(ledger.bring_in([1, 2, 3], far), ledger, FreeRanges([(BLOCK, BLOCK),
                                                                                           (3 * BLOCK, BLOCK)]),
                                       discarded)
    assert sorted(ordered) == [(BLOCK, BLOCK, "populate"), (3 * BLOCK, BLOCK, "populate")]
    assert [(m.kind, m.blocks) for m in side] == [("prefetch", (2,))]
    assert turned == {"free_discard_bytes": 0, "free_populate_bytes": 2 * BLOCK, "refilled_bytes": BLOCK}
    assert ledger.prefetched_bytes == BLOCK and ledger.populated_bytes == 2 * BLOCK
    assert discarded == set() and ledger.resident_bytes == 3 * BLOCK
    ledger.check()


def test_populates_of_blocks_discarded_for_other_reasons_are_left_alone():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(0, 2 * BLOCK)
    ledger.discard([0])  # e.g. a dead gradient block the plan discarded
    moves = ledger.bring_in([0], far)
    side, ordered, _ = split_free(moves, ledger, FreeRanges([]), set())
    assert ordered == [] and [(m.kind, m.blocks) for m in side] == [("populate", (0,))]


class FreeWorld(World):
    """The World of test_budget_executor whose allocator holds ``free_now`` free (activation segments)."""

    def __init__(self, order):
        super().__init__(order.segments)
        self.act = sorted({s for p in order.positions for s in p.spans(DataType.ACT)})
        self.free_now: list = []

    def free_ranges(self):
        return list(self.free_now)


class CheckedRuntime(DiscardingRuntime):
    """Fails any discard or populate of a range the world does not hold free at the moment of the call."""

    def __init__(self, world):
        super().__init__()
        self.world = world

    def discard(self, ptr, nbytes, stream):
        assert FreeRanges(self.world.free_now).covers(ptr, nbytes), "discarded a range holding live data"
        super().discard(ptr, nbytes, stream)

    def discard_and_prefetch(self, ptr, nbytes, device, stream):
        assert FreeRanges(self.world.free_now).covers(ptr, nbytes), "populated a range holding live data"
        super().discard_and_prefetch(ptr, nbytes, device, stream)


def link_bytes(runtime):
    return sum(c[1] for c in runtime.prefetched)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_the_executor_issues_free_moves_in_order_moves_fewer_bytes_and_stays_under_budget(lookahead):
    order = layered_order(layers=5, param_blocks=2, act_blocks=2)
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    layers = 5

    def run(with_free):
        world = FreeWorld(order)
        runtime, streams = CheckedRuntime(world), RecordingStreams()
        ex = BudgetExecutor(budget, runtime, 0, streams, world.segments, generation=world.generation,
                            lookahead=lookahead, free_ranges=world.free_ranges if with_free else None)
        ex.refresh_segments()

        def between(i):  # a layer's activations are free once its backward is done (positions L..2L-1)
            done = i - layers if i >= layers else 0
            world.free_now = world.act[layers - done:] if done else []

        drive(ex, order, between)
        ex.set_order(order)
        for _ in range(3):
            runtime.prefetched.clear()
            stats = drive(ex, order, between)
            assert stats["max_resident_ledger"] <= budget
            ex.ledger.check()
        return runtime, streams, stats

    plain, _, _ = run(False)
    runtime, streams, stats = run(True)
    assert stats["free_queries"] > 0 and stats["free_discard_bytes"] > 0
    assert runtime.discarded and all(c[2] == RecordingStreams.ORDERED for c in runtime.discarded)
    assert all(c[3] == RecordingStreams.ORDERED for c in runtime.populated)
    assert ("ordered_begin", RecordingStreams.ORDERED) in streams.log
    assert link_bytes(runtime) < link_bytes(plain)
    assert link_bytes(plain) - link_bytes(runtime) == stats["free_discard_bytes"] + stats["free_populate_bytes"]


def test_without_free_ranges_nothing_changes():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    runtime = DiscardingRuntime()
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation)
    ex.refresh_segments()
    drive(ex, order)
    ex.set_order(order)
    stats = drive(ex, order)
    assert "free_queries" not in stats and not runtime.discarded and not runtime.populated


def test_free_discards_are_off_by_default_and_refused_without_a_budget(env):
    from test_budget_session import make_session

    from um_lab.errors import InputError

    with make_session(env, budget=48 * BLOCK) as lab:
        assert lab.budget.executor.free_ranges is None
    with make_session(env, budget=48 * BLOCK, discard_free=True) as lab:
        assert lab.options.discard_free  # the fake driver has no allocator snapshot: nothing to ask
        assert lab.budget.executor.free_ranges is None
    with pytest.raises(InputError, match="needs a budget"):
        make_session(env, discard_free=True)


def test_moves_issued_between_steps_are_turned_too():
    """Placing a model and staging inputs issue moves before any step began (a GPU run once
    failed there: the step's counters did not exist yet)."""
    order = layered_order(layers=3, param_blocks=1, act_blocks=1)
    world = FreeWorld(order)
    runtime = CheckedRuntime(world)
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation,
                        free_ranges=world.free_ranges)
    ex.refresh_segments()
    ex.touch_now(order.segments)
    world.free_now = world.act
    assert ex.evict_all() > 0
    assert runtime.discarded and ex.stats["free_discard_bytes"] == sum(n for _, n in world.act)
    drive(ex, order)
    ex.ledger.check()


def test_ordered_calls_come_after_every_earlier_move_was_issued_to_the_side_stream():
    """A discard is undefined while a prefetch of the same range runs: the mover is drained first, so every
    earlier move is on the side stream, which the ordered stream waits for (CudaStreams.run_ordered)."""
    from um_lab.schedule.live.mover import InlineMover

    order = layered_order(layers=4, param_blocks=1, act_blocks=2)
    world = FreeWorld(order)
    runtime, streams = CheckedRuntime(world), RecordingStreams()

    class LoggedMover(InlineMover):
        def drain(self):
            streams.log.append(("drain", 0))

    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, streams, world.segments, generation=world.generation,
                        free_ranges=world.free_ranges, mover=LoggedMover(runtime, streams))
    ex.refresh_segments()
    world.free_now = world.act
    drive(ex, order)
    kinds = [k for k, _ in streams.log]
    begins = [i for i, k in enumerate(kinds) if k == "ordered_begin"]
    assert begins and all(kinds[i - 1] == "drain" for i in begins)
