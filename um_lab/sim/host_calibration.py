"""The host side of a profile for the machine at hand: how fast this host dispatches a training step's ops.

A step whose kernels are short is bound by the host (Python, the dispatcher, autograd's engine, kernel launches),
and hosts differ: the same host-bound step took 1.5-2x longer on some lent H100 machines than on the H200 host the
packaged profile was fitted on, and varies between runs on one machine. :func:`measure_host_probes` times a few
host-bound zoo steps (tiny batches: the GPU idles) on this GPU; :func:`fit_host_scale` finds the one factor on
every host constant of a profile (:data:`HOST_FIELDS`) that makes the simulator match them;
:func:`with_host_scale` applies a factor. The probes are zoo models only, so a profile calibrated this way
predicts any other model without having seen it::

    measured = measure_host_probes()                 # on the GPU machine, a few seconds
    profile, scale = fit_host_scale(load_profile("h200"), measured)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from um_lab.sim.calibration import _golden, _log_err, measure_steps, simulate_ms
from um_lab.sim.profile import Profile

#: The profile's host constants (microseconds of host time), scaled together.
HOST_FIELDS = ("cpu_op_us", "cpu_bwd_op_us", "cpu_cudnn_call_us", "cpu_foreach_tensor_us", "cpu_view_op_us",
               "cpu_step_us")
#: Host-bound zoo steps (tiny batches, no advice): a transformer, a convolutional network and a deep MLP.
HOST_PROBES: tuple[dict[str, Any], ...] = (
    {"model": "gpt2-small", "model_kwargs": {"batch_size": 1, "seq_len": 32}, "policy": "um-default"},
    {"model": "resnet50", "model_kwargs": {"batch_size": 1, "image_size": 64}, "policy": "um-default"},
    {"model": "mlp", "model_kwargs": {"batch_size": 8, "width": 256, "depth": 64}, "policy": "um-default"},
)


def with_host_scale(profile: Profile, scale: float, name: str | None = None) -> Profile:
    """``profile`` with every host constant (:data:`HOST_FIELDS`) multiplied by ``scale`` (> 0)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    changes: dict[str, Any] = {field: getattr(profile, field) * scale for field in HOST_FIELDS}
    return profile.replace(**changes, **({"name": name} if name else {}))


def fit_host_scale(profile: Profile, measured: Iterable[Mapping[str, Any]], lo: float = 0.25,
                   hi: float = 4.0) -> tuple[Profile, float]:
    """The factor on ``profile``'s host constants that makes the simulator's steps match ``measured`` (targets
    ``{"model", "model_kwargs", "policy", "ms"}``, host-bound ones: :data:`HOST_PROBES` timed on this machine),
    least squares in log space; returns the scaled profile and the factor."""
    targets = list(measured)
    if not targets:
        raise ValueError("no measured host probes to fit")

    def loss(scale: float) -> float:
        scaled = with_host_scale(profile, scale)
        return sum(_log_err(simulate_ms(scaled, t), float(t["ms"])) for t in targets)

    scale = _golden(loss, lo, hi, iters=24)
    return with_host_scale(profile, scale), scale


def measure_host_probes(probes: Iterable[Mapping[str, Any]] = HOST_PROBES, steps: int = 15,
                        warmup: int = 5) -> list[dict[str, Any]]:
    """Each probe's median step time on this machine's GPU through the real backend (no telemetry; the simulator's
    replica of each model, as :func:`~um_lab.sim.calibration.measure_steps` runs it): the
    targets :func:`fit_host_scale` takes. Needs CUDA (:class:`~um_lab.errors.CudaUnavailableError` otherwise)."""
    import torch

    from um_lab.errors import CudaUnavailableError

    if not torch.cuda.is_available():
        raise CudaUnavailableError("measuring the host probes needs a CUDA GPU")
    from um_lab.backend import get_backend

    return measure_steps(probes, get_backend("cuda", telemetry=False), steps, warmup)
