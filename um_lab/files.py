"""Reading user files safely: regular files only, with a size limit per format, JSON of bounded depth.

Every reader here raises :class:`~um_lab.errors.FileReadError` naming the file and what it was meant to
be (a policy, a profile, a run's records) before reading more than the limit: a directory, ``/dev/zero``,
a FIFO or a file far larger than its format allows is refused, never read until memory runs out.
"""

from __future__ import annotations

import json
import os
import stat
import unicodedata
from pathlib import Path
from typing import Any

from um_lab.errors import FileReadError

KIB = 1024
MIB = 1024 * KIB

#: Size limits per format: a policy is a few KB, a profile tens of KB (it carries its raw measurements).
POLICY_LIMIT = 256 * KIB
PROFILE_LIMIT = 8 * MIB
RUN_FILE_LIMIT = 16 * MIB
#: A table written by um_lab (a comparison's ``summary.csv``: a row per run).
TABLE_LIMIT = 64 * MIB
#: The longest line a ``records.jsonl`` may hold (a step record is a few KB).
RECORD_LINE_LIMIT = 1 * MIB
#: Deepest nesting accepted in JSON read from a file (um_lab's own formats nest fewer than 10 levels).
JSON_DEPTH_LIMIT = 64


def _describe(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def describe(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is (links followed): ``a regular file``, ``a directory``, ``a device``, ...; ``a broken
    link`` for a link to nothing; None where nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else None
    except OSError as e:
        return f"something that cannot be examined ({e.strerror or e})"
    return "a regular file" if stat.S_ISREG(mode) else _describe(mode)


def check_regular(path: str | os.PathLike[str], what: str, limit: int | None = None) -> Path:
    """``path`` as a :class:`Path` if it is an existing regular file (links followed) of at most ``limit``
    bytes; otherwise :class:`FileReadError` naming it and ``what`` it was meant to be."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileReadError(p, what, "not found") from None
    except OSError as e:
        raise FileReadError(p, what, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileReadError(p, what, f"is {_describe(st.st_mode)}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise FileReadError(p, what, f"is {st.st_size:,} bytes, more than the {limit:,} a {what} may be")
    return p


def read_text(path: str | os.PathLike[str], what: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (:class:`FileReadError` otherwise)."""
    p = check_regular(path, what, limit)
    try:
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise FileReadError(p, what, f"cannot be read ({e.strerror or e})") from None
    if len(raw) > limit:  # it grew after the check
        raise FileReadError(p, what, f"is more than the {limit:,} bytes a {what} may be")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileReadError(p, what, f"is not UTF-8 text (byte {e.start})") from None


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping once past ``limit`` (iterative: no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(text: str | bytes, what: str, source: str | os.PathLike[str] | None = None) -> Any:
    """Parse JSON text of a ``what`` (from ``source`` when given) with bounded nesting; errors are
    :class:`FileReadError` (with a source) or :class:`~um_lab.errors.InputError` naming ``what``."""
    from um_lab.errors import InputError

    def fail(reason: str) -> Exception:
        if source is not None:
            return FileReadError(Path(source), what, reason)
        return InputError(f"{what}: {reason}", what)

    try:
        data = json.loads(text)
    except RecursionError:
        raise fail(f"is JSON nested deeper than the {JSON_DEPTH_LIMIT} levels a {what} may have") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"is not valid JSON ({e})") from None
    if _depth(data, JSON_DEPTH_LIMIT) > JSON_DEPTH_LIMIT:
        raise fail(f"is JSON nested deeper than the {JSON_DEPTH_LIMIT} levels a {what} may have")
    return data


def read_json(path: str | os.PathLike[str], what: str, limit: int) -> Any:
    """Parse a regular JSON file of at most ``limit`` bytes (:class:`FileReadError` naming it otherwise)."""
    return parse_json(read_text(path, what, limit), what, source=path)


def read_csv(path: str | os.PathLike[str], what: str, limit: int) -> Any:
    """A regular CSV file of at most ``limit`` bytes as a pandas DataFrame; :class:`FileReadError` naming it
    when it is not a regular file, too large, or cannot be parsed as CSV."""
    import pandas as pd

    p = check_regular(path, what, limit)
    try:
        return pd.read_csv(p)
    except ValueError as e:  # pandas' ParserError and EmptyDataError, bad UTF-8
        reason = " ".join(str(e).split())
        raise FileReadError(p, what, f"cannot be parsed as CSV ({reason[:200]})") from None
    except OSError as e:
        raise FileReadError(p, what, f"cannot be read ({e.strerror or e})") from None


#: Unicode categories a name shown in a terminal, a table or a folder name may not hold: control (newlines,
#: escapes), format (bidi overrides such as U+202E, zero-width characters), surrogate (lone halves of a pair),
#: line and paragraph separators.
REFUSED_CATEGORIES = {"Cc": "a control character", "Cf": "a format (bidi or invisible) character",
                      "Cs": "a lone surrogate", "Zl": "a line separator", "Zp": "a paragraph separator"}


def refused_character(text: str, allowed: str = "") -> str | None:
    """Why ``text`` cannot stand as a name (its first character of :data:`REFUSED_CATEGORIES` not in ``allowed``:
    what it is, its position and code point), or None when it can."""
    for index, char in enumerate(text):
        kind = REFUSED_CATEGORIES.get(unicodedata.category(char))
        if kind is not None and char not in allowed:
            label = unicodedata.name(char, "") if kind != "a lone surrogate" else ""
            return f"{kind} at position {index} (U+{ord(char):04X}{' ' + label if label else ''})"
    return None
