"""Remote optimizer state copied to the device for its chunk's step and back (um_lab.budget.remote_state): the
step's result is the in-place one bit for bit, the state dict holds the original tensors after every exit,
and a session with staged activations and remote state copies it and trains exactly as without a budget."""

import copy

import pytest
import torch
from test_budget_session import make_session, model_and_data, train

from um_lab.budget.pinned import CpuCopyOps
from um_lab.budget.record import optimizer_chunks, step_optimizer_in_chunks
from um_lab.budget.remote_state import RemoteStateCopies

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


@pytest.mark.parametrize("max_held", [0, 64 * MiB])
def test_copied_remote_state_steps_bit_for_bit_like_in_place_and_the_originals_stay_in_the_state(max_held):
    model, opt, x, y = trained_mlp()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors (load_state_dict keeps them)
    is_remote, chosen = remote_of(opt)
    originals = {id(v): v for s in opt.state.values() for v in s.values() if id(v) in chosen}
    for _ in range(2):
        for m, o, copier in ((model, opt, True), (twin, twin_opt, False)):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            chunks = optimizer_chunks([m], o)
            copies = RemoteStateCopies(o, [p for _, p in chunks], is_remote, CpuCopyOps(), CpuCopyOps(),
                                       max_held_bytes=max_held) if copier else None
            step_optimizer_in_chunks(o, chunks, around_step=copies.around_step if copies else None)
            if copies is not None:
                stats = copies.finish()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert all(torch.equal(opt.state[p][k], twin_opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))
    now = {id(v) for s in opt.state.values() for v in s.values()}
    assert set(originals) <= now  # the same tensors, updated in place
    remote_bytes = sum(v.numel() * v.element_size() for v in originals.values())
    assert stats["tensors"] == len(originals) == 4 and stats["bytes_in"] == stats["bytes_out"] == remote_bytes


def test_a_step_that_fails_leaves_the_original_state_unchanged_and_issues_no_copy_back():
    model, opt, x, y = trained_mlp()
    is_remote, chosen = remote_of(opt, layers=(0,))
    before = {id(v): v.clone() for s in opt.state.values() for v in s.values() if id(v) in chosen}
    torch.nn.functional.cross_entropy(model(x), y).backward()
    chunks = optimizer_chunks([model], opt)
    copies = RemoteStateCopies(opt, [p for _, p in chunks], is_remote, CpuCopyOps(), CpuCopyOps(), 1 << 30)
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
    copies = RemoteStateCopies(opt, [list(model.parameters())], lambda t: False, CpuCopyOps(), CpuCopyOps(), 0)
    state_ids = {id(v) for s in opt.state.values() for v in s.values()}
    with copies.around_step(0, list(model.parameters())):
        assert {id(v) for s in opt.state.values() for v in s.values()} == state_ids
    assert copies.finish()["tensors"] == 0


def test_a_session_copies_remote_state_with_staged_activations_and_trains_exactly_as_without_a_budget(env):
    model, batches = model_and_data()
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    budget = 48 * MiB  # the model, gradients and AdamW state are ~120 MiB: some state stays remote
    with pytest.warns(RuntimeWarning, match="experimental"), \
            make_session(env, gpu_budget_bytes=budget, budget_stage_activations=True) as lab:
        records = train(lab, model, batches)
    with pytest.warns(RuntimeWarning, match="experimental"), \
            make_session(env, gpu_budget_bytes=budget, budget_stage_activations=True) as lab:
        lab.budget.copy_remote_state = False
        in_place = train(lab, third, batches)
    with make_session(env) as plain:
        expected = train(plain, twin, batches)
    assert [r.loss for r in records] == [r.loss for r in expected] == [r.loss for r in in_place]
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    copied = [r.extra["budget"].get("remote_copies") for r in records]
    late = [c for c, r in zip(copied, records, strict=True) if r.extra["budget"]["remote_bytes"] > 0]
    assert late and all(c is not None and c["bytes_in"] == c["bytes_out"] > 0 for c in late)
    assert all("remote_copies" not in r.extra["budget"] for r in in_place)
    assert all(r.extra["budget"]["max_resident_ledger"] <= budget + r.extra["budget"]["touched_bytes"]
               for r in records)
