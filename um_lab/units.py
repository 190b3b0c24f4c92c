"""Units and the checks of quantities a user writes: bytes (parsed and formatted), ratios, host memory,
and the UM driver's block size. One place for each, so every part of um_lab reads them alike."""

from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any

from um_lab.errors import SpecError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
#: the UM driver's VA block and GPU root chunk: the unit of residency, eviction and the scheduler's ledger
BLOCK = 2 * MiB


def whole_bytes(name: str, value: Any) -> int:
    """``value`` as a whole number of bytes > 0 (``1e9`` and NumPy integers are accepted), else
    :class:`SpecError` naming ``name``: the one check of a capacity in bytes (:class:`RunSpec`,
    :func:`um_lab.sizing.size_for_ratio`, the simulator's capacity)."""
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value <= 0:
        raise SpecError(f"{name} must be > 0 and a whole number of bytes, got {value!r}", name)
    return int(value)


def positive_ratio(name: str, value: Any) -> float:
    """``value`` as a finite number > 0 (an oversubscription ratio), else :class:`SpecError` naming ``name``:
    the one check of a ratio (:class:`RunSpec`, :func:`um_lab.sizing.size_for_ratio`, the simulator)."""
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer past what a float holds
        number = math.inf
    if not math.isfinite(number) or not number > 0:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise SpecError(f"{name} must be > 0 and finite, got {shown}", name)
    return number


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def size_bytes(text: str, field: str | None = None) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5GB"`` and ``"1.5e9"`` -> 1500000000; plain numbers are bytes.
    Anything else, or a size <= 0, raises :class:`SpecError` (naming ``field``)."""
    match = _SIZE.fullmatch(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise SpecError(f"not a size: {text!r} (examples: 8GiB, 512MiB, 1.5GB, 1e9, 1048576)", field)
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number):
        raise SpecError(f"size too large: {text!r}", field)
    value = int(number)
    if value <= 0:
        raise SpecError(f"size must be > 0: {text!r}", field)
    return value


_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """A byte count in binary units: ``512`` -> ``'512 B'``, ``1536`` -> ``'1.50 KiB'``,
    ``671174623232`` -> ``'625.08 GiB'``, ``4.1e12`` -> ``'3.73 TiB'`` (never a raw 10-digit number)."""
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def available_host_bytes() -> int | None:
    """Host memory this process can still use: the smaller of the system's available memory (psutil,
    else ``/proc/meminfo``'s MemAvailable, else free pages) and a cgroup v2 limit's headroom; None if
    unknown."""
    found: list[int] = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except Exception:  # not installed, or no /proc: the fallbacks
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        except (OSError, ValueError, IndexError):
            pass
        if not found:
            try:
                found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
            except (ValueError, OSError, AttributeError):
                pass
    try:  # a cgroup v2 limit (containers): its headroom over anonymous memory (file cache is reclaimable)
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.stat", encoding="ascii") as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            found.append(max(0, int(limit) - int(stat["anon"])))
    except (OSError, ValueError, KeyError):
        pass
    return min(found) if found else None
