"""The one protocol both backends implement, and how a name becomes a backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from um_lab.models import ModelCase
from um_lab.policy import Policy
from um_lab.types import RunSpec, StepRecord


@runtime_checkable
class Backend(Protocol):
    """Runs ``spec.steps`` training steps of ``case`` under ``policy``, yielding one record per step.

    Records are yielded as each step completes (warm-up steps first, flagged ``warmup=True``).
    Closing the generator early must leave the process usable (pools released, state restored).
    """

    name: str

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]: ...


def cuda_available() -> bool:
    """True when a CUDA GPU and a CUDA build of torch are present."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend_name(name: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is present, else ``sim``; other names are checked."""
    if name == "auto":
        return "cuda" if cuda_available() else "sim"
    if name not in ("cuda", "sim"):
        raise ValueError(f"unknown backend {name!r}; valid: cuda, sim, auto")
    return name


def get_backend(name: str = "auto", **options) -> Backend:
    """Instantiate a backend by name (``cuda``, ``sim`` or ``auto``)."""
    resolved = resolve_backend_name(name)
    if resolved == "cuda":
        from um_lab.cuda.backend import CudaBackend

        return CudaBackend(**options)
    from um_lab.sim.backend import SimBackend

    return SimBackend(**options)
