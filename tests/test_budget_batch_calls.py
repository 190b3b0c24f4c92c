"""budget_batch_calls: consecutive prefetches to one location go to the driver as one
cudaMemPrefetchBatchAsync; their order between locations, freed-range checks and training are unchanged."""

import copy

import torch
from fakes import FakeRuntime
from test_budget_session import make_session, model_and_data, train

from um_lab.schedule.live.mover import DISCARD, POPULATE, MoveBatch, _groups
from um_lab.schedule.live.streams import RecordingStreams

MiB = 1 << 20
HOST, GPU = FakeRuntime.codes.location_host, FakeRuntime.codes.location_device


class BatchRuntime(FakeRuntime):
    """A fake runtime that has the batch call: records each batch, and every range it covers."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[list[int], list[int], int, int, int]] = []

    def prefetch_batch(self, ptrs, sizes, location_type, location_id, stream):
        self.batches.append((list(ptrs), list(sizes), location_type, location_id, stream))

    def can_prefetch_batch(self) -> bool:
        return True

    def discard(self, ptr, nbytes, stream):
        self.prefetched.append((ptr, nbytes, DISCARD, 0, stream))

    def ranges(self):
        """Every range moved, in issue order, as (address, bytes, location type)."""
        return [(p, n, t) for p, n, t, *_ in self.prefetched] + [
            (p, n, b[2]) for b in self.batches for p, n in zip(b[0], b[1], strict=True)]


def test_runs_of_one_location_form_groups_and_discards_or_populates_go_alone():
    calls = [(1, 1, HOST, 0), (2, 1, HOST, 0), (3, 1, GPU, 0), (4, 1, DISCARD, 0), (5, 1, DISCARD, 0),
             (6, 1, GPU, 0), (7, 1, GPU, 0), (8, 1, POPULATE, 0), (9, 1, GPU, 1)]
    assert [[c[0] for c in g] for g in _groups(calls, True)] == [[1, 2], [3], [4], [5], [6, 7], [8], [9]]
    assert [[c[0] for c in g] for g in _groups(calls, False)] == [[c[0]] for c in calls]


def test_a_batched_move_makes_one_call_per_run_and_still_skips_freed_ranges():
    runtime = BatchRuntime()
    calls = [(1 * MiB, MiB, HOST, 0), (3 * MiB, MiB, HOST, 0), (5 * MiB, MiB, HOST, 0), (7 * MiB, MiB, GPU, 0),
             (9 * MiB, MiB, DISCARD, 0), (11 * MiB, MiB, GPU, 0), (13 * MiB, MiB, GPU, 0)]
    freed = {3 * MiB}
    batch = MoveBatch(None, calls, record=True, live=lambda p, n: p not in freed, batched=True)
    batch.run(runtime, RecordingStreams())
    assert batch.error is None and batch.skipped == 1 and batch.side_event is not None
    side = RecordingStreams.SIDE
    assert runtime.batches == [([1 * MiB, 5 * MiB], [MiB, MiB], HOST, 0, side),
                               ([11 * MiB, 13 * MiB], [MiB, MiB], GPU, 0, side)]
    assert runtime.prefetched == [(7 * MiB, MiB, GPU, 0, side), (9 * MiB, MiB, DISCARD, 0, side)]


def test_without_the_batch_call_every_range_is_its_own_call():
    runtime = FakeRuntime()
    calls = [(1 * MiB, MiB, HOST, 0), (3 * MiB, MiB, HOST, 0)]
    MoveBatch(None, calls, record=False, batched=True).run(runtime, RecordingStreams())
    assert [c[:3] for c in runtime.prefetched] == [(1 * MiB, MiB, HOST), (3 * MiB, MiB, HOST)]


def test_a_session_with_batch_calls_moves_the_same_ranges_and_trains_the_same(env):
    source, driver, api, _ = env
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    results = {}
    for batched, m in ((False, model), (True, twin)):
        runtime = BatchRuntime()
        with make_session((source, driver, api, runtime), budget=48 * MiB, batch_calls=batched,
                          budget_issue="inline") as lab:
            assert lab.budget.executor.batch_calls is batched
            records = train(lab, m, batches)
        results[batched] = (records, runtime)
    plain, batched = results[False], results[True]
    assert [r.loss for r in plain[0]] == [r.loss for r in batched[0]]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    assert plain[1].batches == [] and batched[1].batches  # batch calls only when asked for
    # (CPU tensors move every step, so the two runs' ranges differ: compare calls with ranges in one run)
    calls = len(batched[1].prefetched) + len(batched[1].batches)
    assert calls < len(batched[1].ranges())
    assert all(len(set(p)) == len(p) for p, *_ in batched[1].batches)  # no range twice in one call


def test_batch_calls_stay_off_where_the_runtime_lacks_them(env):
    with make_session(env, budget=48 * MiB, batch_calls=True) as lab:
        assert lab.budget.executor.batch_calls is False
