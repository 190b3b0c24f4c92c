"""Checks of model size knobs, run before anything is built: positive integers below generous limits, config
overrides' names, types (against each field's annotation or default) and values, and transformer shapes.

Size limits (:data:`SIZE_LIMITS`; a larger value hangs building or tracing long before it could run):

======================================================================  ==========
knobs                                                                   at most
======================================================================  ==========
layers: ``depth``, ``n_layer``, ``num_hidden_layers``, ``num_layers``   4,096
widths and heads: ``width``, ``n_embd``, ``n_inner``, ``hidden_size``,  1,048,576
``intermediate_size``, ``hidden_dim``, ``mlp_dim``, ``n_head``,
``num_heads``, ``num_attention_heads``; lengths: ``seq_len``,
``n_positions``, ``max_position_embeddings``, ``image_size``,
``patch_size``
classes: ``classes``, ``vocab_size``, ``type_vocab_size``               16,777,216
======================================================================  ==========

``batch_size`` has no limit here: the simulator refuses a batch beyond host memory, and a GPU run one beyond
the safety cap. Config fields: an integer given for a float field is taken as that float; a float must be
finite, an epsilon positive, a dropout probability within [0, 1], ``initializer_range`` not negative; knobs
um_lab relies on (:data:`FIXED_KNOBS`: ``return_dict``) cannot be changed.

Each failure is a :class:`~um_lab.errors.ModelConfigError` naming the knob (its ``field``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

from um_lab.errors import ModelConfigError


def did_you_mean(name: str, valid: Iterable[str], n: int = 1) -> list[str]:
    """The valid names closest to a misspelt ``name`` (at most ``n``; none when nothing is close)."""
    import difflib

    return difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)


LAYER_LIMIT = 4096  #: the most layers a model may have
WIDTH_LIMIT = 1 << 20  #: the widest layer, the most heads, the longest sequence or image side
CLASS_LIMIT = 1 << 24  #: the most classes or vocabulary entries
#: knob -> the largest value it may take (see the table above)
SIZE_LIMITS: dict[str, int] = {
    **dict.fromkeys(("depth", "n_layer", "num_hidden_layers", "num_layers"), LAYER_LIMIT),
    **dict.fromkeys(("width", "n_embd", "n_inner", "hidden_size", "intermediate_size", "hidden_dim", "mlp_dim",
                     "n_head", "num_heads", "num_attention_heads", "seq_len", "n_positions",
                     "max_position_embeddings", "image_size", "patch_size"), WIDTH_LIMIT),
    **dict.fromkeys(("classes", "vocab_size", "type_vocab_size"), CLASS_LIMIT),
}
#: config fields um_lab relies on, with the one value it needs (the loss is read from ``outputs.loss``)
FIXED_KNOBS: dict[str, Any] = {"return_dict": True}


def check_positive(**values: Any) -> None:
    """Each value must be a positive integer (bools are not), at most its :data:`SIZE_LIMITS` entry."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelConfigError(f"{key} must be a positive integer, got {value!r}", key)
        limit = SIZE_LIMITS.get(key)
        if limit is not None and value > limit:
            raise ModelConfigError(f"{key}={value:,} is more than the {limit:,} um_lab allows (building or tracing "
                                   "a model that size would not finish); give a smaller value", key)


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


def check_overrides(config_cls: type, overrides: Mapping[str, Any], model_name: str) -> dict[str, Any]:
    """``overrides`` checked, with an integer given for a float field as that float (the library refuses an
    int there). Unknown config fields, wrongly typed values (checked against each field's annotation or
    default), values out of range (:func:`_check_value`) and changes to :data:`FIXED_KNOBS` raise
    :class:`ModelConfigError` naming the knob, before transformers sees them."""
    params = _config_params(config_cls)
    unknown = sorted(set(overrides) - set(params))
    if unknown:
        close = did_you_mean(unknown[0], params, n=4)
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"{config_cls.__name__}'s documentation lists its fields")
        raise ModelConfigError(f"unknown {config_cls.__name__} field(s) {unknown} for model {model_name!r}; {hint}",
                               unknown[0])
    checked = dict(overrides)
    for key, value in overrides.items():
        if key in FIXED_KNOBS and value != FIXED_KNOBS[key]:
            raise ModelConfigError(f"model {model_name!r}: knob {key} must stay {FIXED_KNOBS[key]!r} (um_lab reads "
                                   f"the model's outputs by name), got {value!r}", key)
        allowed = _allowed_kinds(params[key])
        if allowed is None or (value is None and allowed[1]):
            continue
        if _is_kind(value, allowed[0]):
            if allowed[0] == {"float"} and isinstance(value, numbers.Integral) and not isinstance(value, bool):
                checked[key] = value = float(value)  # 1 for layer_norm_epsilon: the library wants 1.0
            _check_value(key, value, model_name)
            continue
        expected = " or ".join(_KIND_TEXT[k] for k in _SCALARS if k in allowed[0]) or "None"
        raise ModelConfigError(
            f"model {model_name!r}: knob {key} must be {expected}{' or None' if allowed[1] else ''} "
            f"({config_cls.__name__}'s default is {params[key].default!r}), got {value!r} "
            f"({type(value).__name__})", key)
    return checked


def _check_value(key: str, value: Any, model_name: str) -> None:
    """A config value in range: a size within :data:`SIZE_LIMITS`, a finite float, a positive epsilon, a
    dropout probability within [0, 1], a non-negative ``initializer_range``."""
    if key in SIZE_LIMITS:
        check_positive(**{key: value})
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    bad = None
    if not math.isfinite(number):
        bad = "a finite number"
    elif "eps" in key and number <= 0:
        bad = "positive"
    elif ("dropout" in key or "pdrop" in key) and not 0 <= number <= 1:
        bad = "a probability within [0, 1]"
    elif key == "initializer_range" and number < 0:
        bad = "zero or more"
    if bad is not None:
        raise ModelConfigError(f"model {model_name!r}: knob {key} must be {bad}, got {repr(value)[:40]}", key)


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


def knob_error(name: str, knobs: Mapping[str, Any], error: BaseException) -> ModelConfigError:
    """A :class:`ModelConfigError` for ``error``, raised by the model library while building ``name`` with
    ``knobs``: it names the knobs the error quotes (by name or value), or the one knob given, else all knobs
    given."""
    text = str(error)

    def quoted(key: str, value: Any) -> bool:
        if re.search(rf"\b{re.escape(key)}\b", text):
            return True
        if isinstance(value, str) and value:
            return repr(value) in text or text.strip("'\"") == value or (len(value) >= 4 and value in text)
        return False

    named = [k for k, v in knobs.items() if quoted(k, v)] or (list(knobs) if len(knobs) == 1 else [])
    shown = ", ".join(f"{k}={knobs[k]!r}" for k in (named or knobs))
    which = f"knob {shown}" if len(named) == 1 else f"knobs {shown}" if named else f"one of its knobs ({shown})"
    reason = f"{type(error).__name__}: {text}"[:300]
    return ModelConfigError(f"model {name!r}: the model library cannot build it with {which} ({reason}); "
                            "check the value", named[0] if len(named) == 1 else None)
