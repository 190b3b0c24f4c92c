"""Hooks that record which byte ranges each layer touches, in order, during a training step.

- forward: a pre-hook per module opens a position with the module's own parameters and buffers and its input tensors; a
  post-hook adds the outputs (written by the layer: touched on the GPU) and puts a tensor hook on the
  first output that requires grad, which opens the module's **backward** position when the gradient
  reaches it (parameters, their gradients, the tensors saved for it, the incoming gradient);
- ``saved_tensors_hooks`` attribute each tensor autograd saves to the innermost open module call (after
  a child returned, in a continuation position of the caller, so positions follow the true order; ops
  outside every module, such as a loss in the step closure, get a ``(step)`` position, whose backward
  position opens first);
- the optimizer: the session steps it one layer at a time (:func:`optimizer_chunks`) and calls
  :meth:`StepRecorder.optimizer_position` for each (parameters, gradients, optimizer state).

A listener (the executor) hears each position as it opens (:meth:`PositionListener.enter`) and each
range written after the fact (:meth:`PositionListener.touched`); without one the recorder only builds
the :class:`~um_lab.schedule.order.Order`, e.g. on the CPU for tests and planning.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from um_lab.errors import UnsupportedOptimizer
from um_lab.schedule.ledger import Span
from um_lab.schedule.order import (  # noqa: F401
    OPTIMIZER_CHUNK_DIVISOR,
    STEP_POSITION,
    Order,
    Position,
    join_consecutive,
)
from um_lab.types import DataType

Touch = tuple[DataType, Span]


class PositionListener(Protocol):
    """What the executor hears from the recorder."""

    def enter(self, index: int, position: Position) -> None:
        """Position ``index`` opens: the ranges in ``position`` are about to be used."""

    def touched(self, index: int, data_type: DataType, spans: list[Span]) -> None:
        """Position ``index``'s kernels wrote ``spans`` (outputs, saved tensors): they are on the GPU now."""


def tensor_span(t: torch.Tensor) -> Span:
    """The bytes a (possibly strided) tensor's elements occupy: (address, extent)."""
    if t.numel() == 0:
        return (int(t.data_ptr()), 0)
    if t.is_contiguous():
        return (int(t.data_ptr()), t.numel() * t.element_size())
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return (int(t.data_ptr()), int(extent * t.element_size()))


def tensors_in(value: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, model outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v, depth - 1)


def hooked_modules(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The modules that get hooks: all of them (a container's own functional ops, such as attention
    inside a block, save tensors for backward too), named by their path (the root by its class)."""
    return [(name or type(m).__name__, m) for name, m in root.named_modules(prefix=prefix)]


class _Call:
    """One open forward call of a module: its first position, the position it writes into now, and
    whether a child ran since (the next write then opens a continuation position, in true order)."""

    __slots__ = ("first", "current", "layer", "resumed")

    def __init__(self, first: int, layer: str, resumed: bool = False) -> None:
        self.first, self.current, self.layer, self.resumed = first, first, layer, resumed


STEP_CALL = -1  #: the call id of ops outside every module (a loss computed in the step closure)


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """A module's own parameters, each once (``parameters(recurse=False)`` without its generator machinery: the
    hooks ask at every position of every step)."""
    out: list[nn.Parameter] = []
    for p in module._parameters.values():
        if p is not None and not any(p is q for q in out):
            out.append(p)
    return out


def own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    buffers: list[torch.Tensor] = []
    for b in module._buffers.values():
        if b is not None and not any(b is c for c in buffers):
            buffers.append(b)
    return [*own_parameters(module), *buffers]


class SavedTensorSaver(Protocol):
    """Where tensors forward saves for backward may go instead
    (:class:`um_lab.schedule.live.stage.ActivationStager`)."""

    def pack(self, t: torch.Tensor) -> Any:
        """``t`` itself to keep it, or a handle that :meth:`unpack` turns back into a tensor in backward."""

    def unpack(self, saved: Any) -> torch.Tensor:
        """The tensor behind a handle :meth:`pack` returned."""


class StepRecorder:
    """Records a step's :class:`Order` through hooks on ``roots`` (see the module docstring).

    ``classify(address)`` may name the data type of a range (the session asks its segment index);
    ranges it returns None for keep the role's type (parameters, gradients, optimizer state,
    activations). ``keep(tensor)`` (optional) drops tensors that cannot be managed memory (on a GPU:
    tensors on another device, such as an optimizer's step counters on the CPU).
    """

    def __init__(self, roots: Sequence[nn.Module], listener: PositionListener | None = None,
                 classify: Callable[[int], DataType | None] | None = None,
                 keep: Callable[[torch.Tensor], bool] | None = None, saver: SavedTensorSaver | None = None) -> None:
        self.roots = list(roots)
        self.saver = saver
        self.keep = keep
        self.listener = listener
        self.classify = classify
        self.order = Order()
        self._handles: list[Any] = []
        self._stack: list[_Call] = []  # open forward calls (innermost last)
        self._saved: dict[int, list[Span]] = {}  # a call's first position -> the ranges it saved for backward
        self._lock = threading.Lock()
        self.active = False
        self._in_backward = False  # backward runs: module calls now are recomputes (activation checkpointing)
        #: host time this step's hooks took, the listener's work inside them included (reset by :meth:`recording`)
        self.hook_ms = 0.0

    # ---- install / remove ----

    def install(self) -> None:
        """Put the hooks on every hooked module (idempotent)."""
        if self._handles:
            return
        multi = len(self.roots) > 1
        for r, root in enumerate(self.roots):
            for name, module in hooked_modules(root, prefix=f"m{r}" if multi else ""):
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True))

    def remove(self) -> None:
        """Take every hook off."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator[Order]:
        """Record one step's forward and backward (and optimizer positions added inside) into a new order."""
        self.order = Order()
        self.hook_ms = 0.0
        self._stack[:] = [_Call(STEP_CALL, STEP_POSITION, resumed=True)]  # ops outside modules: their own position
        self._saved.clear()
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.order
        finally:
            self.active = False
            self._stack.clear()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Keep recording while backward runs (called outside :meth:`recording`'s forward context).

        Tensors saved by ops outside every module (the loss) are needed first: their backward position
        opens here, before ``backward()`` starts."""
        self.active = True
        outside = self._saved.get(STEP_CALL)
        if outside:
            began = time.perf_counter()
            self.open_position("backward", STEP_POSITION, [(DataType.ACT, s) for s in outside])
            self.hook_ms += (time.perf_counter() - began) * 1e3
        # modules called in backward recompute their forward (activation checkpointing): their calls nest on a
        # step call of their own, so each one's post-hook closes it and records its outputs at its own position
        self._stack[:] = [_Call(STEP_CALL, "(recompute)", resumed=True)]
        self._in_backward = True
        try:
            yield
        finally:
            self.active = False
            self._in_backward = False
            self._stack.clear()

    # ---- hooks ----

    def _spans(self, tensors: Iterable[torch.Tensor]) -> list[Span]:
        keep = self.keep
        return [tensor_span(t) for t in tensors if t.numel() > 0 and (keep is None or keep(t))]

    def _type(self, span: Span, default: DataType) -> DataType:
        found = self.classify(span[0]) if self.classify is not None else None
        return found or default

    def open_position(self, phase: str, layer: str, touches: Iterable[Touch]) -> int:
        """Append a position touching ``touches`` and tell the listener; returns its index."""
        position = Position(phase, layer)
        by_type: dict[DataType, list[Span]] = {}
        for data_type, span in touches:
            by_type.setdefault(self._type(span, data_type), []).append(span)
        for data_type, spans in by_type.items():
            position.add(data_type, spans)
        with self._lock:
            self.order.positions.append(position)
            index = len(self.order.positions) - 1
        if self.listener is not None:
            self.listener.enter(index, position)
        return index

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.active:
                return
            began = time.perf_counter()
            touches = [(DataType.PARAM, s) for s in self._spans(own_tensors(module))]
            touches += [(DataType.ACT, s) for s in self._spans(tensors_in((args, kwargs)))]
            self._stack.append(_Call(self.open_position("forward", name, touches), name))
            self.hook_ms += (time.perf_counter() - began) * 1e3
        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self.active or len(self._stack) < 2 or self._stack[-1].layer != name:
                return
            began = time.perf_counter()
            call = self._stack.pop()
            self._stack[-1].resumed = True  # the caller's next write follows this call
            outs = list(tensors_in(output))
            self._touch(call.current, self._spans(outs))
            grad_root = next((t for t in outs if t.requires_grad and t.grad_fn is not None), None)
            if grad_root is not None and not self._in_backward:  # a recompute's outputs get no gradient
                grad_root.register_hook(self._backward_hook(name, module, call.first))
            self.hook_ms += (time.perf_counter() - began) * 1e3
        return hook

    def _backward_hook(self, name: str, module: nn.Module, forward_index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.active:
                return
            began = time.perf_counter()
            touches = [(DataType.PARAM, s) for s in self._spans(own_tensors(module))]
            touches += [(DataType.GRAD, s) for s in self._spans(  # a frozen parameter's gradient is not written
                p.grad for p in own_parameters(module) if p.grad is not None and p.requires_grad)]
            touches += [(DataType.ACT, s) for s in self._saved.get(forward_index, [])]
            touches += [(DataType.ACT, s) for s in self._spans([grad])]
            self.open_position("backward", name, touches)
            self.hook_ms += (time.perf_counter() - began) * 1e3
        return hook

    def _pack(self, t: torch.Tensor) -> Any:
        began = time.perf_counter()
        saved: Any = t if self.saver is None else self.saver.pack(t)
        if self.active and self._stack:
            spans = self._spans([t])
            call = self._stack[-1]
            if call.resumed:
                call.current = self.open_position("forward", call.layer, [])
                call.resumed = False
            if saved is t:  # kept where it is: backward reads it there (a staged tensor comes back elsewhere)
                self._saved.setdefault(call.first, []).extend(spans)
            self._touch(call.current, spans)
        self.hook_ms += (time.perf_counter() - began) * 1e3
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor) or self.saver is None:
            return saved
        began = time.perf_counter()
        t = self.saver.unpack(saved)
        if self.active and self.order.positions:  # its copy back was written in blocks backward now reads
            self._touch(len(self.order.positions) - 1, self._spans([t]))
        self.hook_ms += (time.perf_counter() - began) * 1e3
        return t

    def touched(self, index: int, data_type: DataType, spans: list[Span]) -> None:
        """Position ``index`` wrote ``spans`` of ``data_type`` (e.g. optimizer state created by its step)."""
        began = time.perf_counter()
        spans = [s for s in spans if s[1] > 0]
        if spans:
            self.order.positions[index].add(data_type, spans)
            if self.listener is not None:
                self.listener.touched(index, data_type, spans)
        self.hook_ms += (time.perf_counter() - began) * 1e3

    def _touch(self, index: int, spans: list[Span]) -> None:
        spans = [s for s in spans if s[1] > 0]
        if not spans:
            return
        by_type: dict[DataType, list[Span]] = {}
        for s in spans:
            by_type.setdefault(self._type(s, DataType.ACT), []).append(s)
        position = self.order.positions[index]
        for data_type, group in by_type.items():
            position.add(data_type, group)
            if self.listener is not None:
                self.listener.touched(index, data_type, group)

    # ---- the optimizer ----

    def optimizer_position(self, layer: str, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
        """Open the optimizer position for one chunk of parameters (before stepping it)."""
        began = time.perf_counter()
        touches = [(DataType.PARAM, s) for s in self._spans(params)]
        touches += [(DataType.GRAD, s) for s in self._spans(p.grad for p in params if p.grad is not None)]
        touches += [(DataType.OPTIM, s) for s in self._spans(
            v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))]
        index = self.open_position("optimizer", layer, touches)
        self.hook_ms += (time.perf_counter() - began) * 1e3
        return index


Chunks = list[tuple[str, list[nn.Parameter]]]


def optimizer_chunks(roots: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                     max_bytes: int | None = None) -> Chunks:
    """The optimizer's parameters grouped by the module that owns them, in module order (each once);
    parameters no registered module owns form a last chunk. With ``max_bytes``, consecutive chunks are joined
    while their parameters hold at most that many bytes together (:func:`join_chunks`)."""
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen: set[int] = set()
    chunks: Chunks = []
    multi = len(roots) > 1
    for r, root in enumerate(roots):
        for name, module in root.named_modules(prefix=f"m{r}" if multi else ""):
            params = [p for p in module.parameters(recurse=False) if id(p) in in_optimizer and id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                chunks.append((name or type(module).__name__, params))
    rest = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in seen]
    if rest:
        chunks.append(("(other parameters)", rest))
    return chunks if max_bytes is None else join_chunks(chunks, max_bytes)


def join_chunks(chunks: Chunks, max_bytes: int) -> Chunks:
    """Consecutive ``chunks`` joined while their parameters hold at most ``max_bytes`` together
    (:func:`join_consecutive`); a joined chunk is named ``"first..last"``. Each chunk costs a Python optimizer
    step and the session's position hooks: on the H200, GPT-2-XL's 291 one-module chunks left the GPU idle
    for ~170 ms of a ~1,000 ms budget step."""
    sizes = [sum(p.numel() * p.element_size() for p in params) for _, params in chunks]
    return [(chunks[run[0]][0] if len(run) == 1 else f"{chunks[run[0]][0]}..{chunks[run[-1]][0]}",
             [p for i in run for p in chunks[i][1]]) for run in join_consecutive(sizes, max_bytes)]


#: optimizers whose step is per parameter, so stepping them one layer at a time equals one full step
CHUNKABLE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def check_chunkable(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`~um_lab.errors.UnsupportedOptimizer` unless ``optimizer`` is exactly one of
    :data:`CHUNKABLE_OPTIMIZERS` (a subclass may change ``step``; others may mix parameters: LBFGS, or
    optimizers with a global norm)."""
    if type(optimizer) not in CHUNKABLE_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in CHUNKABLE_OPTIMIZERS)
        raise UnsupportedOptimizer(
            f"a GPU budget steps the optimizer one layer at a time, which is known to equal one full step only "
            f"for {names}; got {type(optimizer).__module__}.{type(optimizer).__qualname__}. Use one of those, "
            "or train without a budget.")


def step_optimizer_in_chunks(optimizer: torch.optim.Optimizer, chunks: Sequence[tuple[str, list[nn.Parameter]]],
                             before_chunk: Callable[[str, list[nn.Parameter]], object] | None = None,
                             after_chunk: Callable[[str, list[nn.Parameter], object], None] | None = None,
                             zero_grad: bool = True,
                             around_chunk: Callable[[list[nn.Parameter]], contextlib.AbstractContextManager[object]]
                             | None = None,
                             around_step: Callable[[int, list[nn.Parameter]], contextlib.AbstractContextManager[object]]
                             | None = None) -> None:
    """``optimizer.step()`` one chunk at a time: each call sees only the chunk's parameters in its
    groups (per-parameter state, so the result equals one full step for element-wise optimizers such as
    SGD, Adam, AdamW), then the chunk's gradients are zeroed in place. ``before_chunk(name, params)``
    runs before each chunk's step, ``after_chunk(name, params, what before_chunk returned)`` after it,
    all three inside ``around_chunk(params)`` when given (the session's allocation routing); the step alone
    runs inside ``around_step(index, params)`` when given (remote state copied in and back).
    The groups are restored on any exit. Other optimizers raise
    :class:`~um_lab.errors.UnsupportedOptimizer` (:func:`check_chunkable`) before anything runs.
    """
    check_chunkable(optimizer)
    groups = optimizer.param_groups
    originals = [g["params"] for g in groups]
    try:
        for index, (name, params) in enumerate(chunks):
            ids = {id(p) for p in params}
            for g, full in zip(groups, originals, strict=True):
                g["params"] = [p for p in full if id(p) in ids]
            with around_chunk(params) if around_chunk is not None else contextlib.nullcontext():
                token = before_chunk(name, params) if before_chunk is not None else None
                with around_step(index, params) if around_step is not None else contextlib.nullcontext():
                    optimizer.step()
                if after_chunk is not None:
                    after_chunk(name, params, token)
            if zero_grad:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    torch._foreach_zero_(grads)
    finally:
        for g, full in zip(groups, originals, strict=True):
            g["params"] = full
