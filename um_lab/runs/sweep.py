"""Policy comparisons: run every model x policy x oversubscription ratio and tabulate them.

``from um_lab.runs.sweep import compare`` (it runs each configuration through :class:`um_lab.runs.runner.Run`), in this
process one after another, or on any :class:`concurrent.futures.Executor` (``executor=``: local processes, a
Dask ``Client.get_executor()``, Ray's executor). The checks it makes of its input before anything runs are
:mod:`um_lab.runs.sweep_checks`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from pathlib import Path
from typing import Any, cast

import pandas as pd

from um_lab.backend import backend_class, backend_names, get_backend
from um_lab.backend_base import Backend
from um_lab.errors import OutputExistsError, SpecError
from um_lab.models import ModelCase
from um_lab.policy import Policy, is_scheduled
from um_lab.runs.runlog import check_writable, prepare_run_dir, resolve_out_dir, timestamp
from um_lab.runs.sweep_checks import (
    ModelsArg,
    check_cases,
    check_cells,
    check_executor_backend,
    check_export_path,
    checked_batch_size,
    checked_policies,
    checked_ratios,
    normalise_models,
)
from um_lab.schedule.config import Budget
from um_lab.streams import QuietBar
from um_lab.summary import summarize, with_speedup
from um_lab.types import Recompute, RunSpec

__all__ = ["BASELINE_POLICY", "ModelsArg", "check_export_path", "compare", "write_export"]

BASELINE_POLICY = "um-default"


def write_export(table: pd.DataFrame, path: str | os.PathLike[str], force: bool = False,
                 fmt: str = "csv") -> Path:
    """Write ``table`` to ``path`` as ``csv`` or ``parquet``. Without ``force`` the file is created, never
    replaced: one made meanwhile (by another comparison) raises :class:`~um_lab.errors.OutputExistsError`
    and is kept. With ``force`` a whole new file replaces the old one (written beside it, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp") if force else path
    try:
        f = open(target, "xb")
    except FileExistsError:
        raise OutputExistsError(path, f"{path} was created by something else while this comparison ran; it was "
                                      "not replaced") from None
    try:
        with f:
            if fmt == "parquet":
                table.to_parquet(f, index=False)
            else:
                f.write(table.to_csv(index=False).encode())
        if force:
            os.replace(target, path)
    except BaseException:
        target.unlink(missing_ok=True)  # the file this call created, never one that was there
        raise
    return path


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
    out_dir: str | os.PathLike[str] | None = None,
    baseline: str = BASELINE_POLICY,
    progress: bool | Any = False,
    keep_going: bool = False,
    backend_instance: Backend | None = None,
    band: bool = False,
    budget: Budget | int | str | None = None,
    executor: Executor | None = None,
    precision: str = "fp32",
    recompute: Recompute = "none",
) -> pd.DataFrame:
    """Run every model x policy x oversubscription ratio and tabulate them, one row per run.

    ``models``: zoo names (with ``model_kwargs`` for all of them), a ``{name: kwargs}`` dict, or
    :class:`ModelCase` objects. ``ratios``: simulated oversubscription ratios (``None`` = the
    profile's card; sim only). The ``baseline`` policy is added when missing, and
    ``speedup_vs_<baseline>`` = baseline median / run median within each (model, ratio). Every name is
    checked before the first run. Runs go to ``out_dir/compare-<time>/`` (default ``out_dir``:
    ``$UM_LAB_RUNS_DIR``, else ``runs/``), with ``summary.csv``.
    ``progress=True`` shows a tqdm bar (or pass a tqdm-like object with ``update``/``set_postfix_str``).
    ``keep_going=True`` records a failed run as a row (status ``failed``, or ``refused`` when it could not
    start, with ``error``) and goes on. Bad input is checked before the first run and before the backend is
    built: model names, run specs, policies (one reusing a preset's name with other advice), ratios on a
    backend that does not simulate capacity, and a named backend that cannot run here raise; a model's
    knobs and the backend's own check of each model (``check_case``; on the simulator an input batch
    larger than the host memory available) raise too unless ``keep_going`` (then that model's runs are
    recorded as refused or failed). ``backend_instance``: a backend object to run on instead of a new
    ``backend``. ``budget`` (a :class:`~um_lab.schedule.config.Budget`, bytes, ``"8GiB"`` or ``"0.5x"``): the GPU
    budget of the runs under a scheduled policy (``layer-ahead``; without one, on the simulator, each ratio's
    simulated capacity); the other policies run without a scheduler.
    ``precision`` and ``recompute`` (:class:`~um_lab.types.RunSpec`'s, :mod:`um_lab.training`): how every run
    trains; a table column each when not the default.
    ``band=True`` (sim only): each run's step time also at the fast and slow ends of the profile constants'
    ranges (:mod:`um_lab.sim.band`; columns band_fast_ms, band_slow_ms, speedup_band_lo/hi, and
    ranking_flips: the run's place among its cell's policies changes inside the band).
    Each model and each ratio is given once (a duplicate is refused; a policy given twice runs once), and
    ``batch_size`` may not contradict a model's ``batch_size`` knob, nor ``capacity_bytes`` come with ratios.
    Unless ``keep_going``, every run is checked before the first one starts: the backend's pre-flight of each
    (on the simulator a GPU budget too small for the model, on a GPU a size over the safety cap) and the GPU
    size each ratio gives each model. A run that still fails (or Ctrl-C) ends the comparison, but the table
    of the runs made (the one that failed included) is written to ``summary.csv`` first, and the exception
    raised carries it as ``compare_table`` (and a note saying where it is).
    ``executor``: a :class:`concurrent.futures.Executor` (e.g. ``ProcessPoolExecutor(4)``, a Dask
    ``Client.get_executor()``) that runs the runs, each in a worker with a backend of its own, instead of one
    after another in this process (the default). Everything is checked here first, as without it; each run
    then goes to the executor as a picklable task and writes its folder under the comparison folder (on a
    cluster, give an ``out_dir`` that every worker sees), and the table lists the rows in the same order, with
    the same numbers on the simulator. Only the simulator runs in a worker: with an executor a ``cuda`` run
    (or ``auto`` on a GPU) and a ``backend_instance`` are refused (:class:`~um_lab.errors.SpecError` naming
    ``executor``), and a :class:`ModelCase` must be picklable by the executor (a zoo name always is). A run
    that fails without ``keep_going`` cancels the runs not started yet; the table then holds every run that
    finished, in order. The progress bar counts runs as they finish.
    Columns: model, policy, ratio, backend, steps, median_ms, mean_ms, p90_ms, speedup_vs_<baseline>,
    migrated_bytes, htod_bytes, dtoh_bytes, gpu_page_faults, evictions, remote_bytes, ..., status, run_dir.
    """
    if executor is not None and not isinstance(executor, Executor):
        raise SpecError(f"executor must be a concurrent.futures.Executor (e.g. ProcessPoolExecutor(), a Dask "
                        f"Client.get_executor()) or None, got {type(executor).__name__}", "executor")
    model_items = normalise_models(models, model_kwargs)
    checked_batch_size(batch_size, model_items)
    policy_objs = checked_policies(policies, baseline)
    ratio_list = checked_ratios(ratios)
    if capacity_bytes is not None and any(r is not None for r in ratio_list):
        raise SpecError("capacity_bytes and ratios both set the simulated GPU's size (a ratio: the model's "
                        "footprint / ratio): give capacity_bytes with ratios=[None], or ratios alone",
                        "capacity_bytes")
    # the backend's class answers every question asked before the first run; it is built only after them
    kind = type(backend_instance) if backend_instance is not None else backend_class(backend)
    backend_name = backend_instance.name if backend_instance is not None else kind.name
    if not kind.simulates_capacity and any(r is not None for r in ratio_list):
        raise SpecError(f"oversubscription ratios are simulated (backend 'sim'); on {backend_name} size the "
                        "model instead (um_lab.sizing.size_for_ratio)", "ratios")
    if band and not kind.reports_uncertainty_band:
        raise SpecError(f"backend {kind.name!r} reports no uncertainty band (the simulator does: profile constants' "
                        "ranges); use backend='sim'", "band")
    if executor is not None:
        check_executor_backend(backend, backend_instance)
    if backend_instance is None:
        kind.check_available()
    spec_backend = backend_name if backend_name in backend_names() else backend
    specs = {(label, ratio): RunSpec(model=label, policy=baseline, backend=spec_backend, steps=steps,
                                     warmup_steps=warmup_steps, batch_size=batch_size,
                                     model_kwargs=dict(model) if isinstance(model, dict) else {},
                                     capacity_bytes=capacity_bytes, oversubscription_ratio=ratio, seed=seed,
                                     precision=precision, recompute=recompute)
             for label, model in model_items for ratio in ratio_list}
    training = _training_columns(RunSpec(precision=precision, recompute=recompute))
    budget_spec = RunSpec(budget=cast(Any, budget))  # checked now (a SpecError naming the budget)
    cases = check_cases(model_items, specs, kind, keep_going)
    cells = []  # (label, model, ratio, policy, spec), in the order they run
    for label, model in model_items:
        for ratio in ratio_list:
            for policy in policy_objs:
                spec = dataclasses.replace(specs[(label, ratio)], policy=policy.name)
                if is_scheduled(policy):
                    spec = dataclasses.replace(spec, budget=budget_spec.budget)
                cells.append((label, model, ratio, policy, spec))
    out = check_writable(resolve_out_dir(out_dir))  # a file or device there: refused, naming it
    shared_backend = backend_instance if backend_instance is not None else get_backend(backend_name)
    # with keep_going a cell that cannot run is recorded as refused by its run; otherwise each run takes the
    # pre-flight result checked here (the backend is asked once per run)
    checked: list[Any] = [True] * len(cells) if keep_going else check_cells(cells, cases, shared_backend, kind)
    sweep_dir = prepare_run_dir(out, f"compare-{timestamp()}-{uuid.uuid4().hex[:6]}")

    bar = _progress_bar(progress, len(cells))
    tasks = [_CellTask(spec, model if isinstance(model, ModelCase) else None, policy, sweep_dir, checked[index],
                       band, {"model": label, "policy": policy.name, "ratio": ratio, "backend": backend_name,
                              **training})
             for index, (label, model, ratio, policy, spec) in enumerate(cells)]
    try:
        if executor is None:
            rows, stopped = _run_here(tasks, shared_backend, keep_going, bar)
        else:
            rows, stopped = _run_on(executor, tasks, backend_name, keep_going, bar)
    finally:
        if bar is not None and progress is True:
            bar.close()
    if stopped is None:
        return _write_table(rows, baseline, band, sweep_dir)
    if rows:
        table = _write_table(rows, baseline, band, sweep_dir)
        stopped.compare_table = table  # type: ignore[attr-defined]  # for the CLI: shown and exported
        complete = sum(1 for row in rows if row["status"] == "complete")
        stopped.add_note(f"the comparison stopped after {len(rows)} of {len(cells)} runs ({complete} complete); "
                         f"their table is in {sweep_dir / 'summary.csv'}")
    raise stopped


@dataclasses.dataclass(frozen=True)
class _CellTask:
    """One run of a comparison: what its :class:`~um_lab.runs.runner.Run` is built from, and its row's keys.
    Picklable (a spec, a policy, a path), so an executor can send it to a worker."""

    spec: RunSpec
    case: ModelCase | None  #: the caller's ModelCase; None: the zoo model the spec names
    policy: Policy
    sweep_dir: Path  #: the comparison folder; the run's folder goes under it
    preflight: Any  #: the pre-flight result checked before the first run (True: the run checks it)
    band: bool
    row: dict[str, Any]  #: model, policy, ratio, backend


def _run_cell(task: _CellTask, backend: Backend) -> tuple[dict[str, Any], BaseException | None]:
    """Run one cell on ``backend``: its row (status ``refused`` when the run could not start) and the error
    that refused or ended it (None when it completed). An error outside the run (the band's) is raised."""
    from um_lab.runs.runner import Run  # runner imports sizing and the backends: only when comparing

    row = dict(task.row)
    try:
        active = Run(task.spec, task.case, task.policy, task.sweep_dir, backend=backend, preflight=task.preflight)
    except Exception as e:  # refused before any step (bad size, over the safety cap)
        return {**row, **summarize(()), "status": "refused", "error": _error_text(e), "run_dir": None}, e
    error: BaseException | None = None
    try:
        for _ in active:
            pass
    except BaseException as e:  # the row is kept; the caller raises it again
        row["error"] = _error_text(e)
        error = e
    if task.band and active.status == "complete":
        row["band_fast_ms"], row["band_slow_ms"] = _band_ms(task.spec, active.case, task.policy, backend)
    return {**row, **active.summary(), "status": active.status, "run_dir": str(active.path)}, error


def _stops(error: BaseException | None, keep_going: bool) -> bool:
    """Whether a run's error ends the comparison: any without ``keep_going``, else only one that is not an
    ``Exception`` (Ctrl-C)."""
    return error is not None and (not keep_going or not isinstance(error, Exception))


def _run_here(tasks: Sequence[_CellTask], backend: Backend, keep_going: bool,
              bar: Any) -> tuple[list[dict[str, Any]], BaseException | None]:
    """The cells one after another in this process, on ``backend``, until one stops the comparison: the rows
    of the runs made and what stopped it (None when every cell ran)."""
    rows: list[dict[str, Any]] = []
    try:
        for task in tasks:
            if bar is not None:
                bar.set_postfix_str(f"{task.row['model']} {task.row['policy']} ratio={task.row['ratio']}")
            row, error = _run_cell(task, backend)
            rows.append(row)
            stop = _stops(error, keep_going)
            if bar is not None and not (stop and row["status"] == "refused"):
                bar.update(1)
            if stop:
                return rows, error
    except BaseException as e:  # e.g. Ctrl-C between runs: the finished runs' table is written
        return rows, e
    return rows, None


_WORKER_BACKENDS: dict[str, Backend] = {}  #: backend name -> the one a worker process runs its cells on
_WORKER_LOCK = threading.Lock()


def _run_cell_in_worker(task: _CellTask, backend_name: str) -> tuple[dict[str, Any], BaseException | None]:
    """An executor's task: one cell on the worker's own ``backend_name`` backend (built once per worker
    process, so the simulator's traces are kept between its cells). The error comes back as a value, made
    picklable when it is not."""
    with _WORKER_LOCK:
        if backend_name not in _WORKER_BACKENDS:
            _WORKER_BACKENDS[backend_name] = get_backend(backend_name)
        backend = _WORKER_BACKENDS[backend_name]
    row, error = _run_cell(task, backend)
    if error is not None:
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            error = RuntimeError(f"{_error_text(error)} (raised in a worker; this error could not be sent back)")
    return row, error


def _run_on(executor: Executor, tasks: Sequence[_CellTask], backend_name: str, keep_going: bool,
            bar: Any) -> tuple[list[dict[str, Any]], BaseException | None]:
    """The cells as tasks on ``executor``: the rows of the runs that finished, in the cells' order, and what
    stopped the comparison (the first run in that order whose error stops it, an error of the executor's own
    such as a task it could not send, or Ctrl-C; None when every cell ran). Once one stops it, the runs not
    started are cancelled; those already running are waited for when the executor cannot cancel them."""
    sweep_dir = tasks[0].sweep_dir if tasks else Path()
    absolute = [dataclasses.replace(t, sweep_dir=Path(os.path.abspath(t.sweep_dir))) for t in tasks]
    outcomes: list[tuple[dict[str, Any] | None, BaseException | None] | None] = [None] * len(tasks)
    interrupted: BaseException | None = None
    futures: dict[Future[Any], int] = {}
    try:
        for index, task in enumerate(absolute):
            futures[executor.submit(_run_cell_in_worker, task, backend_name)] = index
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
            stop = False
            for future in done:
                index = futures[future]
                if future.cancelled():
                    continue
                try:
                    row, error = future.result()
                    if row["run_dir"] is not None:  # as the serial comparison names it
                        row["run_dir"] = str(sweep_dir / Path(row["run_dir"]).name)
                    outcomes[index] = (row, error)
                    stop = stop or _stops(error, keep_going)
                except Exception as e:  # not a run's error: the executor's, or one outside the run
                    if tasks[index].case is not None and "pickl" in f"{type(e).__name__} {e}".lower():
                        e.add_note(f"the executor could not send {tasks[index].row['model']} to a worker: with an "
                                   "executor, a ModelCase must be picklable by it (built from top-level "
                                   "functions); a zoo model given by name always is")
                    outcomes[index] = (None, e)
                    stop = True
                if bar is not None:
                    bar.set_postfix_str(f"{tasks[index].row['model']} {tasks[index].row['policy']} "
                                        f"ratio={tasks[index].row['ratio']}")
                    bar.update(1)
            if stop:  # those it cannot cancel (already running) are waited for
                remaining = {f for f in remaining if not f.cancel()}
    except BaseException as e:  # e.g. Ctrl-C while waiting: the finished runs' table is written
        interrupted = e
        for future in futures:
            future.cancel()
    rows = [row for outcome in outcomes if outcome is not None and (row := outcome[0]) is not None]
    if interrupted is not None:
        return rows, interrupted
    for outcome in outcomes:
        if outcome is not None and (outcome[0] is None or _stops(outcome[1], keep_going)):
            return rows, outcome[1]
    return rows, None


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _write_table(rows: list[dict[str, Any]], baseline: str, band: bool, sweep_dir: Path) -> pd.DataFrame:
    """The comparison's table (speed-ups, the band's columns), written to ``sweep_dir/summary.csv``."""
    table = with_speedup(pd.DataFrame(rows), baseline)
    if band and "band_fast_ms" in table:
        from um_lab.sim.band import with_band

        table = with_band(table, baseline)
    table.to_csv(sweep_dir / "summary.csv", index=False)
    table.attrs["sweep_dir"] = str(sweep_dir)
    return table


def _training_columns(spec: RunSpec) -> dict[str, Any]:
    """The table's precision and recompute columns, each only when not the default."""
    columns: dict[str, Any] = {}
    if spec.precision != "fp32":
        columns["precision"] = spec.precision
    if spec.recompute not in ("none", 0):
        columns["recompute"] = ",".join(spec.recompute) if isinstance(spec.recompute, tuple) else spec.recompute
    return columns


def _band_ms(spec: RunSpec, case: ModelCase, policy: Policy, backend: Backend) -> tuple[float, float]:
    """The run's step time at the fast and slow ends of the simulator profile's ranges."""
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.band import band_ms

    if not isinstance(backend, SimBackend):
        raise ValueError("uncertainty bands are the simulator's (profile constants' ranges): use backend='sim'")
    return band_ms(spec, case, policy, backend.profile, backend.prefetch_stream)


def _progress_bar(progress: bool | Any, total: int) -> Any:
    if progress is True:
        return QuietBar(total=total, desc="compare", unit="run")
    if progress:
        return progress
    return None
