"""Reading run folders back: records, status, and whether a ``running`` run still runs.

Writing the folder is :mod:`um_lab.runs.runlog`'s job.
Reading is forgiving where the data allows it: a bad line in ``records.jsonl`` is skipped with one
:class:`RunLogWarning` naming the file and line; a corrupt ``status.json`` (or other side file) is
warned about and read as missing; only a corrupt ``spec.json`` raises (:class:`RunLogError`). A run
left ``running`` (or ``pending``: created, never started) by a process that is gone (or whose status is
stale) is read as ``interrupted`` (:data:`LEFT_RUNNING`), with its real step count taken from
``records.jsonl``, ``interrupted_by`` :data:`ENDED_WITHOUT_CLOSING` and a ``note`` saying how it was found.
A step recorded more than once is read once, with a warning.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import html
import json
import os
import socket
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from um_lab.errors import FileReadError, UmLabError
from um_lab.files import RECORD_LINE_LIMIT, RUN_FILE_LIMIT, check_regular, describe, read_json
from um_lab.policy import Policy
from um_lab.runs import runexit
from um_lab.summary import NOT_MEASURED, format_summary, records_frame, summarize
from um_lab.types import RunSpec, StepRecord

STALE_AFTER_S = 1800.0  #: a ``running`` status with a heartbeat, not rewritten for this long, is stale
#: the states of a run not ended yet: created (``pending``, not started) or stepping (``running``)
OPEN_STATES = ("pending", "running")
LEFT_RUNNING = "interrupted"  #: the state of a run left open (OPEN_STATES) by a process that no longer runs it
#: the ``interrupted_by`` of such a run (a signal's name, or ``interpreter exit``, when the process closed it)
ENDED_WITHOUT_CLOSING = "the process running it ended without closing it"
#: the ``interrupted_by`` of a ``running`` status whose process cannot be checked from here (written on
#: another host, or without its process's start time): read as not running, since nothing shows it runs
NOT_CHECKABLE = "its process cannot be checked from here"


class RunLogError(UmLabError, ValueError):
    """A file of a run folder cannot be read (e.g. a corrupt ``spec.json``); the message names it."""


class NotARunFolderError(UmLabError, FileNotFoundError):
    """The folder given to :func:`load` is not a run folder (it has no ``spec.json``)."""


class RunLogWarning(UserWarning):
    """Part of a run folder could not be read or written (a bad line, a corrupt status); the rest was."""


def _record_from_line(raw: bytes) -> StepRecord:
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    record = StepRecord.from_dict(data)
    for field in ("step", "wall_ms"):
        value = getattr(record, field)
        if isinstance(value, bool) or not isinstance(value, int if field == "step" else (int, float)):
            raise ValueError(f"{field} is {value!r}")
    return record


def iter_records(path: str | os.PathLike[str], *, warn: bool = True) -> Iterator[StepRecord]:
    """Stream the records of a ``records.jsonl``.

    A last line cut off by a crash mid-write is skipped silently. Any other line that is not a step
    record (a line longer than :data:`~um_lab.files.RECORD_LINE_LIMIT` too) is skipped and the rest are
    kept, with one :class:`RunLogWarning` per read naming the file and the first bad line's number (none
    with ``warn=False``). A step number seen before (a line copied) is skipped: each step is yielded once,
    its first line, with one :class:`RunLogWarning` at the end naming the file, the repeated steps and any
    missing below the last. A ``records.jsonl`` that is not a regular file (a FIFO, a link to a device) raises
    :class:`RunLogError` naming it, before anything is read from it. An absent one yields nothing.
    """
    path = Path(path)
    if not _records_file(path):
        return
    warned = False

    def bad(number: int, e: Exception) -> None:
        nonlocal warned
        if warn and not warned:
            warned = True
            reason = str(e) if len(str(e)) <= 100 else str(e)[:97] + "..."
            warnings.warn(f"{path}: line {number} is not a step record ({type(e).__name__}: {reason}); "
                          "skipped it (and skip any other bad line) and kept the rest", RunLogWarning, stacklevel=4)

    seen: set[int] = set()
    repeated: dict[int, int] = {}
    yield from _first_of_each_step(_read_records(path, bad), seen, repeated)
    if repeated and warn:
        missing, which = _gaps(seen, max(seen) + 1)
        warnings.warn(f"{path}: {_repeated_text(repeated)}{f'; missing: {which}' if missing else ''}; "
                      "read each step once (its first line)", RunLogWarning, stacklevel=3)


def _first_of_each_step(records: Iterable[StepRecord], seen: set[int],
                        repeated: dict[int, int]) -> Iterator[StepRecord]:
    """Each step's first record of ``records``; the steps go into ``seen``, the extra lines of a step recorded more
    than once into ``repeated`` (step -> its extra lines)."""
    for record in records:
        if record.step in seen:
            repeated[record.step] = repeated.get(record.step, 0) + 1
            continue
        seen.add(record.step)
        yield record


def _records_file(path: Path) -> bool:
    """True when a ``records.jsonl`` is there to read, False when absent; :class:`RunLogError` naming it when it
    is not a regular file (nothing is read from it)."""
    if not path.exists() and not path.is_symlink():
        return False
    try:
        check_regular(path, "run's records")
    except FileReadError as e:
        raise RunLogError(f"{e}: the run's steps cannot be read from it") from None
    return True


def _read_records(path: Path, bad: Callable[[int, Exception], None]) -> Iterator[StepRecord]:
    """Every step record line of a regular ``records.jsonl`` in order (copies too); ``bad(line number,
    error)`` for each line that is not one (a cut-off last line is dropped silently)."""
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(RECORD_LINE_LIMIT + 1)
            if not raw:
                return
            number += 1
            if len(raw) > RECORD_LINE_LIMIT:  # skip the rest of an over-long line, a bounded piece at a time
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(RECORD_LINE_LIMIT + 1)
                if not raw:
                    return
                bad(number, ValueError(f"longer than {RECORD_LINE_LIMIT:,} bytes"))
                continue
            if not raw.endswith(b"\n"):
                return  # a partial last line from a crash mid-write
            if not raw.strip():
                continue
            try:
                record = _record_from_line(raw)
            except (ValueError, TypeError) as e:  # bad JSON or UTF-8, missing or mistyped fields
                bad(number, e)
                continue
            yield record


def count_records(path: str | os.PathLike[str]) -> int:
    """How many steps a ``records.jsonl`` holds (each step once; bad lines not counted, nor warned about)."""
    return sum(1 for _ in iter_records(path, warn=False))


def _spans(steps: Iterable[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3-5, 9`` (at most 6 spans shown)."""
    spans: list[str] = []
    ordered = sorted(steps)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            spans.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return _joined(spans)


def _joined(spans: list[str]) -> str:
    return ", ".join(spans[:6]) + (f" and {len(spans) - 6} more spans" if len(spans) > 6 else "")


def _gaps(seen: set[int], end: int) -> tuple[int, str]:
    """How many of the steps ``0..end-1`` are not in ``seen``, and which (``step 3``, ``steps 3-5, 9``); counted
    from the gaps, never a list of every step (a corrupt step number may be huge)."""
    spans: list[str] = []
    count = expected = 0
    for step in [*sorted(s for s in seen if 0 <= s < end), end]:
        if step > expected:
            count += step - expected
            spans.append(str(expected) if step - 1 == expected else f"{expected}-{step - 1}")
        expected = step + 1
    return count, f"step{'s' if count > 1 else ''} {_joined(spans)}"


def _repeated_text(repeated: Mapping[int, int]) -> str:
    """``step 3 is recorded more than once (1 extra line)`` for ``{3: 1}`` (step -> its extra lines)."""
    extra = sum(repeated.values())
    several = len(repeated) > 1
    return (f"step{'s' if several else ''} {_spans(repeated)} {'are' if several else 'is'} recorded more than "
            f"once ({extra:,} extra line{'s' if extra > 1 else ''})")


def _check_recorded(path: Path, status: dict[str, Any]) -> dict[str, Any]:
    """``status`` (an ended run's) checked against ``records.jsonl``: when the file holds fewer steps than
    ``steps_completed`` says (lines lost after the run, a file emptied or removed, a step replaced by a copy of
    another), a :class:`RunLogWarning` names the file and the missing steps, and the status returned counts
    what is there (``complete`` false, ``steps_in_status`` what status.json said, a ``note``). Steps recorded
    more than once are named in the ``note`` (each is counted once)."""
    claimed = status.get("steps_completed")
    if isinstance(claimed, bool) or not isinstance(claimed, int) or claimed <= 0:
        return status
    records = path / "records.jsonl"
    seen: set[int] = set()
    repeated: dict[int, int] = {}
    if _records_file(records):
        for _ in _first_of_each_step(_read_records(records, lambda number, e: None), seen, repeated):
            pass
    copies = f"; {_repeated_text(repeated)}, counted once" if repeated else ""
    if len(seen) >= claimed:
        if not repeated:
            return status
        note = f"{records}: {_repeated_text(repeated)}; each step is counted once"
        return {**status, "note": f"{status['note']}; {note}" if status.get("note") else note}
    missing, which = _gaps(seen, claimed)
    held = "none" if not seen else f"{len(seen)}"
    lost = "it is missing" if not records.exists() else (
        "lines were lost or copied over after the run wrote them" if repeated else
        "lines were lost after the run wrote them")
    text = (f"{records} holds {held} of the {claimed} steps status.json counts"
            f"{f' (missing: {which})' if missing else ''}{copies}: {lost}; the summary covers only the steps it holds")
    warnings.warn(text, RunLogWarning, stacklevel=3)
    note = f"{text}; status.json says {status.get('status', 'unknown')} after {claimed} steps"
    return {**status, "steps_completed": len(seen), "steps_in_status": claimed, "complete": False,
            "note": f"{status['note']}; {note}" if status.get("note") else note}


@dataclasses.dataclass
class LoadedRun:
    """A run folder read back: its spec, policy, environment, status; records stream from disk."""

    path: Path
    spec: RunSpec
    policy: Policy | None
    environment: dict[str, Any]
    status: dict[str, Any]
    model: dict[str, Any]

    @property
    def complete(self) -> bool:
        """True only for a run that ran every step (a stopped, interrupted or failed run is incomplete)."""
        return bool(self.status.get("complete"))

    @property
    def state(self) -> str:
        """``complete``, ``stopped``, ``interrupted`` (also a run left ``running`` by a process that is
        gone, or stale: see :func:`left_running_reason`; its status says so), ``failed``, ``running``
        (still being written), or ``unknown`` (no readable ``status.json``)."""
        state = self.status.get("status", "unknown")
        if state in OPEN_STATES and left_running_reason(self.path, self.status) is not None:
            return LEFT_RUNNING
        return state

    def records(self, include_warmup: bool = True) -> Iterator[StepRecord]:
        """The step records, streamed from ``records.jsonl``."""
        for record in iter_records(self.path / "records.jsonl"):
            if include_warmup or not record.warmup:
                yield record

    def to_frame(self, include_warmup: bool = True) -> pd.DataFrame:
        """One row per step; per-type dicts become columns like ``live_bytes.param``."""
        return records_frame(self.records(include_warmup))

    def summary(self) -> dict[str, Any]:
        """Step-time statistics and traffic totals over the measured (non-warm-up) steps."""
        return summarize(self.records())

    @property
    def model_text(self) -> str:
        """The model's name, with `` (custom)`` for your own model (``custom(...)``: model.json says so)."""
        info = self.model.get("info")
        custom = isinstance(info, Mapping) and info.get("custom") is True
        return f"{self.spec.model} (custom)" if custom else str(self.spec.model)

    @property
    def steps_text(self) -> str:
        """Completed / planned steps (warm-up included), e.g. ``22/22``."""
        return f"{self.status.get('steps_completed', '?')}/{self.status.get('steps_planned', '?')}"

    def __repr__(self) -> str:
        return (f"LoadedRun('{self.path}', model={self.spec.model!r}, policy={self.spec.policy!r}, "
                f"backend={self.environment.get('backend')!r}, state={self.state!r}, steps={self.steps_text})")

    def _repr_html_(self) -> str:
        """Jupyter display: what ran, how it ended, and the summary with rounded, unit-bearing values."""
        esc = html.escape
        head = (f"<b>{esc(self.model_text)}</b> under <b>{esc(str(self.spec.policy))}</b> on "
                f"<b>{esc(str(self.environment.get('backend', '?')))}</b>: {esc(self.state)}, "
                f"{esc(self.steps_text)} steps")
        error = self.status.get("error")
        rows = "".join(
            f"<tr><th style='text-align:left'>{esc(key)}</th><td style='text-align:right'>{esc(text)}</td></tr>"
            for key, text in format_summary(self.summary()).items())
        return (f"<div class='um-lab-run'><div>{head}</div>"
                + (f"<div style='color:#b00'>error: {esc(str(error))}</div>" if error else "")
                + f"<table>{rows}</table>"
                + f"<div style='font-size:smaller'><code>{esc(str(self.path))}</code> "
                f"({NOT_MEASURED} = not measured)</div></div>")


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3 on of Linux's ``/proc/<pid>/stat`` (state first, start time at index 19); None where
    there is no such file."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, Linux); None where unknown. With the pid
    it names one process, even after the pid is reused."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _same_host_pid(status: Mapping[str, Any]) -> int | None:
    pid = status.get("pid")
    if status.get("host") != socket.gethostname() or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    return pid


def _start_times_known() -> bool:
    """True where this platform tells when a process started (Linux's /proc): a status written here then
    records its process's start time, and one without it cannot be tied to a live pid."""
    return process_start_ticks(os.getpid()) is not None


def _age_s(iso: Any) -> float | None:
    try:
        when = _dt.datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    return None if when.tzinfo is None else (_dt.datetime.now(_dt.UTC) - when).total_seconds()


def _left_running(path: Path, status: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(interrupted_by, reason)`` for a ``running`` or ``pending`` status that no longer holds (or cannot be
    shown to); None while its run is shown to be running (or, pending, its process lives)."""
    pid = _same_host_pid(status)
    if pid is not None and pid == os.getpid():
        if status.get("status") == "pending":  # a Run of this process not started yet
            return None
        return None if runexit.own_status(path) is not None else (ENDED_WITHOUT_CLOSING,
                                                                   "no run of this process writes it")
    if pid is None:
        stale = _stale(status)
        if stale is not None:
            return ENDED_WITHOUT_CLOSING, stale
        host = status.get("host")
        where = f"on host {host!r}, not this one ({socket.gethostname()!r})" if isinstance(host, str) and \
            host != socket.gethostname() else "without a valid host and pid"
        return NOT_CHECKABLE, f"it was written {where}, so its process cannot be checked from here"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ENDED_WITHOUT_CLOSING, f"its process (pid {pid}) is gone"
    except OSError:
        pass  # not ours to signal: it exists
    fields = _proc_stat(pid)
    if fields and fields[0] == "Z":
        return ENDED_WITHOUT_CLOSING, f"its process (pid {pid}) has exited"
    started = status.get("pid_started")
    now = process_start_ticks(pid)
    if isinstance(started, int) and not isinstance(started, bool) and now is not None:
        if now != started:
            return ENDED_WITHOUT_CLOSING, f"pid {pid} now names another process"
        return None  # its own process is alive: a long step or a paused loop is not a crash
    if _start_times_known():
        return NOT_CHECKABLE, (f"it does not say when its process started, so the live pid {pid} cannot be shown "
                               "to be the run's process")
    stale = _stale(status)  # no start times on this platform: a live pid is trusted until it is stale
    return None if stale is None else (ENDED_WITHOUT_CLOSING, stale)


def _stale(status: Mapping[str, Any]) -> str | None:
    age = _age_s(status.get("updated_at"))
    if status.get("heartbeat_s") is not None and age is not None and age > STALE_AFTER_S:
        return f"it is stale (last rewritten {age / 60:.0f} minutes ago)"
    return None


def left_running_reason(path: str | os.PathLike[str], status: Mapping[str, Any]) -> str | None:
    """Why a ``running`` (or ``pending``) status no longer holds, or None while its run is shown to be running
    (a ``pending`` one: created by a process that still lives, not started yet).

    Liveness is judged only where the status names this host and its process's pid and start time: a
    process alive with that pid and start time is trusted (a long step or a paused loop is not a crash);
    one that is gone, a zombie, or whose pid now names another process is not; in this process, a folder
    no run of ours writes is not. A status written on another host (a folder copied here, or on a shared
    file system), or a live pid without its start time, cannot be checked: it is not read as running.
    Where it cannot be checked, a status that promised a heartbeat and was not rewritten for
    :data:`STALE_AFTER_S` is called stale.
    """
    found = _left_running(Path(path), status)
    return None if found is None else found[1]


def current_status(path: str | os.PathLike[str], status: dict[str, Any]) -> dict[str, Any]:
    """``status`` (as read from ``path``'s status.json) as it stands now.

    A ``running`` status written by this process comes from the run itself (its file may lag, or be
    unwritable); a ``running`` or ``pending`` one that no longer holds (:func:`left_running_reason`) becomes
    :data:`LEFT_RUNNING`, incomplete, with the step count of ``records.jsonl``, ``interrupted_by``
    :data:`ENDED_WITHOUT_CLOSING` and a ``note`` saying why.
    """
    if status.get("status") not in OPEN_STATES:
        return status
    path = Path(path)
    if _same_host_pid(status) == os.getpid() and (own := runexit.own_status(path)) is not None:
        return own
    found = _left_running(path, status)
    if found is None:
        if status.get("status") == "pending":
            return status
        counted = count_records(path / "records.jsonl")  # the heartbeat lags the records
        steps = status.get("steps_completed")
        if isinstance(steps, int) and not isinstance(steps, bool) and counted > steps:
            return {**status, "steps_completed": counted}
        return status
    by, reason = found
    return {**status, "status": LEFT_RUNNING, "complete": False,
            "steps_completed": count_records(path / "records.jsonl"),
            "interrupted_by": by,
            "note": f"{by}: status.json says {status.get('status')}, but {reason}; steps counted from records.jsonl"}


def _read_object(file: Path, what: str) -> dict[str, Any]:
    """A run file's JSON object: a regular file of at most :data:`~um_lab.files.RUN_FILE_LIMIT` bytes, of
    bounded depth (:class:`~um_lab.errors.FileReadError` otherwise), holding an object."""
    data = read_json(file, what, RUN_FILE_LIMIT)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def _why(error: Exception) -> str:
    """What was wrong with a run file, for a message that names the file already."""
    if isinstance(error, FileReadError):
        return f"it {error.reason}"
    return f"{type(error).__name__}: {error}"


def load(path: str | os.PathLike[str]) -> LoadedRun:
    """Read a run folder written by :class:`~um_lab.runs.runner.Run` (complete or not).

    Raises :class:`NotARunFolderError` for a path not found, a file, or a folder without a ``spec.json``;
    :class:`RunLogError` for a corrupt one.
    A corrupt ``status.json``, ``policy.json``, ``model.json`` or ``environment.json`` is warned about
    (:class:`RunLogWarning`, naming it) and read as missing: the state is then ``unknown``. The status
    is read as it stands now (:func:`current_status`).
    """
    path = Path(path)
    spec_file = path / "spec.json"
    if not path.exists():
        raise NotARunFolderError(f"run folder {path} not found (no such file or folder)")
    if not path.is_dir():
        raise NotARunFolderError(f"{path} is {describe(path)}, not a um_lab run folder")
    if not (spec_file.exists() or spec_file.is_symlink()):
        raise NotARunFolderError(f"{path} is not a um_lab run folder (no spec.json)")
    try:
        spec = RunSpec.from_dict(_read_object(spec_file, "run spec"), recorded=True)
    except (ValueError, TypeError, OSError) as e:
        raise RunLogError(f"{spec_file} is not a readable run spec ({_why(e)}); the run folder cannot be loaded"
                          ) from None

    def side(name: str, parse: Any = None) -> Any:
        file = path / name
        if not file.exists() and not file.is_symlink():
            return None
        try:
            data = _read_object(file, f"run's {name}")
            return parse(data) if parse else data
        except (ValueError, TypeError, OSError) as e:
            warnings.warn(f"{file} cannot be read ({_why(e)}); read as missing", RunLogWarning, stacklevel=3)
            return None

    status = side("status.json")
    if not status:
        status = {"status": "unknown", "complete": False,
                  "steps_completed": count_records(path / "records.jsonl"),
                  "steps_planned": spec.warmup_steps + spec.steps,
                  "note": "no readable status.json; steps counted from records.jsonl"}
    status = current_status(path, status)
    if status.get("status") not in OPEN_STATES:
        status = _check_recorded(path, status)
    return LoadedRun(
        path=path,
        spec=spec,
        policy=side("policy.json", Policy.from_dict),
        environment=side("environment.json") or {},
        status=status,
        model=side("model.json") or {},
    )
