"""The layer-ahead scheduler on the simulator: its plan on a traced step, and its step time.

**Order.** The real scheduler plans on positions its module hooks record (one layer in one phase). A
:class:`~um_lab.sim.trace.StepTrace` has kernel ops, not modules, so :func:`derive_order` groups ops into
positions by the parameters they touch: parameters first read by one forward op form a *layer* (a
Linear's weight and bias, a norm's scale and shift); a forward position opens at each op that reads
another layer's parameters, a backward position at each op that touches another layer's parameters or
gradients, and ops touching no parameter join the open position. The optimizer is stepped in chunks of
consecutive layers holding at most B/64 of parameters, as the budgeted session does
(:func:`um_lab.schedule.live.record.step_optimizer_in_chunks`): one position per chunk with its parameters,
gradients and optimizer state. This is coarser than the hooks (which also
open positions for parameter-free modules and containers), so ``lookahead`` positions reach a little
further here than on a GPU. Byte ranges come from the placed layout (:mod:`um_lab.sim.placement`);
the optimizer's temporaries (the foreach step's per-tensor results, one layer's worth when stepped per
layer) are left out of the order and their largest layer's worth is taken off the budget instead.

**Plan.** The same planner as the session: :func:`um_lab.schedule.plan.make_plan` (Belady evictions,
look-ahead prefetches, the steady-state step), so the moves are the ones the real executor would replay.

**Time.** :func:`replay_plan` walks three steady steps on four clocks: the training thread (each
position's hook cost and its ops' dispatch times), the mover thread that makes the prefetch calls
(``prefetch_call_us`` + ``prefetch_call_us_per_block`` each; with ``prefetch_host_sync`` a call first
waits until the side stream's earlier work is done), the side stream (evictions wait for the compute
queued before their position; transfers at the profile's ``scheduler_h2d_GBps`` to the GPU and
``scheduler_d2h_GBps`` to the host, the side-stream rates measured in training (where a profile has none,
the lone-prefetch rates ``prefetch_h2d_GBps`` / ``prefetch_d2h_GBps``), ``prefetch_block_us`` per block; both
directions share the stream, so they never overlap)
and the compute stream (each position's ops at their resident roofline times, after the prefetches it
waits for). The step time is the compute stream's, as the session's CUDA-event timer measures it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from um_lab.errors import BudgetTooSmall
from um_lab.schedule.ledger import BLOCK, Span
from um_lab.schedule.order import OPTIMIZER_CHUNK_DIVISOR, STEP_POSITION, Order, Position, join_consecutive
from um_lab.schedule.plan import Plan, make_plan
from um_lab.schedule.staging import WINDOW_BYTES
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.remote_optim import RemoteCost, by_layer, remote_costs, remote_extra_us, remote_state_bytes
from um_lab.sim.trace import ACC_WRITE_ONLY, KIND_H2D_COPY, PHASE_BWD, PHASE_FWD, PHASE_OPT, StepTrace
from um_lab.types import DATA_TYPES, DataType, StepRecord

#: host time of the recorder's Python hooks and the executor's ledger work per position (an assumption,
#: not measured: a forward pre/post hook pair, a tensor hook, a few dict look-ups)
HOOK_US_PER_POSITION = 40.0
STEADY_STEPS = 3  #: steady steps replayed; the last one's time is reported
_PARAM, _GRAD, _OPTIM = (DATA_TYPES.index(t) for t in (DataType.PARAM, DataType.GRAD, DataType.OPTIM))


@dataclasses.dataclass
class DerivedOrder:
    """A traced step as the scheduler's :class:`Order`, with each position's GPU and host time."""

    order: Order
    compute_us: list[float]  #: resident GPU time of each position's ops
    host_us: list[float]  #: host dispatch time of each position's ops (hooks excluded)
    optim_scratch_bytes: int  #: the largest layer's optimizer temporaries (kept resident: off the budget)
    layers: int  #: parameter layers found (optimizer positions)
    grad_segments: frozenset[int] = frozenset()  #: starts of the gradient runs (what a plan may discard)
    op_start: tuple[int, ...] = ()  #: the first op of each position (optimizer positions: the first optimizer op)
    #: per position, its optimizer-state storages' cost if left in host memory (:mod:`um_lab.sim.remote_optim`)
    remote_costs: tuple[tuple[RemoteCost, ...], ...] = ()



@dataclasses.dataclass(frozen=True)
class StageCopies:
    """The staging copies of a step, by position: bytes out after ``out_bytes[i]``'s position, bytes back
    before ``in_bytes[i]``'s; ``GBps`` the copy rate (None: the profile's ``stage_copy_GBps``), ``window`` the
    bytes in flight / ahead."""

    out_bytes: tuple[int, ...]
    in_bytes: tuple[int, ...]
    GBps: float | None = None
    window: int = WINDOW_BYTES

    @property
    def staged_bytes(self) -> int:
        """Bytes copied to the host per step (as many come back)."""
        return sum(self.out_bytes)


@dataclasses.dataclass
class BudgetStep:
    """One simulated steady step under the budget: the step time and where it went."""

    wall_us: float
    compute_us: float  #: the positions' resident GPU time
    side_busy_us: float  #: time the side stream spent moving data (both directions)
    host_waits: int  #: positions whose prefetches the training thread had to wait to see issued
    calls: int  #: prefetch calls made per step
    remote_us: float = 0.0  #: GPU time the optimizer spent on state left in host memory
    remote_link_bytes: float = 0.0  #: bytes its kernels read and wrote over the link for it


def _layer_of_params(trace: StepTrace) -> tuple[dict[int, int], int]:
    """Storage -> layer for persistent parameters, gradients and optimizer state (see the module doc)."""
    persistent = trace.st_persistent & (trace.st_nbytes > 0)
    params = [int(s) for s in np.flatnonzero(persistent & (trace.st_type == _PARAM))]
    grads = [int(s) for s in np.flatnonzero(persistent & (trace.st_type == _GRAD))]
    states = [int(s) for s in np.flatnonzero(persistent & (trace.st_type == _OPTIM))]
    param_set = set(params)
    first_use: dict[int, int] = {}
    for op in range(trace.n_ops):
        if trace.op_phase[op] != PHASE_FWD:
            continue
        for s in trace.acc_storage[trace.acc_ptr[op]:trace.acc_ptr[op + 1]].tolist():
            if s in param_set and s not in first_use:
                first_use[s] = op
    ops_in_order = sorted(set(first_use.values()))
    layer_at_op = {op: k for k, op in enumerate(ops_in_order)}
    layer = {s: layer_at_op[op] for s, op in first_use.items()}
    n_layers = len(ops_in_order)
    for s in params:  # used by no forward op (or only by the optimizer): a layer of its own at the end
        if s not in layer:
            layer[s] = n_layers
            n_layers += 1
    trainable = params[:len(grads)]  # grads are registered in parameter order, parameters first
    for g, p in zip(grads, trainable, strict=False):
        layer[g] = layer[p]
    if trainable and states:
        per = max(1, len(states) // len(trainable))  # each parameter's state tensors, registered together
        for k, s in enumerate(states):
            layer[s] = layer[trainable[min(k // per, len(trainable) - 1)]]
    return layer, n_layers


def derive_order(trace: StepTrace, layout: Layout, profile: Profile,
                 optimizer_chunk_bytes: int | None = None) -> DerivedOrder:
    """Group ``trace``'s ops into the scheduler's positions on ``layout`` (see the module docstring). With
    ``optimizer_chunk_bytes``, consecutive layers whose parameters hold at most that together share one
    optimizer position, as the session joins its chunks (:func:`~um_lab.schedule.live.record.join_consecutive`)."""
    from um_lab.sim.roofline import op_host_us, op_times_us

    base = op_times_us(trace, profile)
    host = op_host_us(trace, profile)
    layer, n_layers = _layer_of_params(trace)
    st_va = layout.st_va
    types = [DATA_TYPES[int(t)] for t in trace.st_type]
    positions: list[Position] = []
    starts: list[int] = []
    compute: list[float] = []
    host_us: list[float] = []
    current: tuple[str, int] | None = None
    previous: tuple[str, int] | None = None
    opt_ops: list[int] = []
    scratch = np.zeros(max(n_layers, 1))
    phase_name = {PHASE_FWD: "forward", PHASE_BWD: "backward"}

    def spans_of(op: int) -> Iterator[tuple[DataType, Span, int]]:
        for k in range(int(trace.acc_ptr[op]), int(trace.acc_ptr[op + 1])):
            s = int(trace.acc_storage[k])
            va = int(st_va[s])
            lo, hi = int(trace.acc_lo[k]), int(trace.acc_hi[k])
            if va >= 0 and hi > lo:
                yield types[s], (va + lo, hi - lo), s

    for op in range(trace.n_ops):
        phase = int(trace.op_phase[op])
        if op == 0 and trace.op_kind[0] == KIND_H2D_COPY:
            continue  # the batch copy precedes the timed step (lab.inputs)
        if phase == PHASE_OPT:
            opt_ops.append(op)
            continue
        owners = [layer[s] for _, _, s in spans_of(op) if s in layer
                  and (phase == PHASE_BWD or trace.st_type[s] == _PARAM)]
        owner = owners[0] if owners else None
        key = (phase_name[phase], owner if owner is not None else -1)
        if current is None or current[0] != key[0] or (
                owner is not None and owner != current[1] and (previous is None or previous != key)):
            previous = current
            current = key
            positions.append(Position(key[0], f"layer {key[1]}" if key[1] >= 0 else STEP_POSITION))
            starts.append(op)
            compute.append(0.0)
            host_us.append(0.0)
        for dtype, span, _ in spans_of(op):
            positions[-1].add(dtype, [span])
        compute[-1] += float(base[op])
        host_us[-1] += float(host[op])

    # the optimizer, one layer at a time: its state, parameters and gradients; temporaries kept apart
    opt_layers: dict[int, Position] = {}
    out_layer: dict[int, int] = {}
    own_us = {"compute": np.zeros(max(n_layers, 1)), "host": np.zeros(max(n_layers, 1))}
    shared_ops: list[int] = []  # ops over many layers (foreach): launched again for every layer's step
    for op in opt_ops:
        accesses = list(spans_of(op))
        lo, hi = int(trace.acc_ptr[op]), int(trace.acc_ptr[op + 1])
        inputs = [layer.get(s, out_layer.get(s)) for s in trace.acc_storage[lo:hi].tolist()]
        inputs_known = [lay for k, lay in enumerate(inputs) if lay is not None
                        and trace.acc_write[lo + k] != ACC_WRITE_ONLY]
        new = [int(trace.acc_storage[lo + k]) for k in range(hi - lo)
               if trace.acc_write[lo + k] == ACC_WRITE_ONLY and int(trace.acc_storage[lo + k]) not in layer]
        for k, s in enumerate(new):  # a foreach result: the layer of the k-th element of its input lists
            if inputs_known:
                out_layer.setdefault(s, inputs_known[k % len(inputs_known)])
        touched: set[int] = set()
        for dtype, span, s in accesses:
            if s in layer:
                lay = layer[s]
                touched.add(lay)
                if lay not in opt_layers:
                    opt_layers[lay] = Position("optimizer", f"layer {lay}")
                opt_layers[lay].add(dtype, [span])
        if len(touched) == 1:  # one layer's own op (a gradient's zero_): that layer's step only
            lay = touched.pop()
            own_us["compute"][lay] += float(base[op])
            own_us["host"][lay] += float(host[op])
        else:
            shared_ops.append(op)
    for s, lay in out_layer.items():
        scratch[lay] += int(trace.st_nbytes[s])
    param_bytes = np.zeros(max(n_layers, 1))
    for s, lay in layer.items():
        if trace.st_type[s] == _PARAM:
            param_bytes[lay] += int(trace.st_nbytes[s])
    total_param = float(param_bytes.sum()) or 1.0
    shared_compute = float(base[shared_ops].sum()) if shared_ops else 0.0
    # each layer's step launches the shared ops again: their dispatch (cpu_op_us each) per layer, the rest of
    # their host time (Python over the tensor lists, views) in proportion to the layer's parameter tensors
    shared_host = float(host[shared_ops].sum()) if shared_ops else 0.0
    dispatch = min(shared_host, profile.cpu_op_us * len(shared_ops))
    tensors = np.zeros(max(n_layers, 1))
    for s, lay in layer.items():
        if trace.st_type[s] == _PARAM:
            tensors[lay] += 1
    total_tensors = float(tensors.sum()) or 1.0
    remote = by_layer(remote_costs(trace, layout, profile, opt_ops), layer)
    costs: list[tuple[RemoteCost, ...]] = [()] * len(positions)
    stepped = sorted(opt_layers)
    runs = ([[k] for k in range(len(stepped))] if optimizer_chunk_bytes is None
            else join_consecutive([int(param_bytes[lay]) for lay in stepped], optimizer_chunk_bytes))
    chunk_scratch = 0
    for run in runs:  # one optimizer step per chunk: the shared ops dispatched once, their other host time shared
        lays = [stepped[k] for k in run]
        if len(lays) == 1:
            position = opt_layers[lays[0]]
        else:
            position = Position("optimizer", f"layers {lays[0]}..{lays[-1]}")
            for a in (a for lay in lays for a in opt_layers[lay].accesses):
                position.add(a.data_type, a.spans)
        costs.append(tuple(c for lay in lays for c in remote.get(lay, ())))
        positions.append(position)
        starts.append(opt_ops[0] if opt_ops else trace.n_ops)
        compute.append(sum(shared_compute * float(param_bytes[lay]) / total_param + float(own_us["compute"][lay])
                           for lay in lays))
        host_us.append(dispatch + sum((shared_host - dispatch) * float(tensors[lay]) / total_tensors
                                      + float(own_us["host"][lay]) for lay in lays))
        chunk_scratch = max(chunk_scratch, int(sum(scratch[lay] for lay in lays)))
    segments = _type_runs(layout)
    grads = frozenset(p for p, _ in segments if DATA_TYPES[int(layout.block_type[p // BLOCK])] is DataType.GRAD)
    if not runs:
        chunk_scratch = int(scratch.max()) if len(scratch) else 0
    return DerivedOrder(Order(positions, segments), compute, host_us, chunk_scratch, len(runs), grads,
                        tuple(starts), tuple(costs))


def budget_footprint(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int) -> int:
    """Live managed bytes of ``trace``'s step in a session with a GPU budget of ``budget_bytes``: the pools' segments
    as without a budget, but the optimizer stepped in chunks, so its pool holds its state and the temporaries of
    about :attr:`~um_lab.sim.profile.Profile.optimizer_cached_chunks` chunks instead of one whole step's."""
    derived = budget_order(trace, layout, profile, budget_bytes)
    segments = layout.segment_bytes
    optim = int(segments.get(DataType.OPTIM, 0))
    state = trace.bytes_by_type(persistent_only=True).get(DataType.OPTIM.value, 0)
    held = state + profile.optimizer_cached_chunks * derived.optim_scratch_bytes
    return int(sum(segments.values()) - optim + min(optim, -(-int(held) // BLOCK) * BLOCK))


def _type_runs(layout: Layout) -> list[Span]:
    """The layout's managed memory as runs of consecutive blocks of one data type (a prefetch call each;
    the real pools' segments may split a run further, so calls are a lower bound)."""
    types = layout.block_type
    runs: list[Span] = []
    start = 0
    for b in range(1, len(types) + 1):
        if b == len(types) or types[b] != types[start]:
            runs.append((start * BLOCK, (b - start) * BLOCK))
            start = b
    return runs


def plan_budget(derived: DerivedOrder, budget_bytes: int, lookahead: int = 2, discard: bool = False,
                remote_optimizer: bool = False) -> Plan:
    """The scheduler's steady-state plan of ``derived`` under ``budget_bytes`` less the optimizer's
    temporaries (whole blocks); ``discard``: dead gradients discarded, as the experimental
    ``discard_gradients`` option; ``remote_optimizer``: optimizer state the plan would move left in host memory,
    as the experimental ``remote_optimizer`` option (on by default). Raises :class:`BudgetTooSmall` when one
    position cannot fit."""
    scratch = -(-derived.optim_scratch_bytes // BLOCK) * BLOCK
    usable = budget_bytes - scratch
    if usable < BLOCK:
        raise BudgetTooSmall(budget_bytes, scratch + BLOCK, "the optimizer's temporaries of one layer")
    return make_plan(derived.order, usable, lookahead, discard_segments=derived.grad_segments if discard else (),
                     remote_optimizer=remote_optimizer)


def restore_start(backward: Sequence[bool], out_bytes: Sequence[int]) -> int:
    """The position at which staged activations start coming back: the one after forward's last copy out
    (:meth:`~um_lab.schedule.live.stage.ActivationStager.forward_done`), backward's first at the latest."""
    first_back = next((i for i, b in enumerate(backward) if b), len(backward))
    last_out = max((i for i, nbytes in enumerate(out_bytes) if nbytes and not backward[i]), default=None)
    return first_back if last_out is None else min(last_out + 1, first_back)


def replay_plan(derived: DerivedOrder, plan: Plan, profile: Profile, *,
                evict_GBps: float | None = None, prefetch_GBps: float | None = None,
                staging: StageCopies | None = None,
                remote_copies: bool = False) -> BudgetStep:
    """The steady step's time on the four clocks of the module docstring (``evict_GBps``: the
    GPU->host rate, default the profile's ``scheduler_d2h_GBps``, else ``prefetch_d2h_GBps``; ``prefetch_GBps``:
    the host->GPU rate, default ``scheduler_h2d_GBps``, else ``prefetch_h2d_GBps``; ``staging``: saved
    activations copied through pinned memory on a fifth clock, the copy stream, as :mod:`um_lab.sim.staged`
    describes; ``remote_copies``: remote optimizer state copied to the device for its position's step, a
    position ahead, and back after it, on two more clocks at the profile's ``stage_copy_GBps``, as
    :mod:`um_lab.schedule.live.remote_state` does, instead of updated in place over the link)."""
    p = profile
    h2d = (prefetch_GBps or p.scheduler_h2d_GBps or p.prefetch_h2d_GBps) * 1e3  # bytes per microsecond
    d2h = (evict_GBps or p.scheduler_d2h_GBps or p.prefetch_d2h_GBps) * 1e3
    sync = p.prefetch_host_sync >= 0.5
    cpu = mover = side = gpu = 0.0
    next_pending: dict[int, tuple[float, float]] = {}
    wall = busy = 0.0
    waits = calls = 0
    n = len(derived.order.positions)
    copy = 0.0  # the staging copy stream's clock
    backward = [pos.phase == "backward" for pos in derived.order.positions]
    remote_us, remote_link = remote_extra_us(derived.remote_costs, plan.remote_blocks, n)  # state updated over the link
    copied = remote_state_bytes(derived.remote_costs, plan.remote_blocks, n) if remote_copies else [0] * n
    if remote_copies:
        remote_us, remote_link = [0.0] * n, 2.0 * sum(copied)
    copy_rate = p.stage_copy_GBps * 1e3
    first_back = next((i for i in range(n) if backward[i]), n)
    restores_from = restore_start(backward, staging.out_bytes if staging is not None else [0] * n)
    for _ in range(STEADY_STEPS):
        cpu += p.cpu_step_us
        t0 = max(gpu, cpu)
        pending, next_pending = next_pending, {}
        busy = 0.0
        waits = calls = 0
        in_flight: list[tuple[float, int]] = []  # copies to the host: (end, bytes)
        restored: dict[int, float] = {}  # backward position -> the end of its restores
        next_restore = 0
        copy_in = copy_out = 0.0  # the remote state copies' two streams
        copied_in: dict[int, float] = {}
        for i in range(n):
            cpu += HOOK_US_PER_POSITION
            ready = 0.0
            for j in (i, i + 1):  # this position's copies in (if not issued yet), then the next one's
                if j < n and copied[j] and j not in copied_in:
                    copy_in = max(copy_in, cpu, gpu) + copied[j] / copy_rate
                    copied_in[j] = copy_in
            ready = max(ready, copied_in.get(i, 0.0))
            if staging is not None and (backward[i] or i == restores_from):  # a window ahead of backward, in its order
                rate = (staging.GBps or p.stage_copy_GBps) * 1e3
                first = i if backward[i] else first_back
                next_restore = max(next_restore, first)
                ahead = sum(staging.in_bytes[first:next_restore])
                while next_restore < n and backward[next_restore] and (next_restore == first
                                                                        or ahead < staging.window):
                    nbytes = staging.in_bytes[next_restore]
                    if nbytes:  # its device block comes from the compute stream's pool: it waits for compute so far
                        copy = max(copy, cpu, gpu) + nbytes / rate
                        restored[next_restore] = copy
                        ahead += nbytes
                    next_restore += 1
                ready = max(ready, restored.get(i, 0.0))
            for target in sorted(t for t in pending if t <= i):
                side_done, issued = pending.pop(target)
                if issued > cpu:
                    waits += 1
                    cpu = issued
                ready = max(ready, side_done)
            moves = [m for m in plan.moves[i] if m.kind != "touch"]
            if moves:
                compute_event = gpu if any(m.kind in ("evict", "discard") for m in moves) else 0.0
                mover = max(mover, cpu)
                if compute_event:
                    side = max(side, compute_event)
                targets: set[int] = set()
                for m in moves:
                    for _ptr, nbytes in m.spans:
                        blocks = -(-nbytes // BLOCK)
                        if sync:
                            mover = max(mover, side)
                        mover += p.prefetch_call_us + p.prefetch_call_us_per_block * blocks
                        if m.kind in ("discard", "populate"):  # no copy: the driver's page work only
                            rate = p.discard_GBps if m.kind == "discard" else p.discard_populate_GBps
                            took = nbytes / rate / 1e3
                        else:
                            took = nbytes / (h2d if m.kind == "prefetch" else d2h) + p.prefetch_block_us * blocks
                        side = max(side, mover) + took
                        busy += took
                        calls += 1
                    if m.to_gpu:
                        targets.add(m.target)
                for t in targets:
                    if t == i:
                        if mover > cpu:
                            waits += 1
                            cpu = mover
                        ready = max(ready, side)
                    elif t > i:
                        old = pending.get(t, (0.0, 0.0))
                        pending[t] = (max(old[0], side), max(old[1], mover))
                    else:
                        old = next_pending.get(t, (0.0, 0.0))
                        next_pending[t] = (max(old[0], side), max(old[1], mover))
            start = max(gpu, ready, cpu)
            cpu += derived.host_us[i]
            gpu = max(start + derived.compute_us[i] + remote_us[i], cpu + p.kernel_us)
            if copied[i]:
                copy_out = max(copy_out, gpu) + copied[i] / copy_rate
            if staging is not None and staging.out_bytes[i]:  # after the position's ops; the host throttles
                copy = max(copy, gpu) + staging.out_bytes[i] / ((staging.GBps or p.stage_copy_GBps) * 1e3)
                in_flight.append((copy, staging.out_bytes[i]))
                while sum(b for _, b in in_flight) > staging.window and len(in_flight) > 1:
                    cpu = max(cpu, in_flight.pop(0)[0])
        gpu = max(gpu, copy_out)  # the compute stream waits for the copies back at the optimizer's end
        wall = gpu - t0
        cpu = max(cpu, gpu)  # the step's end: the loss is read back
    return BudgetStep(wall, float(sum(derived.compute_us)), busy, waits, calls, float(sum(remote_us)), remote_link)


@dataclasses.dataclass
class BudgetSimulation:
    """A traced step under a budget: its order, the scheduler's plan and the steady step."""

    derived: DerivedOrder
    plan: Plan
    step: BudgetStep


_SIMULATED: dict[tuple[Any, ...], Any] = {}
_SIMULATED_KEEP = 16
_T = TypeVar("_T")


def memoised(key: tuple[Any, ...], compute: Callable[[], _T]) -> _T:
    """``compute()``, kept for the next call with the same ``key`` (the last :data:`_SIMULATED_KEEP` results): a
    pre-flight and the run that follows plan once."""
    hit = _SIMULATED.get(key)
    if hit is not None:
        return cast(_T, hit)
    result = compute()
    if len(_SIMULATED) >= _SIMULATED_KEEP:
        _SIMULATED.pop(next(iter(_SIMULATED)))
    _SIMULATED[key] = result
    return result


def budget_order(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int) -> DerivedOrder:
    """:func:`derive_order` with the optimizer in the chunks a session with ``budget_bytes`` steps it in (memoised
    per trace, profile constants and chunk size: the planner's footprint and every simulation under that budget
    share it)."""
    from um_lab.sim.profile import profile_sha256

    chunk = budget_bytes // OPTIMIZER_CHUNK_DIVISOR
    return memoised(("order", trace.key, profile_sha256(profile), int(chunk)),
                    lambda: derive_order(trace, layout, profile, chunk))


def simulate_budget(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int,
                    lookahead: int = 2, discard: bool = False, remote_optimizer: bool = True) -> BudgetSimulation:
    """Order, plan and steady step of ``trace`` placed by ``layout`` (the steady one) under ``budget_bytes``
    (memoised per trace, profile constants, budget, look-ahead and ``discard``; a pre-flight and the run that
    follows plan once). Raises :class:`BudgetTooSmall`."""
    from um_lab.sim.profile import profile_sha256

    def compute() -> BudgetSimulation:
        derived = budget_order(trace, layout, profile, budget_bytes)
        plan = plan_budget(derived, budget_bytes, lookahead, discard, remote_optimizer)
        return BudgetSimulation(derived, plan, replay_plan(derived, plan, profile))

    key = ("budget", trace.key, profile_sha256(profile), int(budget_bytes), int(lookahead), bool(discard),
           bool(remote_optimizer))
    return memoised(key, compute)


def budget_records(trace: StepTrace, layout: Layout, profile: Profile, steps: int, warmup_steps: int,
                   budget_bytes: int, capacity: int, policy_name: str, backend: str,
                   lookahead: int = 2) -> Iterator[StepRecord]:
    """The SimBackend's records for a run under the layer-ahead scheduler on ``trace`` placed by ``layout``:
    every step the steady step (the first step, which learns the order on a GPU, is not modelled apart)."""
    simulated = simulate_budget(trace, layout, profile, budget_bytes, lookahead)
    derived, plan, step = simulated.derived, simulated.plan, simulated.step
    moved_in, moved_out = moved_by_type(plan, layout)
    return steady_records(trace, layout, plan, step, budget_extra(plan, step, derived, budget_bytes),
                          resident_by_type(plan, layout), moved_in, moved_out, steps=steps,
                          warmup_steps=warmup_steps, capacity=capacity, policy_name=policy_name, backend=backend)


def steady_records(trace: StepTrace, layout: Layout, plan: Plan, step: BudgetStep, extra: dict[str, Any],
                   resident: dict[str, int], moved_in: dict[str, int], moved_out: dict[str, int], *, steps: int,
                   warmup_steps: int, capacity: int, policy_name: str, backend: str) -> Iterator[StepRecord]:
    """One :class:`StepRecord` per step (warm-up steps first), each the simulated steady ``step`` of ``plan``:
    resident and moved bytes per type and ``extra["budget"]`` as given."""
    live = {t.value: int(layout.segment_bytes[t.value]) for t in DATA_TYPES}
    for i in range(warmup_steps + steps):
        yield StepRecord(step=i, wall_ms=step.wall_us / 1e3, live_bytes=live, cap_bytes=None,
                         gpu_capacity_bytes=int(capacity // BLOCK * BLOCK), backend=backend, policy=policy_name,
                         warmup=i < warmup_steps, resident_bytes=dict(resident), htod_bytes=dict(moved_in),
                         dtoh_bytes=dict(moved_out), gpu_page_faults=0,
                         evictions=sum(len(m.blocks) for m in plan.evictions()),
                         remote_bytes=int(step.remote_link_bytes),
                         telemetry="simulated", extra={"budget": dict(extra), "trace_ops": trace.n_ops})


def budget_extra(plan: Plan, step: BudgetStep, derived: DerivedOrder, budget_bytes: int) -> dict[str, Any]:
    """``StepRecord.extra["budget"]`` on the simulator: the plan's totals and where the time went."""
    summary = plan.summary()
    return {**summary, "budget_bytes": budget_bytes, "planned_budget_bytes": plan.budget_bytes,
            "optim_scratch_bytes": derived.optim_scratch_bytes, "followed_plan": True, "planned": True,
            "over_budget": plan.max_resident > plan.budget_bytes, "compute_ms": step.compute_us / 1e3,
            "side_busy_ms": step.side_busy_us / 1e3, "remote_optimizer_ms": step.remote_us / 1e3,
            "host_waits": step.host_waits, "prefetch_calls": step.calls,
            "model": "sim.budget: steady-state plan replayed on host, mover, side-stream and compute clocks"}


def _block_types(layout: Layout) -> np.ndarray:
    return layout.block_type


def resident_by_type(plan: Plan, layout: Layout) -> dict[str, int]:
    """GPU-resident bytes per data type when the steady step starts (its end, too)."""
    types = _block_types(layout)
    out = {t.value: 0 for t in DATA_TYPES}
    for b in plan.start_resident:
        if 0 <= b < len(types):
            out[DATA_TYPES[int(types[b])].value] += BLOCK
    return out


def moved_by_type(plan: Plan, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes prefetched to the GPU and evicted to the host per data type in the steady step."""
    types = _block_types(layout)
    moved_in = {t.value: 0 for t in DATA_TYPES}
    moved_out = {t.value: 0 for t in DATA_TYPES}
    for moves in plan.moves:
        for m in moves:
            target = moved_in if m.kind == "prefetch" else moved_out if m.kind == "evict" else None  # link bytes
            if target is None or not m.blocks:
                continue
            per_block = m.nbytes / len(m.blocks)
            for b in m.blocks:
                target[DATA_TYPES[int(types[b])].value] += int(per_block)
    return moved_in, moved_out
