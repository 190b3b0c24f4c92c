"""The layer-ahead scheduler on the simulator (um_lab.sim.budget): the order derived from a traced step,
the real planner's plan on it, and the step time replayed on the host, mover, side-stream and compute clocks."""

from __future__ import annotations

import dataclasses

import pytest

from um_lab import get_model
from um_lab.errors import BudgetTooSmall
from um_lab.schedule.ledger import BLOCK
from um_lab.sim.backend import SimBackend
from um_lab.sim.budget import derive_order, plan_budget, replay_plan, simulate_budget
from um_lab.types import DataType, RunSpec

MLP = {"width": 1024, "depth": 3, "batch_size": 64}


@pytest.fixture(scope="module")
def prepared():
    sim = SimBackend()
    return sim, sim.prepare(get_model("mlp", **MLP))


def test_the_derived_order_runs_forward_then_backward_then_one_optimizer_position_per_layer(prepared):
    sim, prep = prepared
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    phases = [p.phase for p in derived.order.positions]
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    assert phases.count("optimizer") == derived.layers >= 3
    assert len(derived.compute_us) == len(derived.host_us) == len(phases)
    assert all(c >= 0 for c in derived.compute_us) and sum(derived.compute_us) > 0
    # every parameter, gradient and optimizer-state byte is touched by some position
    touched = {b for p in derived.order.positions for s in p.spans()
               for b in range(s[0] // BLOCK, (s[0] + s[1] - 1) // BLOCK + 1)}
    trace, va = prep.trace, prep.placement.final.st_va
    for dtype in (DataType.PARAM, DataType.GRAD, DataType.OPTIM):
        index = list(DataType).index(dtype)
        stored = [s for s in range(len(trace.st_nbytes)) if trace.st_persistent[s] and trace.st_type[s] == index
                  and trace.st_nbytes[s] > 0]
        blocks = {b for s in stored for b in range(va[s] // BLOCK, (va[s] + trace.st_nbytes[s] - 1) // BLOCK + 1)}
        assert blocks and blocks <= touched, dtype
    optimizer = [p for p in derived.order.positions if p.phase == "optimizer"]
    assert all(p.spans(DataType.OPTIM) and p.spans(DataType.GRAD) for p in optimizer[:-1])


def test_joined_optimizer_chunks_keep_every_byte_and_the_gpu_time_and_dispatch_their_shared_ops_once(prepared):
    sim, prep = prepared
    per_layer = derive_order(prep.trace, prep.placement.final, sim.profile)
    joined = derive_order(prep.trace, prep.placement.final, sim.profile, optimizer_chunk_bytes=1 << 40)
    one = [p for p in per_layer.order.positions if p.phase == "optimizer"]
    [whole] = [p for p in joined.order.positions if p.phase == "optimizer"]
    assert joined.layers == 1 and per_layer.layers == len(one) >= 3
    assert sorted(whole.spans()) == sorted(s for p in one for s in p.spans())
    n = len(per_layer.order.positions) - len(one)  # forward and backward positions are the same
    assert joined.compute_us[:n] == per_layer.compute_us[:n]
    assert joined.compute_us[n] == pytest.approx(sum(per_layer.compute_us[n:]))
    assert joined.host_us[n] < sum(per_layer.host_us[n:])  # one step's dispatch, not one per layer
    assert joined.optim_scratch_bytes >= per_layer.optim_scratch_bytes
    assert sum(len(c) for c in joined.remote_costs) == sum(len(c) for c in per_layer.remote_costs)


def test_the_plan_stays_under_the_budget_and_moves_as_much_in_as_out_each_steady_step(prepared):
    sim, prep = prepared
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    budget = prep.footprint_bytes // 2
    plan = plan_budget(derived, budget)
    assert plan.steady and plan.max_resident <= plan.budget_bytes <= budget
    assert plan.prefetched_bytes == plan.evicted_bytes > 0


def test_the_step_time_falls_as_the_budget_grows_and_needs_no_moves_when_all_fits(prepared):
    sim, prep = prepared
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    times = []
    for fraction in (0.4, 0.6, 0.8):
        plan = plan_budget(derived, int(prep.footprint_bytes * fraction))
        times.append(replay_plan(derived, plan, sim.profile).wall_us)
    assert times[0] >= times[1] >= times[2] and times[0] > times[2]
    everything = plan_budget(derived, prep.footprint_bytes + 64 * BLOCK)
    assert everything.prefetched_bytes == everything.evicted_bytes == 0
    fits = replay_plan(derived, everything, sim.profile)
    assert fits.side_busy_us == 0 and fits.wall_us <= times[-1] < times[0]
    assert fits.wall_us >= fits.compute_us


def test_slower_evictions_make_a_slower_step(prepared):
    sim, prep = prepared
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    plan = plan_budget(derived, prep.footprint_bytes // 2)
    steady = replay_plan(derived, plan, sim.profile)
    first = replay_plan(derived, plan, sim.profile, evict_GBps=3.65)
    assert first.wall_us > steady.wall_us and first.side_busy_us > steady.side_busy_us


def test_a_budget_below_one_position_is_refused(prepared):
    sim, prep = prepared
    with pytest.raises(BudgetTooSmall):
        simulate_budget(prep.trace, prep.placement.final, sim.profile, 3 * BLOCK)


def test_the_scheduler_beats_the_drivers_demand_paging_on_the_simulator(prepared):
    sim, prep = prepared
    case = get_model("mlp", **MLP)
    spec = RunSpec(model="mlp", model_kwargs=MLP, backend="sim", oversubscription_ratio=2.0, steps=2, warmup_steps=0)
    paging = [r.wall_ms for r in sim.run(spec, case, "um-default")]
    scheduled = list(sim.run(dataclasses.replace(spec, policy="layer-ahead"), case, "layer-ahead"))
    assert max(r.wall_ms for r in scheduled) < min(paging)
    budget = scheduled[-1].extra["budget"]
    assert budget["max_resident_ledger"] <= budget["budget_bytes"] <= scheduled[-1].gpu_capacity_bytes
    # at ratio 2 all the MLP's moving data is optimizer state: it stays in host memory, updated over the link
    assert scheduled[-1].gpu_page_faults == 0 and budget["remote_bytes"] > 0
    assert scheduled[-1].remote_bytes >= 2 * budget["remote_bytes"]  # read and written back at least once
    assert sum(scheduled[-1].htod_bytes.values()) + scheduled[-1].remote_bytes > 0


@pytest.mark.parametrize("name, kwargs", [("mlp", MLP), ("gpt2-small", {"batch_size": 1, "seq_len": 16, "n_layer": 2}),
                                          ("resnet50", {"batch_size": 2, "image_size": 32})])
def test_the_trace_counts_the_hook_positions_the_recorder_opens_on_the_real_model(name, kwargs):
    """The scheduler's hooks open a position per module call, continuation and backward; the trace counts them by
    running the same recorder under fake tensors, so the count matches a real step's on the CPU."""
    import torch

    from um_lab.schedule.live.record import StepRecorder
    from um_lab.sim.replicas import model_case
    from um_lab.sim.trace import trace_step

    class Counting(StepRecorder):
        tensors = 0

        def _spans(self, tensors):
            spans = super()._spans(tensors)
            self.tensors += len(spans)
            return spans

    case = model_case(name, **kwargs)  # the simulator's replicas: ResNet-50 without torchvision
    trace = trace_step(case)
    torch.manual_seed(0)
    model = case.build_model()
    batch = case.batch(0)
    recorder = Counting([model])
    recorder.install()
    with recorder.recording() as order:
        loss = case.loss_fn(model, *batch)
    forward, forward_tensors = len(order.positions), recorder.tensors
    with recorder.backward():
        loss.backward()
    recorder.remove()
    assert trace.hook_positions == (forward, len(order.positions) - forward)
    assert forward > 0 and trace.hook_positions[1] > 0
    # the tensors the hooks record, what their host time scales with, counted as the real step's hooks count them
    # (within 2%: GPT-2's fake step records two tensors more in forward than its real one)
    assert trace.hook_tensors == pytest.approx((forward_tensors, recorder.tensors - forward_tensors), rel=0.02)
    assert trace.hook_tensors[0] > forward and trace.hook_tensors[1] > 0


def test_each_derived_position_carries_its_share_of_the_hook_positions_and_the_hooks_cost_host_time(prepared):
    sim, prep = prepared
    derived = derive_order(prep.trace, prep.placement.final, sim.profile)
    forward, backward = prep.trace.hook_positions
    phases = [p.phase for p in derived.order.positions]
    shares = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
    for phase, share in zip(phases, derived.hook_positions, strict=True):
        shares[phase] += share
    assert shares["forward"] == pytest.approx(forward) and shares["backward"] == pytest.approx(backward)
    assert shares["optimizer"] == phases.count("optimizer")
    tensors = dict.fromkeys(shares, 0.0)
    for phase, share in zip(phases, derived.hook_tensors, strict=True):
        tensors[phase] += share
    assert (tensors["forward"], tensors["backward"]) == pytest.approx(prep.trace.hook_tensors)
    assert tensors["optimizer"] == 0  # an optimizer chunk is priced per position
    plan = plan_budget(derived, prep.footprint_bytes // 2)

    def wall(order=derived, **prices):
        return replay_plan(order, plan, dataclasses.replace(sim.profile, **prices)).wall_us

    # forward and backward pay per tensor recorded, the optimizer's chunks per position
    per_tensor = wall(scheduler_tensor_us=2000.0) - wall(scheduler_tensor_us=1000.0)
    assert per_tensor == pytest.approx(sum(prep.trace.hook_tensors) * 1000.0, rel=0.02)
    per_chunk = wall(scheduler_hook_us=2000.0) - wall(scheduler_hook_us=1000.0)  # partly under the GPU's time
    assert 0 < per_chunk <= phases.count("optimizer") * 1000.0 * 1.02
    # a trace without the tensor count prices every position at scheduler_hook_us, as before
    uncounted = dataclasses.replace(derived, hook_tensors=())
    per_position = wall(uncounted, scheduler_hook_us=2000.0) - wall(uncounted, scheduler_hook_us=1000.0)
    assert per_position == pytest.approx(sum(derived.hook_positions) * 1000.0, rel=0.02)


def test_a_model_that_turns_saved_tensor_hooks_off_still_traces_and_counts_no_hook_positions():
    """torch.func and similar code turn saved-tensor hooks off inside a forward: the scheduler's recorder cannot
    run there, so the trace takes the step without it (the plain step's ops are all still recorded)."""
    import torch

    from um_lab.models import custom
    from um_lab.sim.trace import trace_step

    class TurnsHooksOff(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner(x)
            with torch.autograd.graph.disable_saved_tensors_hooks("no saved-tensor hooks here"):
                h = h.tanh() * 2
            return self.head(h)

    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    trace = trace_step(custom("turns-hooks-off", TurnsHooksOff, batch))
    plain = trace_step(custom("plain", lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                                                    torch.nn.Linear(8, 2)), batch))
    assert trace.hook_positions == (0, 0) and plain.hook_positions[0] > 0
    assert any("tanh" in name for name in trace.op_names) and trace.n_ops >= plain.n_ops - 2
