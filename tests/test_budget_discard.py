"""Dead gradients are discarded, not copied: the ledger's accounting of discards and of
populating dead blocks, which blocks a plan may discard, that discards only cut link traffic, the
executor's discard calls, and a session whose gradients are garbage between steps trains exactly as
one without a budget (the hooks zero each gradient before its first accumulation)."""

import copy

import pytest
import torch
from fakes import FakeRuntime
from test_budget_executor import World, drive
from test_budget_ledger import layered_order
from test_budget_session import make_session, model_and_data, train

from um_lab.cuda.allocator import Segment
from um_lab.schedule.ledger import BLOCK, Ledger
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.schedule.order import Access, Order
from um_lab.schedule.plan import dead_gradient_blocks, make_plan, new_ledger
from um_lab.types import DataType

MiB = 1 << 20


def far(_block):
    return 0.0


def test_discarding_frees_resident_bytes_without_a_copy_and_bringing_back_populates():
    ledger = Ledger(8 * BLOCK)
    ledger.add_segment(0, 4 * BLOCK)
    ledger.bring_in([0, 1], far)
    ledger.reset_counters()
    moves = ledger.discard([1, 2])  # one resident, one on the host
    assert [m.kind for m in moves] == ["discard"] and moves[0].nbytes == BLOCK
    assert ledger.resident_bytes == BLOCK and ledger.evicted_bytes == 0 and ledger.discarded_bytes == BLOCK
    assert ledger.is_dead(1) and ledger.is_dead(2) and not ledger.is_dead(0)
    assert ledger.discard([1]) == []  # already dead
    moves = ledger.bring_in([1, 2, 3], far)
    assert [(m.kind, m.blocks, m.link_bytes) for m in moves] == [("populate", (1, 2), 0), ("prefetch", (3,), BLOCK)]
    assert ledger.populated_bytes == 2 * BLOCK and ledger.prefetched_bytes == BLOCK  # only block 3 is copied
    assert not ledger.is_dead(1)
    ledger.check()


def gradient_segments(order):
    grads = {s for p in order.positions for s in p.spans(DataType.GRAD)}
    return {ptr for ptr, _ in grads}


def test_a_plan_discards_only_dead_gradient_blocks_and_moves_fewer_bytes():
    order = layered_order()
    footprint = sum(n for _, n in order.segments)
    budget = footprint // 2 // BLOCK * BLOCK
    plain = make_plan(order, budget)
    grads = gradient_segments(order)
    plan = make_plan(order, budget, discard_segments=grads)
    assert plan.steady and plan.max_resident <= budget
    discards = [m for ms in plan.moves for m in ms if m.kind == "discard"]
    assert discards and plan.discarded_bytes > 0
    ledger = new_ledger(order, budget)
    for m in discards:
        assert all(ledger.segment_starts(b) <= grads for b in m.blocks)
    assert plan.evicted_bytes < plain.evicted_bytes
    assert plan.prefetched_bytes + plan.evicted_bytes < plain.prefetched_bytes + plain.evicted_bytes
    # a discarded block is next used by the backward that writes it, never read before
    keys = plan.keys
    for i, ms in enumerate(plan.moves):
        for m in ms:
            if m.kind == "discard":
                j = next(k for k in list(range(i, len(keys))) + list(range(i)) if set(m.blocks) & {
                    b for s in order.positions[k].spans() for b in ledger.blocks([s])})
                assert keys[j][0] == "backward"


def test_blocks_shared_with_other_data_or_outside_gradient_segments_are_never_discarded():
    g, p = (0, 2 * BLOCK), (2 * BLOCK, 2 * BLOCK)
    acc = [Access("forward", "l0", DataType.PARAM, (p,)),
           Access("backward", "l0", DataType.GRAD, (g,)), Access("backward", "l0", DataType.PARAM, (p,)),
           Access("optimizer", "l0", DataType.GRAD, (g,)), Access("optimizer", "l0", DataType.PARAM, (p,))]
    order = Order.from_accesses(acc, [g, p])
    ledger = new_ledger(order, 8 * BLOCK)
    assert sorted(b for bs in dead_gradient_blocks(ledger, order, {0}).values() for b in bs) == [0, 1]
    assert dead_gradient_blocks(ledger, order, set()) == {}  # not a gradient segment: kept
    shared = Order.from_accesses(acc + [Access("forward", "l1", DataType.ACT, ((BLOCK, 64),))], [g, p])
    assert sorted(b for bs in dead_gradient_blocks(new_ledger(shared, 8 * BLOCK), shared, {0}).values()
                  for b in bs) == [0]  # block 1 also holds activations


class DiscardingRuntime(FakeRuntime):
    def __init__(self):
        super().__init__()
        self.discarded = []
        self.populated = []
        self.log = []

    def discard(self, ptr, nbytes, stream):
        self.discarded.append((ptr, nbytes, stream))
        self.log.append(("discard", ptr))

    def discard_and_prefetch(self, ptr, nbytes, device, stream):
        self.populated.append((ptr, nbytes, device, stream))
        self.log.append(("populate", ptr))

    def prefetch(self, ptr, nbytes, location_type, location_id, stream):
        super().prefetch(ptr, nbytes, location_type, location_id, stream)
        self.log.append(("prefetch" if location_type == self.codes.location_device else "evict", ptr))

    def can_discard(self):
        return True


def test_the_executor_discards_on_the_side_stream_after_compute_and_only_gradient_segments():
    order = layered_order()
    grads = gradient_segments(order)
    world = World([])
    world.live = [Segment(ptr, n, DataType.GRAD if ptr in grads else DataType.PARAM) for ptr, n in order.segments]
    runtime = DiscardingRuntime()
    budget = sum(n for _, n in order.segments) // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, RecordingStreams(), world.segments, generation=world.generation,
                        discard_gradients=True)
    ex.refresh_segments()
    ex.set_order(order)
    assert ex.plans_discards
    for _ in range(2):
        stats = drive(ex, order)
    assert stats["discarded_bytes"] > 0 and stats["max_resident_ledger"] <= budget
    assert runtime.discarded and {s for *_, s in runtime.discarded} == {RecordingStreams.SIDE}
    # dead blocks come back by discard-and-prefetch, never by a plain prefetch or a kernel's faults
    assert runtime.populated and {(d, s) for _, _, d, s in runtime.populated} == {(0, RecordingStreams.SIDE)}
    last: dict[int, str] = {}
    for kind, ptr in runtime.log:
        if kind in ("prefetch", "evict"):
            assert last.get(ptr) != "discard", "a discarded range was copied, not populated"
        last[ptr] = kind
    assert all(any(ptr <= p < ptr + n for ptr, n in order.segments if ptr in grads) for p, *_ in runtime.discarded)
    ex.discard_gradients = False  # e.g. the session stopped discarding: planned discards are not carried out
    before = len(runtime.discarded)
    drive(ex, order)
    assert len(runtime.discarded) == before
    ex.close()


@pytest.mark.parametrize("poison", [False, True])
def test_a_session_that_discards_trains_exactly_as_one_without_a_budget(env, poison):
    source, driver, api, _ = env
    runtime = DiscardingRuntime()
    env = (source, driver, api, runtime)
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=48 * MiB, budget_issue="inline", discard_gradients=True) as lab:
        assert lab.budget.executor.discard_gradients
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = []
        for xb, yb in batches:
            x, y = lab.inputs(xb, yb)
            losses.append(lab.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), opt).loss)
            if poison:  # what a discard may leave: any contents at all
                for p in model.parameters():
                    p.grad.fill_(float("nan"))
    with make_session(env) as plain:
        expected = [r.loss for r in train(plain, twin, batches)]
    assert losses == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_step_that_accumulates_gradients_turns_discards_off(env):
    source, driver, api, _ = env
    env = (source, driver, api, DiscardingRuntime())
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=48 * MiB, budget_issue="inline", discard_gradients=True) as lab:
        assert lab.budget.executor.discard_gradients
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        for k, (xb, yb) in enumerate(batches):
            x, y = lab.inputs(xb, yb)
            lab.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), opt, zero_grad=k != 2)
        assert not lab.budget.executor.discard_gradients
    with make_session(env) as plain:
        opt2 = plain.attach(plain.place(twin), torch.optim.AdamW(twin.parameters(), lr=1e-3))
        for k, (xb, yb) in enumerate(batches):
            x, y = plain.inputs(xb, yb)
            plain.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(twin(x), y), opt2, zero_grad=k != 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_discards_are_off_by_default_and_gradients_stay_zeroed_after_each_step(env):
    source, driver, api, _ = env
    env = (source, driver, api, DiscardingRuntime())
    model, batches = model_and_data()
    with make_session(env, budget=48 * MiB) as lab:
        assert not lab.budget.executor.discard_gradients
        train(lab, model, batches[:2])
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def _discarding_env(env):
    source, driver, api, _ = env
    return (source, driver, api, DiscardingRuntime())


def _run(lab_or_plain, model, batches, plan, poison):
    """Train with per-step actions: ``plan(k, model, lab)`` before step k (k = -1: before attach); poison
    the gradients after each step when ``poison`` (what a discard may leave)."""
    lab = lab_or_plain
    plan(-1, model, lab)  # before the model is placed and attached
    opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
    for k, (xb, yb) in enumerate(batches):
        plan(k, model, lab)
        x, y = lab.inputs(xb, yb)
        skip = getattr(model, "skip", None)

        def loss(x=x, y=y, skip=skip):
            h = x
            for i, layer in enumerate(model):
                if i != skip:
                    h = layer(h)
            return torch.nn.functional.cross_entropy(h, y)
        lab.step(loss, opt)
        if poison:  # a plan never discards a frozen parameter's gradient (no backward writes it)
            for p in model.parameters():
                if p.requires_grad:
                    p.grad.fill_(float("nan"))


def _unfreeze_later(k, model, lab):
    if k == -1:
        for p in model[0].parameters():
            p.requires_grad_(False)
    if k == 2:
        for p in model[0].parameters():
            p.requires_grad_(True)


def _skip_a_layer(k, model, lab):
    model.skip = 2 if k == 3 else None


def _second_model(k, model, lab):
    if k == 2:
        lab.place(torch.nn.Linear(8, 8))


@pytest.mark.parametrize("plan", [_unfreeze_later, _skip_a_layer, _second_model])
def test_discarding_trains_exactly_as_without_a_budget_when_the_model_changes_between_steps(env, plan):
    """Review findings of a parameter unfrozen later, a layer skipped in one step, a second model
    placed mid-run: every gradient still reads zero before its step's first accumulation."""
    env = _discarding_env(env)
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=48 * MiB, budget_issue="inline", discard_gradients=True) as lab:
        _run(lab, model, batches, plan, poison=True)
    with make_session(env) as plain:
        _run(plain, twin, batches, plan, poison=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_an_optimizer_interrupted_mid_step_leaves_every_gradient_owed_a_zero(env):
    env = _discarding_env(env)
    model, batches = model_and_data()
    with make_session(env, budget=48 * MiB, budget_issue="inline", discard_gradients=True) as lab:
        opt = lab.attach(lab.place(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
        original, calls = opt.step, []

        def flaky_step(*a, **kw):
            calls.append(1)
            if len(calls) == 12:  # the second step, a few chunks in
                raise KeyboardInterrupt
            return original(*a, **kw)
        opt.step = flaky_step
        for xb, yb in batches:
            x, y = lab.inputs(xb, yb)
            try:
                lab.step(lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y), opt)
            except KeyboardInterrupt:
                pass
            for p in model.parameters():
                p.grad.fill_(float("nan"))
        assert len(calls) > 12
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_gradient_the_optimizer_reads_but_no_backward_writes_is_never_discarded():
    g_live, g_frozen = (0, BLOCK), (BLOCK, BLOCK // 2)  # a frozen parameter's gradient shares block 1
    g_live2 = (BLOCK + BLOCK // 2, BLOCK // 2)
    acc = [Access("backward", "l0", DataType.GRAD, (g_live, g_live2)),
           Access("optimizer", "l0", DataType.GRAD, (g_live, g_live2, g_frozen))]
    order = Order.from_accesses(acc, [(0, 2 * BLOCK)])
    ledger = new_ledger(order, 8 * BLOCK)
    assert sorted(b for bs in dead_gradient_blocks(ledger, order, {0}).values() for b in bs) == [0]
