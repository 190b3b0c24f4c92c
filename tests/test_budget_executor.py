"""The budget executor when the world changes under its plan: segments freed between or during steps
(``torch.cuda.empty_cache()``, an allocator retry), planned look-aheads that no longer fit, mover errors.
A freed range is never prefetched, and a step never fails for what only the look-ahead wanted."""

import threading

import pytest
from fakes import FakeRuntime
from test_budget_ledger import layered_order

from um_lab import BudgetTooSmall
from um_lab.cuda.allocator import Segment
from um_lab.schedule.ledger import BLOCK
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.mover import ThreadMover
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.schedule.order import Order, Position
from um_lab.types import DataType


class World:
    """Live segments and a generation counter, as the session's segment source gives them."""

    def __init__(self, segments):
        self.live = [Segment(p, n, DataType.ACT) for p, n in segments]
        self.gen = 0

    def segments(self):
        return list(self.live)

    def generation(self):
        return self.gen

    def free(self, ptr):
        self.live = [s for s in self.live if s.ptr != ptr]
        self.gen += 1


def drive(ex, order, between=None):
    ex.begin_step()
    for i, p in enumerate(order.positions):
        if between is not None:
            between(i)
        ex.enter(i, p)
    return ex.end_step()


def without(order, span):
    """The order with every use of ``span`` dropped (its tensors died)."""
    return Order([Position(p.phase, p.layer, [a for a in p.accesses if span not in a.spans])
                  for p in order.positions], [])


def on(span, calls):
    return [c for c in calls if span[0] <= c[0] < span[0] + span[1]]


def planned_executor(world, order, *, mover=None, runtime=None):
    runtime = runtime or FakeRuntime()
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation,
                        mover=mover)
    ex.refresh_segments()
    drive(ex, order)
    ex.set_order(order)
    drive(ex, order)
    return ex, runtime


@pytest.mark.parametrize("k", range(16))
def test_a_segment_freed_between_steps_is_never_prefetched_and_the_step_runs(k):
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    ex, runtime = planned_executor(world, order)
    gone = order.segments[k]
    world.free(gone[0])  # e.g. torch.cuda.empty_cache() between steps
    runtime.prefetched.clear()
    for _ in range(2):
        stats = drive(ex, without(order, gone))
        assert stats["max_resident_ledger"] <= ex.ledger.budget_bytes
        ex.ledger.check()
    assert not on(gone, runtime.prefetched)
    assert gone[0] not in ex.ledger.segments()


def test_a_segment_freed_during_a_step_is_forgotten_before_the_next_move_is_issued():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    ex, runtime = planned_executor(world, order)
    # an optimizer-state segment the plan prefetches ahead late in the step; freed (an allocator retry)
    # after the first position ran, while the ledger still holds it
    gone = next(s for s in reversed(order.segments) if on(s, runtime.prefetched))
    runtime.prefetched.clear()
    drive(ex, without(order, gone), between=lambda i: world.free(gone[0]) if i == 1 else None)
    assert not on(gone, runtime.prefetched)
    ex.ledger.check()


def test_the_mover_skips_a_range_freed_after_its_batch_was_queued():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    gate = threading.Event()

    class Gated(FakeRuntime):
        def prefetch(self, *args):
            gate.wait(10)
            super().prefetch(*args)

    runtime = Gated()
    gate.set()
    ex, _ = planned_executor(world, order, mover=ThreadMover(runtime, RecordingStreams()), runtime=runtime)
    ex.mover.drain()
    gate.clear()  # the mover is now held at its first call
    runtime.prefetched.clear()
    first, second = order.segments[0], order.segments[1]
    both = ex.ledger.blocks([first, second])
    ex._issue(ex.ledger.evict(both), -1)  # the mover holds this batch at the gate
    ex._issue(ex.ledger.bring_in(both, lambda b: 0.0, target=5), -1)  # queued behind it (a look-ahead)
    world.free(second[0])  # freed while the batch waits in the mover's queue
    gate.set()
    ex.mover.drain()
    ex.close()
    assert on(first, runtime.prefetched) and not on(second, runtime.prefetched)


def test_a_lookahead_that_no_longer_fits_is_skipped_not_raised():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, FakeRuntime(), 0, RecordingStreams(), lambda: [], cover_unknown=True)
    for ptr, size in order.segments:
        ex.ledger.add_segment(ptr, size)
    drive(ex, order)
    plan = ex.set_order(order)
    drive(ex, order)
    ahead = [m for m in plan.moves[1] if m.kind == "prefetch" and m.target != 1]
    assert ahead  # position 1 prefetches for later positions
    # the next step: same layers, but position 1 writes new activations, so its own ranges fill the budget
    own = ex.ledger.bytes_of(ex.blocks(order.positions[1].spans()))
    extra = (budget - own) // BLOCK
    new = Position(order.positions[1].phase, order.positions[1].layer, list(order.positions[1].accesses))
    new.add(DataType.ACT, [(1 << 44, extra * BLOCK)])
    step = Order([*order.positions[:1], new, *order.positions[2:]], [])
    stats = drive(ex, step)  # before: BudgetTooSmall from the look-ahead prefetch
    assert stats["skipped_ahead"] >= 1 and stats["followed_plan"]
    assert stats["max_resident_ledger"] <= budget
    ex.ledger.check()
    with pytest.raises(BudgetTooSmall):  # the position's own ranges above the budget still fail the step
        new.add(DataType.ACT, [(1 << 45, BLOCK)])
        drive(ex, step)


class Failing(FakeRuntime):
    """Fails the prefetch calls while ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def prefetch(self, *args):
        if self.fail:
            raise RuntimeError("cudaMemPrefetchAsync failed")
        super().prefetch(*args)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failed_move_is_raised_and_the_next_step_starts_from_everything_evicted(threaded):
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    runtime = Failing()
    mover = ThreadMover(runtime, RecordingStreams()) if threaded else None
    ex, _ = planned_executor(world, order, mover=mover, runtime=runtime)
    runtime.fail = True
    with pytest.raises(RuntimeError, match="cudaMemPrefetchAsync failed"):
        drive(ex, order)  # raised inside a position (a batch it waits for) or at the step's end
    ex.abort()
    assert ex.residency_unknown
    runtime.fail = False
    runtime.prefetched.clear()
    stats = drive(ex, order)
    host = runtime.codes.location_host
    evicted = {(p, n) for p, n, loc, _, _ in runtime.prefetched if loc == host}
    assert set(order.segments) <= evicted  # every segment pushed to the host, whatever the ledger believed
    assert not ex.residency_unknown and stats["max_resident_ledger"] <= ex.ledger.budget_bytes
    ex.ledger.check()
    ex.close()


def test_a_failed_move_nobody_waited_for_is_raised_at_the_step_end_and_at_close():
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    runtime = Failing()
    ex, _ = planned_executor(world, order, runtime=runtime)
    ex.begin_step()
    runtime.fail = True
    ex.evict_all()  # no position waits for an eviction
    runtime.fail = False
    with pytest.raises(RuntimeError, match="failed"):
        ex.end_step()
    assert ex.residency_unknown
    ex.touch_now([order.segments[0]])  # the GPU wrote a segment: resident, to be evicted
    runtime.fail = True
    assert ex.evict_all() > 0
    runtime.fail = False
    with pytest.raises(RuntimeError, match="failed"):
        ex.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_timed_moves_account_for_every_byte_the_ledger_moved(threaded):
    """time_moves() puts a timed side event around every call: a step's move_timing has the ledger's
    prefetched and evicted bytes under to_gpu / to_host, one call per span, and their side-stream times
    (the recording fake: 1 ms a call); off by default (no key, no timed events)."""
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    runtime = FakeRuntime()
    mover = ThreadMover(runtime, RecordingStreams()) if threaded else None
    ex, runtime = planned_executor(world, order, mover=mover, runtime=runtime)
    assert "move_timing" not in drive(ex, order)
    ex.mover.drain()  # the last untimed batches issued
    ex.time_moves()
    runtime.prefetched.clear()
    stats = drive(ex, order)
    ex.mover.drain()
    timing = stats["move_timing"]
    late = ex.clock.collect(ex.streams.elapsed_ms) if ex.clock is not None else {}  # calls issued after end_step
    got = {k: timing.get(k, {}).get("bytes", 0) + late.get(k, {}).get("bytes", 0) for k in ("to_gpu", "to_host")}
    assert got == {"to_gpu": stats["prefetched_bytes"], "to_host": stats["evicted_bytes"]}
    assert stats["prefetched_bytes"] > 0 and stats["evicted_bytes"] > 0
    calls = sum(t.get("calls", 0) for t in (*timing.values(), *late.values()))
    assert calls == len(runtime.prefetched)
    assert all(t["ms"] == t["calls"] and 0 <= t["host_ms"] < 1e3 for t in (*timing.values(), *late.values()))
    ex.close()


def test_the_training_threads_time_in_the_hooks_and_waiting_for_the_mover_is_counted():
    """executor_ms: host time in enter/touched; host_wait_ms: the part spent waiting for a batch not yet issued."""
    import time as _time

    class SlowRuntime(FakeRuntime):
        def prefetch(self, *args):
            _time.sleep(0.002)
            super().prefetch(*args)

    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    mover = ThreadMover(SlowRuntime(), RecordingStreams())
    ex, _ = planned_executor(world, order, mover=mover)
    stats = drive(ex, order)
    assert stats["host_waits"] > 0
    assert 0 < stats["host_wait_ms"] <= stats["executor_ms"]
    assert stats["host_wait_ms"] >= 2.0 * 0.5  # at least part of one slow call was waited for
    ex.close()


def test_a_kernel_write_to_a_host_written_pool_is_not_counted_resident_and_the_plan_prefetches_it():
    """Pools with the budget's host advice (preferred location: host): a GPU write to a page that is not resident
    lands in host memory, mapped remotely (the driver populates pages at the preferred location). The executor
    keeps such writes out of the ledger's resident bytes and out of the room it reserves for unforeseen writes,
    and a planned step prefetches those ranges before the positions that use them."""
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    runtime = FakeRuntime()
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation,
                        host_written_types=[DataType.ACT])
    ex.refresh_segments()
    first = order.segments[0]
    ex.touch_now([first])  # e.g. a batch copied in: stays on the host
    assert ex.ledger.resident_bytes == 0 and ex.ledger.host_touched_bytes == first[1]
    drive(ex, order)
    ex.set_order(order)
    runtime.prefetched.clear()
    ex.begin_step()
    for i, p in enumerate(order.positions):
        ex.enter(i, p)
        ex.touched(i, DataType.ACT, [s for s in p.spans()])  # every position writes what it uses
    stats = ex.end_step()
    assert stats["followed_plan"] and stats["max_resident_ledger"] <= budget
    assert stats["touched_bytes"] == 0  # every block a position wrote was resident by a prefetch first
    assert on(first, [c for c in runtime.prefetched if c[2] == runtime.codes.location_device])
    assert not ex._touch_estimate or max(ex._touch_estimate.values()) == 0
