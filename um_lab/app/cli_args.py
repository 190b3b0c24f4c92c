"""Parsing and checking ``um-lab``'s arguments before anything runs (used by :mod:`um_lab.app.cli`).

Sizes (``8GiB``, ``1e9``), ratios (``1.5``, ``none``), ``--model-kw KEY=VALUE``, ``--policy`` (a preset
name always means the preset; a policy file is given with a path or a ``.json`` name and may not take a
preset's name), the runs folder, and how a comparison table is shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from um_lab.errors import BudgetError, SpecError, UmLabError
from um_lab.schedule.config import Budget
from um_lab.types import MIN_CAPACITY_BYTES, MIN_RATIO, size_bytes  # one rule for the CLI and RunSpec

#: the columns ``um-lab compare`` and ``um-lab show`` print: remote bytes (read over the link, never
#: migrated) next to the migrated bytes, so a policy that migrates nothing is not read as moving nothing
SUMMARY_COLUMNS = ["model", "policy", "ratio", "steps", "median_ms", "mean_ms", "p90_ms",
                   "speedup_vs_um-default", "migrated_bytes", "remote_bytes", "gpu_page_faults", "evictions",
                   "status"]


class CliError(UmLabError):
    """A problem the user can fix; printed as ``um-lab: error: ...`` with exit status 2."""


#: options that take one value which may start with ``-`` (``--budget -1GiB``): joined as ``--budget=-1GiB``
#: before argparse reads them, so that the value is refused by what it is, not taken for an option
SIGNED_VALUE_OPTIONS = ("--budget", "--capacity", "--ratio")


def _refuse_negative(text: str, what: str) -> None:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text!r}")


def parse_bytes(text: str) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5GB"`` and ``"1.5e9"`` -> 1500000000; plain numbers are bytes
    (:func:`um_lab.types.size_bytes` as an argparse type)."""
    _refuse_negative(text, "a size")
    try:
        return size_bytes(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_capacity(text: str) -> int:
    """A simulated GPU capacity (:func:`parse_bytes`), at least one 2 MiB chunk."""
    _refuse_negative(text, "a simulated GPU capacity")
    value = parse_bytes(text)
    if value < MIN_CAPACITY_BYTES:
        raise argparse.ArgumentTypeError(
            f"a simulated GPU capacity is at least one 2 MiB chunk ({MIN_CAPACITY_BYTES} B), got {text!r} "
            f"({value} B); e.g. --capacity 8GiB")
    return value


def port_number(text: str) -> int:
    """A TCP port to listen on: a whole number from 1 to 65535 (an argparse type)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (a whole number from 1 to 65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535, got {text!r}")
    return port


def join_signed_values(argv: Sequence[str]) -> list[str]:
    """``["--budget", "-1GiB"]`` -> ``["--budget=-1GiB"]`` for :data:`SIGNED_VALUE_OPTIONS` (argparse takes a
    value starting with ``-`` for an option unless it is a plain negative number); the rest as given."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            return [*out, *argv[i:]]
        if argv[i] in SIGNED_VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1][:1] == "-" \
                and argv[i + 1] != "--" and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def parse_ratio(text: str) -> float | None:
    """An oversubscription ratio (a finite number > 0), or ``none`` for the profile's card."""
    if text.lower() in ("none", "-"):
        return None
    if "_" in text:  # float() reads "1_5" as 15
        raise argparse.ArgumentTypeError(f"not a ratio: {text!r} (a number > 0 without underscores, or none)")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a ratio: {text!r} (a number > 0, or none)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"ratio must be a finite number > 0 (or none): {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"ratio must be > 0: {text!r}")
    if value < MIN_RATIO:
        raise argparse.ArgumentTypeError(
            f"ratio {text!r} is below {MIN_RATIO:g}: the simulated GPU would be over {1 / MIN_RATIO:g} times the "
            "model's footprint (no oversubscription); give a ratio >= 0.001, or none for the profile's card")
    return value


def parse_budget(text: str) -> Budget:
    """A GPU budget: a size (``8GiB``, ``1.5e9``) or a fraction of the run's footprint (``0.5x``, in (0, 1])
    as a :class:`~um_lab.schedule.config.Budget` (an argparse type)."""
    _refuse_negative(text, "a GPU budget")
    try:
        return Budget(text)
    except (SpecError, BudgetError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def recompute_arg(text: str) -> Any:
    """``--recompute``: ``none``, ``every-layer``, a number of layers, or layer names separated by commas."""
    names = [n.strip() for n in text.split(",")]
    return names[0] if len(names) == 1 else tuple(names)


def parse_model_kwargs(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["width=1024", "n_layer=2"]`` -> ``{"width": 1024, "n_layer": 2}`` (JSON values, else text)."""
    kwargs: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--model-kw expects KEY=VALUE, got {pair!r}")
        if key.strip() in kwargs:
            raise CliError(f"--model-kw {key.strip()} is given twice ({pair!r} after "
                           f"{key.strip()}={json.dumps(kwargs[key.strip()])}): give each knob once")
        try:
            kwargs[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key.strip()] = raw
    return kwargs


def check_batch_size(batch_size: int | None, model_kwargs: dict[str, Any]) -> None:
    """Refuse ``--batch-size`` and ``--model-kw batch_size=...`` that disagree (one would be silently dropped)."""
    if batch_size is None or "batch_size" not in model_kwargs or model_kwargs["batch_size"] == batch_size:
        return
    given = model_kwargs["batch_size"]
    raise SpecError(f"--batch-size {batch_size} and --model-kw batch_size={given} disagree: give the batch size "
                    f"once (--batch-size {batch_size}, or --model-kw batch_size={given})", "batch_size")


def check_capacity_and_ratios(capacity: int | None, ratios: Sequence[float | None], flag: str) -> None:
    """Refuse ``--capacity`` with a ratio: each sets the simulated GPU's size (a ratio: footprint / ratio)."""
    given = [r for r in ratios if r is not None]
    if capacity is not None and given:
        shown = " ".join(f"{r:g}" for r in given)
        raise SpecError(f"--capacity {capacity} B ({capacity / 2**30:.3g} GiB) and {flag} {shown} both set the "
                        "simulated GPU's size (a ratio: the model's footprint / ratio): give one of them",
                        "capacity_bytes")


def _looks_like_path(value: str) -> bool:
    return value.endswith(".json") or any(sep and sep in value for sep in (os.sep, os.altsep, "/"))


def load_policy_arg(value: str) -> Any:
    """A preset name (always the preset, whatever files the folder holds), or a policy JSON file given
    with a path (``./mine``) or a ``.json`` name. A file may not take a preset's name."""
    from um_lab.policy import Policy, get_policy, named_policies

    presets = named_policies()  # the scheduled policies (layer-ahead) are names too
    if value in presets:
        return presets[value]
    if not _looks_like_path(value):
        if Path(value).is_file():
            raise CliError(f"{value!r} is not a preset; to use the policy file of that name, give it with "
                           f"a path: ./{value}")
        return get_policy(value)  # unknown preset: the error lists the valid ones
    policy = Policy.load(Path(value))  # a typed error says what the path is when it is not a policy file
    if policy.name in presets:
        raise CliError(f"policy file {value} is named {policy.name!r}, the name of a preset: a file may not "
                       f"stand in for a preset. Rename it (its \"name\" field, e.g. \"my-{policy.name}\")")
    return policy


def check_out_dir(out: str | None) -> None:
    """Refuse a runs folder where something other than a folder is (a file, ``/dev/null``), before anything is
    written."""
    from um_lab.files import describe
    from um_lab.runs.runlog import resolve_out_dir

    path = resolve_out_dir(out)
    if path.exists() and not path.is_dir():
        flag = "--out" if out is not None else "the runs folder"
        what = describe(path)
        kind = "a file" if what == "a regular file" else what
        raise CliError(f"{flag} {path} already exists and is {kind}, not a folder; give a folder for the "
                       "run logs (--out DIR)")


def ratio_text(value: Any) -> str:
    """A table's ratio cell: ``none`` for the profile's card (None or NaN), else the number."""
    try:
        missing = value is None or math.isnan(float(value))
    except (TypeError, ValueError):
        return str(value)
    return "none" if missing else f"{float(value):g}"


def _missing(value: Any) -> bool:
    """None, NaN or pandas' NA (a quantity no run measured)."""
    import pandas as pd  # loaded already: a table is a DataFrame

    if value is None or isinstance(value, (str, bool)):
        return value is None
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # not a scalar
        return False


_COUNT_COLUMNS = frozenset({"steps", "warmup_steps", "gpu_page_faults", "evictions"})


def table_cell(column: str, value: Any) -> str:
    """One cell of a printed table, by its column: ``*_bytes`` in B/KiB/MiB/GiB/TiB, ``*_ms`` as ``12.345 ms``,
    speed-ups as ``2.333x``, counts with thousands separators, ratios as numbers or ``none``, a value not
    measured as ``—`` (never ``NaN``, never a raw byte count)."""
    from um_lab.summary import NOT_MEASURED
    from um_lab.units import format_bytes

    if column == "ratio":
        return ratio_text(value)
    if _missing(value):
        return NOT_MEASURED
    if isinstance(value, (str, bool)):
        return str(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if column.endswith("_bytes"):
        return format_bytes(number)
    if column.endswith("_ms"):
        return f"{number:,.3f} ms"
    if column.startswith("speedup"):
        return f"{number:.3f}x"
    if column in _COUNT_COLUMNS and number.is_integer():
        return f"{int(number):,}"
    return f"{number:.3f}"


def format_table(table: Any) -> str:
    """A comparison table as text: the summary columns (remote bytes next to migrated bytes), bytes in
    binary units, times in ms, ratios as numbers or ``none``, a value not measured (e.g. the times of a run
    refused before its first step) as ``—``: never ``NaN``, never a raw byte count."""
    shown = table[[c for c in SUMMARY_COLUMNS if c in table.columns]].astype(object)
    for column in shown.columns:
        shown[column] = [table_cell(str(column), v) for v in shown[column]]
    return shown.to_string(index=False)
