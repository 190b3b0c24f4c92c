"""The real backend behind the one Backend protocol: a training loop inside a :class:`Session`."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from um_lab.cuda.session import Session
from um_lab.models import ModelCase
from um_lab.policy import Policy
from um_lab.types import RunSpec, StepRecord


class CudaBackend:
    """Trains ``case`` on the GPU with every tensor in per-type managed pools under ``policy``.

    Each step copies the (fixed, synthetic) batch to the GPU into the input pool, as a data loader
    would, then runs forward, backward and the optimizer step. The safety cap is always on unless
    ``allow_oversubscription=True`` is passed (meant for one's own machine only). ``telemetry``
    (default ``"auto"``: on when CUPTI can be used, else each record says why not) is passed to the
    :class:`Session`.
    """

    name = "cuda"

    def __init__(self, *, cap_bytes: int | None = None, allow_oversubscription: bool = False,
                 telemetry: bool | str = "auto") -> None:
        self.cap_bytes = cap_bytes
        self.allow_oversubscription = allow_oversubscription
        self.telemetry = telemetry

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]:
        """Yield one record per step (warm-up steps first, flagged); closing early cleans up."""
        torch.manual_seed(spec.seed)
        model = case.build_model()
        batch = case.batch(spec.seed)
        lab = Session(policy, cap_bytes=self.cap_bytes, allow_oversubscription=self.allow_oversubscription,
                      evacuate_on_close=False, telemetry=self.telemetry)
        lab.open()
        try:
            model = lab.place(model)
            optimizer = lab.attach(model, case.make_optimizer(list(model.parameters())))
            for i in range(spec.warmup_steps + spec.steps):
                inputs = lab.inputs(*batch)
                inputs = inputs if isinstance(inputs, tuple) else (inputs,)
                record = lab.step(functools.partial(case.loss_fn, model, *inputs), optimizer)
                record.warmup = i < spec.warmup_steps
                record.step = i
                del inputs
                yield record
        finally:
            model = optimizer = inputs = None  # type: ignore[assignment]  # noqa: F841 - drop the managed tensors first
            lab.close()
