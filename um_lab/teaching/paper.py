"""The paper's experiment on the simulator: advice per paper data type, every mapping, the best one.

Choi & Lee (2021) split training data into three types (model parameters, intermediate results,
input data), gave each its own ``cudaMemAdvise`` and report 9.4% less execution time than default
Unified Memory. They do not say which advice went to which type. Here every combination of a small set
of candidate options per group (:data:`GROUP_OPTIONS`) is simulated at several oversubscription
ratios, and the mapping with the highest geometric-mean speed-up over ``um-default`` is chosen.

    from um_lab.teaching.paper import mappings, run_grid, choose
    table = run_grid({"gpt2-medium": {"batch_size": 8, "seq_len": 1024}}, [0.8, 1.5], mappings())
    result = choose(table)          # best per (model, ratio), ranking, best overall

``bench/paper_three_types.py`` runs the full experiment; the ``paper-3type`` preset is its winner
(:data:`PRESET_PROVENANCE` says which run, profile and simulator it came from).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from um_lab.errors import UmLabError
from um_lab.policy import Advice, Policy, presets
from um_lab.types import RunSpec

if TYPE_CHECKING:
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.profile import Profile

PAPER = ("Choi & Lee, Efficient Use of GPU Memory for Large-Scale Deep Learning Model Training, "
         "Applied Sciences 11(21):10377, 2021")
PAPER_TIME_SAVED = 0.094  #: the paper's execution-time reduction against default Unified Memory
GROUPS = ("model parameters", "intermediate results", "input data")  #: as in um_lab.types.PAPER_GROUPS
BASELINE = "um-default"
TIE_TOLERANCE = 0.001  #: scores within 0.1% count as a tie, broken toward the simpler mapping

_GPU = frozenset({"gpu"})
#: Candidate advice, by short name. "pin-gpu" = preferred GPU + mapped on the GPU; "zero-copy" = data
#: stays in host memory and the GPU reads and writes it over the host link.
OPTIONS: dict[str, Advice] = {
    "none": Advice(),
    "prefer-gpu": Advice(preferred_location="gpu"),
    "pin-gpu": Advice(preferred_location="gpu", accessed_by=_GPU),
    "pin-gpu+prefetch": Advice(preferred_location="gpu", accessed_by=_GPU, prefetch="to-gpu-before-use"),
    "prefetch": Advice(prefetch="to-gpu-before-use"),
    "zero-copy": Advice(preferred_location="cpu", accessed_by=_GPU),
    "read-mostly+prefetch": Advice(read_mostly=True, prefetch="to-gpu-before-use"),
}
_COMMON = ("none", "prefer-gpu", "pin-gpu", "pin-gpu+prefetch", "prefetch", "zero-copy")
#: The options tried for each paper group. read_mostly only for input data: parameters, gradients,
#: optimizer state and intermediate results are written every step, and each write to read-mostly
#: data collapses every duplicate (measured on the H200: 100-1,500x slower on parameters; calibration/h200-probe.json).
GROUP_OPTIONS: dict[str, tuple[str, ...]] = {
    "model parameters": _COMMON,
    "intermediate results": _COMMON,
    "input data": (*_COMMON, "read-mostly+prefetch"),
}
LEFT_OUT = {
    ("model parameters", "read-mostly+prefetch"): "written every step (optimizer, backward): duplicates collapse",
    ("intermediate results", "read-mostly+prefetch"): "written by every forward and backward op",
}

#: Where the committed full experiment lives (relative to the repository root).
RESULTS_JSON = "bench/results/paper_three_types.json"
#: The ``paper-3type`` preset's origin: the run of ``bench/paper_three_types.py`` that chose it.
#: ``tests/test_paper.py`` checks it against the committed JSON and the current profile.
#: The columns of a run stored in the results JSON (the groups, speed-up and time saved are derived on loading).
ROW_COLUMNS = ("model", "ratio", "mapping", "median_ms", "htod_bytes", "dtoh_bytes", "gpu_page_faults", "evictions",
               "remote_bytes", "live_gib")
PRESET_PROVENANCE: dict[str, Any] = {
    "mapping": {"model parameters": "none", "intermediate results": "pin-gpu+prefetch", "input data": "pin-gpu"},
    "results_json": RESULTS_JSON,
    "profile": "h200",
    "profile_sha256": "018429d8827b38b4c1ec32a1000d3ff09a3b9a045f5dacca64150aed15c9bc07",
    "sim_source_sha256": "4773e8c7a145eef8b3b7162aaed33f76d5dbaccc2647ccb5dc4f5744d63dcea3",
    # a 2-core CPU machine, all three models in one run (torch 2.14.1 + torchvision 0.29.1)
    "date": "2026-12-08T01:13:33+00:00",
    "um_lab_version": "0.1.0",
}


class PaperExperimentError(UmLabError, ValueError):
    """A bad grid, option name or results table for the paper experiment."""


@dataclasses.dataclass(frozen=True, order=True)
class PaperMapping:
    """One option name per paper group: a candidate answer to "which advice for which type"."""

    params: str = "none"  #: model parameters (param + grad + optim)
    act: str = "none"  #: intermediate results
    input: str = "none"  #: input data

    def __post_init__(self) -> None:
        for group, option in zip(GROUPS, self.options, strict=True):
            if option not in OPTIONS:
                raise PaperExperimentError(f"{group}: unknown option {option!r}; valid: {', '.join(OPTIONS)}")

    @property
    def options(self) -> tuple[str, str, str]:
        """The option names in :data:`GROUPS` order."""
        return (self.params, self.act, self.input)

    @property
    def name(self) -> str:
        """A readable label: ``params / act / input`` option names."""
        return " / ".join(self.options)

    @property
    def complexity(self) -> int:
        """How many advice settings the mapping makes (fewer = simpler; used to break ties)."""
        return sum(_advice_count(OPTIONS[o]) for o in self.options)

    def policy(self, name: str | None = None, description: str = "") -> Policy:
        """The :class:`Policy` (``Policy.from_paper_groups``); all ``none`` is the ``um-default`` preset."""
        if self.options == ("none", "none", "none") and name is None:
            return presets[BASELINE]
        params, acts, inputs = (OPTIONS[o] for o in self.options)
        return Policy.from_paper_groups(name or f"paper: {self.name}", params, acts, inputs, description=description)

    def to_dict(self) -> dict[str, str]:
        """``{group: option}``, as the JSON and :data:`PRESET_PROVENANCE` store it."""
        return dict(zip(GROUPS, self.options, strict=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> PaperMapping:
        """Inverse of :meth:`to_dict`."""
        missing = [g for g in GROUPS if g not in data]
        if missing:
            raise PaperExperimentError(f"mapping lacks group(s) {missing}; needs {list(GROUPS)}")
        return cls(*(data[g] for g in GROUPS))

    @classmethod
    def parse(cls, name: str) -> PaperMapping:
        """Inverse of :attr:`name` (``"pin-gpu / none / prefetch"``)."""
        parts = [p.strip() for p in name.split("/")]
        if len(parts) != 3:
            raise PaperExperimentError(f"a mapping name has three parts 'params / act / input', got {name!r}")
        return cls(*parts)


def _advice_count(advice: Advice) -> int:
    return ((advice.preferred_location != "none") + len(advice.accessed_by) + advice.read_mostly
            + (advice.prefetch != "none"))


def mappings(group_options: Mapping[str, Sequence[str]] | None = None) -> list[PaperMapping]:
    """Every combination of the options per group (default :data:`GROUP_OPTIONS`), baseline first."""
    opts = dict(GROUP_OPTIONS if group_options is None else group_options)
    unknown = sorted(set(opts) - set(GROUPS))
    if unknown:
        raise PaperExperimentError(f"unknown group(s) {unknown}; valid: {list(GROUPS)}")
    per_group = [list(dict.fromkeys(opts.get(g, ("none",)))) for g in GROUPS]
    if any(not o for o in per_group):
        raise PaperExperimentError("every group needs at least one option")
    grid = [PaperMapping(*combo) for combo in itertools.product(*per_group)]
    base = PaperMapping()
    return [base, *(m for m in grid if m != base)]


# ------------------------------------------------------------------------------------ running it


def run_grid(
    models: Mapping[str, Mapping[str, Any]],
    ratios: Sequence[float | None],
    grid: Iterable[PaperMapping],
    *,
    steps: int = 4,
    warmup_steps: int = 2,
    backend: Any = None,
    progress: bool | Any = False,
    executor: Executor | None = None,
) -> pd.DataFrame:
    """Simulate every model x ratio x mapping; one row each, with ``speedup`` and ``time_saved`` against
    the all-``none`` mapping (= ``um-default``, added when missing).

    ``models``: ``{zoo name: knobs}``. ``backend``: a :class:`~um_lab.sim.SimBackend` (default: the h200
    profile). No run folders are written. Columns: model, ratio, mapping, the three groups, median_ms,
    speedup, time_saved, htod_bytes, dtoh_bytes, gpu_page_faults, evictions, remote_bytes (per step).
    ``executor``: any :class:`concurrent.futures.Executor` (local processes, a Dask ``Client.get_executor()``,
    Ray's executor) that runs the simulations, one picklable task each, on workers that build a simulator of
    the backend's profile and prefetch stream (so ``backend`` must be a plain ``SimBackend``); the table is
    the same, in the same order, as without it (the default: one after another in this process). The
    executor is left running; the progress bar counts runs as they finish.
    """
    from um_lab.models import get_model
    from um_lab.sim.backend import SimBackend

    if executor is not None and not isinstance(executor, Executor):
        raise PaperExperimentError(f"executor must be a concurrent.futures.Executor (e.g. a Dask "
                                   f"Client.get_executor()) or None, got {type(executor).__name__}")
    if executor is not None and backend is not None and type(backend) is not SimBackend:
        raise PaperExperimentError(f"executor: a {type(backend).__name__} cannot be rebuilt in a worker; give a "
                                   "SimBackend (its profile and prefetch stream are sent), or leave executor=None")
    grid = list(dict.fromkeys(grid))
    if PaperMapping() not in grid:
        grid.insert(0, PaperMapping())
    if not models or not list(ratios):
        raise PaperExperimentError("run_grid needs at least one model and one ratio")
    backend = backend if backend is not None else SimBackend()
    cases = {name: get_model(name, **dict(knobs)) for name, knobs in models.items()}
    tasks = [_GridTask(name, dict(models[name]), RunSpec(model=name, backend="sim", steps=steps,
                                                         warmup_steps=warmup_steps, oversubscription_ratio=ratio),
                       mapping) for name in cases for ratio in ratios for mapping in grid]
    bar = _bar(progress, len(tasks))
    try:
        if executor is None:
            summaries = []
            policies = {m: m.policy() for m in grid}
            for task in tasks:
                if bar is not None and task.mapping == grid[0]:
                    bar.set_postfix_str(f"{task.model} ratio={task.spec.oversubscription_ratio}")
                summaries.append(_grid_summary(backend, cases[task.model], task.spec, policies[task.mapping]))
                if bar is not None:
                    bar.update(1)
        else:
            summaries = _run_on(executor, tasks, backend.profile, backend.prefetch_stream, bar)
    finally:
        if bar is not None and progress is True:
            bar.close()
    rows = []
    for task, s in zip(tasks, summaries, strict=True):
        n = max(s["steps"], 1)
        rows.append({"model": task.model, "ratio": task.spec.oversubscription_ratio, "mapping": task.mapping.name,
                     **dict(zip(GROUPS, task.mapping.options, strict=True)), "median_ms": s["median_ms"],
                     **{k: (s[k] or 0) / n for k in ("htod_bytes", "dtoh_bytes", "gpu_page_faults",
                                                     "evictions", "remote_bytes")},
                     "live_gib": s["peak_live_bytes"] / 2**30})
    return add_speedup(pd.DataFrame(rows))


@dataclasses.dataclass(frozen=True)
class _GridTask:
    """One simulation of the grid (picklable, for an executor's worker): a zoo model by name and knobs."""

    model: str
    knobs: dict[str, Any]
    spec: RunSpec
    mapping: PaperMapping


def _grid_summary(backend: Any, case: Any, spec: RunSpec, policy: Policy) -> dict[str, Any]:
    """The run's summary (:func:`um_lab.summary.summarize` of its records)."""
    from um_lab.summary import summarize

    return summarize(backend.run(spec, case, policy))


_WORKER_SIMS: list[tuple[Profile, str, SimBackend]] = []  #: a worker's simulators (kept: they cache traces)
_WORKER_LOCK = threading.Lock()


def _grid_task_in_worker(task: _GridTask, profile: Profile, prefetch_stream: str) -> dict[str, Any]:
    """An executor's task: :func:`_grid_summary` on the worker's simulator of ``profile`` (built once per
    worker process and profile)."""
    from um_lab.models import get_model
    from um_lab.sim.backend import SimBackend

    with _WORKER_LOCK:
        found = [sim for p, stream, sim in _WORKER_SIMS if p == profile and stream == prefetch_stream]
        if found:
            backend = found[0]
        else:
            backend = SimBackend(profile, prefetch_stream)
            _WORKER_SIMS[:] = [*_WORKER_SIMS[-3:], (profile, prefetch_stream, backend)]
    return _grid_summary(backend, get_model(task.model, **task.knobs), task.spec, task.mapping.policy())


def _run_on(executor: Executor, tasks: Sequence[_GridTask], profile: Profile, prefetch_stream: str,
            bar: Any) -> list[dict[str, Any]]:
    """Every task's summary, in the tasks' order, from ``executor``; the first error cancels the tasks not
    started and is raised."""
    futures: list[Future[dict[str, Any]]] = []
    try:
        futures = [executor.submit(_grid_task_in_worker, task, profile, prefetch_stream) for task in tasks]
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()  # an error is raised as soon as it comes
                if bar is not None:
                    bar.update(1)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return [future.result() for future in futures]


def _bar(progress: bool | Any, total: int) -> Any:
    if progress is True:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="paper grid", unit="run")
    return progress or None


def add_speedup(table: pd.DataFrame) -> pd.DataFrame:
    """(Re)compute ``speedup`` (baseline median / median) and ``time_saved`` (1 - median / baseline)
    within each (model, ratio); the baseline is the all-``none`` mapping."""
    table = table.copy()
    key = table["ratio"].astype(object).where(table["ratio"].notna(), "none")
    base_rows = table[table["mapping"] == PaperMapping().name]
    base = dict(zip(zip(base_rows["model"], key[base_rows.index], strict=True), base_rows["median_ms"],
                    strict=True))
    missing = {(m, k) for m, k in zip(table["model"], key, strict=True)} - set(base)
    if missing:
        raise PaperExperimentError(f"no {BASELINE} row for (model, ratio) {sorted(missing, key=str)}")
    base_ms = np.array([base[(m, k)] for m, k in zip(table["model"], key, strict=True)], dtype=float)
    table["speedup"] = base_ms / table["median_ms"].to_numpy(dtype=float)
    table["time_saved"] = 1.0 - table["median_ms"].to_numpy(dtype=float) / base_ms
    return table


# ------------------------------------------------------------------------------------ choosing


def _simplest_of_ties(frame: pd.DataFrame, column: str, higher_is_better: bool) -> pd.Series:
    """The row with the best ``column``; rows within :data:`TIE_TOLERANCE` of it count as ties, and
    the tie goes to the fewest advice settings, then the earliest row."""
    values = frame[column].to_numpy(dtype=float)
    best = np.nanmax(values) if higher_is_better else np.nanmin(values)
    if higher_is_better:
        tied = values >= best * (1 - TIE_TOLERANCE)
    else:
        tied = values <= best * (1 + TIE_TOLERANCE)
    candidates = frame[tied]
    complexity = [PaperMapping.parse(m).complexity for m in candidates["mapping"]]
    return candidates.iloc[int(np.argmin(complexity))]


def best_per_cell(table: pd.DataFrame) -> pd.DataFrame:
    """For each (model, ratio): the fastest mapping (ties: the simplest), its speed-up and time saved,
    and how many mappings tied with it."""
    rows = []
    for (model, ratio), cell in table.groupby(["model", "ratio"], sort=False, dropna=False):
        best = _simplest_of_ties(cell, "median_ms", higher_is_better=False)
        ties = int((cell["median_ms"] <= cell["median_ms"].min() * (1 + TIE_TOLERANCE)).sum())
        rows.append({"model": model, "ratio": ratio, "best_mapping": best["mapping"],
                     "median_ms": best["median_ms"], "um_default_ms": best["median_ms"] * best["speedup"],
                     "speedup": best["speedup"], "time_saved": best["time_saved"], "tied": ties})
    return pd.DataFrame(rows)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean (NaN when empty or any value is not positive)."""
    arr = np.asarray(list(values), dtype=float)
    if not len(arr) or not np.all(arr > 0):
        return math.nan
    return float(np.exp(np.log(arr).mean()))


def ranking(table: pd.DataFrame) -> pd.DataFrame:
    """One row per mapping, best first: geometric-mean speed-up over every (model, ratio) cell, its
    equivalent time saved, the worst and best cell, and the same geometric mean over the cells above
    ratio 1 (``oversubscribed_speedup``) and at or below it (``fits_speedup``)."""
    cells = table[["model", "ratio"]].drop_duplicates()
    n_cells = len(cells)
    over = table["ratio"].fillna(0).astype(float) > 1
    rows = []
    for name, group in table.groupby("mapping", sort=False):
        if len(group) != n_cells:
            raise PaperExperimentError(f"mapping {name!r} has {len(group)} of {n_cells} (model, ratio) cells")
        g = geomean(group["speedup"])
        rows.append({"mapping": name, **dict(zip(GROUPS, PaperMapping.parse(name).options, strict=True)),
                     "geomean_speedup": g, "time_saved": 1 - 1 / g,
                     "oversubscribed_speedup": geomean(group.loc[over[group.index], "speedup"]),
                     "fits_speedup": geomean(group.loc[~over[group.index], "speedup"]),
                     "worst_speedup": group["speedup"].min(), "best_speedup": group["speedup"].max(),
                     "complexity": PaperMapping.parse(name).complexity})
    out = pd.DataFrame(rows).sort_values(["geomean_speedup", "complexity"], ascending=[False, True],
                                         kind="stable")
    return out.reset_index(drop=True)


def best_overall(table: pd.DataFrame) -> pd.Series:
    """The mapping with the highest geometric-mean speed-up (ties within :data:`TIE_TOLERANCE`: the simplest)."""
    return _simplest_of_ties(ranking(table), "geomean_speedup", higher_is_better=True)


@dataclasses.dataclass
class Choice:
    """What the experiment chose: the ranking, the best per cell and the best overall."""

    table: pd.DataFrame
    ranking: pd.DataFrame
    per_cell: pd.DataFrame
    best: pd.Series

    @property
    def mapping(self) -> PaperMapping:
        """The best overall mapping."""
        return PaperMapping.parse(self.best["mapping"])


def choose(table: pd.DataFrame) -> Choice:
    """Rank the mappings of a :func:`run_grid` table and pick the best per cell and overall."""
    rank = ranking(table)
    return Choice(table, rank, best_per_cell(table), _simplest_of_ties(rank, "geomean_speedup", True))


# ------------------------------------------------------------------------------------ provenance


def sim_source_sha256() -> str:
    """SHA-256 over the simulator's Python sources (``um_lab/sim/*.py``), recorded for information."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).parent.parent / "sim").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def results_path(root: str | Path | None = None) -> Path:
    """The committed results JSON (``root`` defaults to this checkout's repository root)."""
    return Path(root if root is not None else Path(__file__).resolve().parents[2]) / RESULTS_JSON


def rows_to_json(table: pd.DataFrame) -> dict[str, Any]:
    """A run_grid table as ``{"columns", "data"}`` (one list per run; times rounded to the microsecond,
    per-step traffic to whole units); :func:`rows_from_json` reads it back."""
    out = table[list(ROW_COLUMNS)].copy()
    out["median_ms"] = out["median_ms"].round(3)
    for col in ("htod_bytes", "dtoh_bytes", "gpu_page_faults", "evictions", "remote_bytes"):
        out[col] = out[col].round().astype("int64")
    out["live_gib"] = out["live_gib"].round(3)
    out = out.astype(object)
    return {"columns": list(out.columns), "data": out.to_numpy().tolist()}


def rows_from_json(rows: Mapping[str, Any]) -> pd.DataFrame:
    """Inverse of :func:`rows_to_json`: the table with the group columns, ``speedup`` and ``time_saved``."""
    table = pd.DataFrame(rows["data"], columns=rows["columns"])
    groups = pd.DataFrame([PaperMapping.parse(m).options for m in table["mapping"]], columns=list(GROUPS),
                          index=table.index)
    table = pd.concat([table.iloc[:, :3], groups, table.iloc[:, 3:]], axis=1)
    return add_speedup(table)


def load_results(path: str | Path | None = None) -> dict[str, Any] | None:
    """The committed full experiment as a dict (its rows as a DataFrame in ``table``), or None when absent."""
    path = Path(path) if path is not None else results_path()
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    data["table"] = rows_from_json(data["rows"])
    return data
