"""Building a case's model outside fake mode, and the ops a fake-tensor trace cannot run on its own.

:func:`build_outside_fake` runs the model's constructor with small tensors real and large ones on the meta device;
:func:`_fake_model` then turns its parameters and buffers into fake tensors. :class:`_DataDependentOps` sizes the
ops whose output size depends on tensor values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``bincount`` with a ``minlength``) as if every element were selected, and gives one-element random draws a real
value. An op that needs values the trace does not have, has no fake kernel or refuses the shapes it is given
becomes a :class:`TraceError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from um_lab.errors import ModelConfigError
from um_lab.models import ModelCase

T = TypeVar("T")


class TraceError(ModelConfigError):
    """A model's training step cannot be traced on fake tensors: ``op`` (an ATen op) needs tensor values the
    trace does not have, or has no fake kernel. ``module`` names where it ran (its path in the model and its
    class; the class alone while the model is being built), ``phase`` when (``build``, ``forward``,
    ``backward``, ``optimizer step``); ``model`` is the case's name."""

    def __init__(self, model: str, op: str, module: str | None, phase: str, reason: str) -> None:
        self.model, self.op, self.module, self.phase, self.reason = model, op, module, phase, reason
        where = f" in {module}" if module else ""
        super().__init__(f"model {model!r} cannot be traced: {op} ({phase}{where}) {reason}", "model")

    def __reduce__(self):
        return (type(self), (self.model, self.op, self.module, self.phase, self.reason))


def _context_free(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, whose :class:`TraceError` leaves without the fake-tensor error it replaced: that one holds
    torch's op objects, which do not pickle, and a Dask worker pickles an error with its context."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except TraceError as e:
            e.__context__ = None
            raise

    return wrapper


#: A tensor a model's constructor makes with at most this many elements is real (its values can be read,
#: e.g. drop-path rates from ``torch.linspace(0, rate, depth).tolist()`` or a relative-position index); a
#: larger one lives on the meta device (no memory).
SMALL_REAL_NUMEL = 1 << 16


class _ValuesNeeded(Exception):
    """Raised inside a build or a step for an op that needs the values of a tensor that has none."""

    def __init__(self, op: str, reason: str) -> None:
        self.op, self.reason = op, reason
        super().__init__(f"{op} {reason}")


class _OpFailed(_ValuesNeeded, RuntimeError, IndexError):
    """Raised inside a step for an op its fake kernel refuses (shapes that do not fit: ``aten.mm`` of [4, 9] and
    [8, 2]); still a ``RuntimeError`` and an ``IndexError`` (what torch raises there), so a model that catches
    one to fall back keeps doing so."""


#: the trace thread's flag: fake-tensor failures it turns into a TraceError are not also logged with a traceback
_QUIET = threading.local()


class _QuietFakeFailures(logging.Filter):
    """Drops torch's "failed while attempting to run meta" log record (a traceback on stderr) in a thread that is
    tracing: the failure reaches the caller as a :class:`TraceError` naming the op."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(_QUIET, "on", False) and str(record.msg).startswith("failed while attempting to run"))


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietFakeFailures())


def _op_name(func: Any) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


class _SmallRealBuild(TorchDispatchMode):
    """Runs a model's constructor: each op first runs on meta copies of its inputs (sizes only); when its
    inputs are real and its outputs small (:data:`SMALL_REAL_NUMEL`) it runs for real, else its meta outputs
    stand (a large tensor, or one computed from one). Reading the values of a meta tensor raises
    :class:`_ValuesNeeded`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        on_meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)
        meta_flat = [t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t for t in flat]
        meta_args, meta_kwargs = tree_unflatten(meta_flat, spec)
        if "device" in {a.name for a in func._schema.arguments}:  # a factory: size it on meta
            meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
        try:
            out = func(*meta_args, **meta_kwargs)
        except Exception as e:  # noqa: BLE001 - no meta kernel, or the op reads values
            if on_meta:
                raise _ValuesNeeded(_op_name(func), f"reads the values of a tensor the model's constructor made "
                                                    f"too large to keep (more than {SMALL_REAL_NUMEL} elements: it "
                                                    f"has none; {type(e).__name__})") from e
            return func(*args, **kwargs)
        if on_meta:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or sum(t.numel() for t in outs) <= SMALL_REAL_NUMEL:
            return func(*args, **kwargs)  # small: real values
        return out


@_context_free
def build_outside_fake(case: ModelCase) -> torch.nn.Module:
    """``case``'s model built outside fake mode: small tensors real, large ones on the meta device (see
    :class:`_SmallRealBuild`). A constructor that needs the values of a large tensor raises
    :class:`TraceError` naming the op and the module class being built."""
    try:
        with _SmallRealBuild():
            model = case.build_model()
    except _ValuesNeeded as e:
        raise TraceError(case.name, e.op, _module_at(e.__traceback__, {}), "build", e.reason) from None
    if not isinstance(model, torch.nn.Module):
        raise TraceError(case.name, "build_model", None, "build",
                         f"returned {type(model).__name__}, not an nn.Module")
    return model


def _to_fake(model: torch.nn.Module, fake: FakeTensorMode) -> None:
    """Replace ``model``'s parameters, buffers and tensor attributes by fake tensors of the same shapes,
    strides and dtypes (in place; a tensor held in two places stays one tensor)."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, kept alive; its fake)

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)][1]
        if t.is_meta:
            with fake:
                data = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        else:
            data = fake.from_tensor(t.detach())
        hit: torch.Tensor
        if isinstance(t, torch.nn.Parameter):
            hit = torch.nn.Parameter(data, requires_grad=t.requires_grad)
            hit.__dict__.update({k: v for k, v in vars(t).items() if k != "_is_param"})
        else:
            hit = data.requires_grad_(t.requires_grad) if t.requires_grad else data
        memo[id(t)] = (t, hit)
        return hit

    for module in model.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for name, t in list(store.items()):
                if t is not None:
                    store[name] = convert(t)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                module.__dict__[name] = convert(value)


def _fake_model(case: ModelCase, fake: FakeTensorMode) -> torch.nn.Module:
    model = build_outside_fake(case)
    _to_fake(model, fake)
    return model


#: random draws whose single value a step may read (LayerDrop: ``if torch.rand([]) < p: skip the layer``)
_SCALAR_DRAWS = frozenset({"aten.rand", "aten.uniform_", "aten.randn", "aten.normal_", "aten.bernoulli_",
                           "aten.bernoulli"})


class _DataDependentOps(TorchDispatchMode):
    """Sizes the ops whose output size depends on values (see the module's notes) as if every element were
    selected; sits between the recorder (which records the op as called) and the fake mode.

    A one-element random draw also gets a real value (the real op on the CPU, from a generator seeded with the
    trace's seed, so a trace is repeatable), and so does each small op computed from such values and plain
    numbers: a step can then read it (``.item()``, ``if tensor:``), as LayerDrop does. An op that writes a
    valued tensor in place and cannot be computed forgets every value (reading one then raises TraceError).
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from torch.utils.weak import WeakTensorKeyDictionary

        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real CPU value
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name == "aten._local_scalar_dense" and args and args[0] in self.values:
            with _disable_current_modes():
                return self.values[args[0]].item()
        if not self.values and name not in _SCALAR_DRAWS:
            return self._dispatch(func, name, args, kwargs)
        written = [t for t, write, _ in _tensor_args(func, args, kwargs) if write and t in self.values]
        out = self._dispatch(func, name, args, kwargs)
        value = None
        if isinstance(out, torch.Tensor) and out.numel() <= 1:
            with _disable_current_modes():  # real CPU tensors, outside the fake mode
                try:
                    value = self._real(func, name, args, kwargs, out)
                except Exception:  # noqa: BLE001 - no value: reading it raises the usual TraceError
                    value = None
        if isinstance(value, torch.Tensor) and value.shape == out.shape:
            self.values[out] = value
        elif written:  # a value changed that cannot be followed: views of it would go stale too
            self.values.clear()
        return out

    def _real(self, func, name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        """The op's result on real CPU tensors, or None when an input has no value."""
        if name in ("aten.rand", "aten.randn"):
            make = torch.rand if name == "aten.rand" else torch.randn
            return make(tuple(out.shape), generator=self.generator, dtype=out.dtype)
        flat, spec = tree_flatten((args, kwargs))
        real = []
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                if t in self.values:
                    real.append(self.values[t])
                elif i == 0 and name in _SCALAR_DRAWS and not (name == "aten.bernoulli"
                                                               and func._overloadname == "default"):
                    real.append(torch.empty(t.shape, dtype=t.dtype))  # the draw writes or ignores its values
                else:
                    return None
            else:
                real.append(torch.device("cpu") if isinstance(t, torch.device) else t)
        real_args, real_kwargs = tree_unflatten(real, spec)
        if name in _SCALAR_DRAWS:
            real_kwargs = {**real_kwargs, "generator": self.generator}
        value = func(*real_args, **real_kwargs)
        return value if isinstance(value, torch.Tensor) else None

    def _dispatch(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "aten.nonzero":
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._unsafe_index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            indices = []  # tensors, or None for a dim not indexed
            for i in args[1]:  # a mask indexes with the positions it selects (each of its dims)
                if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                    indices += [torch.empty((i.numel(),), dtype=torch.long, device=i.device)] * i.dim()
                else:
                    indices.append(i)
            return func(args[0], indices, *args[2:], **kwargs)
        if name == "aten.masked_select":
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            return torch.empty((int(np.prod(shape)),), dtype=args[0].dtype, device=args[0].device)
        if name in ("aten._unique2", "aten._unique"):  # torch.unique without dim: at most numel values
            x = args[0]
            values = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            inverse = torch.empty(x.shape, dtype=torch.long, device=x.device)
            if name == "aten._unique":
                return values, inverse
            return values, inverse, torch.empty((x.numel(),), dtype=torch.long, device=x.device)
        if name == "aten.bincount":
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            if minlength > 0:  # values assumed below minlength (a count per class or expert)
                weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
                dtype = torch.long if weights is None else torch.promote_types(weights.dtype, torch.float)
                return torch.empty((int(minlength),), dtype=dtype, device=args[0].device)
        if name == "aten._grouped_mm" and args[0].dtype not in (torch.bfloat16, torch.float16):
            # the fake kernel takes 16-bit inputs only; the CPU and CUDA kernels take fp32 too (a mixture of
            # experts in fp32: Hugging Face's default experts implementation). Its shapes, in the input's dtype.
            half = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args]
            out = func(*half, **{**kwargs, "out_dtype": None})
            return torch.empty_strided(out.shape, out.stride(), dtype=kwargs.get("out_dtype") or args[0].dtype,
                                       device=out.device)
        try:
            return func(*args, **kwargs)
        except _FAKE_LIMITS as e:
            raise _ValuesNeeded(name, _why(e)) from e
        except _ValuesNeeded:
            raise
        except (RuntimeError, IndexError) as e:  # the fake kernel's own check: shapes, dims, dtypes
            first = (str(e).strip().splitlines() or ["no message"])[0][:300]
            raise _OpFailed(name, f"cannot run on the tensors it is given ({type(e).__name__}: {first})") from e


def _tensor_args(func: Any, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool, int]]:
    """Every tensor an op takes (in lists too): ``(tensor, written in place, position)``, position -1 for a
    keyword argument."""
    schema_args = func._schema.arguments
    found: list[tuple[torch.Tensor, bool, int]] = []
    for pos, a in enumerate(args):
        write = bool(pos < len(schema_args) and schema_args[pos].alias_info is not None
                     and schema_args[pos].alias_info.is_write)
        found += [(t, write, pos) for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    for key, a in kwargs.items():
        write = any(s.name == key and s.alias_info is not None and s.alias_info.is_write for s in schema_args)
        found += [(t, write, -1) for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    return found


def _why(e: Exception) -> str:
    from torch._subclasses import fake_tensor as ft

    if isinstance(e, ft.DataDependentOutputException):
        return ("reads tensor values (.item(), .tolist(), a tensor used as a Python bool or int), which a fake "
                "trace has none of")
    if isinstance(e, ft.DynamicOutputShapeException):
        return "has an output size that depends on tensor values, and no size rule in the tracer"
    return f"has no fake-tensor kernel ({type(e).__name__})"


def _fake_limits() -> tuple[type[Exception], ...]:
    from torch._subclasses import fake_tensor as ft

    return (ft.DataDependentOutputException, ft.DynamicOutputShapeException, ft.UnsupportedOperatorException)


_FAKE_LIMITS = _fake_limits()


def _module_at(tb: Any, names: dict[int, str]) -> str | None:
    """The innermost module whose method is on the traceback ``tb``: its path in the model (``names``: id of
    a module -> its name) and class, or its class alone."""
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, torch.nn.Module):
            found = obj
        tb = tb.tb_next
    if found is None:
        return None
    name = names.get(id(found))
    cls = type(found).__qualname__.rsplit("<locals>.", 1)[-1]
    return f"{name or '<model>'} ({cls})" if name is not None else cls


@contextlib.contextmanager
def _explained(case: ModelCase, model: torch.nn.Module, phase_box: dict[str, Any]) -> Iterator[None]:
    """Turn an op the trace cannot run into a :class:`TraceError` naming it, the module and the phase."""
    quiet, _QUIET.on = getattr(_QUIET, "on", False), True
    try:
        yield
    except _ValuesNeeded as e:
        names = {id(m): n for n, m in model.named_modules()}
        raise TraceError(case.name, e.op, _module_at(e.__traceback__, names), phase_box["name"], e.reason) from None
    except _FAKE_LIMITS as e:
        names = {id(m): n for n, m in model.named_modules()}
        func = getattr(e, "func", None)
        raise TraceError(case.name, _op_name(func) if func is not None else type(e).__name__,
                         _module_at(e.__traceback__, names), phase_box["name"], _why(e)) from None
    finally:
        _QUIET.on = quiet
