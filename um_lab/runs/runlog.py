"""Run folders: their layout and writing them (reading them back: :mod:`um_lab.runs.runread`).

Each run writes a folder: ``spec.json`` (the :class:`RunSpec`), ``policy.json``, ``model.json``,
``environment.json`` (versions, backend, and what the backend says of itself: device, calibration
profile name and SHA-256 on the simulator), ``records.jsonl`` (one
:class:`StepRecord` per line, appended and flushed as each step completes) and ``status.json``
(``running`` until the run ends, rewritten as a heartbeat with its step count; then ``complete``,
``stopped``, ``interrupted`` or ``failed``). A run that failed or was killed keeps every completed step and is
never marked complete. Warm-up steps are recorded (``warmup: true``) and left out of summaries.

Writing a folder is :class:`um_lab.runs.runner.Run`'s job; :func:`list_runs` lists them and
:mod:`um_lab.runs.runread` (``load``, ``iter_records``) reads them back.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import errno
import importlib.metadata
import json
import os
import platform
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from um_lab.backend_base import Backend
from um_lab.errors import UmLabError
from um_lab.files import describe, refused_character
from um_lab.runs.runread import (
    RunLogWarning,
    count_records,
    process_start_ticks,
)
from um_lab.types import RunSpec, StepRecord

DEFAULT_OUT_DIR = Path("runs")  #: the fallback of :func:`default_out_dir` (relative to the current folder)
RUNS_DIR_ENV = "UM_LAB_RUNS_DIR"
HEARTBEAT_S = 5.0  #: a running run rewrites status.json (its step count) at most this often, between steps


class RunDirError(UmLabError, OSError):
    """The run directory cannot be created or written (raised before the run starts, or when a file of a
    running run cannot be written)."""


class RunNameError(UmLabError, ValueError):
    """A run name that is not one plain folder name: it would put the run outside ``out_dir``."""


# ----------------------------------------------------------------------------------- run folders


def default_out_dir() -> Path:
    """Where runs go when no ``out_dir`` is given: ``$UM_LAB_RUNS_DIR`` if set, else ``runs/`` in the
    current folder. Read at call time (``um-lab lab`` sets the variable for its notebooks' kernels)."""
    value = os.environ.get(RUNS_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else DEFAULT_OUT_DIR


def resolve_out_dir(out_dir: str | os.PathLike[str] | None) -> Path:
    """``out_dir`` as a Path, or :func:`default_out_dir` when it is None; anything but a path is refused
    (:class:`RunDirError` naming it)."""
    if out_dir is None:
        return default_out_dir()
    if not isinstance(out_dir, (str, os.PathLike)):
        raise RunDirError(f"out_dir must be a folder path (str or os.PathLike) or None, got "
                          f"{type(out_dir).__name__} {out_dir!r}")
    return Path(out_dir)


def timestamp() -> str:
    """Local time for folder names, e.g. ``20250101-120000``."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def now_iso() -> str:
    """UTC time in ISO format (seconds), as written in the JSON files."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def safe_name(text: str) -> str:
    """``text`` cut to a folder-name-safe form (at most 60 characters)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:60]


#: The longest run name, in bytes of the file system's encoding (a folder name's limit on Linux and macOS).
RUN_NAME_LIMIT = 255
def check_run_name(name: str | os.PathLike[str]) -> str:
    """``name`` if it is one plain folder name, else :class:`RunNameError` (nothing is created): not
    empty, ``.`` or ``..``, not absolute, no path separator, so that the run stays inside ``out_dir``; no
    control, bidi-override, invisible or surrogate character (a name shown in a terminal or a table must
    read as what it is); at most :data:`RUN_NAME_LIMIT` bytes."""
    text = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(text, str):
        raise RunNameError(f"a run name must be a string, not {type(name).__name__}")
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if (not text.strip() or text in (".", "..") or "\0" in text or any(sep in text for sep in separators)
            or Path(text).is_absolute() or Path(text).drive):
        raise RunNameError(
            f"run name {text!r} is not a plain folder name: it must not be empty, '.' or '..', absolute, "
            "or hold a path separator, so that the run folder stays inside out_dir (to put runs "
            "elsewhere, pass out_dir). Nothing was created.")
    why = refused_character(text)
    if why is not None:
        raise RunNameError(
            f"run name {ascii(text)} is not a plain folder name: it holds {why}; a run name may not hold control, "
            "bidi, invisible or surrogate characters. Nothing was created.")
    size = len(text.encode("utf-8"))
    if size > RUN_NAME_LIMIT:
        raise RunNameError(
            f"run name {text[:40]!r}... is {len(text)} characters ({size} bytes), more than the {RUN_NAME_LIMIT} "
            "bytes a folder name may have; give a shorter run name. Nothing was created.")
    return text


def check_out_folder(out_dir: str | os.PathLike[str], lead: str = "cannot write runs under") -> Path:
    """``out_dir`` as a Path unless something other than a folder is there (a file, ``/dev/null``, a broken
    link): then :class:`RunDirError` naming it, before anything is created. A folder, or nothing yet, passes."""
    out = Path(out_dir)
    what = describe(out)
    if what is not None and what != "a directory":
        raise RunDirError(f"{lead} {out}: out_dir {out} is {what}, not a folder; give a folder for the runs "
                          "(CLI: --out DIR). Nothing was created.")
    return out


def _create_folders(out: Path, made: list[Path]) -> None:
    """``out`` and its missing parents (``mkdir -p``), each folder this call created appended to ``made``."""
    missing = []
    for folder in (out, *out.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    out.mkdir(parents=True, exist_ok=True)
    made.extend(reversed(missing))


def _remove_made(made: list[Path]) -> None:
    """Remove what a failed check created, newest first (a file; a folder only while empty)."""
    for item in reversed(made):
        with contextlib.suppress(OSError):
            if item.is_dir() and not item.is_symlink():
                item.rmdir()
            else:
                item.unlink()


def prepare_run_dir(out_dir: str | os.PathLike[str], name: str) -> Path:
    """Create ``out_dir/name`` (unique) and prove it writable, or raise :class:`RunDirError`
    (:class:`RunNameError` for a name that is not one plain folder name); a failure removes what it created."""
    name = check_run_name(name)
    out = check_out_folder(out_dir, "cannot write the run directory under")
    made: list[Path] = []
    try:
        _create_folders(out, made)
        path = out / name
        path.mkdir()
        made.append(path)
        probe = path / ".write-test"
        made.append(probe)
        _write_file(probe, b"ok")
        probe.unlink()
        made.remove(probe)
    except FileExistsError:
        _remove_made(made)
        raise RunDirError(f"run directory {out / name} already exists; choose another name") from None
    except OSError as e:
        _remove_made(made)
        if e.errno == errno.ENAMETOOLONG:
            raise RunNameError(f"run name {name[:40]!r}... is too long for a folder name under {out} "
                               f"({e.strerror}); give a shorter run name. Nothing was run.") from None
        raise RunDirError(
            f"cannot write the run directory under {out} ({e.strerror or e}); choose a writable "
            "out_dir (CLI: --out DIR). Nothing was run.") from None
    except BaseException:
        _remove_made(made)
        raise
    return path


def check_writable(out_dir: str | os.PathLike[str]) -> Path:
    """Raise :class:`RunDirError` unless runs can be written under ``out_dir`` (creating it if needed; a
    failure removes what it created)."""
    out = check_out_folder(out_dir)
    made: list[Path] = []
    try:
        _create_folders(out, made)
        probe = out / f".write-test-{uuid.uuid4().hex[:8]}"
        made.append(probe)
        _write_file(probe, b"ok")
        probe.unlink()
        made.remove(probe)
    except OSError as e:
        _remove_made(made)
        raise RunDirError(
            f"cannot write runs under {out} ({e.strerror or e}); choose a writable out_dir "
            "(CLI: --out DIR). Nothing was run.") from None
    except BaseException:
        _remove_made(made)
        raise
    return out


#: The errors of a full disk or quota: a file that exists may still be rewritten in place.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def _write_file(path: Path, data: bytes) -> None:
    """Create (or truncate) ``path`` and write ``data`` to it."""
    with open(path, "wb") as f:
        f.write(data)


def write_json(path: Path, data: Any, *, in_place_if_full: bool = False) -> None:
    """Write JSON atomically (a reader never sees half a file): a temporary file, then renamed over ``path``.
    A failed write leaves no temporary file. ``in_place_if_full``: when the disk is full (or over quota),
    an existing ``path`` is rewritten in place instead, in the blocks it already has (not atomic: the
    last resort of a run's final status)."""
    text = (json.dumps(data, indent=2, default=str) + "\n").encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _write_file(tmp, text)
        os.replace(tmp, path)
    except OSError as e:
        _remove_temporary(tmp)
        if not (in_place_if_full and e.errno in _NO_SPACE and path.is_file()):
            raise
        try:
            _rewrite_in_place(path, text)
        except OSError:
            raise e from None
    except BaseException:  # interrupted mid-write: no temporary file is left behind
        _remove_temporary(tmp)
        raise


def _remove_temporary(tmp: Path) -> None:
    """Remove a temporary file a failed write left (only a file: anything else there is not ours)."""
    with contextlib.suppress(OSError):
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path`` with ``data`` without allocating a new file (works on a full disk while the
    file's blocks hold ``data``)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
        f.flush()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_info(backend: Backend, requested_backend: str) -> dict[str, Any]:
    """Versions, host and backend of a run, and what the backend records of itself
    (:meth:`~um_lab.backend_base.Backend.environment`: ``device``, the simulator's ``calibration_profile`` and
    ``calibration_profile_sha256``); written as ``environment.json``."""
    import torch

    import um_lab

    versions = {"python": platform.python_version(), "um_lab": um_lab.__version__, "torch": torch.__version__,
                "torch_cuda": torch.version.cuda}
    for dist in ("numpy", "pandas", "transformers", "torchvision", "cupy-cuda12x", "cupy-cuda13x",
                 "cuda-bindings", "cupti-python"):
        if (v := _version(dist)) is not None:
            versions[dist] = v
    info: dict[str, Any] = {
        "created_at": now_iso(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "pid": os.getpid(),
        "backend": backend.name,
        "backend_requested": requested_backend,
        "backend_note": backend_note(requested_backend, backend.name),
        "backend_class": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "measures_residency": backend.measures_residency,
        "versions": versions,
        "calibration_profile": None,  # a calibrated backend names its profile
    }
    info.update(jsonable(backend.environment()))
    return info


def backend_note(requested: str, resolved: str) -> str:
    """A line for users: which backend runs and why, e.g. ``sim (auto: no CUDA GPU here)``."""
    if requested != "auto":
        return resolved
    return f"{resolved} (auto: {'a CUDA GPU is available' if resolved == 'cuda' else 'no CUDA GPU here'})"


def jsonable(value: Any) -> Any:
    """Make a value JSON-safe (non-finite floats stay floats: json writes NaN/Infinity)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


# ------------------------------------------------------------------------------- writing a run


_START_TICKS: dict[int, int | None] = {}


def _own_start_ticks() -> int | None:
    """This process's start time (see :func:`~um_lab.runs.runread.process_start_ticks`), read once per pid."""
    pid = os.getpid()
    if pid not in _START_TICKS:
        _START_TICKS[pid] = process_start_ticks(pid)
    return _START_TICKS[pid]


class RunFolderWriter:
    """Writes a run's ``records.jsonl`` lines and its ``status.json`` (mixed into :class:`um_lab.runs.runner.Run`).

    ``status.json`` is rewritten as a heartbeat (at most every :data:`HEARTBEAT_S`, between steps) and
    once at the end, which seals the folder: nothing is written after it, so a run ended from outside
    (SIGTERM, interpreter exit: :meth:`end_abruptly`) keeps the status written then, and its step count
    matches ``records.jsonl``. One re-entrant lock orders record lines and status writes across threads.
    """

    path: Path
    spec: RunSpec
    status: str
    steps_completed: int
    latest: StepRecord | None
    tail: collections.deque[StepRecord]
    records: list[StepRecord] | None
    _started_at: str | None

    def _init_writer(self) -> None:
        self._io_lock = threading.RLock()
        self._sealed = False  # the final status is on disk: nothing more is written
        self._error_text: str | None = None
        self._interrupted_by: str | None = None
        self._status_written_at = 0.0
        self._heartbeat_warned = False
        self._status_problem: object = None

    def _open_log(self) -> IO[str]:
        """``records.jsonl``, opened to append a line per step."""
        return open(self.path / "records.jsonl", "a", encoding="utf-8")

    def _log(self, log: IO[str], record: StepRecord) -> bool:
        """Append ``record`` to records.jsonl and count it; False (nothing written) once sealed."""
        line = json.dumps(jsonable(record.to_dict())) + "\n"
        with self._io_lock:
            if self._sealed:
                return False
            try:
                log.write(line)
                log.flush()
            except OSError as e:
                raise RunDirError(f"cannot write {self.path / 'records.jsonl'} ({e.strerror or e}); the "
                                  f"{self.steps_completed} steps before this one are in it") from e
            self.steps_completed += 1
            self.latest = record
            self.tail.append(record)
            if self.records is not None:
                self.records.append(record)
        return True

    def _end_as(self, state: str, *, if_running: bool = False) -> bool:
        """Set the end state, unless the final status is on disk already (or, ``if_running``, the run
        has an end state already); True if set."""
        with self._io_lock:
            if self._sealed or (if_running and self.status != "running"):
                return False
            self.status = state
            return True

    def _heartbeat(self) -> None:
        if time.monotonic() - self._status_written_at < HEARTBEAT_S:
            return
        try:
            self._write_status()
        except OSError as e:  # the records still go to their open file; warn once, go on
            if not self._heartbeat_warned:
                self._heartbeat_warned = True
                warnings.warn(f"cannot update {self.path / 'status.json'} ({e.strerror or e}); the run goes on "
                              "and its steps still go to records.jsonl", RunLogWarning, stacklevel=3)

    def _finish(self) -> bool:
        """Write the final status and seal the folder; False if status.json could not be written."""
        with self._io_lock:
            if self._sealed:
                return True
            if self.status == "interrupted":  # a signal between a record's write and its count: trust the file
                self.steps_completed = max(self.steps_completed, count_records(self.path / "records.jsonl"))
            try:
                self._write_status(final=True)
            except OSError as e:
                self._status_problem = e.strerror or e
                return False
            self._sealed = True
            return True

    def end_abruptly(self, state: str, reason: str) -> bool:
        """End the run from outside because its process is ending (SIGTERM, interpreter exit): a run
        still running becomes ``state`` with its completed steps; its final status is written (retried,
        for a run that ended but could not write it). True once the final status is on disk."""
        with self._io_lock:
            if self._sealed:
                return True
            if self.status == "running":
                self.status = state
                self._interrupted_by = reason
            return self._finish()

    def current_status(self) -> dict[str, Any]:
        """The status as it stands now (what status.json says, or is about to)."""
        with self._io_lock:
            return {
                "status": self.status,
                "complete": self.status == "complete",
                "steps_completed": self.steps_completed,
                "steps_planned": self.spec.warmup_steps + self.spec.steps,
                "started_at": self._started_at,
                "updated_at": now_iso(),
                "error": self._error_text,
                "interrupted_by": self._interrupted_by if self.status == "interrupted" else None,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_started": _own_start_ticks(),
                "heartbeat_s": HEARTBEAT_S,
            }

    def _write_status(self, *, final: bool = False) -> None:
        with self._io_lock:
            if self._sealed:
                return
            write_json(self.path / "status.json", self.current_status(), in_place_if_full=final)
            self._status_written_at = time.monotonic()


# ---------------------------------------------------------------------------------- listing runs


def list_runs(out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Run folders under ``out_dir`` (default: :func:`default_out_dir`; recursively: sweeps keep theirs
    in a subfolder), oldest first. The default folder may not exist yet (no runs: ``[]``); an ``out_dir``
    given that does not exist, or is a file, is refused (:class:`RunDirError`): likely a typo."""
    folder = resolve_out_dir(out_dir)
    if out_dir is not None and not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise RunDirError(f"cannot list runs under {folder}: it {what}")
    return sorted((p.parent for p in folder.rglob("spec.json")), key=lambda p: p.name)
