"""The layer-ahead scheduler's order on a traced step: its positions, each one's GPU and host time.

The real scheduler plans on positions its module hooks record (one layer in one phase). A
:class:`~um_lab.sim.trace.StepTrace` has kernel ops, not modules, so :func:`derive_order` groups ops into
positions by the parameters they touch: parameters first read by one forward op form a *layer* (a
Linear's weight and bias, a norm's scale and shift); a forward position opens at each op that reads
another layer's parameters, a backward position at each op that touches another layer's parameters or
gradients, and ops touching no parameter join the open position. The optimizer is stepped in chunks of
consecutive layers holding at most B/64 of parameters, as the budgeted session does
(:func:`um_lab.schedule.live.record.step_optimizer_in_chunks`; :func:`budget_order` picks the chunk size
for a budget): one position per chunk with its parameters,
gradients and optimizer state. This is coarser than the hooks (which also
open positions for parameter-free modules and containers), so ``lookahead`` positions reach a little
further here than on a GPU. Byte ranges come from the placed layout (:mod:`um_lab.sim.placement`);
the optimizer's temporaries (the foreach step's per-tensor results, one layer's worth when stepped per
layer) are left out of the order and their largest layer's worth is taken off the budget instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from um_lab.schedule.ledger import BLOCK, Span
from um_lab.schedule.order import OPTIMIZER_CHUNK_DIVISOR, STEP_POSITION, Order, Position, join_consecutive
from um_lab.sim.budget_memo import memoised
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.remote_optim import RemoteCost, by_layer, remote_costs
from um_lab.sim.trace import ACC_WRITE_ONLY, KIND_H2D_COPY, PHASE_BWD, PHASE_FWD, PHASE_OPT, StepTrace
from um_lab.types import DATA_TYPES, DataType

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
    #: per position, how many of the scheduler's hook positions it stands for: a forward or backward position
    #: here groups ops by parameters, the hooks open one per module call (the trace's ``hook_positions``,
    #: spread evenly over the phase's positions); an optimizer position is one chunk, as on a GPU
    hook_positions: tuple[float, ...] = ()
    #: per position, its share of the tensors the hooks record in its phase (the trace's ``hook_tensors``, spread
    #: evenly like ``hook_positions``); 0 where they were not counted (an optimizer position, an old trace)
    hook_tensors: tuple[float, ...] = ()


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
                        tuple(starts), tuple(costs), _per_phase_share(positions, trace.hook_positions, 1.0),
                        _per_phase_share(positions, trace.hook_tensors, 0.0))


def _per_phase_share(positions: list[Position], counted: tuple[int, int], uncounted: float) -> tuple[float, ...]:
    """Each position's share of what the trace counted per phase (forward, backward): hook positions or the
    tensors they record; ``uncounted`` where the phase has no count (optimizer positions)."""
    per_phase = dict(zip(("forward", "backward"), counted, strict=True))
    here = {phase: sum(p.phase == phase for p in positions) for phase in per_phase}
    return tuple(per_phase[p.phase] / here[p.phase] if per_phase.get(p.phase) else uncounted for p in positions)


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


def budget_order(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int) -> DerivedOrder:
    """:func:`derive_order` with the optimizer in the chunks a session with ``budget_bytes`` steps it in (memoised
    per trace, profile constants and chunk size: the planner's footprint and every simulation under that budget
    share it)."""
    from um_lab.sim.profile import profile_sha256

    chunk = budget_bytes // OPTIMIZER_CHUNK_DIVISOR
    return memoised(("order", trace.key, profile_sha256(profile), int(chunk)),
                    lambda: derive_order(trace, layout, profile, chunk))
