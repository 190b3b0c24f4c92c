"""How a model trains, beyond its memory advice: numeric precision and activation recompute.

Both are transforms of a :class:`~um_lab.models.ModelCase`: :func:`with_training` returns a case whose
model recomputes the chosen layers' activations in backward (``torch.utils.checkpoint``, non-reentrant) and
whose loss runs under autocast. The simulator traces the transformed case, the CUDA backend trains it, so
both see the same step.

* ``precision``: ``"fp32"`` (the default), ``"bf16"`` or ``"fp16"`` — autocast with fp32 master weights,
  gradients and optimizer state; ``fp16`` also scales the loss (:class:`LossScaler`).
* ``recompute``: ``"none"``, ``"every-layer"``, a number *n* (the first *n* layers: the activations kept
  longest), or the names of the layers to recompute (see :func:`layer_names`). A run's ``"auto"`` is
  resolved by the memory planner (:mod:`um_lab.sim.planner`) to one of these before the case is built.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from um_lab.errors import SpecError
from um_lab.types import Recompute, check_precision, check_recompute

#: The dtype autocast computes in, per precision (None: no autocast).
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _containers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            yield name, module


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated layers, in order: the children of a ``ModuleList`` or ``Sequential`` that share
    their class with a sibling (a transformer's blocks, a ResNet's bottlenecks, an MLP's hidden layers),
    outermost first (a layer inside a layer is not one)."""
    found: list[tuple[str, nn.Module]] = []
    for name, container in _containers(model):
        classes = [type(c) for c in container.children()]
        for child_name, child in container.named_children():
            if classes.count(type(child)) < 2:
                continue
            path = f"{name}.{child_name}" if name else child_name
            if any(path.startswith(p + ".") for p, _ in found):
                continue  # inside a layer already found
            found.append((path, child))
    return found


def layer_names(model: nn.Module) -> list[str]:
    """The names :func:`with_training`'s ``recompute`` takes for ``model`` (see :func:`layers`)."""
    return [name for name, _ in layers(model)]


@contextlib.contextmanager
def _function_modes(modes: Sequence[Any]) -> Iterator[None]:
    """Re-enter the torch function modes a layer's forward ran under (the simulator's kernel choices), which
    backward's recompute runs without."""
    with contextlib.ExitStack() as stack:
        active = {id(m) for m in torch.overrides._get_current_function_mode_stack()}  # noqa: SLF001
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        modes = list(torch.overrides._get_current_function_mode_stack())  # noqa: SLF001

        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _function_modes(modes)

        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


def _planned_only(model_name: str) -> SpecError:
    return SpecError(f"recompute='auto': the memory planner chooses {model_name}'s layers for a run with a GPU "
                     "budget (RunSpec(recompute='auto', budget=...), um_lab.sim.planner.plan_memory)", "recompute")


def recompute_layers(model: nn.Module, recompute: Recompute, model_name: str = "model") -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` that ``recompute`` chooses (nothing changed); a name that is not a layer, or
    more layers than there are, raises :class:`~um_lab.errors.SpecError` listing the layers there are."""
    recompute = check_recompute(recompute)
    if recompute in ("none", 0):
        return []
    if recompute == "auto":
        raise _planned_only(model_name)
    found = layers(model)
    if not found:
        raise SpecError(f"recompute={recompute!r}: {model_name} has no repeated layers to recompute (children of "
                        "a ModuleList or Sequential that share a class)", "recompute")
    if recompute == "every-layer":
        return found
    if isinstance(recompute, int):
        if recompute > len(found):
            raise SpecError(f"recompute={recompute}: {model_name} has {len(found)} layers", "recompute")
        return found[:recompute]
    by_name = dict(found)
    unknown = [n for n in recompute if n not in by_name]
    if unknown:
        shown = ", ".join(n for n, _ in found[:8]) + (", ..." if len(found) > 8 else "")
        raise SpecError(f"recompute: {unknown[:4]} are not layers of {model_name}; its layers: {shown}"[:400],
                        "recompute")
    return [(n, by_name[n]) for n in recompute]


def apply_recompute(model: nn.Module, recompute: Recompute, model_name: str = "model") -> list[str]:
    """Make the layers ``recompute`` chooses (:func:`recompute_layers`) recompute their activations in
    backward, in place: each one's ``forward`` runs under non-reentrant ``torch.utils.checkpoint`` (names and
    parameters unchanged). Returns their names."""
    chosen = recompute_layers(model, recompute, model_name)
    if not chosen:
        return []
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", None):  # a Hugging Face model: its key-value cache would differ on recompute
        config.use_cache = False
    for _, layer in chosen:
        if "forward" not in vars(layer):  # not already wrapped
            layer.forward = _checkpointed(layer.forward)
    return [n for n, _ in chosen]


#: Functions CUDA's autocast runs in fp32 that the CPU's autocast leaves in the 16-bit dtype (torch's autocast op
#: lists, by function name: ``torch.pow`` and ``Tensor.pow`` alike).
CUDA_FP32_FUNCTIONS = frozenset({
    "pow", "__pow__", "__rpow__", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "acos",
    "asin", "cosh", "sinh", "tan", "erfinv", "softplus", "layer_norm", "group_norm", "softmax", "log_softmax",
    "logsumexp", "cumsum", "cumprod", "cosine_similarity", "renorm", "dist", "pdist"})


class CudaAutocastOnCpu(torch.overrides.TorchFunctionMode):
    """Under the CPU's autocast, compute in fp32 what CUDA's autocast computes in fp32 (:data:`CUDA_FP32_FUNCTIONS`):
    a model traced on CPU tensors then keeps the dtypes, and so the bytes, it has on a GPU (GPT-2's GELU raises its
    input to the third power: fp32 on a GPU, with what follows it)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in CUDA_FP32_FUNCTIONS and torch.is_autocast_enabled("cpu"):
            def up(x: Any) -> Any:
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x

            args = tuple(up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def autocast_loss(loss_fn: Callable[..., torch.Tensor], precision: str) -> Callable[..., torch.Tensor]:
    """``loss_fn(model, *batch)`` under autocast in ``precision`` on the batch's device, its loss in fp32. On the
    CPU (the simulator's trace) with CUDA's choice of the ops that stay in fp32 (:class:`CudaAutocastOnCpu`)."""
    dtype = AUTOCAST_DTYPES[check_precision(precision)]
    if dtype is None:
        return loss_fn

    def loss(model: nn.Module, *batch: Any) -> torch.Tensor:
        device = next((t.device for t in batch if isinstance(t, torch.Tensor)), torch.device("cpu"))
        with torch.autocast(device.type, dtype=dtype), \
                (CudaAutocastOnCpu() if device.type == "cpu" else contextlib.nullcontext()):
            out = loss_fn(model, *batch)
        return out.float()

    return loss


def with_training(case: Any, precision: str = "fp32", recompute: Recompute = "none") -> Any:
    """``case`` (a :class:`~um_lab.models.ModelCase`) trained in ``precision`` with ``recompute``; the case
    itself when both are the defaults. Its ``info`` records both (the simulator's trace key reads it)."""
    import dataclasses

    precision = check_precision(precision)
    recompute = check_recompute(recompute)
    if recompute == "auto":
        raise _planned_only(repr(case.name))
    if precision == "fp32" and recompute in ("none", 0):
        return case
    inner_build = case.build_model

    def build() -> nn.Module:
        model = inner_build()
        apply_recompute(model, recompute, repr(case.name))
        return model

    template = getattr(inner_build, "__um_lab_template__", None)
    if template is not None:
        build.__um_lab_template__ = template  # type: ignore[attr-defined]
    info = {**case.info, "precision": precision,
            "recompute": list(recompute) if isinstance(recompute, tuple) else recompute}
    return dataclasses.replace(case, build_model=build, loss_fn=autocast_loss(case.loss_fn, precision), info=info)


class LossScaler:
    """fp16's dynamic loss scale (``torch.amp.GradScaler``) for a loop that calls ``optimizer.step()`` itself
    (a :class:`~um_lab.cuda.session.Session`): :meth:`scale` the loss, :meth:`unscale` the gradients before
    the optimizer, whose ``step`` :meth:`guard` makes skip a step with an infinite gradient; :meth:`update`
    after the step."""

    def __init__(self, device: str = "cuda") -> None:
        self.scaler = torch.amp.GradScaler(device)
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale."""
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, noting whether any is infinite."""
        self.scaler.unscale_(optimizer)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` skip the update when :meth:`unscale` found an infinite gradient."""
        step = optimizer.step

        @functools.wraps(step)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # GradScaler keeps found_inf per optimizer, in a table update() replaces: read it at each step
            states = self.scaler._per_optimizer_states  # noqa: SLF001
            found = states[id(optimizer)].get("found_inf_per_device", {})
            if sum(v.item() for v in found.values()):
                self.skipped += 1
                return None
            return step(*args, **kwargs)

        optimizer.step = guarded  # type: ignore[method-assign]

    def update(self) -> None:
        """Adjust the scale after a step (halved after an infinite gradient, doubled after a run of good ones)."""
        self.scaler.update()

    @property
    def value(self) -> float:
        """The current loss scale."""
        return float(self.scaler.get_scale())
