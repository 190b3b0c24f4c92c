"""Per-op GPU time from a roofline: compute-bound GEMMs, memory-bound elementwise kernels."""

from __future__ import annotations

import warnings

import numpy as np

from um_lab.sim.ops import BATCH_NORM, BATCH_NORM_BWD
from um_lab.sim.profile import Profile, ProfileDefaultsWarning
from um_lab.sim.trace import KIND_ATTENTION, KIND_CONV, KIND_H2D_COPY, KIND_MATMUL, PHASE_BWD, StepTrace


def op_times_us(trace: StepTrace, profile: Profile) -> np.ndarray:
    """GPU time of each op in microseconds with all its data in GPU memory.

    GEMM-like ops (GEMM, convolution, fused attention: each with its own peak) run at
    ``peak * f / (f + f_half)`` (small GEMMs fill the GPU badly), bounded below by their HBM traffic; a
    16-bit one (autocast) at the profile's 16-bit peak with the same fixed cost ``f_half / peak``;
    memory-bound ops move ``op_bytes`` at the HBM bandwidth (batch norms ``norm_*_hbm_passes`` times);
    the batch copy runs at the pinned host-to-device bandwidth. Every kernel adds ``kernel_us``.
    """
    flops = trace.op_flops
    kind = trace.op_kind
    mem_us = trace.op_bytes / (profile.hbm_GBps * 1e3)
    for names, passes in ((BATCH_NORM, profile.norm_fwd_hbm_passes), (BATCH_NORM_BWD, profile.norm_bwd_hbm_passes)):
        if passes != 1.0:
            sel = np.array([name in names for name in trace.op_names], bool)
            mem_us[sel] *= passes
    t = mem_us.copy()
    sixteen = trace.op_16bit if trace.op_16bit is not None else np.zeros(len(kind), bool)
    missing = [name for k, name in ((KIND_MATMUL, "matmul"), (KIND_CONV, "conv"), (KIND_ATTENTION, "attention"))
               if getattr(profile, f"{name}_16bit_tflops") == 0 and (sixteen & (kind == k)).any()]
    if missing:
        warnings.warn(f"profile {profile.name!r} has no 16-bit tensor-core rate for {', '.join(missing)} kernels: "
                      "they are costed at the fp32 rates, an upper bound on their time", ProfileDefaultsWarning,
                      stacklevel=2)
    for k, tflops, half, tflops_16 in (
            (KIND_MATMUL, profile.matmul_tflops, profile.matmul_half_gflop, profile.matmul_16bit_tflops),
            (KIND_CONV, profile.conv_tflops, profile.conv_half_gflop, profile.conv_16bit_tflops),
            (KIND_ATTENTION, profile.attention_tflops, profile.attention_half_gflop, profile.attention_16bit_tflops)):
        for is_16, peak in ((False, tflops), (True, tflops_16 or tflops)):
            sel = (kind == k) & (sixteen == is_16)
            f = flops[sel]
            # time = (f + half) / peak: a 16-bit kernel keeps the fp32 kind's fixed cost half / peak
            fixed_us = half * 1e9 / (tflops * 1e6)
            t[sel] = np.maximum(f / (peak * 1e6) + fixed_us, mem_us[sel])
    copy = kind == KIND_H2D_COPY
    t[copy] = trace.op_bytes[copy] / (profile.pinned_h2d_GBps * 1e3)
    return t + profile.kernel_us


#: ATen ops that go through cuDNN (descriptor set-up and an execution-plan lookup on the host per
#: call) -> number of cuDNN calls (a convolution's backward runs data- and filter-gradient kernels).
CUDNN_CALLS: dict[str, int] = {
    "aten.convolution": 1, "aten._convolution": 1, "aten.cudnn_convolution": 1, "aten.convolution_backward": 2,
    "aten.native_batch_norm": 1, "aten.native_batch_norm_backward": 1, "aten.cudnn_batch_norm": 1,
    "aten.cudnn_batch_norm_backward": 1, "aten._native_batch_norm_legit": 1,
    "aten._native_batch_norm_legit_functional": 1,
}


def op_host_us(trace: StepTrace, profile: Profile) -> np.ndarray:
    """Host (CPU) time to dispatch each op: what bounds a step whose kernels are short.

    Forward ops go through Python (module call, dispatcher, autograd recording): ``cpu_op_us``;
    backward ops are issued by autograd's C++ engine: ``cpu_bwd_op_us``; optimizer-phase ops are
    Python again (``cpu_op_us``), and a ``foreach`` op also walks its tensor lists in Python
    (grouping by device and dtype, per-tensor scalars): ``cpu_foreach_tensor_us`` per tensor
    argument. cuDNN calls (convolution, batch norm) add ``cpu_cudnn_call_us`` each. Host-only ops (views,
    reshapes, allocations) dispatched before an op in the forward or optimizer phase add
    ``cpu_view_op_us`` each (in the backward they are C++ calls, counted in ``cpu_bwd_op_us``). The
    step's fixed cost ``cpu_step_us`` is paid before its first op. The batch copy (op 0) is issued
    before the step's timer.
    """
    n = trace.n_ops
    backward = trace.op_phase == PHASE_BWD
    host = np.where(backward, profile.cpu_bwd_op_us, profile.cpu_op_us).astype(np.float64)
    if trace.op_host_only is not None:
        host += np.where(backward, 0.0, trace.op_host_only * profile.cpu_view_op_us)
    n_args = np.diff(trace.acc_ptr).astype(np.float64)
    foreach = np.array([name.startswith("aten._foreach") for name in trace.op_names], bool)
    host[foreach] += n_args[foreach] * profile.cpu_foreach_tensor_us
    cudnn = np.array([CUDNN_CALLS.get(name, 0) for name in trace.op_names], np.float64)
    host += cudnn * profile.cpu_cudnn_call_us
    first = 0
    if n and trace.op_kind[0] == KIND_H2D_COPY:
        host[0] = 0.0
        first = 1
    if n > first:
        host[first] += profile.cpu_step_us
    return host


def native_step_ms(trace: StepTrace, profile: Profile) -> float:
    """Step time with everything resident: GPU kernels queued behind the host's op dispatch.

    The batch copy (op 0) happens before the timed step, as in the real backend.
    """
    times = op_times_us(trace, profile)
    host = op_host_us(trace, profile)
    if trace.n_ops and trace.op_kind[0] == KIND_H2D_COPY:
        times, host = times[1:], host[1:]
    return float(queue_time_us(times, host)) / 1e3


def queue_time_us(gpu_us: np.ndarray, cpu_op_us: float | np.ndarray) -> float:
    """End time of a kernel queue where the host needs ``cpu_op_us`` to issue each op (a scalar, or
    one value per op).

    ``end = max_k (issue_k + sum_{j >= k} gpu_us[j])`` with ``issue_k`` the host's cumulative
    dispatch time up to op k (vectorised recurrence).
    """
    n = len(gpu_us)
    if n == 0:
        return 0.0
    suffix = np.cumsum(gpu_us[::-1])[::-1]
    issue = np.cumsum(np.broadcast_to(np.asarray(cpu_op_us, np.float64), (n,)))
    return float(np.max(issue + suffix))
