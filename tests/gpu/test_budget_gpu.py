"""Session(budget=B) on the GPU: the ledger stays under B once the plan is followed, training
matches a run without a budget, an interrupted step leaves the session usable. Live managed bytes stay
far below the card (an MLP of ~2 GiB with its AdamW state); the safety cap stays on."""

import pytest
import torch

from um_lab.schedule.config import Budget

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _session(*args, **kw):
    from fakes import new_session

    return new_session(*args, **kw)


def _train(budget, steps=6, interrupt_at=None, remote_copies=False, stage_activations=False, **session_kw):
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        if budget is not None:
            budget = Budget(budget, stage_activations=stage_activations)
        return _train_deterministic(budget, steps, interrupt_at, session_kw, remote_copies)
    finally:  # restored: later tests in the process run as they would alone
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _train_deterministic(budget, steps, interrupt_at, session_kw, remote_copies=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU())
                                  for _ in range(8)], torch.nn.Linear(4096, 10))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(256, 4096, generator=g), torch.randint(0, 10, (256,), generator=g)) for _ in range(steps)]
    records = []
    with _session("um-default", budget=budget, **session_kw) as lab:
        if lab.budget is not None:
            lab.budget.copy_remote_state = remote_copies
        model = lab.place(model)
        opt = lab.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        for i, (xb, yb) in enumerate(data):
            x, y = lab.inputs(xb, yb)
            if i == interrupt_at:
                def interrupted(x=x, model=model):
                    model[0](x)
                    raise KeyboardInterrupt
                with pytest.raises(KeyboardInterrupt):
                    lab.step(interrupted, opt)
            records.append(lab.step(lambda x=x, y=y, model=model: torch.nn.functional.cross_entropy(model(x), y),
                                    opt))
        footprint = sum(lab.live_bytes().values())
        params = [p.detach().cpu() for p in model.parameters()]
        del opt, model, x, y
    return records, params, footprint


@pytest.mark.parametrize("discard", [True, False])
def test_budget_run_stays_under_b_and_trains_like_a_run_without_one(discard):
    from um_lab.cuda.driver import can_discard

    plain, plain_params, footprint = _train(None)
    budget = footprint // 2
    # optimizer state moving (not left in host memory): the moves under test
    records, params, _ = _train(budget, discard_gradients=discard, remote_optimizer=False)
    for r in records[2:]:  # dead gradients are discarded (CUDA 13+), not copied to the host
        assert (r.extra["budget"]["discarded_bytes"] > 0) == (discard and can_discard()), r.extra["budget"]
    for r in records:
        b = r.extra["budget"]
        assert b["budget_bytes"] == budget and b["managed_bytes"] > budget
    for r in records[2:]:  # learnt in step 1, (re)planned after step 2 at the latest
        b = r.extra["budget"]
        assert b["followed_plan"] and b["unplanned_positions"] == 0, b
        assert b["max_resident_ledger"] <= budget and not b["over_budget"], b
        assert b["prefetched_bytes"] > 0 and b["evicted_bytes"] > 0
    for a, p in zip(plain_params, params, strict=True):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-6)
    assert [round(r.loss, 4) for r in records] == [round(r.loss, 4) for r in plain]


def test_batched_prefetch_calls_keep_the_ledger_under_b_and_train_like_a_run_without_a_budget():
    """The experimental batch_calls (cudaMemPrefetchBatchAsync for runs of one location): same bounds, same
    training."""
    from um_lab.cuda.driver import can_prefetch_batch

    if not can_prefetch_batch():
        pytest.skip("cudaMemPrefetchBatchAsync needs CUDA 13+")
    plain, plain_params, footprint = _train(None)
    budget = footprint // 2
    records, params, _ = _train(budget, remote_optimizer=False, batch_calls=True)
    for r in records[2:]:
        b = r.extra["budget"]
        assert b["followed_plan"] and b["max_resident_ledger"] <= budget and not b["over_budget"], b
        assert b["prefetched_bytes"] > 0 and b["evicted_bytes"] > 0
    for a, p in zip(plain_params, params, strict=True):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-6)
    assert [round(r.loss, 4) for r in records] == [round(r.loss, 4) for r in plain]


def test_an_interrupted_budget_step_leaves_the_session_usable_on_the_gpu():
    footprint = _train(None, steps=2)[2]
    records, _, _ = _train(footprint // 2, steps=6, interrupt_at=3)
    assert len(records) == 6 and all(r.loss == r.loss for r in records)  # no NaN, every step ran
    assert records[-1].extra["budget"]["followed_plan"]


def _deterministic_setting():
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def test_training_leaves_the_deterministic_setting_as_it_found_it():
    before = _deterministic_setting()
    _train(None, steps=1)
    assert _deterministic_setting() == before


def test_with_host_advice_cupti_residency_stays_under_b_at_each_step_end():
    """budget_host_advice (the default): only the scheduler's prefetches make data resident, so CUPTI-measured
    residency at each step's end (after the step's moves completed) stays under B (plus the 2 MiB-block
    rounding of what the CUPTI records cover) measured ResNet-50 at 1.7 x B without it."""
    from um_lab.cuda.telemetry import Telemetry

    _, _, footprint = _train(None, steps=2)
    budget = footprint // 2
    records, _, _ = _train(budget, steps=5, telemetry=Telemetry(flush="step"))
    if records[-1].telemetry.startswith("unavailable"):
        pytest.skip(f"CUPTI telemetry {records[-1].telemetry}")
    for r in records[2:]:
        resident = sum(r.resident_bytes.values())
        assert 0 < resident <= budget + 2 * MiB, (resident, budget, r.extra["budget"])
        assert r.extra["budget"]["finish_moves_ms"] >= 0


def test_staged_activations_train_bit_for_bit_like_a_budget_run_without_staging():
    """budget_stage_activations: saved activations go to pinned host memory and back; the copies are exact,
    so training matches the same budget run without staging bit for bit, and the ledger stays under B."""
    _, _, footprint = _train(None, steps=2)
    budget = footprint // 2
    plain, plain_params, _ = _train(budget, steps=5, remote_optimizer=False)
    records, params, _ = _train(budget, steps=5, stage_activations=True, remote_optimizer=False)
    for r in records:
        st = r.extra["budget"]["staging"]
        # every Linear's 4 MiB input and GELU's input are saved: 8 layers' worth at least
        assert st["staged_tensors"] >= 8 and st["staged_bytes"] >= 8 * 4 * MiB, st
        assert st["restored_bytes"] >= st["staged_bytes"] and st["kept_bytes"] == 0, st
    for r in records[2:]:
        b = r.extra["budget"]
        assert b["followed_plan"] and b["max_resident_ledger"] <= budget + b["touched_bytes"], b
        # the intermediate-results pool stays resident, a fixed part of B, and the scheduler still moves the rest
        assert 0 < b["fixed_bytes"] < budget and b["evicted_bytes"] > 0, b
    for a, p in zip(plain_params, params, strict=True):
        assert torch.equal(a, p)
    assert [r.loss for r in records] == [r.loss for r in plain]


def test_staged_activations_in_device_memory_train_bit_for_bit_like_managed_ones():
    """budget_device_activations (on with staging by default): the intermediate-results pool is cudaMalloc memory
    (the CUDA runtime says so), every other pool managed; training matches the same staged run with a managed
    intermediate pool bit for bit, and the ledger stays under B."""
    from um_lab.cuda.driver import _cudart
    from um_lab.types import DataType

    cudart = _cudart()
    with _session("um-default", budget=Budget(1 << 30, stage_activations=True)) as lab:
        with lab.allocating("act"):
            act = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        with lab.allocating("grad"):
            grad = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        kinds = {}
        for name, t in (("act", act), ("grad", grad)):
            err, attrs = cudart.cudaPointerGetAttributes(t.data_ptr())
            assert int(err) == 0
            kinds[name] = attrs.type
        assert kinds == {"act": cudart.cudaMemoryType.cudaMemoryTypeDevice,
                         "grad": cudart.cudaMemoryType.cudaMemoryTypeManaged}
        assert {s.data_type for s in lab._pools.source.segments() if not s.managed} == {DataType.ACT}
        del act, grad
    _, _, footprint = _train(None, steps=2)
    budget = footprint // 2
    managed, managed_params, _ = _train(budget, steps=5, stage_activations=True,
                                        device_activations=False)
    records, params, _ = _train(budget, steps=5, stage_activations=True)
    for r in records[2:]:
        b = r.extra["budget"]
        assert b["device_activations"] and b["followed_plan"], b
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"], b
    assert not managed[-1].extra["budget"]["device_activations"]
    for a, p in zip(managed_params, params, strict=True):
        assert torch.equal(a, p)
    assert [r.loss for r in records] == [r.loss for r in managed]


def test_optimizer_state_left_in_host_memory_trains_bit_for_bit_like_moving_it():
    """budget_remote_optimizer (the default): the optimizer state the plan would move stays in host memory and
    AdamW updates it there over the link; the same kernels on the same values, so training matches the run that
    prefetches it in and out bit for bit. No optimizer state is prefetched or evicted, the ledger stays under B,
    and with staging too."""
    _, _, footprint = _train(None, steps=2)
    budget = footprint // 2
    for stage in (False, True):
        moving, moving_params, _ = _train(budget, steps=5, remote_optimizer=False,
                                          stage_activations=stage)
        records, params, _ = _train(budget, steps=5, stage_activations=stage)
        for r in records[2:]:
            b = r.extra["budget"]
            assert b["remote_optimizer"] and b["remote_bytes"] > 0 and b["followed_plan"], b
            assert b["max_resident_ledger"] <= budget + b["touched_bytes"], b
        late = [r.extra["budget"] for r in records[2:]]
        before = [r.extra["budget"] for r in moving[2:]]
        assert sum(b["evicted_bytes"] for b in late) < sum(b["evicted_bytes"] for b in before), (late, before)
        for a, p in zip(moving_params, params, strict=True):
            assert torch.equal(a, p)
        assert [r.loss for r in records] == [r.loss for r in moving]


def test_optimizer_state_left_in_host_memory_keeps_cupti_residency_under_b():
    """Remote optimizer state is read and written in place over the link, never migrated: CUPTI's residency at
    each step's end stays under B."""
    records = _assert_cupti_residency_under_b(remote_optimizer=True)
    assert all(r.extra["budget"]["remote_bytes"] > 0 for r in records[2:])


def _copies_taken(monkeypatch):
    """The copy slots taken whatever they cost (this MLP's layers make them a large share of B, so the session
    would weigh them against moves and often refuse: remote_state.worth_copying); their mechanics are tested."""
    from um_lab.schedule.live import control

    monkeypatch.setattr(control, "worth_copying", lambda in_place, copying, costs: True)


def test_remote_state_copied_for_its_chunks_step_trains_bit_for_bit_like_updating_it_in_place(monkeypatch):
    """With staged activations, remote optimizer state is copied to device slots for its chunk's step and back
    (two side streams): the same AdamW kernels on the same values, so training matches the in-place run bit for
    bit; every remote byte is copied in and out, and the ledger stays under B with the slots in the fixed pool."""
    _copies_taken(monkeypatch)
    _, _, footprint = _train(None, steps=2)
    budget = footprint // 2
    in_place, in_place_params, _ = _train(budget, steps=5, stage_activations=True)
    records, params, _ = _train(budget, steps=5, stage_activations=True, remote_copies=True)
    for r in records[2:]:
        b = r.extra["budget"]
        assert b["remote_bytes"] > 0 and b["followed_plan"], b
        copies = b["remote_copies"]
        assert copies["bytes_in"] == copies["bytes_out"] > 0, copies
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"], b
    assert all("remote_copies" not in r.extra["budget"] for r in in_place)
    for a, p in zip(in_place_params, params, strict=True):
        assert torch.equal(a, p)
    assert [r.loss for r in records] == [r.loss for r in in_place]


def test_remote_state_copies_keep_cupti_residency_under_b(monkeypatch):
    """The copies read and write the remote blocks where they are (host memory), never migrating them: CUPTI's
    residency at each step's end stays under B with them on."""
    _copies_taken(monkeypatch)
    records = _assert_cupti_residency_under_b(stage_activations=True, remote_copies=True)
    assert all(r.extra["budget"]["remote_copies"]["bytes_in"] > 0 for r in records[2:]), \
        [r.extra["budget"].get("remote_copies") for r in records]


def test_partial_staging_trains_bit_for_bit_like_full_staging_and_stays_under_b():
    """budget_partial_staging (experimental): with room under B, forward's last saves stay on the GPU from the step
    after the decision; the same tensors reach backward, so training matches full staging bit for bit, and the
    ledger stays under B while the intermediate pool grows into the announced room."""
    _, _, footprint = _train(None, steps=2)
    budget = int(footprint * 0.9)
    full, full_params, _ = _train(budget, steps=6, stage_activations=True)
    records, params, _ = _train(budget, steps=6, stage_activations=True, partial_staging=True)
    reasons = [r.extra["budget"]["replan_reason"] for r in records]
    assert "partial staging" in reasons, reasons
    decided = reasons.index("partial staging")
    for r in records[decided + 1:]:
        b = r.extra["budget"]
        assert b["staging"]["tail_kept_bytes"] > 0, b["staging"]
        assert b["max_resident_ledger"] <= budget + b["touched_bytes"] and not b["over_budget"], b
    for a, p in zip(full_params, params, strict=True):
        assert torch.equal(a, p)
    assert [r.loss for r in records] == [r.loss for r in full]


def test_staged_activations_keep_cupti_residency_under_b_at_each_step_end():
    """With staging the intermediate-results pool gets no host advice (copies to host-advised pages ran at
    3.7-4.0 GB/s) and stays resident, fixed in the ledger from its segments' registration: CUPTI-measured
    residency at each step's end still stays under B (plus the 2 MiB-block rounding of CUPTI's records). That
    pool is device memory by default, resident by construction: its bytes are added to CUPTI's managed ones."""
    records = _assert_cupti_residency_under_b(stage_activations=True)
    assert all(r.extra["device_memory_bytes"]["act"] > 0 for r in records[2:])


def test_partial_staging_keeps_cupti_residency_under_b_at_each_step_end():
    """Partial staging sizes its kept tail in rounds from the ledger's peaks: CUPTI-measured residency (the kept
    saves are in the device-memory pool, added to CUPTI's managed bytes) stays under B at each step's end."""
    records = _assert_cupti_residency_under_b(0.9, stage_activations=True, partial_staging=True)
    assert any(r.extra["budget"]["staging"]["tail_kept_bytes"] > 0 for r in records[2:]), \
        [r.extra["budget"]["staging"] for r in records]


def _assert_cupti_residency_under_b(fraction: float = 0.5, **session_kw):
    """A budget run of 5 steps at ``fraction`` of the footprint with CUPTI on: measured residency at each step's end
    (after the first two) is under B plus CUPTI's 2 MiB rounding, and the ledger's maximum under B plus what
    kernels touched unforeseen."""
    from um_lab.cuda.telemetry import Telemetry

    _, _, footprint = _train(None, steps=2)
    budget = int(footprint * fraction)
    records, _, _ = _train(budget, steps=5, telemetry=Telemetry(flush="step"), **session_kw)
    if records[-1].telemetry.startswith("unavailable"):
        pytest.skip(f"CUPTI telemetry {records[-1].telemetry}")
    for r in records[2:]:
        resident = sum(r.resident_bytes.values())
        assert 0 < resident <= budget + 2 * MiB, (resident, budget, r.extra["budget"])
        assert r.extra["budget"]["max_resident_ledger"] <= budget + r.extra["budget"]["touched_bytes"]
    return records


def test_what_the_ledger_counts_resident_reads_at_device_speed():
    """With host advice, a kernel's first write to a pool page lands in host memory (the preferred location) and is
    mapped remotely: the ledger must not count it resident until a prefetch moved it. A GPU run once found optimizer
    state and gradients, created by GPU writes, counted resident while the GPU read them over the host link.
    After planned steps at 0.9 of the footprint, the optimizer state and gradients the ledger holds resident
    read at device-memory speed (a remote read runs at ~50 GB/s on the H200's link; HBM at ~3,000)."""
    _, _, footprint = _train(None, steps=2)
    budget = int(footprint * 0.9)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU())
                                  for _ in range(8)], torch.nn.Linear(4096, 10))
    with _session("um-default", budget=budget) as lab:
        model = lab.place(model)
        opt = lab.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        for _ in range(5):
            x, y = lab.inputs(torch.randn(256, 4096), torch.randint(0, 10, (256,)))
            rec = lab.step(lambda x=x, y=y, model=model: torch.nn.functional.cross_entropy(model(x), y), opt)
        assert rec.extra["budget"]["followed_plan"], rec.extra["budget"]
        ex = lab.budget.executor
        ex.mover.drain()  # look-aheads for the next step issued, then done
        torch.cuda.synchronize()
        state = [v for p in model.parameters() for v in opt.state[p].values() if v.is_cuda and v.numel() > 1]
        spans = {id(t): [(t.data_ptr(), t.numel() * t.element_size())] for t in state}
        spans.update({id(p.grad): [(p.grad.data_ptr(), p.grad.numel() * 4)] for p in model.parameters()})
        tensors = [t for t in state + [p.grad for p in model.parameters()]
                   if all(ex.ledger.where(b) == "gpu" for b in ex.blocks(spans[id(t)]))]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert nbytes >= 256 * MiB, (nbytes, rec.extra["budget"])
        for _ in range(2):  # the second pass is timed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for t in tensors:
                t.sum()
            end.record()
            torch.cuda.synchronize()
        gbps = nbytes / (start.elapsed_time(end) * 1e-3) / 1e9
        assert gbps > 400, (gbps, nbytes, rec.extra["budget"])
        del opt, model, x, y, state, tensors


def test_the_runner_stages_activations_under_the_policy_layer_ahead_staged(tmp_path):
    """The scheduled policy ``layer-ahead-staged`` from the runner (as the CLI and the lab run it): the session
    stages saved activations, the ledger stays under B once planned, and the run log completes."""
    from um_lab import RunSpec, run

    spec = RunSpec(model="mlp", model_kwargs={"width": 2048, "depth": 4, "batch_size": 512}, backend="cuda",
                   policy="layer-ahead-staged", steps=4, warmup_steps=1, budget=0.5)
    result = run(spec, out_dir=tmp_path)
    records = list(result.records())
    b = records[-1].extra["budget"]
    assert b["staging"]["staged_bytes"] > 0 and b["fixed_bytes"] > 0, b
    assert b["followed_plan"] and b["max_resident_ledger"] <= b["budget_bytes"], b
