"""Remote optimizer state copied to the device for its chunk's step and back (um_lab.schedule.live.remote_state): the
step's result is the in-place one bit for bit, the state dict holds the original tensors after every exit,
and a session with staged activations and remote state copies it and trains exactly as without a budget."""

import copy
from types import SimpleNamespace

import pytest
import torch
from test_budget_session import make_session, model_and_data, train

from um_lab.schedule.config import Budget
from um_lab.schedule.live import control
from um_lab.schedule.live.pinned import CpuCopyOps
from um_lab.schedule.live.record import optimizer_chunks, step_optimizer_in_chunks
from um_lab.schedule.live.remote_state import (
    SLOTS,
    CopySlots,
    LinkCosts,
    RemoteStateCopies,
    chunk_state_bytes,
    link_cost_ms,
    worth_copying,
)

MiB = 1 << 20


def trained_mlp(seed=0):
    """An MLP and its AdamW after one step (state created), and a batch."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, x, y


def remote_of(opt, keys=("exp_avg_sq",), layers=(0, 2)):
    """A predicate marking some state tensors remote (``keys`` of the parameters of ``layers``' chunks)."""
    chosen = {id(opt.state[p][k]) for i, p in enumerate(opt.param_groups[0]["params"]) if i // 2 in layers
              for k in keys}
    return lambda t: id(t) in chosen, chosen


def copies_for(opt, model, is_remote, slot_bytes=None):
    chunks = [p for _, p in optimizer_chunks([model], opt)]
    size = chunk_state_bytes(opt, chunks) if slot_bytes is None else slot_bytes
    slots = CopySlots(size, lambda n: torch.empty(n, dtype=torch.uint8))
    return RemoteStateCopies(opt, chunks, is_remote, CpuCopyOps(), CpuCopyOps(), slots)


@pytest.mark.parametrize("slot_bytes", [None, 1024])  # sized to the largest chunk; too small: in place
def test_copied_remote_state_steps_bit_for_bit_like_in_place_and_the_originals_stay_in_the_state(slot_bytes):
    model, opt, x, y = trained_mlp()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors (load_state_dict keeps them)
    is_remote, chosen = remote_of(opt)
    originals = {id(v): v for s in opt.state.values() for v in s.values() if id(v) in chosen}
    for _ in range(2):
        for m, o, copier in ((model, opt, True), (twin, twin_opt, False)):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            copies = copies_for(o, m, is_remote, slot_bytes) if copier else None
            step_optimizer_in_chunks(o, optimizer_chunks([m], o), around_step=copies.around_step if copies else None)
            if copies is not None:
                stats = copies.finish()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert all(torch.equal(opt.state[p][k], twin_opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))
    now = {id(v) for s in opt.state.values() for v in s.values()}
    assert set(originals) <= now  # the same tensors, updated in place
    remote_bytes = sum(v.numel() * v.element_size() for v in originals.values())
    if slot_bytes is None:
        assert stats["tensors"] == len(originals) == 4 and stats["bytes_in"] == stats["bytes_out"] == remote_bytes
        assert stats["in_place_tensors"] == 0 and stats["slot_bytes"] == SLOTS * chunk_state_bytes(
            opt, [p for _, p in optimizer_chunks([model], opt)])
    else:
        assert stats["tensors"] == stats["bytes_in"] == 0 and stats["in_place_tensors"] == 4


def test_the_largest_chunks_state_sizes_a_slot():
    model, opt, _, _ = trained_mlp()
    chunks = [p for _, p in optimizer_chunks([model], opt)]
    linear = (64 * 64 + 64) * 4  # one hidden Linear's parameters: AdamW keeps two such tensors of state
    assert chunk_state_bytes(opt, chunks) == 2 * (-(-64 * 64 * 4 // 512) * 512 + 512) == 2 * linear + 2 * (512 - 256)


def test_a_step_that_fails_leaves_the_original_state_unchanged_and_issues_no_copy_back():
    model, opt, x, y = trained_mlp()
    is_remote, chosen = remote_of(opt, layers=(0,))
    before = {id(v): v.clone() for s in opt.state.values() for v in s.values() if id(v) in chosen}
    torch.nn.functional.cross_entropy(model(x), y).backward()
    chunks = optimizer_chunks([model], opt)
    copies = copies_for(opt, model, is_remote)
    params = chunks[0][1]
    with pytest.raises(RuntimeError, match="boom"), copies.around_step(0, params):
        swapped = [opt.state[p]["exp_avg_sq"] for p in params]
        assert not {id(t) for t in swapped} & chosen  # device temporaries while the chunk steps
        for t in swapped:
            t.add_(1.0)  # a partial update, then the failure
        raise RuntimeError("boom")
    copies.abort()
    after = {id(v): v for s in opt.state.values() for v in s.values() if id(v) in chosen}
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert copies.stats.bytes_out == 0


def test_a_chunk_without_remote_state_is_stepped_in_place():
    model, opt, x, y = trained_mlp()
    copies = copies_for(opt, model, lambda t: False)
    state_ids = {id(v) for s in opt.state.values() for v in s.values()}
    with copies.around_step(0, [p for _, p in optimizer_chunks([model], opt)][0]):
        assert {id(v) for s in opt.state.values() for v in s.values()} == state_ids
    assert copies.finish()["tensors"] == 0


def test_a_session_copies_remote_state_with_staged_activations_and_trains_exactly_as_without_a_budget(env,
                                                                                                     monkeypatch):
    # the fake driver's tensors take new addresses every step, so its plans move data whatever the room: the
    # slots would always cost moves here; taken as worth it (the decision itself: test_worth_copying_...)
    monkeypatch.setattr(control, "worth_copying", lambda in_place, copying, costs: True)
    model, batches = model_and_data()
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    budget = 96 * MiB  # the model, gradients and AdamW state are ~120 MiB: some state stays remote, slots fit
    with make_session(env, budget=Budget(budget, stage_activations=True)) as lab:
        lab.budget.copy_remote_state = True  # experimental, off by default
        records = train(lab, model, batches)
        slot = lab.budget._slot_bytes
    with make_session(env, budget=Budget(budget, stage_activations=True)) as lab:
        assert lab.budget.copy_remote_state is False  # the default
        in_place = train(lab, third, batches)
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected] == [r.loss for r in in_place]
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    # the slots are announced to the plan (room left for them) at the end of the first step that made state
    # remote (which step that is depends on the CPU heap's addresses); every step after it copies
    reasons = [r.extra["budget"]["replan_reason"] for r in records]
    announced = next(i for i, why in enumerate(reasons) if why.endswith("remote copies"))
    assert announced < len(records) - 2, reasons
    assert slot >= 8 * MiB and slot % (2 * MiB) == 0  # the largest chunk's AdamW state (a 4 MiB layer), in blocks
    late = [r.extra["budget"] for r in records[announced + 1:]]
    assert all(b["remote_bytes"] > 0 and b["remote_copies"]["bytes_in"] == b["remote_copies"]["bytes_out"] > 0
               and b["remote_copies"]["slot_bytes"] == SLOTS * slot for b in late)
    assert all("remote_copies" not in r.extra["budget"] for r in in_place)


@pytest.mark.parametrize("budget_mib, worth", [(48, True), (96, False)])
def test_slots_without_room_or_not_worth_their_room_leave_remote_state_updated_in_place(env, monkeypatch,
                                                                                        budget_mib, worth):
    monkeypatch.setattr(control, "worth_copying", lambda in_place, copying, costs: worth)
    model, batches = model_and_data()
    twin = copy.deepcopy(model)
    with make_session(env, budget=Budget(budget_mib * MiB, stage_activations=True)) as lab:
        lab.budget.copy_remote_state = True
        records = train(lab, model, batches)
        assert lab.budget._slot_bytes == -1 and lab.budget.executor.expected_growth == 0
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected]
    assert all(r.extra["budget"]["remote_bytes"] > 0 and "remote_copies" not in r.extra["budget"]
               for r in records[1:])
    reasons = [r.extra["budget"]["replan_reason"] for r in records]
    assert not any(why.endswith("remote copies") for why in reasons)
    refusal = "remote copies refused" if budget_mib == 96 else "remote copies: no room"
    assert sum(why.endswith(refusal) for why in reasons) == 1, reasons  # weighed once


def test_copying_is_worth_its_slots_when_the_link_time_it_saves_exceeds_what_their_room_costs():
    from um_lab.sim.profile import load_profile

    costs = LinkCosts.from_profile(load_profile("h200"))
    gb = 10**9
    in_place = SimpleNamespace(remote_bytes=4 * gb, prefetched_bytes=0, evicted_bytes=0)
    assert worth_copying(in_place, SimpleNamespace(remote_bytes=6 * gb, prefetched_bytes=0, evicted_bytes=0), costs)
    assert not worth_copying(in_place, SimpleNamespace(remote_bytes=11 * gb, prefetched_bytes=0, evicted_bytes=0),
                             costs)
    # room bought by evicting and prefetching data the plan kept resident: the slow direction decides
    assert not worth_copying(in_place, SimpleNamespace(remote_bytes=5 * gb, prefetched_bytes=gb * 3 // 2,
                                                       evicted_bytes=gb * 3 // 2), costs)
    assert link_cost_ms(in_place, False, costs) == pytest.approx(4 * costs.update_ms_per_GB)
