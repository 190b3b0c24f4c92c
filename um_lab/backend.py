"""The backend registry: a name becomes a backend class (:mod:`um_lab.backend_base` says what a
backend is).

The built-in backends (``cuda``, ``sim``) are registered as ``"module:Class"`` and imported on first use,
so ``import um_lab`` stays light. ``auto`` is not a backend: it resolves to ``cuda`` when a GPU is present,
else ``sim``. This module imports no other um_lab module (:mod:`um_lab.types` checks backend names
against it), so backend classes are typed loosely here.
"""

from __future__ import annotations

import importlib
from typing import Any

AUTO = "auto"  #: the name that picks a backend for this process (see :func:`resolve_backend_name`)


# -------------------------------------------------------------------------------------- registry

#: name -> the backend class, or ``"module:Class"`` imported on first use
_REGISTRY: dict[str, type[Any] | str] = {
    "cuda": "um_lab.cuda.backend:CudaBackend",
    "sim": "um_lab.sim.backend:SimBackend",
}


def register_backend(name: str, factory: type[Any] | str, *, replace: bool = False) -> None:
    """Make ``name`` a backend: ``factory`` is its class (called with :func:`get_backend`'s options) or
    ``"module:Class"`` (imported on first use). Its ``name`` must be ``name``; an existing name is kept
    unless ``replace=True``."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"a backend name must be a non-empty string other than {AUTO!r}, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"backend {name!r} is registered already; pass replace=True to replace it")
    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise ValueError(f"a backend given by name is 'module:Class', got {factory!r}")
    else:
        _check_named(name, factory)
    _REGISTRY[name] = factory


def unregister_backend(name: str) -> None:
    """Forget the backend registered as ``name`` (``KeyError`` when there is none)."""
    del _REGISTRY[name]


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in registration order (``auto`` is not one)."""
    return tuple(_REGISTRY)


def valid_backend_names() -> str:
    """The names a ``backend`` argument accepts, for error messages: ``"cuda, sim, auto"``."""
    return ", ".join((*_REGISTRY, AUTO))


def cuda_available() -> bool:
    """True when a CUDA GPU and a CUDA build of torch are present."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend_name(name: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is present, else ``sim``; other names must be registered."""
    if name == AUTO:
        return "cuda" if cuda_available() else "sim"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; valid: {valid_backend_names()}")
    return name


def backend_class(name: str) -> type[Any]:
    """The class registered as ``name`` (``auto`` resolved first), imported if need be."""
    name = resolve_backend_name(name)
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _check_named(name, factory)
        _REGISTRY[name] = factory
    return factory


def get_backend(name: str = AUTO, **options: Any) -> Any:
    """A new backend by name (a registered one, or ``auto``), built with ``options``."""
    return backend_class(name)(**options)


def _check_named(name: str, factory: type[Any]) -> None:
    """A registered class must be a backend class whose ``name`` is the name it is registered as."""
    if not isinstance(factory, type) or not callable(getattr(factory, "run", None)):
        raise TypeError(f"backend {name!r} must be a class with run(spec, case, policy), got {factory!r}")
    if getattr(factory, "name", None) != name:
        raise ValueError(f"backend class {factory.__qualname__} is named {getattr(factory, 'name', None)!r}; "
                         f"register it as that name or set its name to {name!r}")
