"""Orders recorded by hooks on the CPU (an MLP, a small GPT-2, a CNN), planned under budgets, and the
executor replaying a plan: never above B, every byte accounted, evictions in the planned order."""

import copy
import functools

import pytest
import torch
from fakes import FakeRuntime
from test_budget_ledger import replay

from um_lab import BudgetError, BudgetTooSmall, UnsupportedOptimizer
from um_lab.schedule.ledger import BLOCK
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.record import StepRecorder, join_chunks, optimizer_chunks, step_optimizer_in_chunks
from um_lab.schedule.live.streams import RecordingStreams
from um_lab.schedule.order import Order
from um_lab.schedule.plan import make_plan
from um_lab.types import DataType

MiB = 1 << 20


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU())
                                  for _ in range(4)], torch.nn.Linear(1024, 10))
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    return model, lambda: torch.nn.functional.cross_entropy(model(x), y)


def cnn():
    torch.manual_seed(0)
    c = 64
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(2 * c, 10))
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return model, lambda: torch.nn.functional.cross_entropy(model(x), y)


def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4000, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 4000, (4, 128))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def record(build, steps=2):
    """Train ``steps`` steps with hooks on; the last step's order (and the model, optimizer)."""
    model, loss_fn = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = StepRecorder([model])
    recorder.install()
    for _ in range(steps):
        with recorder.recording():
            loss = loss_fn()
        with recorder.backward():
            loss.backward()
        recorder.active = True
        step_optimizer_in_chunks(opt, optimizer_chunks([model], opt),
                                 before_chunk=lambda n, p: recorder.optimizer_position(n, p, opt))
        recorder.active = False
    recorder.remove()
    return recorder.order, model, opt


BUILDS = {"mlp": mlp, "cnn": cnn, "gpt2": gpt2}


@functools.cache
def recorded(name):
    """One recording per model for the whole module (each takes seconds on the CPU)."""
    return record(BUILDS[name])


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_recorded_order_has_forward_backward_reversed_and_one_optimizer_position_per_layer(name):
    order, model, opt = recorded(name)
    phases = [p.phase for p in order.positions]
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)  # three phases, in order
    fwd = [p.layer for p in order.positions if p.phase == "forward"]
    bwd = [p.layer for p in order.positions if p.phase == "backward"]
    seen, with_params = set(), []  # modules owning parameters not seen before (tied weights count once)
    for n, m in model.named_modules():
        new = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in new)
        if new:
            with_params.append(n)
    assert [n for n in fwd if n in with_params][0] == with_params[0]
    assert set(bwd) <= set(fwd) and bwd[0] == [n for n in fwd if n in bwd][-1]  # backward starts at the end
    opt_layers = [p.layer for p in order.positions if p.phase == "optimizer"]
    assert sorted(opt_layers) == sorted(with_params)
    for p in order.positions:
        if p.phase == "optimizer":  # step 2: parameters, gradients and the AdamW state are all recorded
            assert p.spans(DataType.PARAM) and p.spans(DataType.GRAD) and p.spans(DataType.OPTIM)
    assert sum(len(p.spans(DataType.ACT)) for p in order.positions if p.phase == "backward") > 0


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("ratio", [1.5, 2, 3])
def test_plans_of_recorded_orders_never_exceed_the_budget(name, ratio):
    order, _, _ = recorded(name)
    footprint = sum(n for _, n in order.managed_segments())
    first = make_plan(order, footprint)
    budget = max(int(footprint / ratio) // BLOCK * BLOCK, first.largest_working_set)
    plan = make_plan(order, budget)
    assert plan.footprint_bytes == footprint and plan.max_resident <= budget
    if budget < footprint:
        assert plan.evicted_bytes > 0
    replay(plan, order)  # every position resident when it runs, never above B, all bytes accounted


def test_a_budget_below_the_largest_layer_of_a_recorded_order_is_refused():
    order, _, _ = recorded("gpt2")
    largest = make_plan(order, 1 << 40).largest_working_set
    with pytest.raises(BudgetTooSmall) as info:
        make_plan(order, largest - BLOCK)
    assert info.value.needed == largest


def train_chunked_and_full(make_optimizer, batch=256, max_bytes=None):
    """Three steps of an MLP with the optimizer stepped in per-layer chunks (joined up to ``max_bytes``), and of
    its twin in one step."""
    model, _ = mlp()
    twin = copy.deepcopy(model)
    x, y = torch.randn(batch, 1024), torch.randint(0, 10, (batch,))
    chunked, full = make_optimizer(model.parameters()), make_optimizer(twin.parameters())
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step_optimizer_in_chunks(chunked, optimizer_chunks([model], chunked, max_bytes=max_bytes))
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        full.step()
        full.zero_grad(set_to_none=False)
    return model, twin, chunked


def test_chunked_optimizer_step_equals_one_full_step():
    model, twin, chunked = train_chunked_and_full(lambda params: torch.optim.AdamW(params, lr=1e-2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    assert chunked.param_groups[0]["params"] == list(model.parameters())  # groups restored
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())  # zeroed in place
    assert len(optimizer_chunks([model], chunked)) == 5  # one per Linear


LINEAR_BYTES = (1024 * 1024 + 1024) * 4  # one of the MLP's hidden Linears


def test_joined_chunks_hold_at_most_max_bytes_in_module_order_and_step_like_one_full_step():
    model, twin, chunked = train_chunked_and_full(lambda params: torch.optim.AdamW(params, lr=1e-2),
                                                  max_bytes=2 * LINEAR_BYTES)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    chunks = optimizer_chunks([model], chunked, max_bytes=2 * LINEAR_BYTES)
    assert [name for name, _ in chunks] == ["0.0..1.0", "2.0..3.0", "4"]
    assert [p for _, params in chunks for p in params] == list(model.parameters())
    alone = optimizer_chunks([model], chunked, max_bytes=LINEAR_BYTES - 1)  # each Linear is larger: stays alone
    assert [name for name, _ in alone] == ["0.0", "1.0", "2.0", "3.0", "4"]
    assert len(optimizer_chunks([model], chunked, max_bytes=1 << 40)) == 1
    with pytest.raises(ValueError, match="positive"):
        join_chunks(chunks, 0)


def drive(executor, order):
    """Feed an order's positions to the executor as the hooks would."""
    executor.begin_step()
    for i, position in enumerate(order.positions):
        executor.enter(i, position)
    return executor.end_step()


def test_executor_replays_the_plan_evictions_in_order_on_the_side_stream():
    order, _, _ = recorded("mlp")
    footprint = sum(n for _, n in order.managed_segments())
    order = Order(order.positions, order.managed_segments())
    runtime, streams = FakeRuntime(), RecordingStreams()
    budget = footprint // 2 // BLOCK * BLOCK
    ex = BudgetExecutor(budget, runtime, 0, streams, lambda: [], cover_unknown=True)
    for ptr, size in order.segments:
        ex.ledger.add_segment(ptr, size)
    learning = drive(ex, order)
    assert not learning["planned"] and learning["unplanned_positions"] == len(order.positions)
    plan = ex.set_order(order)
    for _ in range(2):
        runtime.prefetched.clear()
        stats = drive(ex, order)
        assert stats["followed_plan"] and stats["unplanned_positions"] == 0
        assert stats["max_resident_ledger"] <= budget and not stats["over_budget"]
        ex.ledger.check()
    # the second planned step is the steady state: it issues exactly the plan's moves, in order
    assert stats["realign_bytes"] == 0
    issued = [m for m in ex.ledger.moves if m.kind != "touch"]
    planned = [m for ms in plan.moves for m in ms]
    assert [(m.kind, m.spans) for m in issued] == [(m.kind, m.spans) for m in planned]
    assert [m.blocks for m in issued if m.kind == "evict"] == [m.blocks for m in plan.evictions()]
    calls = [(ptr, n, "gpu" if loc == runtime.codes.location_device else "host")
             for ptr, n, loc, _, _ in runtime.prefetched]
    expected = [(p, n, "gpu" if m.kind == "prefetch" else "host") for m in planned for p, n in m.spans]
    assert calls == expected and {s for *_, s in runtime.prefetched} == {RecordingStreams.SIDE}
    assert stats["prefetched_bytes"] == plan.prefetched_bytes and stats["evicted_bytes"] == plan.evicted_bytes


def test_executor_orders_evictions_after_compute_and_compute_after_prefetch():
    order, _, _ = recorded("mlp")
    order = Order(order.positions, order.managed_segments())
    streams = RecordingStreams()
    footprint = sum(n for _, n in order.segments)
    ex = BudgetExecutor(footprint // 3 // BLOCK * BLOCK, FakeRuntime(), 0, streams, lambda: [], cover_unknown=True)
    for ptr, size in order.segments:
        ex.ledger.add_segment(ptr, size)
    drive(ex, order)
    ex.set_order(order)
    streams.log.clear()
    drive(ex, order)
    log = streams.log
    for i, (call, ev) in enumerate(log):
        if call == "side_wait":  # each eviction batch waits for an event just recorded on the compute stream
            assert log[i - 1] == ("record_compute", ev)
        if call == "compute_wait":  # compute waits only for events recorded on the side stream
            assert ("record_side", ev) in log[:i]
    assert any(c == "compute_wait" for c, _ in log) and any(c == "side_wait" for c, _ in log)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_every_tensor_saved_for_backward_is_in_a_backward_position(name):
    model, loss_fn = BUILDS[name]()
    recorder = StepRecorder([model])
    recorder.install()
    saved = []
    pack = recorder._pack

    def counting_pack(t):
        saved.append(t)
        return pack(t)

    recorder._pack = counting_pack
    with recorder.recording():
        loss = loss_fn()
    with recorder.backward():
        loss.backward()
    recorder.remove()
    order = recorder.order
    spans = {(t.data_ptr(), t.numel() * t.element_size()) for t in saved if t.numel() and t.is_contiguous()}
    backward = {s for p in order.positions if p.phase == "backward" for s in p.spans()}
    assert spans and spans <= backward
    keys = order.keys()
    if name != "gpt2":  # the loss is computed outside the model: its position opens backward
        assert ("forward", "(step)") in keys and [k for k in keys if k[0] == "backward"][0] == ("backward", "(step)")
    else:  # attention's own ops (no parameters of its own) are attributed to the attention module
        attn = [p for p in order.positions if p.layer == "transformer.h.0.attn"]
        assert [p.phase for p in attn].count("forward") >= 2 and any(p.spans(DataType.ACT) for p in attn)


def test_a_lookahead_past_the_step_end_is_waited_for_in_the_next_step_not_at_once():
    from test_budget_ledger import layered_order

    order = layered_order(layers=4, param_blocks=2, act_blocks=1)
    footprint = sum(n for _, n in order.segments)
    streams = RecordingStreams()
    ex = BudgetExecutor(footprint // 2 // BLOCK * BLOCK, FakeRuntime(), 0, streams, lambda: [], cover_unknown=True)
    for ptr, size in order.segments:
        ex.ledger.add_segment(ptr, size)
    drive(ex, order)
    plan = ex.set_order(order)
    wrapped = [m for i, ms in enumerate(plan.moves) for m in ms if m.kind == "prefetch" and m.target < i]
    assert wrapped  # the plan prefetches the next step's first positions during this step's last ones
    drive(ex, order)
    carried = [batch.side_event for batch in ex._next_pending.values()]
    assert carried and all(("compute_wait", ev) not in streams.log for ev in carried)
    drive(ex, order)
    assert all(("compute_wait", ev) in streams.log for ev in carried)


def test_the_mover_thread_issues_the_same_calls_in_the_same_order_as_inline():
    from um_lab.schedule.live.mover import ThreadMover

    order, _, _ = recorded("mlp")
    order = Order(order.positions, order.managed_segments())
    budget = sum(n for _, n in order.segments) // 3 // BLOCK * BLOCK
    calls = []
    for threaded in (False, True):
        runtime, streams = FakeRuntime(), RecordingStreams()
        mover = ThreadMover(runtime, streams) if threaded else None
        ex = BudgetExecutor(budget, runtime, 0, streams, lambda: [], cover_unknown=True, mover=mover)
        for ptr, size in order.segments:
            ex.ledger.add_segment(ptr, size)
        drive(ex, order)
        ex.set_order(order)
        for _ in range(2):
            stats = drive(ex, order)
        ex.mover.drain()
        ex.close()
        assert stats["max_resident_ledger"] <= budget
        calls.append(list(runtime.prefetched))
        if threaded:  # every compute wait names an event the mover recorded on the side stream first
            log = streams.log
            assert all(("record_side", ev) in log[:i] for i, (c, ev) in enumerate(log) if c == "compute_wait")
    assert calls[0] == calls[1] and calls[0]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adam-foreach-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, weight_decay=1e-2),
    "adamw-wd": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_allowed_optimizer_steps_in_chunks_exactly_as_in_one_step(name):
    model, twin, _ = train_chunked_and_full(OPTIMIZERS[name], batch=64)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


class MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adagrad(ps), lambda ps: torch.optim.LBFGS(ps),
                                  lambda ps: MyAdam(ps)], ids=["adagrad", "lbfgs", "adam-subclass"])
def test_other_optimizers_are_refused_by_name_before_anything_steps(make):
    model, _ = mlp()
    optimizer = make(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedOptimizer, match="SGD, torch.optim.Adam, torch.optim.AdamW") as info:
        step_optimizer_in_chunks(optimizer, optimizer_chunks([model], optimizer))
    assert isinstance(info.value, BudgetError) and type(optimizer).__name__ in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_steps_budget_numbers_read_back_typed_from_its_record():
    from um_lab.schedule.stats import BudgetStats
    from um_lab.types import StepRecord

    numbers = {"budget_bytes": 64 << 20, "max_resident_ledger": 60 << 20, "prefetched_bytes": 5 << 20,
               "followed_plan": True, "staging": {"staged_bytes": 3 << 20, "tail_kept_bytes": 1 << 20},
               "plan": {"moves": 4}}
    blank = {"live_bytes": {}, "cap_bytes": 1 << 30, "gpu_capacity_bytes": 1 << 30}
    record = StepRecord(step=3, wall_ms=1.0, extra={"budget": numbers}, **blank)
    stats = record.budget
    assert isinstance(stats, BudgetStats) and stats.followed_plan and stats.prefetched_bytes == 5 << 20
    assert stats.staged_bytes == 3 << 20 and stats.tail_kept_bytes == 1 << 20 and stats.extra == {"plan": {"moves": 4}}
    assert BudgetStats.from_dict(stats.to_dict()) == stats  # the run log's JSON round trip
    assert StepRecord(step=0, wall_ms=1.0, **blank).budget is None
