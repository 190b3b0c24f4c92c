"""The backend registry: a name becomes a backend class (:mod:`um_lab.backend_base` says what a
backend is).

The built-in backends (``cuda``, ``sim``) are registered as ``"module:Class"`` and imported on first use,
so ``import um_lab`` stays light. An installed package can add one without being imported by hand: an
entry point in the ``um_lab.backends`` group (``third = "my_pkg.backend:ThirdBackend"``) is registered,
by name, the first time the registry is asked (so ``um-lab --backend third`` and the notebook panels'
backend lists find it). ``auto`` is not a backend: it resolves to ``cuda`` when a GPU is present, else
``sim``. This module imports no other um_lab module (:mod:`um_lab.types` checks backend names against
it), so backend classes are typed loosely here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from typing import Any

AUTO = "auto"  #: the name that picks a backend for this process (see :func:`resolve_backend_name`)
ENTRY_POINT_GROUP = "um_lab.backends"  #: installed packages' backends: ``name = "module:Class"``


# -------------------------------------------------------------------------------------- registry

#: name -> the backend class, or ``"module:Class"`` imported on first use
_REGISTRY: dict[str, type[Any] | str] = {
    "cuda": "um_lab.cuda.backend:CudaBackend",
    "sim": "um_lab.sim.backend:SimBackend",
}
_entry_points_read = False


def _read_entry_points() -> None:
    """Register (by name, nothing imported) the backends installed packages declare, once; a name taken
    already is kept, a malformed entry is skipped with a warning."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as e:  # a broken installed distribution must not break the registry
        warnings.warn(f"cannot read the {ENTRY_POINT_GROUP!r} entry points ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=3)
        return
    for entry in found:
        if entry.name in _REGISTRY:
            continue
        try:
            register_backend(entry.name, entry.value)
        except ValueError as e:
            warnings.warn(f"entry point {entry.name} = {entry.value!r} ({ENTRY_POINT_GROUP}) skipped: {e}",
                          RuntimeWarning, stacklevel=3)


def register_backend(name: str, factory: type[Any] | str, *, replace: bool = False) -> None:
    """Make ``name`` a backend: ``factory`` is its class (called with :func:`get_backend`'s options) or
    ``"module:Class"`` (imported on first use). Its ``name`` must be ``name``; an existing name is kept
    unless ``replace=True``."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"a backend name must be a non-empty string other than {AUTO!r}, got {name!r}")
    if name in _REGISTRY and not replace and not _names_the_same(_REGISTRY[name], factory):
        raise ValueError(f"backend {name!r} is registered already; pass replace=True to replace it")
    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise ValueError(f"a backend given by name is 'module:Class', got {factory!r}")
    else:
        _check_named(name, factory)
    _REGISTRY[name] = factory


def _names_the_same(registered: type[Any] | str, factory: type[Any] | str) -> bool:
    """True when ``factory`` is what ``registered`` already stands for: the same class, or the class a
    ``"module:Class"`` names (a module that registers its own class when imported on first use)."""
    if registered is factory:
        return True
    if isinstance(registered, str) and isinstance(factory, type):
        return registered == f"{factory.__module__}:{factory.__qualname__}"
    return False


def unregister_backend(name: str) -> None:
    """Forget the backend registered as ``name`` (``KeyError`` when there is none)."""
    _read_entry_points()  # else an installed backend unregistered now would come back on the next read
    del _REGISTRY[name]


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in registration order (``auto`` is not one)."""
    _read_entry_points()
    return tuple(_REGISTRY)


def valid_backend_names() -> str:
    """The names a ``backend`` argument accepts, for error messages: ``"cuda, sim, auto"``."""
    return ", ".join((*backend_names(), AUTO))


def cuda_available() -> bool:
    """True when a CUDA GPU and a CUDA build of torch are present."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend_name(name: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is present, else ``sim``; other names must be registered."""
    if name == AUTO:
        return "cuda" if cuda_available() else "sim"
    if name not in backend_names():
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


def backend_options(name: str) -> tuple[str, ...]:
    """The keyword options the backend ``name`` (``auto`` resolved first) is built with: the parameters its
    class's constructor names (``**options`` counts for none), e.g. ``("profile", "prefetch_stream")``.
    Callers pass an option only to a backend that takes it (the CLI's ``--profile``, the lab's
    ``telemetry``), never by testing its name."""
    try:
        parameters = inspect.signature(backend_class(name)).parameters.values()
    except (TypeError, ValueError):  # no signature to read: take it as one without options
        return ()
    return tuple(p.name for p in parameters
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def _check_named(name: str, factory: type[Any]) -> None:
    """A registered class must be a backend class whose ``name`` is the name it is registered as."""
    if not isinstance(factory, type) or not callable(getattr(factory, "run", None)):
        raise TypeError(f"backend {name!r} must be a class with run(spec, case, policy), got {factory!r}")
    if getattr(factory, "name", None) != name:
        raise ValueError(f"backend class {factory.__qualname__} is named {getattr(factory, 'name', None)!r}; "
                         f"register it as that name or set its name to {name!r}")
