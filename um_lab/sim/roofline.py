"""Per-op GPU time from a roofline: compute-bound GEMMs, memory-bound elementwise kernels."""

from __future__ import annotations

import numpy as np

from um_lab.sim.profile import Profile
from um_lab.sim.trace import StepTrace


def op_times_us(trace: StepTrace, profile: Profile) -> np.ndarray:
    """GPU time of each op in microseconds with all its data in GPU memory.

    GEMM-like ops (GEMM, convolution, fused attention: each with its own peak) run at
    ``peak * f / (f + f_half)`` (small GEMMs fill the GPU badly), bounded below by their HBM traffic;
    memory-bound ops move ``op_bytes`` at the HBM bandwidth; the batch copy runs at the pinned
    host-to-device bandwidth. Every kernel adds ``kernel_us``.
    """
    flops = trace.op_flops
    kind = trace.op_kind
    mem_us = trace.op_bytes / (profile.hbm_GBps * 1e3)
    t = mem_us.copy()
    for k, tflops, half in ((1, profile.matmul_tflops, profile.matmul_half_gflop),
                            (2, profile.conv_tflops, profile.conv_half_gflop),
                            (4, profile.attention_tflops, profile.matmul_half_gflop)):
        sel = kind == k
        f = flops[sel]
        rate = tflops * 1e6 * f / (f + half * 1e9)  # flop per us
        t[sel] = np.maximum(f / np.maximum(rate, 1e-9), mem_us[sel])
    copy = kind == 3
    t[copy] = trace.op_bytes[copy] / (profile.pinned_h2d_GBps * 1e3)
    return t + profile.kernel_us


def native_step_ms(trace: StepTrace, profile: Profile) -> float:
    """Step time with everything resident: GPU kernels queued behind the host's op dispatch.

    The batch copy (op 0) happens before the timed step, as in the real backend.
    """
    times = op_times_us(trace, profile)
    if trace.n_ops and trace.op_kind[0] == 3:
        times = times[1:]
    return float(queue_time_us(times, profile.cpu_op_us)) / 1e3


def queue_time_us(gpu_us: np.ndarray, cpu_op_us: float) -> float:
    """End time of a kernel queue where the host issues one op every ``cpu_op_us``.

    ``end = max_k (k * cpu_op_us + sum_{j >= k} gpu_us[j])`` (vectorised recurrence).
    """
    n = len(gpu_us)
    if n == 0:
        return 0.0
    suffix = np.cumsum(gpu_us[::-1])[::-1]
    issue = (np.arange(n) + 1) * cpu_op_us
    return float(np.max(issue + suffix))
