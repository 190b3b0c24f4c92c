"""Run a model under a policy on a backend, stream its step records to disk, compare policies.

::

    from um_lab.runs.runner import Run, run
    from um_lab.runs.runread import load
    from um_lab.runs.sweep import compare
    result = run(RunSpec(model="mlp", policy="gpu-first", backend="sim", steps=50))
    result.summary()["median_ms"]
    table = compare(["mlp"], ["um-default", "gpu-first"], ratios=[0.5, 1.5], backend="sim")
    load("runs/2025...-mlp-gpu-first-sim").to_frame()

This module runs the steps (:class:`Run`, :func:`run`) on a backend object (:mod:`um_lab.backend`: its
pre-flight before the folder is written). The run folder's layout
is in :mod:`um_lab.runs.runlog`, reading it back in :mod:`um_lab.runs.runread`, what SIGTERM and interpreter exit
do to a run in :mod:`um_lab.runs.runexit`, summaries in :mod:`um_lab.summary`, and policy sweeps in
:mod:`um_lab.runs.sweep` (``compare``). The main names are also importable from :mod:`um_lab` itself.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import os
import shutil
import signal
import sys
import threading
import traceback
import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from um_lab.backend import backend_class, get_backend, resolve_backend_name
from um_lab.backend_base import Backend
from um_lab.errors import BudgetTooSmall, SpecError, UmLabError, gib
from um_lab.listeners import Listenable, RecordListeners
from um_lab.models import ModelCase, case_for_spec, check_case
from um_lab.policy import Policy, check_preset_name, get_policy
from um_lab.runs import runexit
from um_lab.runs.runexit import RunInterrupted
from um_lab.runs.runlog import (
    RunDirError,
    RunFolderWriter,
    backend_note,
    check_out_folder,
    check_run_name,
    environment_info,
    jsonable,
    now_iso,
    prepare_run_dir,
    resolve_out_dir,
    safe_name,
    timestamp,
    write_json,
)
from um_lab.runs.runread import LoadedRun, RunLogWarning, iter_records, load
from um_lab.summary import summarize
from um_lab.training import with_training
from um_lab.types import RunSpec, StepRecord

if TYPE_CHECKING:
    from um_lab.sim.planner import MemoryPlan

log = logging.getLogger(__name__)


class RunStateError(UmLabError, RuntimeError):
    """A Run was used in the wrong state (started twice, result asked before it ended, ...)."""


# ------------------------------------------------------------------------------------------ Run


class Run(RunFolderWriter, Listenable):
    """One training run: an iterable of :class:`StepRecord` that logs each step to its folder.

    Foreground: ``for record in Run(spec): ...``. Background: ``r = Run(spec).start()``, then
    ``r.latest`` / ``r.tail`` / ``r.steps_completed`` while it runs, ``r.stop()`` to end it after the
    current step, ``r.join()`` to wait (re-raises a backend error). A Run runs once.

    Listeners are the stream, ``tail`` / ``latest`` / ``steps_completed`` the current state:
    ``remove = r.add_listener(callback)`` calls ``callback(record)`` with every record, once, after it is
    written to ``records.jsonl`` and before the foreground loop gets it, on the thread running the steps,
    in registration order (rules in :mod:`um_lab.listeners`); ``remove()`` or ``r.remove_listener(callback)``
    stops it, from any thread, mid-run too. A listener that raises ends the run as a backend error does:
    the record it was given is already on disk, the status is ``failed`` with that error, and the error
    is raised to the foreground loop or by ``join()`` (kept in ``error``).

    ``case``/``policy`` override what ``spec`` names (your own :func:`~um_lab.models.custom` model or
    :class:`Policy`); ``backend`` is a backend instance (default: ``get_backend(spec.backend)``).
    Records are not kept in memory unless ``keep_records=True``: the last ``tail`` records are (a
    bounded deque), and all are on disk. The folder goes under ``out_dir`` (default:
    :func:`~um_lab.runs.runlog.default_out_dir`, ``$UM_LAB_RUNS_DIR`` or ``runs/``), named ``name`` if given
    (one plain folder name, else :class:`~um_lab.runs.runlog.RunNameError`); it and its ``spec.json`` are
    written here, so an unwritable ``out_dir`` fails before anything runs. Before that, a backend named
    by ``spec`` must be able to run here (``check_available``), a backend that does not simulate
    capacity refuses ``capacity_bytes`` and ``oversubscription_ratio``, and ``preflight=True`` runs the
    backend's pre-flight (on cuda: the memory estimate against the safety cap), recorded in
    ``model.json`` (a mapping: its result, checked already).

    While it runs, ``status.json`` is rewritten every :data:`~um_lab.runs.runlog.HEARTBEAT_S` with the step
    count. SIGTERM ends a foreground run on the main thread as Ctrl-C does (``interrupted``), and a
    run still running when the interpreter exits is marked ``interrupted`` (see :mod:`um_lab.runs.runexit`).
    """

    def __init__(
        self,
        spec: RunSpec | None = None,
        case: ModelCase | None = None,
        policy: Policy | str | None = None,
        out_dir: str | os.PathLike[str] | None = None,
        *,
        backend: Backend | None = None,
        keep_records: bool = False,
        tail: int = 128,
        name: str | None = None,
        preflight: bool | Mapping[str, Any] = True,
    ) -> None:
        _check_arguments(spec, case)
        if name is not None:
            name = check_run_name(name)  # before anything is created
        out = check_out_folder(resolve_out_dir(out_dir), "cannot write the run directory under")  # /dev/null, a file
        spec = spec or RunSpec()
        self.policy = check_preset_name(get_policy(policy if policy is not None else spec.policy))
        self.plan: MemoryPlan | None = None
        if spec.recompute == "auto":  # the planner's choice, before anything is built
            spec, self.plan = planned_spec(spec, case, backend)
        self.case = check_case(with_training(case, spec.precision, spec.recompute) if case is not None
                               else case_for_spec(spec))  # built on meta: a knob the
        # library refuses, or an optimizer that needs a closure, is refused before any folder exists
        self.spec = dataclasses.replace(spec, policy=self.policy.name,
                                        model=self.case.name if case is not None else spec.model)
        if backend is None:
            resolved = resolve_backend_name(spec.backend)
            backend_class(resolved).check_available()  # e.g. no GPU: refused before anything is built
            backend = get_backend(resolved)
        self.backend: Backend = backend
        self.backend_name = backend.name
        self.backend_note = backend_note(spec.backend, self.backend_name)
        self.keep_records = keep_records
        self.records: list[StepRecord] | None = [] if keep_records else None
        self.tail: collections.deque[StepRecord] = collections.deque(maxlen=tail)
        self.latest: StepRecord | None = None
        self.steps_completed = 0
        self.status = "pending"
        self.error: BaseException | None = None
        self._listeners = RecordListeners()
        self._stop = threading.Event()
        self._claimed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._holds_sigterm = False
        self._init_writer()

        if not backend.simulates_capacity and (spec.oversubscription_ratio is not None
                                               or spec.capacity_bytes is not None):
            raise ValueError("capacity_bytes and oversubscription_ratio are simulated (backend 'sim'); on "
                             f"{self.backend_name} size the model instead (um_lab.sizing.size_for_ratio)")
        model_info: dict[str, Any] = {"name": self.case.name, "info": jsonable(self.case.info)}
        if self.plan is not None:
            model_info["plan"] = self.plan.to_dict()
        type(backend).check_case(self.case)  # e.g. the simulator's host-memory check: before any folder
        if isinstance(preflight, Mapping):  # checked already (compare checks every run before the first)
            model_info["preflight"] = dict(preflight)
        elif preflight:
            try:
                checked = backend.preflight(self.spec, self.case, self.policy)  # raises before any run
            except BudgetTooSmall as e:
                raise _as_given_budget(e, self.spec) from None
            if checked is not None:
                model_info["preflight"] = checked
        folder = name or f"{timestamp()}-{safe_name(self.case.name)}-{safe_name(self.policy.name)}-" \
                         f"{self.backend_name}-{uuid.uuid4().hex[:6]}"
        self.path = prepare_run_dir(out, folder)
        self._started_at: str | None = None
        try:
            write_json(self.path / "spec.json", self.spec.to_dict())
            write_json(self.path / "policy.json", self.policy.to_dict())
            write_json(self.path / "model.json", model_info)
            write_json(self.path / "environment.json", environment_info(backend, spec.backend))
            self._write_status()
        except BaseException as e:  # a folder that could not be written whole is not left behind
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, UmLabError):
                raise RunDirError(f"cannot write the run folder {self.path} ({e.strerror or e}); nothing was run "
                                  "and the folder was removed") from e
            raise

    # -- consumers ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[StepRecord]:
        """Run in the foreground, yielding each record after it is on disk. A Run runs once: iterating one
        already started (or iterated) raises :class:`RunStateError` (follow a background run with
        ``latest`` / ``tail`` / ``add_listener`` instead)."""
        self._claim()
        return self._steps()

    def start(self) -> Run:
        """Run in a background thread; returns ``self``."""
        self._claim()
        self._holds_sigterm = runexit.hold_sigterm()
        self._thread = threading.Thread(target=self._drain, name=f"um_lab-run-{self.path.name}", daemon=True)
        runexit.started(self, self._thread)
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
        runexit.restore_if_idle()
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
            runexit.restore_if_idle()

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
                how = ("it was started in the background (start()): follow it with latest, tail or "
                       "add_listener(), wait with join()" if self._thread is not None else "it was iterated already")
                raise RunStateError(f"a Run runs once, and {how}; create a new Run to run again")
            self._claimed = True

    def _drain(self) -> None:
        try:
            for _ in self._steps(background=True):
                pass
        except BaseException as e:  # kept for join(); status.json already says failed
            self.error = e
        finally:
            if self._holds_sigterm:
                runexit.release_sigterm()

    def _steps(self, background: bool = False) -> Iterator[StepRecord]:
        foreground = not background and threading.current_thread() is threading.main_thread()
        holds_sigterm = foreground and runexit.hold_sigterm()
        self._started_at = now_iso()
        self.status = "running"
        runexit.opened(self, foreground=foreground)
        ended_normally = False
        records: Iterator[StepRecord] | None = None
        try:
            try:
                self._write_status()
            except OSError as e:
                raise RunDirError(f"cannot write {self.path / 'status.json'} ({e.strerror or e}); "
                                  "nothing was run") from e
            records = self.backend.run(self.spec, self.case, self.policy)
            with self._open_log() as log:
                for record in records:
                    if not self._log(log, record):
                        break  # ended from outside (SIGTERM, interpreter exit): status already written
                    if foreground and (name := runexit.signalled(self)) is not None:
                        # the signal handler's exception was lost (raised inside a finalizer, which Python ignores)
                        raise RunInterrupted(signal.Signals[name].value)
                    self._listeners.emit(record)
                    yield record
                    self._heartbeat()
                    if self._stop.is_set():
                        self._end_as("stopped")
                        break
                else:
                    self._end_as("complete")
            ended_normally = True
        except GeneratorExit:  # the consumer stopped iterating (or SIGTERM surfaced in its loop)
            name = runexit.signalled(self)
            if name is None:
                self._end_as("stopped")
            elif self._end_as("interrupted"):
                self._interrupted_by = name
            raise
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (RunInterrupted) while in the foreground
            if self._end_as("interrupted"):
                self._interrupted_by = e.signal_name if isinstance(e, RunInterrupted) else "KeyboardInterrupt"
            raise
        except BaseException as e:
            if self._end_as("failed"):
                self._error_text = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.error = e
            raise
        finally:
            in_flight = sys.exc_info()[1]
            written = False
            try:
                # a second Ctrl-C (or SIGTERM) now waits: it cannot cut the final status short
                with runexit.held_signals(in_flight):
                    try:
                        if records is not None and hasattr(records, "close"):
                            records.close()  # the backend releases its pools / state
                    finally:
                        try:
                            self._settle(in_flight)
                            written = self._finish()
                        finally:  # even if the final write fails: the registry is put back
                            runexit.closed(self, written=written)
            finally:
                if holds_sigterm:
                    runexit.release_sigterm()
                if foreground and isinstance(in_flight, KeyboardInterrupt):
                    runexit.absorb_repeats()  # Ctrl-C pressed again at once only repeats this interrupt
            if not written:
                problem = RunDirError(
                    f"cannot write {self.path / 'status.json'} ({self._status_problem}): the run ended "
                    f"{self.status} after {self.steps_completed} steps, all in records.jsonl; um_lab "
                    "retries at exit, and load() in this process reads its real state meanwhile")
                if ended_normally:
                    raise problem
                warnings.warn(str(problem), RunLogWarning, stacklevel=2)  # keep the error in flight


    def _settle(self, in_flight: BaseException | None) -> None:
        """The end state of a run still ``running`` as it stops: an interrupt that landed before its handler
        set the state (a signal right after another) ends it ``interrupted``; anything else ``failed``."""
        if isinstance(in_flight, KeyboardInterrupt) and self.status in ("running", "interrupted") \
                and self._end_as("interrupted") and self._interrupted_by is None:
            self._interrupted_by = (in_flight.signal_name if isinstance(in_flight, RunInterrupted)
                                    else "KeyboardInterrupt")
        self._end_as("failed", if_running=True)


def planned_spec(spec: RunSpec, case: ModelCase | None = None,
                 backend: Backend | None = None) -> tuple[RunSpec, MemoryPlan]:
    """``spec`` (``recompute="auto"``) with the memory planner's choice in place: the layers it recomputes and
    its budget in bytes, staged or not (:func:`um_lab.sim.planner.plan_memory`; priced by ``backend`` when it is
    a simulator, else by the packaged profile), and the plan."""
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.planner import plan_memory, planned_budget

    assert spec.budget is not None  # RunSpec refuses "auto" without one
    base = case if case is not None else case_for_spec(dataclasses.replace(spec, recompute="none", precision="fp32"))
    plan = plan_memory(base, spec.budget, precision=spec.precision,
                       backend=backend if isinstance(backend, SimBackend) else None,
                       progress=lambda line: log.info("memory planner: %s", line))
    log.info("memory planner: %s", plan.describe())
    return dataclasses.replace(spec, recompute=plan.recompute,
                               budget=planned_budget(plan, spec.budget.lookahead)), plan


def _as_given_budget(error: BudgetTooSmall, spec: RunSpec) -> BudgetTooSmall:
    """``error`` quoting the budget the user gave: the scheduler sizes its plan from what is left once the
    pools it keeps resident (staged activations' window, the optimizer's temporaries) are set aside."""
    given = spec.budget.bytes if spec.budget is not None else None
    if given is None or error.budget >= given:
        return error
    reserved = given - error.budget
    return BudgetTooSmall(given, error.needed + reserved,
                          f"{error.what} next to the {reserved} B ({gib(reserved)}) the scheduler sets aside first "
                          f"(pools it keeps resident and the optimizer's temporaries), leaving {error.budget} B "
                          f"({gib(error.budget)})")


def _check_arguments(spec: Any, case: Any) -> None:
    """Refuse a ``spec`` that is not a RunSpec and a ``case`` that is not a ModelCase, naming what was given."""
    if spec is not None and not isinstance(spec, RunSpec):
        hint = f"; to run the model {spec!r}: RunSpec(model={spec!r})" if isinstance(spec, str) else ""
        raise SpecError(f"spec must be a RunSpec or None, got {type(spec).__name__} {spec!r:.80}{hint}", "spec")
    if case is not None and not isinstance(case, ModelCase):
        raise SpecError(f"case must be a ModelCase (from um_lab.custom(...) or um_lab.get_model(...)) or None, got "
                        f"{type(case).__name__} {case!r:.80}", "case")


#: The keyword options :func:`run` passes to :class:`Run` (its keyword-only parameters).
RUN_OPTIONS = tuple(p.name for p in inspect.signature(Run.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY)


def run(spec: RunSpec | None = None, case: ModelCase | None = None, policy: Policy | str | None = None,
        out_dir: str | os.PathLike[str] | None = None, **run_options: Any) -> LoadedRun:
    """Run ``spec`` (default ``RunSpec()``) to the end in the foreground and return it as loaded from disk.

    ``case`` / ``policy`` replace the model and policy ``spec`` names (your own :func:`~um_lab.models.custom` model
    or :class:`~um_lab.policy.Policy`); runs go to ``out_dir`` (default ``$UM_LAB_RUNS_DIR`` or ``runs/``).
    ``run_options``: those of :class:`Run` (``backend``, ``keep_records``, ``tail``, ``name``, ``preflight``);
    steps, batch size and the rest are :class:`~um_lab.types.RunSpec` fields."""
    unknown = sorted(set(run_options) - set(RUN_OPTIONS))
    if unknown:
        fields = {f.name for f in dataclasses.fields(RunSpec)}
        spec_fields = [k for k in unknown if k in fields]
        hint = (f"; {', '.join(spec_fields)} {'is a RunSpec field' if len(spec_fields) == 1 else 'are RunSpec fields'}"
                f": run(RunSpec({spec_fields[0]}=...), case=...)" if spec_fields else "")
        raise SpecError(f"run() got unknown option(s) {', '.join(unknown)}; it takes spec, case, policy, out_dir and "
                        f"{', '.join(RUN_OPTIONS)}{hint}", unknown[0])
    active = Run(spec, case, policy, out_dir, **run_options)
    for _ in active:
        pass
    return active.result()
