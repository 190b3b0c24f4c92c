"""Saved activations staged through (pinned) host memory: the stager alone on plain tensors, then
Session(budget=Budget(B, stage_activations=True)) against the fake driver: the same training result as without,
only intermediate-results tensors staged, numbers in the record."""

import contextlib
import copy
import weakref

import pytest
import torch
from test_budget_session import make_session, model_and_data, train

from um_lab.errors import BudgetError, InputError
from um_lab.schedule import staging
from um_lab.schedule.config import Budget
from um_lab.schedule.live.pinned import CpuCopyOps, PinnedArena, available_host_bytes
from um_lab.schedule.live.stage import ActivationStager, StaleSavedTensor
from um_lab.schedule.live.tail import TailSizer
from um_lab.schedule.stats import BudgetStats
from um_lab.types import DataType

MiB = 1 << 20


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: with two, MKL may split a GEMM differently from one call to the next when the
    machine is busy, and the bit-for-bit comparisons below would then fail by ~1e-4 for reasons not the
    stager's (seen once in ~20 runs of this file beside other test processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp(seed=0, width=512, depth=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(depth)])


def cpu_stager():
    """A stager of every tensor of 2 MiB or more, copied on the CPU, a 4 MiB window."""
    return ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=1 << 30, min_bytes=2 * MiB,
                            window_bytes=4 * MiB)


def grads_after(model, x, stager=None):
    model.zero_grad()
    if stager is None:
        out = model(x)
    else:
        with stager.saving():
            out = model(x)
    out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_staged_backward_equals_plain_backward_and_every_large_saved_tensor_is_staged():
    model = mlp()
    x = torch.randn(1024, 512)
    plain = grads_after(model, x)
    ops = CpuCopyOps()
    stager = ActivationStager(ops, lambda t: True, host_limit_bytes=1 << 30, min_bytes=2 * MiB, window_bytes=4 * MiB)
    staged = grads_after(model, x, stager)
    stats = stager.end_step()
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a, b), ((a - b).abs().max().item(), stats)
    # each Linear saves its 2 MiB input (the first: x) and each Tanh its 2 MiB output, which is the next
    # Linear's input: one copy serves both (the 1 MiB weights are under min_bytes)
    assert stats["staged_tensors"] == 5 and stats["shared_tensors"] == 3
    assert stats["staged_bytes"] == stats["staged_tensors"] * 2 * MiB
    assert stats["late_restores"] == 1  # only the first tensor backward asks for is not brought ahead
    assert stats["restored_bytes"] == stats["staged_bytes"]  # one copy back serves both saves
    assert stats["kept_bytes"] == 0 and stats["pinned_bytes"] >= stats["staged_bytes"]


def test_small_or_ineligible_tensors_stay_and_a_full_host_keeps_the_rest_on_the_device():
    model = mlp()
    x = torch.randn(1024, 512)
    plain = grads_after(model, x)
    nothing = ActivationStager(CpuCopyOps(), lambda t: False, host_limit_bytes=1 << 30)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads_after(model, x, nothing), strict=True))
    assert nothing.end_step()["staged_tensors"] == 0
    too_small = ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=1 << 30, min_bytes=4 * MiB)
    grads_after(model, x, too_small)
    assert too_small.end_step()["staged_tensors"] == 0
    limited = ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=6 * MiB, min_bytes=2 * MiB)
    limited.arena = PinnedArena(limited.ops, 6 * MiB, chunk_bytes=2 * MiB)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads_after(model, x, limited), strict=True))
    stats = limited.end_step()
    # five 2 MiB tensors to stage, room for three: the first three forward saved went; the last two stayed,
    # counted per save (one of them is saved twice: a Tanh's output and the next Linear's input)
    assert stats["staged_bytes"] == 6 * MiB and stats["kept_bytes"] == 6 * MiB and stats["pinned_bytes"] == 6 * MiB


def test_the_arena_is_reused_step_after_step_and_aligns_what_it_hands_out():
    ops = CpuCopyOps()
    arena = PinnedArena(ops, 64 * MiB, chunk_bytes=4 * MiB)
    first = [arena.take(n) for n in (1000, 3 * MiB, 2 * MiB, 5 * MiB)]
    assert all(b is not None for b in first)
    pinned = arena.pinned_bytes
    assert pinned == 4 * MiB + 4 * MiB + 5 * MiB  # a chunk, a new chunk for 2 MiB, its own for 5 MiB
    assert first[1].data_ptr() - first[0].data_ptr() == 1024  # 1000 B rounded up to 512-byte alignment
    arena.reset()
    again = [arena.take(n) for n in (1000, 3 * MiB, 2 * MiB, 5 * MiB)]
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in first]
    assert arena.pinned_bytes == pinned
    assert arena.take(64 * MiB) is None  # past the limit: refused, nothing pinned
    assert arena.pinned_bytes == pinned


def test_views_split_out_of_one_tensor_are_staged_once_through_their_storage_and_backward_is_bit_for_bit():
    """q, k and v split out of one projection (as attention does) fill their storage only together: the storage
    is copied once, each view rebuilt on the copy back with its own offset and strides; a view of a storage
    more than MAX_VIEW_SPREAD times its size stays on the device."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * 64)
    big = torch.nn.Linear(64, 64 * 64)
    x = torch.randn(32, 64)

    def loss():
        q, k, v = lin(x).view(32, 3, 64).unbind(1)  # each a strided view of the (32, 192) output
        head = big(x)[:, :8]  # 8 of 4,096 columns: staging its storage would copy 512 times its bytes
        return ((q * k).sum(-1, keepdim=True).softmax(0) * v).sum() + (head * head).sum()

    plain = torch.autograd.grad(loss(), list(lin.parameters()) + list(big.parameters()))
    stager = ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=1 << 30, min_bytes=1024)
    with stager.saving():
        out = loss()
    staged = torch.autograd.grad(out, list(lin.parameters()) + list(big.parameters()))
    stats = stager.end_step()
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a, b)
    assert stats["view_tensors"] == 1 and stats["shared_tensors"] >= 2, stats  # one storage for q, k and v
    assert stats["staged_bytes"] >= 32 * 3 * 64 * 4 and stats["kept_bytes"] >= 32 * 8 * 4, stats
    assert stats["restored_bytes"] == stats["staged_bytes"]


def test_a_permuted_saved_tensor_keeps_its_strides_and_an_overlapping_one_stays():
    kept = []
    stager = ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=1 << 30, min_bytes=0)
    a = torch.randn(64, 32, requires_grad=True)
    with stager.saving():
        t = (a * 2).t()  # a permuted view: staged with its strides
        y = (t * t).sum()
        e = (a * 1).sum(0, keepdim=True).expand(64, 32)  # overlapping: staged through its one-row storage
        z = (e * e).sum()
    (y + z).backward()
    stats = stager.end_step()
    kept.append(stats)
    assert stats["staged_tensors"] >= 1
    expected = 2 * (2 * a.detach()) * 2 + 2 * a.detach().sum(0, keepdim=True).expand(64, 32).sum(0, keepdim=True) * 1
    assert torch.allclose(a.grad, expected)


def test_the_host_memory_available_is_read():
    assert available_host_bytes() > 0


@pytest.mark.parametrize("issue", ["thread", "inline"])
def test_a_budget_session_staging_activations_trains_exactly_as_without_and_stages_only_intermediates(env, issue):
    source, driver, api, runtime = env
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    budget = 48 * MiB
    with make_session(env, budget=Budget(budget, stage_activations=True), budget_issue=issue) as lab:
        stager = lab.budget.stager
        seen = []
        eligible = stager.eligible
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def watched(t):
            seen.append((t.untyped_storage().data_ptr() in params, eligible(t)))
            return seen[-1][1]

        stager.eligible = watched
        records = train(lab, model, batches)
        assert api.balanced()
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    staging = [r.extra["budget"]["staging"] for r in records]
    assert all(s["staged_tensors"] > 0 and s["restored_bytes"] >= s["staged_bytes"] > 0 for s in staging)
    # the parameters (saved by the Linears) were asked and refused (on a GPU the test is the pool: GPU test)
    assert any(is_param for is_param, _ in seen) and not any(ok for is_param, ok in seen if is_param)


def test_staging_is_off_by_default_and_a_session_budget_must_be_bytes(env):
    with make_session(env, budget=48 * MiB) as lab:
        assert lab.budget.stager is None
    with pytest.raises(BudgetError, match="fraction of a run's footprint"):
        make_session(env, budget=Budget("0.5x", stage_activations=True))


class _Event:
    def __init__(self):
        self.done = False


class PendingCopyOps(CpuCopyOps):
    """CPU copies whose events complete only when told (or waited for): which tensors does the stager hold?"""

    def __init__(self):
        super().__init__()
        self.copies = []  # (event, weakref to dst, weakref to src)
        self.synchronized = 0

    def copy_on_side(self, dst, src):
        super().copy_on_side(dst, src)
        event = _Event()
        self.copies.append((event, weakref.ref(dst), weakref.ref(src)))  # weak: the stager alone may hold them
        return event

    def is_done(self, event):
        return event.done

    def host_wait(self, event):
        event.done = True

    def synchronize(self):
        self.synchronized += 1
        for event, _, _ in self.copies:
            event.done = True


def test_every_device_tensor_a_copy_reads_or_writes_is_held_until_the_copy_is_done_then_let_go():
    """A device block read (a copy out) or written (a copy back) on the side stream must not be reused before
    the copy ends: the stager holds the tensor until its event completes, not record_stream (whose release a
    pool routing defers), and lets go of it once it has."""
    ops = PendingCopyOps()
    stager = ActivationStager(ops, lambda t: True, host_limit_bytes=1 << 30, min_bytes=2 * MiB, window_bytes=1 << 30)
    with stager.saving():
        a = torch.randn(1024, 1024, requires_grad=True)
        h = a * 2  # 4 MiB, saved by the multiplication below
        y = (h * h).sum()
    source = weakref.ref(h)
    del h
    assert source() is not None  # its copy out has not completed: held although forward let go of it
    ops.copies[0][0].done = True
    stager._release_done()
    assert source() is None  # copy done: let go, its block may be reused
    y.backward()
    assert len(ops.copies) == 2  # out, then back
    back = ops.copies[1][1]()
    assert back is not None and [held for _, held in stager._restoring] == [back]  # written on the side: held
    del back
    stats = stager.end_step()
    assert ops.synchronized == 1 and stager._restoring == [] and stager._to_host == []  # waited, then let go
    assert stats["restored_bytes"] == stats["staged_bytes"] == 4 * MiB


def test_a_graph_kept_past_its_step_and_an_in_place_write_after_the_pack_are_refused():
    stager = ActivationStager(CpuCopyOps(), lambda t: True, host_limit_bytes=1 << 30, min_bytes=0)
    a = torch.randn(256, 256, requires_grad=True)
    with stager.saving():
        y = (a * 2).exp().sum()  # exp saves its output
    stager.end_step()
    with pytest.raises(StaleSavedTensor, match="earlier training step"):
        y.backward()
    with stager.saving():
        h = a * 2
        z = h.exp()  # saves z
        w = (z * 3).sum()
    z.add_(1)  # in-place after the save: autograd's own check is off under saved-tensor hooks
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        w.backward()
    stager.end_step()


def test_a_failing_step_end_still_ends_the_stagers_step(env, monkeypatch):
    model, batches = model_and_data()
    with make_session(env, budget=Budget(48 * MiB, stage_activations=True)) as lab:
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = lab.inputs(*batches[0])
        stager = lab.budget.stager
        before = stager._step

        def failing_end_step():
            raise RuntimeError("a move failed")

        monkeypatch.setattr(lab.budget.executor, "end_step", failing_end_step)
        with pytest.raises(RuntimeError, match="a move failed"):
            lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt)
        assert stager._step == before + 1 and not stager._staged



def test_a_budget_sessions_window_is_a_tenth_of_the_budget_between_64_mib_and_2_gib():
    """Backward needs about two layers of look-ahead or copies and kernels alternate (window_for_budget's docstring):
    GPT-2-large at ratio 2 (B = 19.48 GiB) gets 1.95 GiB where it had 1 GiB."""
    from um_lab.schedule.live.stage import BUDGET_WINDOW_MAX_BYTES, window_for_budget

    gib = 1 << 30
    assert window_for_budget(int(19.48 * gib)) == int(19.48 * gib) // 10
    assert window_for_budget(100 * gib) == BUDGET_WINDOW_MAX_BYTES == 2 * gib
    assert window_for_budget(100 << 20) == 64 << 20


def test_staging_makes_the_intermediate_pool_device_memory_by_default_and_the_pools_managed_again_at_close(env):
    source, driver, api, runtime = env
    with make_session(env, budget=Budget(48 * MiB, stage_activations=True)) as lab:
        assert lab.budget_device_activations is True
        pools = lab._pools
        assert pools.device_types == {DataType.ACT}
        act = source.allocate(DataType.ACT, 4 * MiB)
        grad = source.allocate(DataType.GRAD, 4 * MiB)
        assert driver.device_mallocs and driver.device_mallocs[-1] == (act, 4 * MiB)
        managed = {s.ptr: s.managed for s in source.segments()}
        assert managed[act] is False and managed[grad] is True
        runtime.advised.clear()
        assert lab.set_policy("um-default") == 1  # re-advises live segments: never the device-memory one
        advised = {ptr for ptr, *_ in runtime.advised}
        assert grad in advised and act not in advised
        runtime.prefetched.clear()
        lab._pools.prefetch(DataType.ACT, "gpu")
        assert runtime.prefetched == [], "device memory is never prefetched"
        source.free(act)
        source.free(grad)
    assert pools.device_types == frozenset()
    source.set_cap(1 << 40)  # close set it to 0
    after = source.allocate(DataType.ACT, 2 * MiB)
    assert after and {s.ptr: s.managed for s in source.segments()}[after] is True, "close switches the pools back"
    source.free(after)


def test_device_activations_can_be_turned_off_and_need_staging(env):
    source, driver, api, runtime = env
    with make_session(env, budget=Budget(48 * MiB, stage_activations=True),
                         device_activations=False) as lab:
        assert lab.budget_device_activations is False
        act = source.allocate(DataType.ACT, 4 * MiB)
        assert {s.ptr: s.managed for s in source.segments()}[act] is True
        source.free(act)
    with pytest.raises(InputError, match="needs Budget"):
        make_session(env, budget=48 * MiB, device_activations=True)
    with make_session(env, budget=48 * MiB) as lab:
        assert lab.budget_device_activations is False


def test_partial_staging_keeps_forwards_last_saves_on_the_gpu_from_the_second_step_and_backward_is_unchanged():
    model = mlp()
    x = torch.randn(1024, 512)
    plain = grads_after(model, x)
    stager = cpu_stager()
    stager.keep_tail_bytes = 4 * MiB
    first = grads_after(model, x, stager)
    full = stager.end_step()  # no step before it to tell where forward's tail starts: all staged
    assert full["staged_tensors"] == 5 and full["tail_kept_bytes"] == 0 and full["keep_tail_bytes"] == 4 * MiB
    second = grads_after(model, x, stager)
    partial = stager.end_step()
    # 10 MiB of eligible saves (five 2 MiB tensors): the last two stay, the first three go out and come back
    assert partial["tail_kept_bytes"] == 4 * MiB and partial["staged_tensors"] == 3
    assert partial["staged_bytes"] == partial["restored_bytes"] == 6 * MiB
    for a, b, c in zip(plain, first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    stager.keep_tail_bytes = 0
    grads_after(model, x, stager)
    assert stager.end_step()["staged_tensors"] == 5  # off again: all staged


def test_with_a_kept_tail_the_copies_back_start_at_forwards_first_kept_save_before_backward():
    model = mlp()
    x = torch.randn(1024, 512)
    stager = cpu_stager()
    stager.keep_tail_bytes = 4 * MiB
    grads_after(model, x, stager)
    stager.end_step()
    seen = []  # (kept on the GPU, bytes restored so far) at each unpack
    unpack = stager.unpack

    def watched(saved):
        seen.append((isinstance(saved, torch.Tensor), stager.stats.restored_bytes))
        return unpack(saved)

    stager.unpack = watched
    grads_after(model, x, stager)
    assert stager.end_step()["tail_kept_bytes"] == 4 * MiB
    first_staged = next(i for i, (kept, _) in enumerate(seen) if not kept)
    assert first_staged > 0, "backward reads the kept tail first"
    # forward's first kept save started the copies back: a window's worth is on its way before backward begins
    assert seen[0][0] and seen[0][1] >= 4 * MiB


def test_forward_done_starts_the_copies_back_so_backward_finds_every_staged_tensor_brought_ahead():
    model = mlp()
    x = torch.randn(1024, 512)
    plain = grads_after(model, x)
    stager = cpu_stager()
    model.zero_grad()
    with stager.saving():
        out = model(x)
    assert stager.stats.restored_bytes == 0
    stager.forward_done()
    assert stager.stats.restored_bytes >= 4 * MiB  # a window, the last staged first
    stager.forward_done()  # once a step: no second round of copies
    ahead = stager.stats.restored_bytes
    out.square().sum().backward()
    stats = stager.end_step()
    assert ahead <= stats["restored_bytes"] == stats["staged_bytes"]
    assert stats["late_restores"] == 0
    for a, p in zip(plain, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_partial_staging_keeps_the_room_the_plan_leaves_and_trains_exactly_as_without(env, monkeypatch):
    from um_lab.schedule.live import stage

    monkeypatch.setattr(staging, "MIN_TAIL_BYTES", 1 * MiB)  # this model saves ~12 MiB a step
    model, batches = model_and_data()
    batches = batches * 2  # the decision waits for a step that followed its plan with no re-plan: chances for it
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    budget = 320 * MiB  # well above the model, gradients and AdamW state (~120 MiB): room left under the plan
    # everything fits B, so the scheduler would idle after a step (tests/test_budget_session.py); here staging is kept
    # at work to compare partial staging against whole staging with room under the plan
    from um_lab.schedule.live.control import BudgetControl

    monkeypatch.setattr(BudgetControl, "can_idle", lambda self: False)
    with make_session(env, budget=Budget(budget, stage_activations=True),
                         partial_staging=True) as lab:
        records = train(lab, model, batches)
        stager, executor = lab.budget.stager, lab.budget.executor
        # decided once, from the room the plan leaves (the fake's addresses change every step: it varies by a block)
        assert stager.keep_tail_bytes >= 1 * MiB
        plan_room, eligible, announced = executor.plan.budget_bytes, stager.eligible_bytes, executor.expected_growth
    with make_session(env, budget=Budget(budget, stage_activations=True)) as full:
        staged_in_full = train(full, third, batches)
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected] == [r.loss for r in staged_in_full]
    reasons = [r.extra["budget"]["replan_reason"] for r in records]
    decided = reasons.index("partial staging")
    after = [r.extra["budget"]["staging"] for r in records[decided + 2:]]
    assert after and all(s["tail_kept_bytes"] > 0 for s in after)
    whole = [r.extra["budget"]["staging"] for r in staged_in_full[decided + 2:]]
    assert all(a["staged_bytes"] < w["staged_bytes"] for a, w in zip(after, whole, strict=False))
    # sized in rounds while room was left, never past the saves a step makes; each round's plan left its room
    rounds = [r for r in records if r.extra["budget"]["replan_reason"] == "partial staging"]
    assert 1 <= len(rounds) <= stage.TAIL_ROUNDS
    assert stager.keep_tail_bytes <= eligible
    assert plan_room <= budget - announced
    for r in records:
        b = r.extra["budget"]
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"], b


def test_partial_staging_needs_staging(env):
    with pytest.raises(InputError, match="needs Budget"):
        make_session(env, budget=48 * MiB, partial_staging=True)


def test_tail_bytes_is_the_room_less_the_margin_and_nothing_below_the_minimum():
    from um_lab.schedule.live.stage import MIN_TAIL_BYTES, TAIL_MARGIN_FRACTION, tail_bytes

    budget = 20 << 30
    margin = int(TAIL_MARGIN_FRACTION * budget)
    assert tail_bytes(margin + (3 << 30), budget) == 3 << 30
    assert tail_bytes(margin + MIN_TAIL_BYTES, budget) == MIN_TAIL_BYTES
    assert tail_bytes(margin + MIN_TAIL_BYTES - 1, budget) == 0
    assert tail_bytes(0, budget) == 0 and tail_bytes(-(1 << 30), budget) == 0



def test_the_kept_tail_grows_in_rounds_while_a_steps_peak_leaves_room_beyond_the_growth_announced(env, monkeypatch):
    from um_lab.schedule.live import stage

    monkeypatch.setattr(staging, "MIN_TAIL_BYTES", 1 * MiB)
    model, batches = model_and_data()
    budget = 320 * MiB

    @contextlib.contextmanager
    def sized_by_hand():  # partial staging off: the tail is sized below, one round at a time, on made-up peaks
        with make_session(env, budget=Budget(budget, stage_activations=True)) as lab:
            train(lab, model, batches[:3])
            control, executor = lab.budget, lab.budget.executor
            line = budget - executor.fixed_reserve - int(stage.TAIL_MARGIN_FRACTION * budget)
            yield TailSizer(executor, control.stager), control.stager, executor, line, control.stager.eligible_bytes

    with sized_by_hand() as (tail, stager, executor, line, eligible):
        third = eligible // 3
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=line - third)) == \
            (True, "partial staging")
        assert stager.keep_tail_bytes == third and executor.expected_growth == third
        # the next step's peak is the same: the pool has not grown yet, so the room is the announced growth's
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=line - third)) == (False, "")
        assert stager.keep_tail_bytes == third and executor.expected_growth == third
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=0)) == (False, ""), "sized: done"
    with sized_by_hand() as (tail, stager, executor, line, eligible):
        for n in (1, 2, 3):  # each step's peak leaves room for what is announced and a third of the saves more
            step = BudgetStats(followed_plan=True, max_resident_ledger=line - n * third)
            assert tail.keep_more(step) == (True, "partial staging")
            assert stager.keep_tail_bytes == n * third and executor.expected_growth == n * third
        assert stager.keep_tail_bytes <= eligible
        done = BudgetStats(followed_plan=True, max_resident_ledger=0)
        assert tail.keep_more(done) == (False, "")  # 3 rounds
        assert executor.plan.budget_bytes <= budget - executor.fixed_reserve - executor.expected_growth
        full = {"followed_plan": True, "max_resident_ledger": budget}
    with sized_by_hand() as (tail, stager, *_):
        assert tail.keep_more(BudgetStats.from_dict(full)) == (False, "") and stager.keep_tail_bytes == 0  # no room


@contextlib.contextmanager
def tail_sized_by_hand(env, monkeypatch, budget=320 * MiB):
    """A staging session after three steps with a TailSizer of its own (partial staging off: the tests size the tail
    by hand); yields (sizer, stager, executor, the ledger peak that leaves no room)."""
    from um_lab.schedule.live import stage

    monkeypatch.setattr(staging, "MIN_TAIL_BYTES", 1 * MiB)
    model, batches = model_and_data()
    with make_session(env, budget=Budget(budget, stage_activations=True)) as lab:
        train(lab, model, batches[:3])
        executor, stager = lab.budget.executor, lab.budget.stager
        yield (TailSizer(executor, stager), stager, executor,
               budget - executor.fixed_reserve - int(stage.TAIL_MARGIN_FRACTION * budget))


def test_growth_announced_for_the_tail_and_not_come_is_given_back_after_quiet_steps_when_asked(env, monkeypatch):
    from um_lab.schedule.live import tail as tail_module

    with tail_sized_by_hand(env, monkeypatch) as (tail, stager, executor, line):
        third = stager.eligible_bytes // 3
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=line - third))[0]
        assert executor.expected_growth == third
        quiet = {"followed_plan": True, "staging": {"keep_tail_bytes": third, "tail_kept_bytes": third}}
        # off (the default): the growth stays announced however long it does not come
        for _ in range(2 * tail_module.SETTLE_STEPS):
            assert tail.settle_growth(BudgetStats.from_dict(quiet)) == (False, "")
        assert executor.expected_growth == third
        tail.settle = True
        for _ in range(tail_module.SETTLE_STEPS - 1):
            assert tail.settle_growth(BudgetStats.from_dict(quiet)) == (False, "")
        assert tail.settle_growth(BudgetStats.from_dict({**quiet, "followed_plan": False})) == (False, "")  # restarts
        for _ in range(tail_module.SETTLE_STEPS - 1):
            assert tail.settle_growth(BudgetStats.from_dict(quiet)) == (False, "")
        settled = tail.settle_growth(BudgetStats.from_dict(quiet))
        assert settled == (True, "partial staging: announced growth not needed")
        assert executor.expected_growth == 0 and stager.keep_tail_bytes == third  # the room is back in the plan:
        assert executor.plan.budget_bytes == executor.ledger.budget_bytes - executor.fixed_reserve
        assert tail.settle_growth(BudgetStats.from_dict(quiet)) == (False, ""), "nothing outstanding to give back"
        # the room given back: the next round keeps more, and announces it in full
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=line - third)) == \
            (True, "partial staging")
        assert stager.keep_tail_bytes == 2 * third and executor.expected_growth == third
        # a step that did not keep the tail it was sized for counts for nothing
        short = {"followed_plan": True, "staging": {"keep_tail_bytes": third, "tail_kept_bytes": third}}  # ran before
        for _ in range(2 * tail_module.SETTLE_STEPS):
            assert tail.settle_growth(BudgetStats.from_dict(short)) == (False, "")
        assert executor.expected_growth == third


def test_giving_back_the_tails_growth_trains_exactly_as_without_and_keeps_the_ledger_under_b(env, monkeypatch):

    monkeypatch.setattr(staging, "MIN_TAIL_BYTES", 1 * MiB)
    model, batches = model_and_data()
    batches = batches * 3
    twin = copy.deepcopy(model)
    budget = 320 * MiB
    with make_session(env, budget=Budget(budget, stage_activations=True),
                         partial_staging=True) as lab:
        lab.budget.settle_tail_growth = True
        records = train(lab, model, batches)
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]
    reasons = [r.extra["budget"]["replan_reason"] for r in records]
    assert "partial staging: announced growth not needed" in reasons, reasons
    for r in records:
        b = r.extra["budget"]
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"], b


def test_settling_counts_the_pools_growth_first_and_restarts_after_a_replan_or_a_short_tail(env, monkeypatch):
    from um_lab.schedule.ledger import Ledger
    from um_lab.schedule.live import tail as tail_module

    with tail_sized_by_hand(env, monkeypatch) as (tail, stager, executor, line):
        tail.settle = True
        third = stager.eligible_bytes // 3
        assert tail.keep_more(BudgetStats(followed_plan=True, max_resident_ledger=line - third))[0]
        quiet = {"followed_plan": True, "max_resident_ledger": executor.ledger.budget_bytes,  # no room left
                 "staging": {"keep_tail_bytes": third, "tail_kept_bytes": third}}
        steps = tail_module.SETTLE_STEPS
        for _ in range(steps - 1):
            assert tail.after_step(BudgetStats.from_dict(quiet)) == (False, "")
        assert tail.after_step(BudgetStats.from_dict(quiet), replanned=True) == (False, "")  # re-planned: restarts
        short = {**quiet, "staging": {"keep_tail_bytes": third, "tail_kept_bytes": third // 2}}
        for _ in range(steps - 1):
            assert tail.after_step(BudgetStats.from_dict(quiet)) == (False, "")
        assert tail.after_step(BudgetStats.from_dict(short)) == (False, "")  # half the tail kept: not quiet either
        # the pool grows by half the announcement between two steps: only the other half may be given back
        fixed = [executor.ledger.fixed_bytes]
        monkeypatch.setattr(Ledger, "fixed_bytes", property(lambda self: fixed[0]))
        fixed[0] += third // 2
        tail.after_step(BudgetStats.from_dict(quiet), replanned=True)  # (the session re-plans when its pool grows)
        executor.set_order(executor.plan_order)  # the plan now holds the grown pool (and used that much growth)
        announced_before = executor.expected_growth
        for _ in range(steps):
            replanned, reason = tail.after_step(BudgetStats.from_dict(quiet))
        assert (replanned, reason) == (True, "partial staging: announced growth not needed")
        assert announced_before == third - third // 2 and executor.expected_growth == 0
