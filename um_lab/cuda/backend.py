"""The real backend behind the one Backend protocol: a training loop inside a :class:`Session`."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

import um_lab.backend
from um_lab.backend_base import BackendBase
from um_lab.cuda.allocator import default_cap
from um_lab.cuda.session import Session
from um_lab.errors import CudaUnavailableError
from um_lab.models import ModelCase
from um_lab.policy import Policy
from um_lab.schedule.config import Budget
from um_lab.schedule.request import lookahead, resolve_budget, stages, uses_budget
from um_lab.sizing import check_fits, estimate_memory
from um_lab.training import LossScaler
from um_lab.types import RunSpec, StepRecord


class CudaBackend(BackendBase):
    """Trains ``case`` on the GPU with every tensor in per-type managed pools under ``policy``.

    Each step copies the (fixed, synthetic) batch to the GPU into the input pool, as a data loader
    would, then runs forward, backward and the optimizer step. The safety cap is always on unless
    ``allow_oversubscription=True`` is passed (meant for one's own machine only); a run whose estimated
    memory does not fit under it is refused by :meth:`preflight` before anything is allocated.
    ``telemetry`` (default ``"auto"``: on when CUPTI can be used, else each record says why not) is
    passed to the :class:`Session`. A run with a GPU budget (``RunSpec.budget``, or the policy ``layer-ahead`` with
    one) trains under the layer-ahead scheduler (``Session(budget=...)``, its lookahead positions ahead); each record's
    ``extra["budget"]`` holds the scheduler's numbers.
    """

    name = "cuda"
    simulates_capacity = False  # real memory: size the model instead (um_lab.sizing.size_for_ratio)

    def __init__(self, *, cap_bytes: int | None = None, allow_oversubscription: bool = False,
                 telemetry: bool | str = "auto") -> None:
        self.cap_bytes = cap_bytes
        self.allow_oversubscription = allow_oversubscription
        self.telemetry = telemetry

    @property
    def measures_residency(self) -> bool:
        """True unless telemetry is off: CUPTI measures residency (a record says why when it cannot)."""
        return self.telemetry is not False

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`CudaUnavailableError` without a CUDA GPU and a CUDA build of torch."""
        if not um_lab.backend.cuda_available():
            raise CudaUnavailableError("no CUDA GPU (or a CPU build of torch) in this process")

    def capacity_for(self, spec: RunSpec, footprint: int) -> int | None:
        """The safety cap the session will apply: ``cap_bytes``, else the default cap of the free GPU
        memory; None when oversubscription is allowed or there is no GPU to protect (then the run itself
        is refused)."""
        if self.allow_oversubscription:
            return None
        if self.cap_bytes is not None:
            return int(self.cap_bytes)
        if not um_lab.backend.cuda_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return default_cap(free, total)

    def preflight(self, spec: RunSpec, case: ModelCase, policy: Policy) -> dict[str, Any]:
        """Refuse a run whose estimated memory cannot fit under the safety cap, before any allocation.

        Raises :class:`~um_lab.sizing.SizeRefused` (an ``OversubscriptionRefused``) showing the estimate.
        Returns the estimate and cap (recorded in ``model.json``).
        """
        estimate = estimate_memory(case)
        cap = self.capacity_for(spec, estimate.total_bytes)
        check_fits(estimate, cap)
        checked: dict[str, Any] = {"estimate": estimate.to_dict(), "cap_bytes": cap}
        budget = self.budget_for(spec, case, policy, footprint=estimate.total_bytes, cap=cap)
        if budget is not None:
            checked["budget_bytes"] = budget
        return checked

    def budget_for(self, spec: RunSpec, case: ModelCase, policy: Policy, *, footprint: int | None = None,
                   cap: int | None = None) -> int | None:
        """The run's GPU budget in bytes (None: no scheduler): ``RunSpec.budget`` in bytes, or
        its fraction of the estimated footprint (:func:`um_lab.sizing.estimate_memory`;
        ``footprint`` and ``cap`` when the caller has them already). ``layer-ahead`` without one, or a
        budget above the safety cap, raises :class:`~um_lab.errors.BudgetError` before anything is
        allocated."""
        if not uses_budget(spec, policy):
            return None
        if footprint is None:
            footprint = estimate_memory(case).total_bytes
        if cap is None:
            cap = self.capacity_for(spec, footprint)
        return resolve_budget(spec, policy, footprint, default_bytes=None, limit_bytes=cap,
                              limit_name="the safety cap")

    def environment(self) -> dict[str, Any]:
        """The GPU's name, memory, compute capability and count (``cpu`` without a GPU)."""
        if not torch.cuda.is_available():
            return {"device": {"name": "cpu"}}
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"device": {"name": props.name, "total_memory_bytes": props.total_memory,
                           "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}}

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]:
        """Yield one record per step (warm-up steps first, flagged); closing early cleans up."""
        budget = self.budget_for(spec, case, policy)
        torch.manual_seed(spec.seed)
        model = case.build_model()
        batch = case.batch(spec.seed)
        lab = Session(policy, cap_bytes=self.cap_bytes, allow_oversubscription=self.allow_oversubscription,
                      evacuate_on_close=False, telemetry=self.telemetry,
                      budget=None if budget is None else Budget(budget, lookahead=lookahead(spec),
                                                                stage_activations=stages(spec, policy)))
        lab.open()
        inputs: Any = None
        loss_fn: Any = None
        scaler: LossScaler | None = None
        try:
            model = lab.place(model)
            optimizer = lab.attach(model, case.make_optimizer(list(model.parameters())))
            if spec.precision == "fp16":  # a dynamic loss scale; the step skips an update with infinite gradients
                scaler = LossScaler("cuda")
                scaler.guard(optimizer)
            for i in range(spec.warmup_steps + spec.steps):
                inputs = lab.inputs(*batch)
                inputs = inputs if isinstance(inputs, tuple) else (inputs,)
                loss_fn = functools.partial(case.loss_fn, model, *inputs)
                if scaler is None:
                    record = lab.step(loss_fn, optimizer)
                else:
                    scale = scaler.value
                    record = lab.step(functools.partial(_scaled, scaler, loss_fn), optimizer,
                                      before_optimizer=functools.partial(scaler.unscale, optimizer))
                    scaler.update()
                    if record.loss is not None:
                        record.loss /= scale
                    record.extra["loss_scale"], record.extra["skipped_updates"] = scale, scaler.skipped
                record.warmup = i < spec.warmup_steps
                record.step = i
                del inputs
                yield record
        finally:
            # drop every reference to the managed tensors before the pools close: a tensor still held then keeps
            # its segment until the next session empties the cache (the next run would count it as its own)
            model = optimizer = inputs = loss_fn = scaler = None  # type: ignore[assignment]  # noqa: F841
            lab.close()


def _scaled(scaler: LossScaler, loss_fn: Any) -> torch.Tensor:
    return scaler.scale(loss_fn())
