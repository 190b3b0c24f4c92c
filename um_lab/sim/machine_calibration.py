"""A profile for the machine at hand: its host's dispatch speed, its GPU's rates and its host link's.

Machines differ where a packaged profile cannot see: the same host-bound step took 1.5-2x longer on some lent H100
machines than on the H200 host the packaged profile was fitted on (and varies between runs on one machine); an H100's
memory is slower than an H200's; the link to host memory and the scheduler's hooks run at speeds of their own on
each host. Four kinds of zoo probes, timed on this GPU, fit one factor each:

* **host** (:data:`HOST_PROBES`, tiny batches: the GPU idles): every host constant (:data:`HOST_FIELDS`),
  :func:`fit_host_scale`, :func:`with_host_scale`;
* **gpu** (:data:`GPU_PROBES`, GPU-bound steps): every GPU rate (:data:`GPU_FIELDS`), as a factor on time;
* **link** (:data:`LINK_PROBES`, an MLP's parameters read from host memory, its optimizer state updated there):
  :data:`LINK_FIELDS`;
* **scheduler** (:data:`SCHEDULER_PROBES`, a budgeted step of many small layers): the scheduler's host time per
  position and per tensor its hooks record (:data:`SCHEDULER_FIELDS`).

:func:`fit_machine` fits them in that order, twice (each probe feels the others a little). The probes are zoo models
only, so a profile calibrated this way predicts any other model without having seen it::

    measured = measure_machine_probes()            # on the GPU machine, about a minute
    fit = fit_machine(load_profile("h200"), measured)
    fit.profile, fit.scales                        # {"host": ..., "gpu": ..., "link": ..., "scheduler": ...}

``measure_host_probes`` / :func:`fit_host_scale` do the host part alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from um_lab.sim.calibration import _golden, _log_err, measure_steps, simulate_ms
from um_lab.sim.profile import Profile

#: The profile's host constants (microseconds of host time), scaled together. The scheduler's hook time per
#: position (``scheduler_hook_us``, Python in the scheduler's own hooks) has its own probe: on one H100 host the
#: host probes ran at 0.50-0.84x the profile's host while the hooks took 112-160 us a position, as the profile says.
HOST_FIELDS = ("cpu_op_us", "cpu_bwd_op_us", "cpu_cudnn_call_us", "cpu_foreach_tensor_us", "cpu_view_op_us",
               "cpu_step_us")
#: Host-bound zoo steps (tiny batches, no advice): a transformer, a convolutional network and a deep MLP.
HOST_PROBES: tuple[dict[str, Any], ...] = (
    {"model": "gpt2-small", "model_kwargs": {"batch_size": 1, "seq_len": 32}, "policy": "um-default"},
    {"model": "resnet50", "model_kwargs": {"batch_size": 1, "image_size": 64}, "policy": "um-default"},
    {"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 64}, "policy": "um-default"},
)
#: The profile's GPU rates (GEMM, attention, convolution and memory throughput), scaled together.
GPU_FIELDS = ("matmul_tflops", "attention_tflops", "conv_tflops", "hbm_GBps", "matmul_16bit_tflops",
              "attention_16bit_tflops", "conv_16bit_tflops")
#: GPU-bound zoo steps (full batches, no advice): a transformer and a convolutional network.
GPU_PROBES: tuple[dict[str, Any], ...] = (
    {"model": "gpt2-small", "model_kwargs": {"batch_size": 4, "seq_len": 1024}, "policy": "um-default"},
    {"model": "resnet50", "model_kwargs": {"batch_size": 64}, "policy": "um-default"},
)
#: The profile's rates of kernels reading and writing host memory over the link (zero-copy data, optimizer state
#: updated in host memory), and the scheduler's prices of remote optimizer state (per GB updated in place or copied
#: in and back: scaled together, so its choice between them stays as the profile makes it). Reads and in-place
#: updates are scaled together: each probe's step does both (the optimizer updates zero-copy parameters in place).
LINK_FIELDS = ("remote_GBps", "remote_write_GBps", "remote_inplace_GBps", "remote_rw_GBps", "remote_colreduce_GBps",
               "remote_update_ms_per_GB", "remote_copy_ms_per_GB")
#: Zoo steps whose time is mostly the link, no scheduler running: an MLP's 0.5 GB of parameters read from host
#: memory, forward and backward, and its 0.94 GB of optimizer state updated there.
LINK_PROBES: tuple[dict[str, Any], ...] = (
    {"model": "mlp", "model_kwargs": {"batch_size": 64, "width": 4096, "depth": 8}, "policy": "zero-copy-params"},
    {"model": "mlp", "model_kwargs": {"batch_size": 64, "width": 4096, "depth": 8}, "policy": "offload-optimizer"},
)
#: The scheduler's host time per position its hooks open and per tensor they record.
SCHEDULER_FIELDS = ("scheduler_hook_us", "scheduler_tensor_us")
#: A budgeted step of 64 small layers, the host probe's MLP: mostly the scheduler's hooks. The link and the scheduler
#: are probed apart, since a budgeted step of large layers mixes the two.
SCHEDULER_PROBES: tuple[dict[str, Any], ...] = (
    {"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 64}, "policy": "layer-ahead",
     "budget": "0.6x"},
)
#: Each kind of probe: its probes and the fields its factor scales.
KINDS: dict[str, tuple[tuple[dict[str, Any], ...], tuple[str, ...]]] = {
    "host": (HOST_PROBES, HOST_FIELDS),
    "gpu": (GPU_PROBES, GPU_FIELDS),
    "link": (LINK_PROBES, LINK_FIELDS),
    "scheduler": (SCHEDULER_PROBES, SCHEDULER_FIELDS),
}


def with_host_scale(profile: Profile, scale: float, name: str | None = None) -> Profile:
    """``profile`` with every host constant (:data:`HOST_FIELDS`) multiplied by ``scale`` (> 0)."""
    profile = with_scale(profile, "host", scale)
    return profile.replace(name=name) if name else profile


def with_scale(profile: Profile, kind: str, scale: float) -> Profile:
    """``profile`` with the fields of one kind of probe (:data:`KINDS`: ``"host"``, ``"gpu"``, ...) taking
    ``scale`` (> 0) times as long: times (``_us``, ``_ms_per_GB``) multiplied by it, rates divided."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    _, fields = KINDS[kind]
    return profile.replace(**{field: getattr(profile, field) * (1.0 / scale if _is_rate(field) else scale)
                              for field in fields})


def _is_rate(field: str) -> bool:
    return field.endswith(("GBps", "tflops"))


def fit_host_scale(profile: Profile, measured: Iterable[Mapping[str, Any]], lo: float = 0.25,
                   hi: float = 4.0) -> tuple[Profile, float]:
    """The factor on ``profile``'s host constants that makes the simulator's steps match ``measured`` (targets
    ``{"model", "model_kwargs", "policy", "ms"}``, host-bound ones: :data:`HOST_PROBES` timed on this machine),
    least squares in log space; returns the scaled profile and the factor (:func:`fit_machine` on host probes)."""
    targets = [{**t, "kind": "host"} for t in measured]
    if not targets:
        raise ValueError("no measured host probes to fit")
    fit = fit_machine(profile, targets, rounds=1, lo=lo, hi=hi)
    return fit.profile, fit.scales["host"]


@dataclasses.dataclass(frozen=True)
class MachineFit:
    """A profile fitted to this machine's probes: the profile, each kind's factor on time (1: as the base
    profile) and each probe with its measured and fitted step."""

    profile: Profile
    scales: Mapping[str, float]
    probes: tuple[Mapping[str, Any], ...]


def fit_machine(profile: Profile, measured: Iterable[Mapping[str, Any]], rounds: int = 2, lo: float = 0.25,
                hi: float = 4.0) -> MachineFit:
    """Fit ``profile`` to probes timed on this machine (:func:`measure_machine_probes`: targets with a ``"kind"`` of
    :data:`KINDS` and their ``"ms"``): one factor per kind present, in the order of :data:`KINDS`, each
    least squares in log space with the others held, ``rounds`` times over."""
    targets = list(measured)
    kinds = [k for k in KINDS if any(t.get("kind") == k for t in targets)]
    if not kinds:
        raise ValueError(f"no measured probes to fit (each needs a 'kind': {', '.join(KINDS)})")
    scales = dict.fromkeys(kinds, 1.0)

    def scaled(values: Mapping[str, float]) -> Profile:
        out = profile
        for kind, value in values.items():
            out = with_scale(out, kind, value)
        return out

    for _ in range(rounds):
        for kind in kinds:
            mine = [t for t in targets if t.get("kind") == kind]

            def loss(value: float, kind: str = kind, mine: list[Mapping[str, Any]] = mine) -> float:
                trial = scaled({**scales, kind: value})
                return sum(_log_err(simulate_ms(trial, t), float(t["ms"])) for t in mine)

            scales[kind] = _golden(loss, lo, hi, iters=24)
    fitted = scaled(scales)
    probes = tuple({**t, "fitted_ms": round(simulate_ms(fitted, t), 3)} for t in targets)
    return MachineFit(fitted, scales, probes)


def measure_host_probes(probes: Iterable[Mapping[str, Any]] = HOST_PROBES, steps: int = 15,
                        warmup: int = 5) -> list[dict[str, Any]]:
    """Each probe's median step time on this machine's GPU through the real backend (no telemetry; the simulator's
    replica of each model, as :func:`~um_lab.sim.calibration.measure_steps` runs it): the
    targets :func:`fit_host_scale` takes. Needs CUDA (:class:`~um_lab.errors.CudaUnavailableError` otherwise)."""
    import torch

    from um_lab.errors import CudaUnavailableError

    if not torch.cuda.is_available():
        raise CudaUnavailableError("measuring the calibration probes needs a CUDA GPU")
    from um_lab.backend import get_backend

    return measure_steps(probes, get_backend("cuda", telemetry=False), steps, warmup)


def measure_machine_probes(steps: int = 10, warmup: int = 3) -> list[dict[str, Any]]:
    """Every kind of probe (:data:`KINDS`) timed on this machine's GPU, each marked with its ``"kind"``: the
    targets :func:`fit_machine` takes. Needs CUDA."""
    return [{**m, "kind": kind} for kind, (probes, _) in KINDS.items()
            for m in measure_host_probes(probes, steps, warmup)]
