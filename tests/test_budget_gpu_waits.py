"""budget_gpu_waits: compute waits for a batch on the GPU (a counter the side stream writes after the batch's
calls), so the training thread never waits for the mover; a failed batch releases every wait handed out, so
no compute wait can hang; training is unchanged."""

import copy
import threading
import time

import pytest
import torch
from fakes import FakeRuntime
from test_budget_executor import World, drive
from test_budget_ledger import layered_order
from test_budget_session import make_session, model_and_data, train

from um_lab.budget.executor import BudgetExecutor
from um_lab.budget.ledger import BLOCK
from um_lab.budget.mover import MoveBatch, ThreadMover
from um_lab.budget.streams import RELEASE_JUMP, RecordingStreams

MiB = 1 << 20


class SlowRuntime(FakeRuntime):
    def __init__(self, delay=0.002, fail_at=None):
        super().__init__()
        self.delay, self.fail_at, self.calls = delay, fail_at, 0

    def prefetch(self, *args):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("cudaErrorLaunchFailure (a fake)")
        time.sleep(self.delay)
        super().prefetch(*args)


def waiting_executor(runtime):
    """A planned executor whose compute waits on the GPU (steps 1 and 2: learn and plan)."""
    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    world = World(order.segments)
    streams = RecordingStreams(value_waits=True)
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, streams, world.segments, generation=world.generation,
                        mover=ThreadMover(runtime, streams), gpu_waits=True)
    ex.refresh_segments()
    drive(ex, order)
    ex.set_order(order)
    drive(ex, order)
    return ex, order, streams


def counter_log(streams):
    waits = [v for kind, v in streams.log if kind == "compute_wait_value"]
    writes = [v for kind, v in streams.log if kind == "side_write_value"]
    releases = [v for kind, v in streams.log if kind == "release_values"]
    return waits, writes, releases


def test_the_training_thread_never_waits_for_the_mover_and_every_wait_gets_its_write():
    ex, order, streams = waiting_executor(SlowRuntime())
    assert ex.gpu_waits
    stats = drive(ex, order)
    assert stats["followed_plan"] and stats["host_waits"] == 0 and stats["host_wait_ms"] == 0
    ex.close()
    waits, writes, releases = counter_log(streams)
    assert waits and set(waits) <= set(writes)  # each value compute waits for is written by the side stream
    assert writes == sorted(writes)  # in submission order: the counter only grows
    assert releases  # close() releases whatever might still wait
    assert not [kind for kind, _ in streams.log if kind == "compute_wait"]  # no event waits in this mode


def test_a_failed_batch_releases_every_wait_and_the_error_reaches_the_training_thread():
    runtime = SlowRuntime(delay=0.0)
    ex, order, streams = waiting_executor(runtime)
    runtime.fail_at = runtime.calls + 3
    with pytest.raises(RuntimeError, match="a fake"):
        drive(ex, order)
        ex.mover.drain()
        ex.end_step()
    waits, writes, releases = counter_log(streams)
    assert releases and writes and releases[0] >= max(writes) + RELEASE_JUMP  # past every value written
    assert all(v <= releases[-1] for v in waits)  # every value handed out is below the released counter
    assert ex.residency_unknown
    ex.mover.take_error()
    ex.close()


def test_batches_failed_without_running_release_too():
    streams = RecordingStreams(value_waits=True)
    mover = ThreadMover(SlowRuntime(fail_at=1), streams)
    first = mover.submit(MoveBatch(None, [(0, MiB, 1, 0)], record=True, value=streams.next_value()))
    with pytest.raises(RuntimeError):
        first.wait()
    assert [k for k, _ in streams.log].count("release_values") == 1
    mover._error = first.error  # as if nobody had taken the error yet when the next batch was queued
    second = MoveBatch(None, [(2 * MiB, MiB, 1, 0)], record=True, value=streams.next_value())
    mover._queue.put(second)
    assert second._done.wait(5)
    assert second.error is first.error
    assert [k for k, _ in streams.log].count("release_values") == 2
    mover._error = None
    assert mover.close()


def test_a_session_with_gpu_waits_trains_exactly_as_one_without_a_budget(env):
    source, driver, api, runtime = env
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=48 * MiB, gpu_waits=True) as lab:
        assert lab.budget.executor.gpu_waits
        records = train(lab, model, batches)
        streams = lab.budget.executor.streams
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    waits, writes, _ = counter_log(streams)
    assert waits and set(waits) <= set(writes)
    assert all(r.extra["budget"]["host_waits"] == 0 for r in records)


def test_without_gpu_waits_nothing_changes(env):
    with make_session(env, budget=48 * MiB) as lab:
        assert not lab.budget.executor.gpu_waits
        model, batches = model_and_data()
        train(lab, model, batches[:2])
        assert not [k for k, _ in lab.budget.executor.streams.log if k.endswith("_value")]
    assert threading.active_count() >= 1
