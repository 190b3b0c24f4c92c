"""Checks of model size knobs, run before anything is built: positive integers, config overrides'
names and types (against each field's annotation or default), and transformer shapes.

Each failure is a :class:`~um_lab.errors.ModelConfigError` naming the knob (its ``field``).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from um_lab.errors import ModelConfigError


def did_you_mean(name: str, valid: Iterable[str], n: int = 1) -> list[str]:
    """The valid names closest to a misspelt ``name`` (at most ``n``; none when nothing is close)."""
    import difflib

    return difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)


def check_positive(**values: Any) -> None:
    """Each value must be a positive integer (bools are not)."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelConfigError(f"{key} must be a positive integer, got {value!r}", key)


def _config_params(config_cls: type) -> dict[str, inspect.Parameter]:
    return {p.name: p for p in inspect.signature(config_cls).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


_SCALARS = ("bool", "int", "float", "str")


def _allowed_kinds(param: inspect.Parameter) -> tuple[set[str], bool] | None:
    """The scalar kinds a config field takes and whether None is allowed: from its annotation when that
    is a union of scalars (``int``, ``float | int``, ``int | None``), else from its default's type;
    None when neither says (e.g. ``list[str] | None``: not checked)."""
    ann = param.annotation
    text = "" if ann is param.empty else ann.__name__ if isinstance(ann, type) else str(ann)
    members = {m.strip() for m in text.split("|")} - {""}
    if members and members <= {*_SCALARS, "None", "NoneType"}:
        return members & set(_SCALARS), bool(members & {"None", "NoneType"})
    if members:  # a container, Literal or other type: not judged here
        return None
    kind = type(param.default).__name__
    return ({kind}, False) if kind in _SCALARS else None


def _is_kind(value: Any, kinds: set[str]) -> bool:
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, numbers.Integral):
        return bool(kinds & {"int", "float"})
    if isinstance(value, numbers.Real):
        return "float" in kinds
    return isinstance(value, str) and "str" in kinds


_KIND_TEXT = {"bool": "true/false", "int": "an integer", "float": "a number", "str": "a string"}


def check_overrides(config_cls: type, overrides: Mapping[str, Any], model_name: str) -> None:
    """Unknown config fields and wrongly typed values (checked against each field's annotation or
    default) raise :class:`ModelConfigError` naming the knob, before transformers sees them."""
    params = _config_params(config_cls)
    unknown = sorted(set(overrides) - set(params))
    if unknown:
        close = did_you_mean(unknown[0], params, n=4)
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"{config_cls.__name__}'s documentation lists its fields")
        raise ModelConfigError(f"unknown {config_cls.__name__} field(s) {unknown} for model {model_name!r}; {hint}",
                               unknown[0])
    for key, value in overrides.items():
        allowed = _allowed_kinds(params[key])
        if allowed is None or (value is None and allowed[1]) or _is_kind(value, allowed[0]):
            continue
        expected = " or ".join(_KIND_TEXT[k] for k in _SCALARS if k in allowed[0]) or "None"
        raise ModelConfigError(
            f"model {model_name!r}: knob {key} must be {expected}{' or None' if allowed[1] else ''} "
            f"({config_cls.__name__}'s default is {params[key].default!r}), got {value!r} "
            f"({type(value).__name__})", key)


def check_transformer(config: Mapping[str, Any], seq_len: int, model_name: str, layers: str, width: str,
                       heads: str, positions: str) -> None:
    """Size knobs of a transformer config: positive integers, width divisible by heads, room for seq_len."""
    check_positive(**{k: config[k] for k in ("vocab_size", layers, width, heads, positions)})
    if config[width] % config[heads]:
        raise ModelConfigError(f"model {model_name!r}: {width}={config[width]} must be a multiple of "
                               f"{heads}={config[heads]}", width)
    if config[positions] < seq_len:
        raise ModelConfigError(f"model {model_name!r}: seq_len={seq_len} is longer than "
                               f"{positions}={config[positions]}", positions)
