"""Memory per data type of a training step, sizing a model to a capacity, and the pre-flight check.

``estimate_memory(case)`` counts live bytes per data type (simulator trace, else an analytic count on
the meta device); ``size_for_ratio(name, capacity_bytes, ratio)`` finds the size knob that
oversubscribes a capacity by ``ratio``; ``check_fits(estimate, cap_bytes)`` refuses a run whose
estimate is above the safety cap (:class:`SizeRefused`). Import them from here.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from um_lab.errors import OversubscriptionRefused, SpecError
from um_lab.models import Batch, ModelCase, get_model
from um_lab.types import ratio_value, whole_bytes
from um_lab.units import available_host_bytes, format_bytes  # noqa: F401 - importable here too

if TYPE_CHECKING:
    from um_lab.sim.profile import Profile


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step keeps live, per data type (keys: ``param grad optim act input``).

    ``act`` counts the tensors autograd saves for backward (the bulk of intermediate results); the
    real peak adds short-lived temporaries and allocator rounding (2 MiB segments), so treat the total
    as a lower bound. ``method`` says where the numbers came from.

    ``total_bytes`` sums each type's own peak: what um_lab's one pool per data type holds. ``native_peak_bytes``
    (from the simulator's trace only, else None) is what one caching allocator holds at the step's peak,
    everything live at once plus ``workspace_bytes`` (cuBLAS workspaces): native PyTorch's
    ``torch.cuda.max_memory_allocated`` for the step.
    """

    model: str
    bytes_per_type: dict[str, int]
    method: str  #: "sim-trace" or "analytic"
    notes: tuple[str, ...] = ()
    native_peak_bytes: int | None = None
    workspace_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """All data types together."""
        return sum(self.bytes_per_type.values())

    def ratio(self, capacity_bytes: int) -> float:
        """Oversubscription ratio of this estimate against ``capacity_bytes``."""
        return self.total_bytes / capacity_bytes

    def describe(self) -> str:
        """A one-line human summary, e.g. ``param 1.2 GiB, grad 1.2 GiB, ... = 7.3 GiB (analytic)``."""
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.bytes_per_type.items())
        return f"{parts} = {format_bytes(self.total_bytes)} ({self.method})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"model": self.model, "bytes_per_type": dict(self.bytes_per_type), "method": self.method,
                "total_bytes": self.total_bytes, "native_peak_bytes": self.native_peak_bytes,
                "workspace_bytes": self.workspace_bytes, "notes": list(self.notes)}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def estimate_memory(case: ModelCase | str, *, use_sim_trace: bool = True, profile: str | Profile = "h200",
                    **knobs: Any) -> MemoryEstimate:
    """Estimate live bytes per data type for one training step of ``case`` (a case or a zoo name).

    Uses the simulator's trace (``um_lab.sim.trace``: each type's peak over one traced step, optimizer
    temporaries and backward temporaries included) when it is available, else (or with
    ``use_sim_trace=False``) an analytic count on the meta device (nothing is allocated): parameters
    and buffers, gradients, optimizer state (the case's optimizer stepped on meta tensors; AdamW = 2x
    parameters), input batch, and the tensors saved for backward during a forward pass. ``profile`` (a
    simulator profile or its name) gives the card's GEMM workspace for ``native_peak_bytes``.
    """
    if isinstance(case, str):

        case = get_model(case, **knobs)
    elif knobs:
        raise TypeError("size knobs are only accepted with a zoo name, not with a ModelCase")
    notes: tuple[str, ...] = ()
    if use_sim_trace:
        input_bytes = sum(_tensor_bytes(t) for t in _meta_batch(case))
        if input_bytes <= SIM_TRACE_MAX_INPUT_BYTES:
            traced = _sim_trace_estimate(case, profile)
            if traced is not None:
                return traced
        else:  # the trace builds the real batch on the CPU: too big here
            notes = (f"sim trace skipped: it would build a {format_bytes(input_bytes)} batch on the CPU",)
    estimate = _analytic_estimate(case)
    return dataclasses.replace(estimate, notes=notes + estimate.notes)


#: above this input-batch size the simulator trace (which materialises the batch) is not used
SIM_TRACE_MAX_INPUT_BYTES = 1 << 30


def _sim_trace_estimate(case: ModelCase, profile: str | Profile = "h200") -> MemoryEstimate | None:
    """Peak live bytes per data type over the simulator's trace of one step (None if unavailable).

    Each type has its own pool on the real backend, so each type's own peak is what its pool holds.
    """
    from um_lab.sim.profile import load_profile

    workspace = load_profile(profile).gemm_workspace_bytes  # a bad profile is the caller's error, not a fallback
    try:
        import numpy as np

        from um_lab.sim.trace import KIND_MATMUL, PHASE_BWD, cached_trace  # FakeTensor trace: no memory used
        from um_lab.types import DATA_TYPES

        trace = cached_trace(case)
        per_type = {dtype.value: trace.peak_bytes(dtype) for dtype in DATA_TYPES}
        gemms = np.asarray(trace.op_kind) == KIND_MATMUL
        backward = np.asarray(trace.op_phase) == PHASE_BWD
        gemm_threads = int((gemms & ~backward).any()) + int((gemms & backward).any())
        peak = trace.peak_bytes()
    except Exception:  # the simulator is missing or changed shape: the analytic estimate stands in
        return None
    return MemoryEstimate(case.name, per_type, "sim-trace",
                          ("peak live bytes per type over one traced step (tensors, before 2 MiB "
                           "segment rounding)",),
                          native_peak_bytes=peak + gemm_threads * workspace,
                          workspace_bytes=gemm_threads * workspace)


def _meta_batch(case: ModelCase) -> Batch:
    try:
        with torch.device("meta"):
            batch = case.make_batch(torch.Generator())
    except Exception:  # a user's batch factory that needs real tensors
        batch = case.make_batch(torch.Generator())
    return tuple(t if t.is_meta else t.to("meta") for t in batch)


def _analytic_estimate(case: ModelCase) -> MemoryEstimate:
    notes: list[str] = []
    with torch.device("meta"):
        model = case.build_model()
    model.train()
    params = list(model.parameters())
    param_bytes = sum(_tensor_bytes(p) for p in params) + sum(_tensor_bytes(b) for b in model.buffers())
    trainable = [p for p in params if p.requires_grad]
    grad_bytes = sum(_tensor_bytes(p) for p in trainable)
    batch = _meta_batch(case)
    input_bytes = sum(_tensor_bytes(t) for t in batch)

    known = {t.untyped_storage()._cdata for t in [*params, *model.buffers(), *batch]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in known:
            saved[storage._cdata] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = case.loss_fn(model, *batch)
        del loss
    except Exception as e:
        notes.append(f"activations not estimated (meta-device forward failed: {type(e).__name__}: {e})")
    act_bytes = sum(saved.values())

    optim_bytes = _optimizer_state_bytes(case, trainable, notes)
    per_type = {"param": param_bytes, "grad": grad_bytes, "optim": optim_bytes, "act": act_bytes,
                "input": input_bytes}
    return MemoryEstimate(case.name, per_type, "analytic", tuple(notes))


def _optimizer_state_bytes(case: ModelCase, trainable: list[nn.Parameter], notes: list[str]) -> int:
    try:
        for p in trainable:
            p.grad = torch.empty_like(p)
        optimizer = case.make_optimizer(trainable)
        optimizer.step()
        return sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.is_meta)
    except Exception as e:
        notes.append(f"optimizer state assumed AdamW (2x parameters): {type(e).__name__}: {e}")
        return 2 * sum(_tensor_bytes(p) for p in trainable)


@dataclasses.dataclass(frozen=True)
class SizedModel:
    """A zoo model sized to oversubscribe a capacity: its knobs, case and estimate."""

    name: str
    knobs: dict[str, Any]
    case: ModelCase
    estimate: MemoryEstimate
    capacity_bytes: int

    @property
    def ratio(self) -> float:
        """The achieved ratio: estimated bytes / capacity."""
        return self.estimate.ratio(self.capacity_bytes)


def size_for_ratio(name: str, capacity_bytes: int, ratio: float, knob: str = "batch_size",
                   max_value: int = 1 << 20, use_sim_trace: bool = True, **fixed: Any) -> SizedModel:
    """The smallest value of ``knob`` (an integer size knob: ``batch_size``, ``width``, ``seq_len``...)
    whose estimated memory reaches ``ratio x capacity_bytes``; other knobs are ``fixed``.

    Example: ``size_for_ratio("mlp", 80 * 2**30, 1.5, knob="batch_size", width=8192)``.
    """
    capacity_bytes = whole_bytes("capacity_bytes", capacity_bytes)
    ratio = ratio_value("ratio", ratio)
    if isinstance(max_value, bool) or not isinstance(max_value, numbers.Integral) or max_value < 1:
        raise SpecError(f"max_value must be a positive integer, got {max_value!r}", "max_value")
    if knob in fixed:
        raise SpecError(f"{knob!r} is the knob being searched; do not fix it", knob)
    target = ratio * capacity_bytes
    cache: dict[int, MemoryEstimate] = {}

    def total(value: int) -> int:
        if value not in cache:
            cache[value] = estimate_memory(get_model(name, **{**fixed, knob: value}),
                                           use_sim_trace=use_sim_trace)
        return cache[value].total_bytes

    low, high = 1, 1
    if total(1) < target:  # a first guess from the slope between 1 and 2 (memory ~ affine in batch)
        slope = total(2) - total(1)
        guess = int((target - total(1)) / slope) + 1 if slope > 0 else 2
        high = min(max(2, guess), max_value)
        while total(high) < target:
            if high >= max_value:
                raise SpecError(
                    f"{name}: {knob}={max_value} is still below {ratio} x {format_bytes(capacity_bytes)} "
                    f"(estimate {format_bytes(total(max_value))}); fix a larger size or raise max_value",
                    knob)
            low, high = high, min(2 * high, max_value)
        while low + 1 < high:  # invariant: total(low) < target <= total(high), or low == 1
            mid = (low + high) // 2
            low, high = (mid, high) if total(mid) < target else (low, mid)
    knobs = {**fixed, knob: high}
    return SizedModel(name, knobs, get_model(name, **knobs), cache[high], capacity_bytes)


class SizeRefused(OversubscriptionRefused):
    """The model's estimated memory does not fit under the safety cap; nothing was allocated."""

    def __init__(self, estimate_bytes: int, cap: int, detail: str = "") -> None:
        self.detail = detail
        super().__init__(
            estimate_bytes, 0, cap, None,
            message=f"um_lab refused to start the run: the estimated memory {format_bytes(estimate_bytes)} "
                    f"({estimate_bytes} B) does not fit under the safety cap {format_bytes(cap)} ({cap} B). "
                    f"Estimate: {detail}. Nothing was allocated. Use a smaller model or batch, or study "
                    "oversubscription in the simulator (backend='sim').")

    def __reduce__(self):
        return (type(self), (self.requested, self.cap, self.detail))


def check_fits(estimate: MemoryEstimate, cap_bytes: int | None) -> MemoryEstimate:
    """Refuse (:class:`SizeRefused`) an estimate above ``cap_bytes`` before anything is allocated.

    The cuda path of the runner calls this with the session's safety cap; ``None`` means no cap.
    """
    if cap_bytes is not None and estimate.total_bytes > cap_bytes:
        raise SizeRefused(estimate.total_bytes, cap_bytes, estimate.describe())
    return estimate



