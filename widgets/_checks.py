"""Checks of the panels' arguments and of what their controls hold.

Every check raises a typed :class:`~um_lab.errors.UmLabError` that names the argument and quotes the value
as given (``repr``): a panel never changes a number the user gave (no clamping to a control's range),
it refuses it.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from um_lab import models
from um_lab.errors import InputError, ModelConfigError, PolicyError, SpecError, UmLabError
from um_lab.runs.runlog import check_out_folder

#: the error classes a check may raise: an InputError (message, field) or a PolicyError (field, message)
ErrorClass = type[InputError] | type[PolicyError]


def refuse(error: ErrorClass, name: str, message: str) -> UmLabError:
    """``error`` for argument ``name``, saying ``name: message`` (whichever order its constructor takes)."""
    if issubclass(error, PolicyError):
        return error(name, message)
    return error(f"{name}: {message}", name)


def _given(value: object) -> str:
    """The value as given, for a message: its repr, and its type where the repr does not tell it."""
    shown = repr(value)
    if isinstance(value, (str, bool)) or value is None or isinstance(value, numbers.Real):
        return shown if not isinstance(value, str) else f"{shown} (a str)"
    return f"{shown} (a {type(value).__name__})"


def whole_number(name: str, value: Any, low: int, error: type[InputError] = SpecError) -> int:
    """``value`` as an integer >= ``low`` (bools, floats and strings refused), else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise error(f"{name} must be an integer >= {low}, got {_given(value)}", name)
    return int(value)


def real_number(name: str, value: Any, low: float, *, above: bool = False) -> float:
    """``value`` as a finite real number >= ``low`` (> ``low`` with ``above``), else :class:`SpecError`
    naming ``name``; NaN, infinities, bools and strings are refused."""
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and (number > low if above else number >= low)):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise SpecError(f"{name} must be a finite number {bound}, got {_given(value)}", name)
    return number


def optional_positive(name: str, value: Any) -> float | None:
    """None, or a finite number > 0 (an oversubscription ratio, a capacity in GiB)."""
    return None if value is None else real_number(name, value, 0.0, above=True)


def capacity_bytes_of(name: str, gib: float) -> int:
    """``gib`` GiB as whole bytes (refused when it is not finite in bytes or less than one byte)."""
    gib = real_number(name, gib, 0.0, above=True)
    as_bytes = gib * 2**30
    if not math.isfinite(as_bytes) or as_bytes < 1:
        raise SpecError(f"{name} must be a capacity between 1 B and a finite number of GiB, got {gib!r}", name)
    return int(as_bytes)


def text_value(name: str, value: Any) -> str:
    """``value`` as a string (refused otherwise)."""
    if not isinstance(value, str):
        raise SpecError(f"{name} must be a string, got {_given(value)}", name)
    return value


def out_dir_value(value: Any) -> None:
    """``out_dir``: None, or a string or path where nothing but a folder is (refused otherwise)."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise SpecError(f"out_dir must be a folder path (str or Path) or None, got {_given(value)}", "out_dir")
    if value is not None:
        check_out_folder(value)  # a file or /dev/null: refused when the panel is made, not at its first run


def model_name(value: Any, field: str = "model") -> str:
    """A name in the model zoo, else :class:`ModelConfigError` quoting it and listing the valid ones."""
    if not isinstance(value, str) or value not in models.ZOO:
        raise ModelConfigError(f"unknown {field} {value!r}; valid: {', '.join(models.ZOO)}", field)
    return value


def model_kwargs_value(model: str, value: Any, field: str = "model_kwargs", integers: bool = True) -> dict[str, Any]:
    """``value`` as the size knobs of ``model``: a dict of knob names to values (integers with ``integers``:
    the panel's knob fields hold integers) that the zoo accepts; unknown knobs, wrong types and values the
    model refuses raise :class:`ModelConfigError` quoting what was given. Nothing is built."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ModelConfigError(f"{field} must be a dict of knob names to values, got {_given(value)}", field)
    out: dict[str, Any] = {}
    for knob, v in value.items():
        if not isinstance(knob, str):
            raise ModelConfigError(f"{field} keys must be knob names (str), got {knob!r}", field)
        if integers and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise ModelConfigError(f"{field}[{knob!r}] must be an integer, got {_given(v)}", knob)
        out[knob] = int(v) if integers else v
    try:
        models.get_model(model, **out)  # validates every knob
    except ModelConfigError as e:
        raise ModelConfigError(f"{field} for {model!r}: {e} (given: {dict(value)!r})", e.field) from None
    except (TypeError, ValueError) as e:  # a registered model's own check
        raise ModelConfigError(f"{field} for {model!r}: {e} (given: {dict(value)!r})", field) from None
    return out


def sequence_value(name: str, value: Any, error: ErrorClass = SpecError) -> list[Any]:
    """``value`` as a list (a list or tuple; a single string is refused: it would be read letter by letter)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise refuse(error, name, f"must be a list, got {_given(value)}")
    return list(value)


def no_duplicates(name: str, values: list[Any], shown: Any = None, error: ErrorClass = SpecError) -> None:
    """Refuse a list that names the same value twice (a comparison would run it twice and mix the rows)."""
    seen: set[Any] = set()
    twice = []
    for v in values:
        if v in seen and v not in twice:
            twice.append(v)
        seen.add(v)
    if twice:
        listed = ", ".join("none" if v is None else (f"{v:g}" if isinstance(v, float) else str(v)) for v in twice)
        given = values if shown is None else shown
        raise refuse(error, name, f"{listed} given more than once ({given!r}): give each once")
