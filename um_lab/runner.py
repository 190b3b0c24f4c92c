"""Run a model under a policy on a backend, stream its step records to disk, compare policies.

::

    from um_lab.runner import Run, run, compare, load
    result = run(RunSpec(model="mlp", policy="gpu-first", backend="sim", steps=50))
    result.summary()["median_ms"]
    table = compare(["mlp"], ["um-default", "gpu-first"], ratios=[0.5, 1.5], backend="sim")
    load("runs/2025...-mlp-gpu-first-sim").to_frame()

Each run writes a folder: ``spec.json`` (the :class:`RunSpec`), ``policy.json``, ``model.json``,
``environment.json`` (versions, device, backend, calibration profile), ``records.jsonl`` (one
:class:`StepRecord` per line, appended and flushed as each step completes) and ``status.json``
(``running`` until the run ends; then ``complete``, ``stopped``, ``interrupted`` or ``failed``). A run
that crashed keeps every completed step and is never marked complete. Warm-up steps are recorded
(``warmup: true``) and left out of summaries.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import socket
import threading
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from um_lab.backend import Backend, cuda_available, get_backend, resolve_backend_name
from um_lab.errors import CudaUnavailableError, UmLabError
from um_lab.models import ModelCase, case_for_spec, check_fits, estimate_memory
from um_lab.policy import Policy, get_policy
from um_lab.types import DATA_TYPES, RunSpec, StepRecord

DEFAULT_OUT_DIR = Path("runs")
BASELINE_POLICY = "um-default"
FILES = ("spec.json", "policy.json", "model.json", "environment.json", "records.jsonl", "status.json")


class RunDirError(UmLabError, OSError):
    """The run directory cannot be created or written; raised before the run starts."""


class RunStateError(UmLabError, RuntimeError):
    """A Run was used in the wrong state (started twice, result asked before it ended, ...)."""


# ----------------------------------------------------------------------------------- run folders


def _timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _safe(text: str) -> str:
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


def _write_json(path: Path, data: Any) -> None:
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
        "created_at": _now_iso(),
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


# ------------------------------------------------------------------------------------------ Run


def _cuda_cap_bytes(backend: Backend) -> int | None:
    """The safety cap the cuda session will apply (None when the user allowed oversubscription)."""
    if getattr(backend, "allow_oversubscription", False):
        return None
    cap = getattr(backend, "cap_bytes", None)
    if cap is not None:
        return int(cap)
    if not cuda_available():
        return None  # no GPU to protect (the backend itself will refuse to run)
    import torch

    from um_lab.cuda.allocator import default_cap  # the cap's definition belongs to the cuda backend

    free, total = torch.cuda.mem_get_info()
    return default_cap(free, total)


def preflight_cuda(case: ModelCase, backend: Backend) -> dict[str, Any]:
    """Refuse a cuda run whose estimated memory cannot fit under the safety cap, before any allocation.

    Raises :class:`~um_lab.models.SizeRefused` (an ``OversubscriptionRefused``) showing the estimate.
    Returns the estimate and cap (recorded in ``model.json``).
    """
    estimate = estimate_memory(case)
    cap = _cuda_cap_bytes(backend)
    check_fits(estimate, cap)
    return {"estimate": estimate.to_dict(), "cap_bytes": cap}


class Run:
    """One training run: an iterable of :class:`StepRecord` that logs each step to its folder.

    Foreground: ``for record in Run(spec): ...``. Background: ``r = Run(spec).start()``, then
    ``r.latest`` / ``r.tail`` / ``r.steps_completed`` while it runs, ``r.stop()`` to end it after the
    current step, ``r.join()`` to wait (re-raises a backend error). A Run runs once.

    ``case``/``policy`` override what ``spec`` names (your own :func:`~um_lab.models.custom` model or
    :class:`Policy`); ``backend`` is a backend instance (default: ``get_backend(spec.backend)``).
    Records are not kept in memory unless ``keep_records=True``: the last ``tail`` records are
    (a bounded deque), and all are on disk. ``on_record(record)`` is called after each step is
    written. The folder and its ``spec.json`` are written here, so an unwritable ``out_dir`` fails
    before anything runs; on the cuda backend the memory estimate is checked against the safety cap.
    """

    def __init__(
        self,
        spec: RunSpec | None = None,
        case: ModelCase | None = None,
        policy: Policy | str | None = None,
        out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
        *,
        backend: Backend | None = None,
        keep_records: bool = False,
        tail: int = 128,
        on_record: Callable[[StepRecord], None] | None = None,
        name: str | None = None,
        preflight: bool = True,
    ) -> None:
        spec = spec or RunSpec()
        self.policy = get_policy(policy if policy is not None else spec.policy)
        self.case = case if case is not None else case_for_spec(spec)
        self.spec = dataclasses.replace(spec, policy=self.policy.name,
                                        model=self.case.name if case is not None else spec.model)
        self.backend_name = backend.name if backend is not None else resolve_backend_name(spec.backend)
        if backend is None and self.backend_name == "cuda" and not cuda_available():
            raise CudaUnavailableError("no CUDA GPU (or a CPU build of torch) in this process")
        self.backend_note = backend_note(spec.backend, self.backend_name)
        self.backend = backend if backend is not None else get_backend(self.backend_name)
        self.keep_records = keep_records
        self.records: list[StepRecord] | None = [] if keep_records else None
        self.tail: collections.deque[StepRecord] = collections.deque(maxlen=tail)
        self.latest: StepRecord | None = None
        self.steps_completed = 0
        self.status = "pending"
        self.error: BaseException | None = None
        self._callbacks = [on_record] if on_record else []
        self._stop = threading.Event()
        self._claimed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

        if self.backend_name == "cuda" and (spec.oversubscription_ratio is not None
                                            or spec.capacity_bytes is not None):
            raise ValueError("capacity_bytes and oversubscription_ratio are simulated (backend 'sim'); on "
                             "cuda size the model instead (um_lab.models.size_for_ratio)")
        model_info: dict[str, Any] = {"name": self.case.name, "info": _jsonable(self.case.info)}
        if preflight and self.backend_name == "cuda":
            model_info["preflight"] = preflight_cuda(self.case, self.backend)  # raises before any run
        folder = name or f"{_timestamp()}-{_safe(self.case.name)}-{_safe(self.policy.name)}-" \
                         f"{self.backend_name}-{uuid.uuid4().hex[:6]}"
        self.path = prepare_run_dir(out_dir, folder)
        _write_json(self.path / "spec.json", self.spec.to_dict())
        _write_json(self.path / "policy.json", self.policy.to_dict())
        _write_json(self.path / "model.json", model_info)
        _write_json(self.path / "environment.json",
                    environment_info(self.backend, self.backend_name, spec.backend))
        self._started_at: str | None = None
        self._write_status()

    # -- consumers ---------------------------------------------------------------------------------

    def add_listener(self, callback: Callable[[StepRecord], None]) -> None:
        """Call ``callback(record)`` after each step is written (from the thread running the steps)."""
        self._callbacks.append(callback)

    def __iter__(self) -> Iterator[StepRecord]:
        """Run in the foreground, yielding each record after it is on disk."""
        return self._steps()

    def start(self) -> Run:
        """Run in a background thread; returns ``self``."""
        self._claim()
        self._thread = threading.Thread(target=self._drain, name=f"um_lab-run-{self.path.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the run to end after the step in progress (its completed steps stay on disk)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a background run; True once it ended. Re-raises the error a failed run hit."""
        if self._thread is None:
            raise RunStateError("join() is for a run started with start()")
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None and not isinstance(self.error, GeneratorExit):
            raise self.error
        return True

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a ``with`` block stops a background run and waits for it (errors stay in ``error``)."""
        if self._thread is not None and self._thread.is_alive():
            self.stop()
            self._thread.join()

    @property
    def running(self) -> bool:
        """True while steps are being run."""
        return self.status == "running"

    @property
    def done(self) -> bool:
        """True once the run ended, whatever the reason."""
        return self.status not in ("pending", "running")

    def result(self) -> LoadedRun:
        """The finished run as read from disk (see :func:`load`)."""
        if not self.done:
            raise RunStateError(f"run is {self.status}; wait for it to end (join()) first")
        return load(self.path)

    def summary(self) -> dict[str, Any]:
        """Summary statistics of the steps on disk so far (warm-up left out)."""
        return summarize(iter_records(self.path / "records.jsonl"))

    def __repr__(self) -> str:
        return (f"Run({self.case.name!r}, policy={self.policy.name!r}, backend={self.backend_name!r}, "
                f"status={self.status!r}, steps={self.steps_completed}, path='{self.path}')")

    # -- the loop ----------------------------------------------------------------------------------

    def _claim(self) -> None:
        with self._lock:
            if self._claimed:
                raise RunStateError("a Run runs once; create a new Run to run again")
            self._claimed = True

    def _drain(self) -> None:
        try:
            for _ in self._steps(claimed=True):
                pass
        except BaseException as e:  # kept for join(); status.json already says failed
            self.error = e

    def _steps(self, claimed: bool = False) -> Iterator[StepRecord]:
        if not claimed and self._thread is None:
            self._claim()
        self._started_at = _now_iso()
        self.status = "running"
        self._write_status()
        error_text: str | None = None
        records: Iterator[StepRecord] | None = None
        try:
            records = self.backend.run(self.spec, self.case, self.policy)
            with open(self.path / "records.jsonl", "a", encoding="utf-8") as log:
                for record in records:
                    log.write(json.dumps(_jsonable(record.to_dict())) + "\n")
                    log.flush()
                    self._remember(record)
                    yield record
                    if self._stop.is_set():
                        self.status = "stopped"
                        break
                else:
                    self.status = "complete"
        except GeneratorExit:  # the consumer stopped iterating
            self.status = "stopped"
            raise
        except KeyboardInterrupt:
            self.status = "interrupted"
            raise
        except BaseException as e:
            self.status = "failed"
            error_text = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.error = e
            raise
        finally:
            try:
                if records is not None and hasattr(records, "close"):
                    records.close()  # the backend releases its pools / state
            finally:
                if self.status == "running":
                    self.status = "failed"
                self._write_status(error_text)

    def _remember(self, record: StepRecord) -> None:
        self.steps_completed += 1
        self.latest = record
        self.tail.append(record)
        if self.records is not None:
            self.records.append(record)
        for callback in self._callbacks:
            callback(record)

    def _write_status(self, error: str | None = None) -> None:
        _write_json(self.path / "status.json", {
            "status": self.status,
            "complete": self.status == "complete",
            "steps_completed": self.steps_completed,
            "steps_planned": self.spec.warmup_steps + self.spec.steps,
            "started_at": self._started_at,
            "updated_at": _now_iso(),
            "error": error,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        })


def _jsonable(value: Any) -> Any:
    """Make a value JSON-safe (non-finite floats stay floats: json writes NaN/Infinity)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def run(spec: RunSpec | None = None, case: ModelCase | None = None, policy: Policy | str | None = None,
        out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR, **run_options: Any) -> LoadedRun:
    """Run ``spec`` to the end in the foreground and return it as loaded from disk."""
    active = Run(spec, case, policy, out_dir, **run_options)
    for _ in active:
        pass
    return active.result()


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

    def __repr__(self) -> str:
        return (f"LoadedRun('{self.path}', model={self.spec.model!r}, policy={self.spec.policy!r}, "
                f"backend={self.environment.get('backend')!r}, state={self.state!r})")


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
    """Read a run folder written by :class:`Run` (complete or not)."""
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


def list_runs(out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR) -> list[Path]:
    """Run folders under ``out_dir`` (recursively: sweeps keep theirs in a subfolder), oldest first."""
    return sorted((p.parent for p in Path(out_dir).rglob("spec.json")), key=lambda p: p.name)


# ------------------------------------------------------------------------------------- summaries


def _sum_per_type(values: Mapping[str, int] | None) -> int | None:
    return None if values is None else int(sum(values.values()))


def summarize(records: Iterable[StepRecord]) -> dict[str, Any]:
    """Median, mean and p90 step time, traffic and fault totals over the non-warm-up records.

    Streams (keeps only the step times). A quantity no record measured is ``None``, never 0.
    """
    times: list[float] = []
    warmup = 0
    totals: dict[str, int | None] = dict.fromkeys(
        ("htod_bytes", "dtoh_bytes", "gpu_page_faults", "evictions", "remote_bytes"))
    peak_live = 0
    peak_ratio = 0.0
    last_loss = None
    capacity = None
    for record in records:
        if record.warmup:
            warmup += 1
            continue
        times.append(float(record.wall_ms))
        step_values = {"htod_bytes": _sum_per_type(record.htod_bytes),
                       "dtoh_bytes": _sum_per_type(record.dtoh_bytes),
                       "gpu_page_faults": record.gpu_page_faults, "evictions": record.evictions,
                       "remote_bytes": record.remote_bytes}
        for key, value in step_values.items():
            if value is not None:
                totals[key] = (totals[key] or 0) + int(value)
        peak_live = max(peak_live, record.live_total)
        peak_ratio = max(peak_ratio, record.oversubscription_ratio)
        capacity = record.gpu_capacity_bytes
        if record.loss is not None:
            last_loss = record.loss
    migrated = None
    if totals["htod_bytes"] is not None or totals["dtoh_bytes"] is not None:
        migrated = (totals["htod_bytes"] or 0) + (totals["dtoh_bytes"] or 0)
    arr = np.asarray(times, dtype=float)
    return {
        "steps": len(times),
        "warmup_steps": warmup,
        "median_ms": float(np.median(arr)) if len(arr) else math.nan,
        "mean_ms": float(arr.mean()) if len(arr) else math.nan,
        "p90_ms": float(np.percentile(arr, 90)) if len(arr) else math.nan,
        "migrated_bytes": migrated,
        **totals,
        "peak_live_bytes": peak_live,
        "gpu_capacity_bytes": capacity,
        "oversubscription": peak_ratio,
        "last_loss": last_loss,
    }


def records_frame(records: Iterable[StepRecord]) -> pd.DataFrame:
    """A DataFrame of records: scalar fields as they are, per-type dicts flattened to columns."""
    rows = []
    for record in records:
        row: dict[str, Any] = {}
        for key, value in record.to_dict().items():
            if isinstance(value, dict) and key != "extra":
                for dtype in DATA_TYPES:
                    row[f"{key}.{dtype.value}"] = value.get(dtype.value)
            elif key != "extra":
                row[key] = value
        row["live_total"] = record.live_total
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------ comparisons

ModelsArg = Sequence[str | ModelCase] | Mapping[str, Mapping[str, Any]] | str | ModelCase


def _normalise_models(models: ModelsArg, model_kwargs: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """[(label, str name with kwargs | ModelCase)], validating names up front."""
    from um_lab.models import ZOO

    if isinstance(models, (str, ModelCase)):
        models = [models]
    items: list[tuple[str, Any]] = []
    if isinstance(models, Mapping):
        pairs = [(name, dict(kw)) for name, kw in models.items()]
    else:
        pairs = [(m, dict(model_kwargs or {})) if isinstance(m, str) else (m, None) for m in models]
    for model, kwargs in pairs:
        if isinstance(model, ModelCase):
            items.append((model.name, model))
        elif model not in ZOO:
            raise ValueError(f"unknown model {model!r}; valid: {', '.join(ZOO)}")
        else:
            items.append((model, kwargs))
    if not items:
        raise ValueError("compare() needs at least one model")
    return items


def compare(
    models: ModelsArg = ("mlp",),
    policies: Sequence[str | Policy] = (BASELINE_POLICY, "gpu-first"),
    ratios: Sequence[float | None] = (None,),
    *,
    backend: str = "auto",
    steps: int = 20,
    warmup_steps: int = 2,
    batch_size: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    capacity_bytes: int | None = None,
    seed: int = 0,
    out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
    baseline: str = BASELINE_POLICY,
    progress: bool | Any = False,
    keep_going: bool = False,
    backend_instance: Backend | None = None,
) -> pd.DataFrame:
    """Run every model x policy x oversubscription ratio and tabulate them, one row per run.

    ``models``: zoo names (with ``model_kwargs`` for all of them), a ``{name: kwargs}`` dict, or
    :class:`ModelCase` objects. ``ratios``: simulated oversubscription ratios (``None`` = the
    profile's card; sim only). The ``baseline`` policy is added when missing, and
    ``speedup_vs_<baseline>`` = baseline median / run median within each (model, ratio). Every name is
    checked before the first run. Runs go to ``out_dir/compare-<time>/``, with ``summary.csv``.
    ``progress=True`` shows a tqdm bar (or pass a tqdm-like object with ``update``/``set_postfix_str``).
    ``keep_going=True`` records a failed run as a row (status ``failed``, ``error``) and goes on.
    Columns: model, policy, ratio, backend, steps, median_ms, mean_ms, p90_ms, speedup_vs_<baseline>,
    migrated_bytes, htod_bytes, dtoh_bytes, gpu_page_faults, evictions, remote_bytes, ..., status, run_dir.
    """
    model_items = _normalise_models(models, model_kwargs)
    policy_objs = [get_policy(p) for p in policies]
    if baseline not in [p.name for p in policy_objs]:
        policy_objs.insert(0, get_policy(baseline))
    ratio_list = list(ratios) or [None]
    backend_name = backend_instance.name if backend_instance is not None else resolve_backend_name(backend)
    if backend_name == "cuda" and any(r is not None for r in ratio_list):
        raise ValueError("oversubscription ratios are simulated (backend 'sim'); on cuda size the model "
                         "instead (um_lab.models.size_for_ratio) and keep it under the safety cap")
    if backend_name == "cuda" and backend_instance is None and not cuda_available():
        raise CudaUnavailableError("no CUDA GPU (or a CPU build of torch) in this process")
    check_writable(out_dir)
    sweep_dir = prepare_run_dir(out_dir, f"compare-{_timestamp()}-{uuid.uuid4().hex[:6]}")
    shared_backend = backend_instance if backend_instance is not None else get_backend(backend_name)
    spec_backend = backend_name if backend_name in ("cuda", "sim") else backend

    total = len(model_items) * len(policy_objs) * len(ratio_list)
    bar = _progress_bar(progress, total)
    rows = []
    try:
        for label, model in model_items:
            for ratio in ratio_list:
                for policy in policy_objs:
                    if bar is not None:
                        bar.set_postfix_str(f"{label} {policy.name} ratio={ratio}")
                    kwargs = dict(model) if isinstance(model, dict) else {}
                    spec = RunSpec(model=label, policy=policy.name, backend=spec_backend, steps=steps,
                                   warmup_steps=warmup_steps, batch_size=batch_size, model_kwargs=kwargs,
                                   capacity_bytes=capacity_bytes, oversubscription_ratio=ratio, seed=seed)
                    case = model if isinstance(model, ModelCase) else None
                    row: dict[str, Any] = {"model": label, "policy": policy.name, "ratio": ratio,
                                           "backend": backend_name}
                    active = Run(spec, case, policy, sweep_dir, backend=shared_backend)
                    try:
                        for _ in active:
                            pass
                    except Exception as e:
                        if not keep_going:
                            raise
                        row["error"] = f"{type(e).__name__}: {e}"
                    rows.append({**row, **active.summary(), "status": active.status,
                                 "run_dir": str(active.path)})
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None and progress is True:
            bar.close()
    table = _with_speedup(pd.DataFrame(rows), baseline)
    table.to_csv(sweep_dir / "summary.csv", index=False)
    table.attrs["sweep_dir"] = str(sweep_dir)
    return table


def _progress_bar(progress: bool | Any, total: int) -> Any:
    if progress is True:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="compare", unit="run")
    if progress:
        return progress
    return None


def _with_speedup(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    column = f"speedup_vs_{baseline}"
    if table.empty:
        table[column] = []
        return table
    key = table["ratio"].astype(object).where(table["ratio"].notna(), "none")
    base = table[table["policy"] == baseline].assign(_key=key).set_index(["model", "_key"])["median_ms"]
    base_for_row = [base.get((m, k), math.nan) for m, k in zip(table["model"], key, strict=True)]
    speedup = np.asarray(base_for_row, dtype=float) / table["median_ms"].to_numpy(dtype=float)
    position = table.columns.get_loc("p90_ms") + 1
    table.insert(position, column, speedup)
    return table
