"""Run folders: their layout, writing them, and reading them back.

Each run writes a folder: ``spec.json`` (the :class:`RunSpec`), ``policy.json``, ``model.json``,
``environment.json`` (versions, device, backend, calibration profile), ``records.jsonl`` (one
:class:`StepRecord` per line, appended and flushed as each step completes) and ``status.json``
(``running`` until the run ends; then ``complete``, ``stopped``, ``interrupted`` or ``failed``). A run
that crashed keeps every completed step and is never marked complete. Warm-up steps are recorded
(``warmup: true``) and left out of summaries.

Writing a folder is :class:`um_lab.runner.Run`'s job; :func:`load`, :func:`list_runs` and
:func:`iter_records` read them back (all re-exported by :mod:`um_lab.runner`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import html
import importlib.metadata
import json
import os
import platform
import socket
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from um_lab.backend import Backend
from um_lab.errors import UmLabError
from um_lab.policy import Policy
from um_lab.summary import NOT_MEASURED, format_summary, records_frame, summarize
from um_lab.types import RunSpec, StepRecord

DEFAULT_OUT_DIR = Path("runs")  #: the fallback of :func:`default_out_dir` (relative to the current folder)
RUNS_DIR_ENV = "UM_LAB_RUNS_DIR"
FILES = ("spec.json", "policy.json", "model.json", "environment.json", "records.jsonl", "status.json")


class RunDirError(UmLabError, OSError):
    """The run directory cannot be created or written; raised before the run starts."""


# ----------------------------------------------------------------------------------- run folders


def default_out_dir() -> Path:
    """Where runs go when no ``out_dir`` is given: ``$UM_LAB_RUNS_DIR`` if set, else ``runs/`` in the
    current folder. Read at call time (``um-lab lab`` sets the variable for its notebooks' kernels)."""
    value = os.environ.get(RUNS_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else DEFAULT_OUT_DIR


def resolve_out_dir(out_dir: str | os.PathLike[str] | None) -> Path:
    """``out_dir`` as a Path, or :func:`default_out_dir` when it is None."""
    return default_out_dir() if out_dir is None else Path(out_dir)


def timestamp() -> str:
    """Local time for folder names, e.g. ``20250101-120000``."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def now_iso() -> str:
    """UTC time in ISO format (seconds), as written in the JSON files."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def safe_name(text: str) -> str:
    """``text`` cut to a folder-name-safe form (at most 60 characters)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:60]


def prepare_run_dir(out_dir: str | os.PathLike[str], name: str) -> Path:
    """Create ``out_dir/name`` (unique) and prove it writable, or raise :class:`RunDirError`."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / name
        path.mkdir()
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except FileExistsError:
        raise RunDirError(f"run directory {out / name} already exists; choose another name") from None
    except OSError as e:
        raise RunDirError(
            f"cannot write the run directory under {out} ({e.strerror or e}); choose a writable "
            "out_dir (CLI: --out DIR). Nothing was run.") from None
    return path


def check_writable(out_dir: str | os.PathLike[str]) -> Path:
    """Raise :class:`RunDirError` unless runs can be written under ``out_dir`` (creating it if needed)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"cannot write runs under {out} ({e.strerror or e}); choose a writable out_dir "
            "(CLI: --out DIR). Nothing was run.") from None
    return out


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_info(backend: Backend, backend_name: str, requested_backend: str) -> dict[str, Any]:
    """Versions, host, device and calibration profile of a run (written as ``environment.json``)."""
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
        "backend": backend_name,
        "backend_requested": requested_backend,
        "backend_note": backend_note(requested_backend, backend_name),
        "backend_class": f"{type(backend).__module__}.{type(backend).__qualname__}",
        "versions": versions,
        "calibration_profile": _profile_name(backend),
    }
    if backend_name == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["device"] = {"name": props.name, "total_memory_bytes": props.total_memory,
                          "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    else:
        info["device"] = {"name": "cpu (simulated GPU)" if backend_name == "sim" else "cpu"}
    return info


def _profile_name(backend: Backend) -> str | None:
    for attr in ("profile", "calibration", "machine"):
        value = getattr(backend, attr, None)
        if value is None:
            continue
        if isinstance(value, str):
            return value
        name = getattr(value, "name", None)
        return str(name) if name is not None else type(value).__name__
    return None


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


# ---------------------------------------------------------------------------------- loading runs


def iter_records(path: str | os.PathLike[str]) -> Iterator[StepRecord]:
    """Stream the records of a ``records.jsonl`` (a line cut off by a crash is skipped)."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # a partial last line from a crash mid-write
            if line.strip():
                yield StepRecord.from_dict(json.loads(line))


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
        """True only for a run that ran every step (a stopped or crashed run is incomplete)."""
        return bool(self.status.get("complete"))

    @property
    def state(self) -> str:
        """``complete``, ``stopped``, ``interrupted``, ``failed``, or ``crashed`` (left ``running`` by a
        process that is gone), or ``running`` (still being written)."""
        state = self.status.get("status", "unknown")
        if state == "running" and not _process_alive(self.status):
            return "crashed"
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
    def steps_text(self) -> str:
        """Completed / planned steps (warm-up included), e.g. ``22/22``."""
        return f"{self.status.get('steps_completed', '?')}/{self.status.get('steps_planned', '?')}"

    def __repr__(self) -> str:
        return (f"LoadedRun('{self.path}', model={self.spec.model!r}, policy={self.spec.policy!r}, "
                f"backend={self.environment.get('backend')!r}, state={self.state!r}, steps={self.steps_text})")

    def _repr_html_(self) -> str:
        """Jupyter display: what ran, how it ended, and the summary with rounded, unit-bearing values."""
        esc = html.escape
        head = (f"<b>{esc(str(self.spec.model))}</b> under <b>{esc(str(self.spec.policy))}</b> on "
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


def _process_alive(status: Mapping[str, Any]) -> bool:
    if status.get("host") != socket.gethostname() or not isinstance(status.get("pid"), int):
        return True  # cannot tell from here
    try:
        os.kill(status["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(path: str | os.PathLike[str]) -> LoadedRun:
    """Read a run folder written by :class:`~um_lab.runner.Run` (complete or not)."""
    path = Path(path)
    if not (path / "spec.json").is_file():
        raise FileNotFoundError(f"{path} is not a um_lab run folder (no spec.json)")

    def read(name: str) -> dict[str, Any]:
        file = path / name
        return json.loads(file.read_text()) if file.is_file() else {}

    policy_data = read("policy.json")
    return LoadedRun(
        path=path,
        spec=RunSpec.from_dict(read("spec.json")),
        policy=Policy.from_dict(policy_data) if policy_data else None,
        environment=read("environment.json"),
        status=read("status.json") or {"status": "unknown", "complete": False},
        model=read("model.json"),
    )


def list_runs(out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Run folders under ``out_dir`` (default: :func:`default_out_dir`; recursively: sweeps keep theirs
    in a subfolder), oldest first."""
    return sorted((p.parent for p in resolve_out_dir(out_dir).rglob("spec.json")), key=lambda p: p.name)
