"""The trace cache's key for a case: a fingerprint of everything that changes its traced step (model structure,
optimizer and its settings, batch, loss, seed), and its digest."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from um_lab.models import ModelCase, check_optimizer
from um_lab.sim.trace_build import _fake_model


def case_key(case: ModelCase, seed: int = 0) -> str:
    """The trace cache's key for ``case`` traced with ``seed``: a digest of everything that changes its
    step (:func:`case_fingerprint`) and the case's name. Memoised on the case while its name, info and
    factories stay the same objects (and a module given to ``custom`` keeps its shapes)."""
    memo: dict[int, tuple[tuple[Any, ...], str]] = case.__dict__.setdefault("_um_lab_trace_keys", {})
    stamp = _stamp(case)
    hit = memo.get(seed)
    if hit is not None and len(hit[0]) == len(stamp) and all(
            a is b or (isinstance(a, str) and a == b) for a, b in zip(hit[0], stamp, strict=True)):
        return hit[1]
    key = hashlib.sha256(case_fingerprint(case, seed).encode()).hexdigest()[:24] + ":" + case.name
    memo[seed] = (stamp, key)
    return key


def _stamp(case: ModelCase) -> tuple[Any, ...]:
    """What :func:`case_key`'s memo is valid for: the case's factories (by identity), name and info, and the
    shapes of a module given to ``custom`` (it can be changed in place)."""
    template = getattr(case.build_model, "__um_lab_template__", None)
    shapes = _module_text(template) if isinstance(template, torch.nn.Module) else ""
    return (case.build_model, case.make_batch, case.loss_fn, case.make_optimizer, case.name,
            _value_text(case.info), shapes)


def case_fingerprint(case: ModelCase, seed: int = 0) -> str:
    """Text that changes whenever ``case``'s traced step can: its name and info, the model's modules (class,
    the code of its ``forward``, settings) and parameters and buffers (names, shapes, dtypes, which train),
    the optimizer (class, hyper-parameters, parameter groups), the batch's shapes and dtypes, the loss
    function's code and captured values, and ``seed``. The model, optimizer and batch are built on fake
    tensors (no memory; the model built by :func:`build_outside_fake`); an optimizer whose ``step()`` needs a closure is
    refused here (:class:`~um_lab.errors.OptimizerNeedsClosure`)."""

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _fake_model(case, fake)
        with fake:
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = case.make_optimizer(params)
            check_optimizer(case, optimizer)
            batch = case.batch(seed)
    index = {id(p): i for i, p in enumerate(params)}
    groups = [(sorted((str(k), _value_text(v)) for k, v in group.items() if k != "params"),
               [index.get(id(p), -1) for p in group.get("params", ())])
              for group in getattr(optimizer, "param_groups", ())]
    parts = [
        f"name={case.name!r}",
        f"info={_value_text(case.info)}",
        f"model={_module_text(model)}",
        f"optimizer={_type_text(type(optimizer))}|{groups}|{_value_text(getattr(optimizer, 'defaults', None))}",
        f"batch={[_value_text(t) for t in batch]}",
        f"loss={_callable_text(case.loss_fn)}",
        f"seed={seed}",
    ]
    return "\n".join(parts)


def _code_text(code: Any) -> str:
    """A digest of a code object: its bytecode, constants (nested code too) and names."""
    consts = [_code_text(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    text = f"{code.co_code.hex()}|{consts}|{code.co_names}|{code.co_varnames}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _type_text(cls: type) -> str:
    """A class by its module, name and the code of its ``forward`` / ``step`` / ``__call__``."""
    codes = []
    for attr in ("forward", "step", "__call__"):
        fn = getattr(cls, attr, None)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(f"{attr}:{_code_text(code)}")
    return f"{cls.__module__}.{cls.__qualname__}[{','.join(codes)}]"


def _module_text(model: torch.nn.Module) -> str:
    """A model's structure: each module's class and settings, each parameter's and buffer's name, shape,
    dtype and whether it trains (tied ones by where they are tied)."""
    lines = []
    for name, module in model.named_modules(remove_duplicate=False):
        settings = {k: v for k, v in vars(module).items() if not k.startswith("_")
                    and isinstance(v, bool | int | float | str | type(None) | tuple)}
        try:
            extra = module.extra_repr()
        except Exception:  # noqa: BLE001 - a module whose repr needs data: its class and settings stand
            extra = "?"
        lines.append(f"{name}:{_type_text(type(module))}:{extra}:{_value_text(settings)}")
    seen: dict[int, str] = {}
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            if t is None:
                continue
            tied = seen.setdefault(id(t), name)
            lines.append(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
                         + (f":tied={tied}" if tied != name else ""))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _value_text(value: Any, depth: int = 0) -> str:
    """A value as it can change a trace: scalars and text by value, tensors by shape and dtype, containers
    by their items, callables by their code, other objects by their class."""
    if depth > 4:
        return "..."
    if isinstance(value, bool | int | float | complex | str | bytes | type(None)):
        return repr(value)[:200]
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{_value_text(k, depth + 1)}:{_value_text(v, depth + 1)}"
                              for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return "[" + ",".join(_value_text(v, depth + 1) for v in list(items)[:64]) + "]"
    if isinstance(value, torch.nn.Module):
        return f"module:{_module_text(value)}"
    if isinstance(value, type):
        return _type_text(value)
    if callable(value):
        return _callable_text(value, depth + 1)
    return type(value).__qualname__


def _callable_text(fn: Any, depth: int = 0) -> str:
    """A callable by its code: a function's bytecode, defaults and captured values; a partial's function
    and arguments; a bound method's function and its object's class; another callable by its class."""
    import functools
    import inspect

    if depth > 4:
        return "..."
    if isinstance(fn, functools.partial):
        return (f"partial({_callable_text(fn.func, depth + 1)},{_value_text(fn.args, depth + 1)},"
                f"{_value_text(fn.keywords, depth + 1)})")
    if inspect.ismethod(fn):
        return f"method({_callable_text(fn.__func__, depth + 1)},{type(fn.__self__).__qualname__})"
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = [_value_text(c.cell_contents, depth + 1) if c.cell_contents is not fn else "self"
                 for c in (fn.__closure__ or ()) if _has_contents(c)]
        return (f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}:{_code_text(code)}:"
                f"{_value_text(fn.__defaults__, depth + 1)}:{_value_text(fn.__kwdefaults__, depth + 1)}:{cells}")
    if isinstance(fn, type):
        return _type_text(fn)
    return _type_text(type(fn))


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
