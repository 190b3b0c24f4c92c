"""One simulated training step: walk the traced ops through the UM driver model with a clock.

Two clocks: the host issues each op in its dispatch time (:func:`um_lab.sim.roofline.op_host_us`)
plus prefetch calls (which first wait for the stream's earlier kernels when ``prefetch_host_sync``
is 1, and cost host time per call and per block); the GPU runs each op for its roofline time,
stretched by remote accesses (which overlap its compute) and delayed by fault servicing and by
prefetches it waits for. The step ends when the GPU and the copy engine are done.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from um_lab.sim.access import OpBlocks
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.trace import KIND_H2D_COPY, StepTrace
from um_lab.sim.uvm import PAGE, PREFETCH_PHASE, PREFETCH_STREAMS, AdviceTable, StepStats, UvmModel
from um_lab.types import DATA_TYPES

#: An optional observer of one simulated step (:mod:`um_lab.sim.timeline`), called as ``recorder(kind, index,
#: start_us, end_us)``: after each op (kind :data:`REC_OP`, the op's index, its GPU start and end), after each
#: explicit prefetch (:data:`REC_PREFETCH_GPU` / :data:`REC_PREFETCH_HOST`, the data type's index in
#: ``DATA_TYPES``, its copy's start and end). It reads the driver model's counters itself; it must not change them.
StepRecorder = Callable[[str, int, float, float], None]
REC_OP, REC_PREFETCH_GPU, REC_PREFETCH_HOST = "op", "prefetch-to-gpu", "prefetch-to-host"


def run_step(model: UvmModel, trace: StepTrace, layout: Layout, ob: OpBlocks, base_us: np.ndarray,
             rm_write_us: np.ndarray, prefetch_stream: str = "compute",
             host_us: np.ndarray | None = None, op_us: np.ndarray | None = None,
             recorder: StepRecorder | None = None) -> StepStats:
    """Simulate one step: walk the ops, servicing faults, remote accesses and prefetches.

    ``base_us``: each op's resident GPU time (:func:`um_lab.sim.roofline.op_times_us`);
    ``rm_write_us``: each op's read_mostly write-fault cost; ``host_us``: each op's host dispatch time
    (:func:`um_lab.sim.roofline.op_host_us`; default ``cpu_op_us`` each). Op 0 (the batch copy) happens before
    the step's timer starts, as in the real backend (``lab.inputs()`` before ``Session.step``); its faults and
    bytes still count. The forward phase's prefetches are issued after it, inside the timed step, so their host
    calls, evictions and copies are on the step's clocks (and they find the fresh batch already written).
    ``op_us``, if given (one float per op), receives each op's GPU time, waits for prefetches excluded.
    ``recorder``, if given, observes each op and prefetch (:data:`StepRecorder`); None (the default) costs nothing.
    """
    if prefetch_stream not in PREFETCH_STREAMS:
        raise ValueError(f"prefetch_stream must be one of {PREFETCH_STREAMS}, got {prefetch_stream!r}")
    on_copy_stream = prefetch_stream == "copy"
    p = model.p
    a = model.a
    model._reset_counters()
    model.block_type[: layout.n_blocks] = layout.block_type
    type_blocks = [np.flatnonzero(layout.block_type == ti) for ti in range(len(DATA_TYPES))]
    protect = np.zeros(len(model.gpu), bool)
    any_rm = bool(a.read_mostly.any())
    rm_block = a.read_mostly[model.block_type] if any_rm else None
    now_gpu = now_cpu = copy_clock = 0.0
    pending = False
    model.arrival[:] = 0.0
    phase = -1
    ptr, blk, msk, wmk, rbytes, wbytes = ob.ptr, ob.block, ob.mask, ob.write_mask, ob.remote_bytes, ob.write_bytes
    ibytes = ob.inplace_bytes
    gpu = model.gpu
    op_phase = trace.op_phase
    if host_us is None:
        host_us = np.full(trace.n_ops, p.cpu_op_us)
    host = host_us.tolist()
    batch_copy = trace.n_ops > 0 and trace.op_kind[0] == KIND_H2D_COPY
    for i in range(trace.n_ops):
        if op_phase[i] != phase and not (i == 0 and batch_copy):
            phase = int(op_phase[i])
            for ti, t in enumerate(DATA_TYPES):
                if a.prefetch_to_gpu[ti] and PREFETCH_PHASE[t] == phase:
                    tb = type_blocks[ti]
                    if p.prefetch_host_sync >= 0.5 and now_gpu > now_cpu:
                        now_cpu = now_gpu  # the call waits until the stream's earlier kernels are done
                    now_cpu += (len(tb) * p.prefetch_call_us_per_block
                                + layout.segment_count[t.value] * p.prefetch_call_us)
                    moved, per_block, t_ev = model.prefetch_to_gpu(tb)
                    start = max(copy_clock, now_cpu) + t_ev
                    if not on_copy_stream:
                        start = max(start, now_gpu)
                    if len(moved):
                        arr = start + np.cumsum(per_block)
                        model.arrival[moved] = arr
                        copy_clock = float(arr[-1])
                        pending = True
                    else:
                        copy_clock = start
                    if not on_copy_stream:
                        now_gpu = max(now_gpu, copy_clock)
                    if recorder is not None:
                        recorder(REC_PREFETCH_GPU, ti, start, copy_clock)
        now_cpu += host[i]
        start = now_gpu if now_gpu > now_cpu else now_cpu
        p0, p1 = ptr[i], ptr[i + 1]
        b = blk[p0:p1]
        m = msk[p0:p1]
        fault_us = remote_us = 0.0
        if ((m & ~gpu[b]) != 0).any():
            protect[b] = True
            fault_us, remote_us = model.access(b, m, wmk[p0:p1], rbytes[p0:p1], protect, wbytes[p0:p1],
                                                ibytes[p0:p1])
            protect[b] = False
        if pending and len(b):
            ready = float(model.arrival[b].max())
            if ready > start:
                start = ready
        if rm_block is not None:
            sel = rm_block[b]
            if sel.any():
                model.invalidate_host_copies(b[sel], wmk[p0:p1][sel])
        base = base_us[i]
        now_gpu = start + (base if base > remote_us else remote_us) + fault_us + rm_write_us[i]
        if op_us is not None:
            op_us[i] = now_gpu - start
        if recorder is not None:
            recorder(REC_OP, i, start, now_gpu)
        if i == 0 and batch_copy:  # the batch copy precedes the timed step and its first prefetches
            now_gpu = now_cpu = copy_clock = 0.0
    end = max(now_gpu, copy_clock)
    for ti, t in enumerate(DATA_TYPES):
        if a.prefetch_to_cpu[ti]:
            begin = end
            end += model.prefetch_to_cpu(type_blocks[ti]) + layout.segment_count[t.value] * p.prefetch_call_us
            if recorder is not None:
                recorder(REC_PREFETCH_HOST, ti, begin, end)
    return StepStats(
        wall_us=end, htod=model.htod.copy(), dtoh=model.dtoh.copy(), resident=model.resident_by_type(),
        faults=model.faults, evictions=model.evictions, remote_bytes=model.remote_bytes,
        fault_us=model.fault_us, remote_us=model.remote_us,
    )


def readmostly_write_us(trace: StepTrace, ob: OpBlocks, block_type: np.ndarray, advice: AdviceTable,
                        profile: Profile) -> np.ndarray:
    """Per-op cost of kernel writes to read_mostly data (one fault per 4 KiB page; copies excluded)."""
    out: np.ndarray = np.zeros(trace.n_ops)
    if not advice.read_mostly.any() or len(ob.block) == 0:
        return out
    entry_op = np.repeat(np.arange(trace.n_ops), np.diff(ob.ptr))
    rm = advice.read_mostly[block_type[ob.block]]
    pages = np.where(rm, np.ceil(ob.write_bytes / PAGE), 0.0)
    out = np.bincount(entry_op, weights=pages, minlength=trace.n_ops) * profile.readmostly_write_fault_us
    out[trace.op_kind == KIND_H2D_COPY] = 0.0
    return out
