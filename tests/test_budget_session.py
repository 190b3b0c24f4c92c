"""Session(budget=...) against the fake driver: validation, hooks only with a budget, the
ledger per step, the same training result as without a budget, a failing step leaves it usable."""

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
from fakes import FakeRuntime, new_session

import um_lab
from um_lab import BudgetError, BudgetTooSmall, InputError, UnsupportedOptimizer
from um_lab.cuda.allocator import ManagedPools
from um_lab.cuda.session import Session
from um_lab.schedule.config import Budget
from um_lab.schedule.live.mover import MoveBatch, ThreadMover
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.types import DataType

MiB = 1 << 20
WIDTH = 1024  # a 4 MiB weight per layer


def make_session(env, **kw):
    """A session on the fake driver; keywords other than Session's are experimental options."""
    source, driver, api, runtime = env
    return new_session("um-default", _pool_api=api, _runtime=runtime, _source=source, **kw)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(6)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(256, WIDTH, generator=g), torch.randint(0, 10, (256,), generator=g)) for _ in range(5)]
    return model, batches


def train(lab, model, batches):
    opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
    records = []
    for xb, yb in batches:
        x, y = lab.inputs(xb, yb)
        records.append(lab.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), opt))
        if lab.budget is not None:
            lab.budget.executor.ledger.check_accounting()
    return records


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, "8 apples", "0.5x"])
def test_a_bad_budget_is_refused_when_the_session_is_built(env, bad):
    with pytest.raises(BudgetError):
        make_session(env, budget=bad)
    with pytest.raises(BudgetError):
        make_session(env, budget=Budget(64 * MiB, lookahead=-1))
    with pytest.raises(InputError, match="budget_issue"):
        make_session(env, budget=64 * MiB, budget_issue="sometimes")


def test_a_budget_above_the_cap_is_refused_at_open_and_nothing_stays_open(env):
    lab = make_session(env, budget=2 << 30, cap_bytes=1 << 30)
    with pytest.raises(BudgetError, match="above the safety cap"):
        lab.open()
    assert not lab.is_open
    with make_session(env, budget=1 << 30, cap_bytes=1 << 30) as ok:  # another may open
        assert ok.budget is not None and ok.budget.budget_bytes == 1 << 30


def test_without_a_budget_no_hooks_are_installed_and_records_have_no_budget(env):
    model, batches = model_and_data()
    with make_session(env) as lab:
        records = train(lab, model, batches[:2])
        assert lab.budget is None
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all("budget" not in r.extra for r in records)


@pytest.mark.parametrize("issue", ["thread", "inline"])
def test_budget_steps_keep_the_ledger_under_b_plus_unforeseen_writes_and_train_exactly_as_without(env, issue):
    source, driver, api, runtime = env
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    budget = 48 * MiB  # the model, gradients and AdamW state alone are ~120 MiB
    with make_session(env, budget=budget, budget_issue=issue) as lab:
        records = train(lab, model, batches)
        assert all(m._forward_pre_hooks for m in model.modules() if not list(m.children()))
        ledger = lab.budget.executor.ledger
        assert ledger.total_bytes > 2 * budget
        assert api.balanced()
    assert all(not m._forward_pre_hooks for m in model.modules())  # hooks off at close
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(model.parameters(), twin.parameters(), strict=True))

    budgets = [r.extra["budget"] for r in records]
    assert not budgets[0]["planned"] and budgets[0]["replanned"]  # the first step learns the order
    for b in budgets[1:]:
        assert b["planned"] and b["followed_plan"] and b["unplanned_positions"] == 0
        assert b["prefetched_bytes"] > 0 and b["evicted_bytes"] > 0 and b["ahead_bytes"] > 0
    for b in budgets[1:]:
        # the scheduler's own moves never pass B; only kernels writing blocks the plan did not foresee can
        # (here: CPU tensors get new addresses every step; a GPU's caching allocator repeats them, and the
        # executor test on a fixed order shows no overshoot at all), and the record says so
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"]
        assert b["over_budget"] == (b["max_resident_ledger"] > budget)
    assert all(b["budget_bytes"] == budget for b in budgets)
    # every prefetch went on the side stream and matches a ledger move
    assert runtime.prefetched and {s for *_, s in runtime.prefetched} == {RecordingStreams.SIDE}


def test_a_layer_that_cannot_fit_is_refused_at_attach_before_any_step(env):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048))  # 16 MiB of weights + 16 MiB of gradients
    with make_session(env, budget=24 * MiB) as lab:
        lab.place(model)
        with pytest.raises(BudgetTooSmall) as info:
            lab.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert info.value.needed >= 32 * MiB and info.value.budget == 24 * MiB


def test_an_optimizer_state_too_big_for_b_is_refused_before_the_second_step_runs(env):
    torch.manual_seed(0)
    # 16 MiB weights: a layer's backward needs its weight and gradient (32-36 MiB in whole 2 MiB blocks, as
    # the tensors' CPU addresses fall) and its AdamW step 64-72 MiB: a budget of 48 MiB fits one, never the
    # other, wherever the allocator puts the tensors (with 4 MiB weights the two ranges overlapped)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    x = torch.randn(8, 2048)
    with make_session(env, budget=48 * MiB) as lab:
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        lab.step(lambda: model(x).sum(), opt)  # learns: a layer's AdamW step needs ~64 MiB at once
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(BudgetTooSmall, match="optimizer of"):
            lab.step(lambda: model(x).sum(), opt)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # nothing ran


def test_an_interrupted_budget_step_leaves_the_session_usable(env):
    source, driver, api, runtime = env
    model, batches = model_and_data()
    with make_session(env, budget=48 * MiB) as lab:
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = lab.inputs(*batches[0])
        lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt)

        def interrupted():
            model[0](x)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            lab.step(interrupted, opt)
        recorder = lab.budget.recorder
        assert not recorder.active and api.balanced() and lab._pools.active_routes == {}
        with pytest.raises(RuntimeError, match="bad hook"):  # and a failure inside backward
            def bad_backward():
                h = model[0](x)
                h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("bad hook")))
                return torch.nn.functional.cross_entropy(model[1:](h), y)
            lab.step(bad_backward, opt)
        assert not recorder.active and api.balanced()
        for _ in range(2):
            rec = lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt)
        assert rec.extra["budget"]["unplanned_positions"] == 0
        lab.budget.executor.ledger.check_accounting()
    assert api.balanced()


class SlowRuntime(FakeRuntime):
    """A fake runtime whose prefetch calls take a while and are logged beside the pools' close."""

    def __init__(self, events, delay=0.05):
        super().__init__()
        self.events, self.delay = events, delay

    def prefetch(self, ptr, nbytes, location_type, location_id, stream):
        time.sleep(self.delay)
        super().prefetch(ptr, nbytes, location_type, location_id, stream)
        self.events.append("prefetch")


def test_close_issues_every_queued_prefetch_before_the_pools_free_their_segments(env, monkeypatch):
    source, driver, api, _ = env
    events = []
    real_close = ManagedPools.close

    def close(pools):
        events.append("pools.close")
        real_close(pools)

    monkeypatch.setattr(ManagedPools, "close", close)
    model, batches = model_and_data()
    lab = Session("um-default", _pool_api=api, _runtime=SlowRuntime(events, delay=0.0), _source=source,
                  budget=48 * MiB)
    with lab:
        train(lab, model, batches[:2])
        executor = lab.budget.executor
        executor.runtime.delay = 0.05
        streams = executor.streams
        # prefetches still queued on the mover thread when the session closes (a look-ahead past the step)
        executor.mover.submit(MoveBatch(None, [(1 << 40, 4096, 0, 0)] * 4, record=False))
    assert events[-1] == "pools.close" and events.count("prefetch") >= 4
    assert streams.log[-1] == ("synchronize_side", 0)  # and the side stream finished before anything was freed


def test_a_failing_budget_close_still_closes_the_session_and_another_may_open(env, monkeypatch):
    source, driver, api, runtime = env
    model, batches = model_and_data()
    lab = make_session(env, budget=48 * MiB)
    lab.open()
    train(lab, model, batches[:1])
    executor = lab.budget.executor

    def broken_close():
        raise RuntimeError("mover broke")

    monkeypatch.setattr(executor, "close", broken_close)
    with pytest.raises(RuntimeError, match="mover broke"):
        lab.close()
    assert not lab.is_open and Session._open_session is None and api.balanced()
    assert all(not m._forward_pre_hooks for m in model.modules())
    with make_session(env, budget=48 * MiB) as again:
        assert again.is_open


def test_a_mover_that_does_not_stop_in_time_is_reported():
    release = threading.Event()

    class Stuck(FakeRuntime):
        def prefetch(self, *args):
            release.wait(10)
            super().prefetch(*args)

    mover = ThreadMover(Stuck(), RecordingStreams())
    mover.submit(MoveBatch(None, [(1 << 40, 4096, 0, 0)], record=False))
    with pytest.warns(RuntimeWarning, match="did not stop"):
        assert not mover.close(timeout=0.1)
    release.set()
    assert mover.close()


def test_closing_drops_the_models_and_parameters_the_budget_held(env):
    model, batches = model_and_data()
    with make_session(env, budget=48 * MiB, evacuate_on_close=False) as lab:
        train(lab, model, batches[:1])
        control = lab.budget
    assert control._roots == [] and control._chunks == {} and control.recorder is None
    ref = weakref.ref(model[0][0].weight)
    del model, lab
    gc.collect()
    assert ref() is None  # nothing of the budget keeps a parameter (and its managed segment) alive


def test_a_budget_session_refuses_an_unsupported_optimizer_at_attach(env):
    model, _ = model_and_data()
    with make_session(env, budget=48 * MiB) as lab:
        with pytest.raises(UnsupportedOptimizer, match="Adagrad"):
            lab.attach(model, torch.optim.Adagrad(model.parameters()))
        assert model not in lab._modules  # refused before anything was placed
    with make_session(env) as plain:  # without a budget any optimizer goes
        plain.attach(model, torch.optim.Adagrad(model.parameters()))


@pytest.mark.parametrize("budget", [None, 48 * MiB])
def test_a_closed_session_still_referenced_holds_no_parameter(env, budget):
    """bench/budget.py keeps its session object after close() and checks the managed bytes left: the
    session's cached parameter list once kept every parameter and gradient segment alive there."""
    model, batches = model_and_data()
    lab = make_session(env, budget=budget, evacuate_on_close=False)
    with lab:
        train(lab, model, batches[:2])
    ref = weakref.ref(model[0][0].weight)
    del model
    gc.collect()
    assert ref() is None and not lab.is_open


@pytest.mark.parametrize("host_advice", [True, False])
def test_a_budget_session_advises_its_pools_to_prefer_the_host_unless_told_not_to(env, host_advice):
    """budget_host_advice (the default): every pool of a type the policy leaves unadvised prefers the host and
    is mapped for the GPU, so only the scheduler's prefetches make data resident (a new policy too); off, and
    without a budget, um-default advises nothing. The session's own policy stays the user's."""
    model, batches = model_and_data()
    with make_session(env, budget=48 * MiB, host_advice=host_advice) as lab:
        records = train(lab, model, batches[:2])
        assert all(r.extra["budget"]["host_advice"] is host_advice for r in records)  # what the pools got
        for policy in (lab._pools.policy, None):
            if policy is None:
                lab.set_policy(um_lab.Policy("mine", {"param": um_lab.Advice(preferred_location="gpu")}))
                policy = lab._pools.policy
                assert policy[DataType.PARAM].preferred_location == "gpu"  # the policy's own advice is kept
            for t in (DataType.GRAD, DataType.OPTIM, DataType.ACT, DataType.INPUT):
                if host_advice:
                    assert policy[t].preferred_location == "cpu" and policy[t].accessed_by == {"gpu"}
                else:
                    assert policy[t].is_default
        assert lab.policy[DataType.ACT].is_default  # the user's policy, unchanged


def test_a_session_without_a_budget_gives_no_host_advice(env):
    model, batches = model_and_data()
    with make_session(env) as lab:
        train(lab, model, batches[:1])
        assert lab._pools.policy is lab.policy and all(lab._pools.policy[t].is_default for t in DataType)


def test_the_optimizer_is_stepped_in_chunks_of_consecutive_layers_up_to_a_64th_of_b(env):
    model, batches = model_and_data()
    budget = 1 << 30  # chunks of at most 16 MiB of parameters: three of the 4 MiB layers (and their biases; the
    # last, 40 KiB, joins the second)
    with make_session(env, budget=budget) as lab:
        records = train(lab, model, batches[:2])
        order = lab.budget.last_order
        assert [p.layer for p in order.positions if p.phase == "optimizer"] == ["0.0..2.0", "3.0..6"]
    assert all(not r.extra["budget"]["over_budget"] for r in records)



def test_an_idle_scheduler_steps_without_its_work_and_wakes_when_a_model_is_placed(env, monkeypatch):
    """Once a step ran under the scheduler and everything the session holds fits B, steps run without its
    positions or moves; the pools get the policy's own advice and those it had advised to the host come to the
    GPU; training is exactly as without a budget; placing a model wakes it, with its advice back."""
    source, driver, api, runtime = env
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=8 << 30) as lab:  # far above the ~150 MiB the model, its state and data hold
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert not lab.budget.can_idle()  # no step has shown what a step allocates
        records, asked = [], []
        monkeypatch.setattr(lab._pools, "prefetch", lambda t, where, asked=asked: asked.append((t, where)) or 0)
        for xb, yb in batches:
            x, y = lab.inputs(xb, yb)
            records.append(lab.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), opt))
        budgets = [r.extra["budget"] for r in records]
        assert [b.get("idle", False) for b in budgets] == [False, True, True, True, True]
        assert budgets[0]["positions"] > 0 and budgets[0]["held_bytes"] > 0
        for b in budgets[1:]:
            assert b["prefetched_bytes"] == 0 and b["positions"] == 0 and not b["over_budget"]
            assert b["max_resident_ledger"] == b["held_bytes"] == lab.budget.held_bytes() > 0
        assert all(lab._pools.policy[t].is_default for t in DataType)  # the policy's own advice while idle
        assert sorted(asked) == sorted((t, "gpu") for t in DataType)  # um-default advises none: all were on the host
        big = torch.nn.Linear(64, 64)
        opt2 = lab.attach(lab.place(big), torch.optim.AdamW(big.parameters(), lr=1e-3))
        assert not lab.budget.idle and not lab.budget.can_idle()  # placing a model wakes it
        assert lab._pools.policy[DataType.GRAD].preferred_location == "cpu"  # the budget's advice is back
        x = lab.inputs(torch.randn(4, 64))
        woke = lab.step(lambda: big(x).square().mean(), opt2).extra["budget"]
        assert not woke.get("idle", False) and woke["positions"] > 0
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]


def test_an_idle_step_whose_pools_passed_b_wakes_the_scheduler(env, monkeypatch):
    model, batches = model_and_data()
    with make_session(env, budget=8 << 30) as lab:
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = lab.inputs(*batches[0])
        lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt)
        held = iter([MiB, 16 << 30])  # under B before the step, past it after (the pools grew during it)
        monkeypatch.setattr(lab.budget, "held_bytes", lambda: next(held))
        b = lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt).extra["budget"]
        assert b["idle"] and b["over_budget"]
        assert not lab.budget.idle and lab.budget.executor.residency_unknown
        assert lab._pools.policy[DataType.GRAD].preferred_location == "cpu"


def test_a_scheduled_step_records_the_host_time_of_all_its_hooks_and_an_idle_step_none(env):
    model, batches = model_and_data()
    with make_session(env, budget=Budget(64 * MiB)) as lab:  # too small for the model: the scheduler moves data
        scheduled = [r.budget for r in train(lab, model, batches)]
    with make_session(env, budget=Budget(1 << 30)) as lab:  # everything fits: idle after the first step
        roomy = [r.budget for r in train(lab, *model_and_data(1))]
    assert not any(n.extra.get("idle") for n in scheduled) and all(n.extra.get("idle") for n in roomy[1:])
    for numbers in scheduled + roomy[:1]:  # the recorder's hooks enclose the executor's work
        assert numbers.hooks_ms >= numbers.executor_ms > 0
    assert all(numbers.hooks_ms == 0 for numbers in roomy[1:])
