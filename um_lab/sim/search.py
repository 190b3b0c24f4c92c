"""Policy search on the simulator: the best advice per data type for a model at an oversubscription ratio.

    from um_lab.sim.search import search_policy
    found = search_policy("gpt2-medium", 1.5, model_kwargs={"batch_size": 8, "seq_len": 1024})
    found.policy, found.speedup, found.ranking.head()

Each coordinate of the space — every data type (``space="five-type"``) or each of the paper's three
groups (``"three-type"``: param, grad and optim share one advice) — takes one of :data:`OPTIONS`, the 36
combinations of preferred location (none / gpu / cpu) x accessed by (nobody / the GPU) x read_mostly x
prefetch (none / to the GPU before use / to the host after use); all 36 pass the policy validation.
The search is a coordinate descent over them, made cheap by:

1. **Merging equivalent options.** A small probe workload (:data:`PROBE_MODEL`) is simulated with each
   option on each coordinate (the others without advice) at the target ratio and at
   :data:`PROBE_RATIO_FACTOR` times it. Options whose step traces (time, traffic, residency, faults,
   evictions and remote bytes of every step) are identical at both form one class, tried through its
   simplest member. The probe also screens out options more than :data:`PROBE_SCREEN_FACTOR` times
   slower than the best at both ratios (in practice read_mostly on data the GPU writes).
2. **Checking the merge where it matters.** At the result, every other member of each chosen class is
   simulated on the model itself; one that behaves differently splits its class and the descent goes on.
3. **Caching** every evaluation by its effective advice (each option replaced by its class's member).
4. **Worker processes** forked after the model is traced and placed, so they share the prepared case; or
   any :class:`concurrent.futures.Executor` given as ``executor`` (a Dask ``Client.get_executor()``, Ray's
   executor), whose workers trace and place the workloads once each.
5. **A good start and an early stop.** The descent starts from the best preset, sweeps the largest
   coordinate first, drops from later sweeps a class more than ``prune_factor`` times slower than the
   best of its sweep, and stops after a sweep that brings no improvement (and a check that holds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from typing import Any, NamedTuple

import pandas as pd
from tqdm.auto import tqdm

from um_lab.errors import UmLabError
from um_lab.models import ZOO, get_model
from um_lab.policy import PREFERRED_LOCATIONS, PREFETCHES, Advice, Policy, presets
from um_lab.sim.backend import SimBackend
from um_lab.sim.placement import BLOCK
from um_lab.sim.profile import Profile, load_profile
from um_lab.summary import summarize
from um_lab.types import DATA_TYPES, PAPER_GROUPS, DataType, RunSpec

#: The option space of one coordinate (index 0 is no advice).
OPTIONS: tuple[Advice, ...] = tuple(
    Advice(preferred_location=where, accessed_by=frozenset(by), read_mostly=rm, prefetch=prefetch)
    for where in PREFERRED_LOCATIONS for by in ((), ("gpu",)) for rm in (False, True) for prefetch in PREFETCHES
)
#: Coordinates of each search space: name -> the data types that share one option.
SPACES: dict[str, dict[str, tuple[DataType, ...]]] = {
    "five-type": {t.value: (t,) for t in DATA_TYPES},
    "three-type": {group: tuple(types) for group, types in PAPER_GROUPS.items()},
}
#: The workload that tells options apart: a 2-layer GPT-2 (every data type, 0.12 GiB; ~20 ms a run).
PROBE_MODEL: tuple[str, dict[str, int]] = (
    "gpt2-small", {"n_layer": 2, "n_embd": 64, "n_head": 2, "batch_size": 2, "seq_len": 32})
PROBE_RATIO_FACTOR = 4.0  #: the probe also runs at this multiple of the target ratio (prefetches do not fit)
#: Options this many times slower than the best on the probe at both ratios are not tried on the model
#: (unless ``prune_factor=None``): read_mostly on data the GPU writes, whose every write collapses duplicates.
PROBE_SCREEN_FACTOR = 5.0


class SearchError(UmLabError, ValueError):
    """Bad input to :func:`search_policy` (raised before any tracing or simulation)."""


def option_label(advice: Advice) -> str:
    """A short name of an option, e.g. ``prefer-cpu+prefetch-gpu``; ``none`` for no advice."""
    parts = (f"prefer-{advice.preferred_location}" if advice.preferred_location != "none" else "",
             "gpu-mapped" if "gpu" in advice.accessed_by else "", "read-mostly" if advice.read_mostly else "",
             {"none": "", "to-gpu-before-use": "prefetch-gpu", "to-cpu-after-use": "prefetch-cpu"}[advice.prefetch])
    return "+".join(p for p in parts if p) or "none"


def _settings(option: int) -> int:
    """How many advice settings an option makes (fewer = simpler)."""
    a = OPTIONS[option]
    return (a.preferred_location != "none") + len(a.accessed_by) + a.read_mostly + (a.prefetch != "none")


@dataclasses.dataclass
class SearchResult:
    """What :func:`search_policy` found: the best policy, its speed-up over ``um-default`` and the ranking."""

    policy: Policy
    speedup: float  #: um-default step time / the policy's (median over the measured steps)
    seconds: float  #: wall time of the whole search, tracing included
    evaluations: int  #: simulations of the model itself (the probe's are in ``probe_evaluations``)
    ranking: pd.DataFrame  #: every evaluated candidate, best first: one column per coordinate, ms, speed-up
    model: str
    ratio: float  #: footprint / simulated capacity
    capacity_bytes: int
    space: str
    baseline_ms: float
    best_ms: float
    classes: dict[str, list[list[str]]]  #: equivalent options per coordinate (labels), as finally used
    sweeps: int
    probe_evaluations: int
    complete: bool  #: False when ``budget_s`` ran out before the descent converged

    def __repr__(self) -> str:
        state = "" if self.complete else ", stopped by the time budget"
        return (f"SearchResult({self.model} at {self.ratio:.2f}x, {self.space}: {self.speedup:.3f}x over um-default"
                f" in {self.evaluations} evaluations, {self.seconds:.1f} s{state}; {self.policy.name})")


class _Job(NamedTuple):
    workload: str  #: "target" or "probe"
    capacity: int
    options: tuple[int, ...]  #: index into OPTIONS per data type (DATA_TYPES order)


class _Recipe(NamedTuple):
    """How to build the workloads (picklable, for spawned workers)."""

    profile: Profile
    target: tuple[str, dict[str, Any]]
    steps: int
    warmup_steps: int


_WORKLOADS: dict[str, tuple[SimBackend, Any]] = {}  #: workload -> (backend, case); inherited by forked workers
_RECIPE: list[_Recipe] = []
_BUILD_LOCK = threading.Lock()  #: an executor's worker may run tasks on several threads


def _build_workloads(recipe: _Recipe) -> None:
    """Trace and place the target and the probe workload once (a forked worker inherits them)."""
    if _RECIPE and _RECIPE[0] == recipe:
        return
    _WORKLOADS.clear()
    _RECIPE[:] = [recipe]
    backend = SimBackend(recipe.profile)
    for workload, (name, knobs) in (("target", recipe.target), ("probe", PROBE_MODEL)):
        case = get_model(name, **knobs)
        backend.prepare(case)
        _WORKLOADS[workload] = (backend, case)


def _simulate(job: _Job) -> tuple[float, str]:
    """Median measured step time (ms) and a digest of every step's record (the step trace)."""
    return _simulate_on(_WORKLOADS[job.workload], _RECIPE[0], job)


def _simulate_with(recipe: _Recipe, job: _Job) -> tuple[float, str]:
    """:func:`_simulate` as an executor's task: the worker builds the workloads of ``recipe`` first (once,
    while its tasks keep the same recipe)."""
    with _BUILD_LOCK:
        _build_workloads(recipe)
        workload = _WORKLOADS[job.workload]
    return _simulate_on(workload, recipe, job)


def _simulate_on(workload: tuple[SimBackend, Any], recipe: _Recipe, job: _Job) -> tuple[float, str]:
    """:func:`_simulate` on the given (backend, case)."""
    backend, case = workload
    policy = Policy("candidate", {t: OPTIONS[i] for t, i in zip(DATA_TYPES, job.options, strict=True)})
    spec = RunSpec(model=case.name, backend="sim", steps=recipe.steps, warmup_steps=recipe.warmup_steps,
                   capacity_bytes=job.capacity)
    records = list(backend.run(spec, case, policy))
    trace = [(r.wall_ms, r.htod_bytes, r.dtoh_bytes, r.resident_bytes, r.gpu_page_faults, r.evictions,
              r.remote_bytes) for r in records]
    return summarize(records)["median_ms"], hashlib.sha1(repr(trace).encode()).hexdigest()


class _OutOfTime(Exception):
    pass


class _Evaluator:
    """Runs jobs (on the caller's ``executor``, else in worker processes of its own when ``workers`` > 1),
    caching every result by its job, in the order the jobs were asked (however they finish)."""

    def __init__(self, recipe: _Recipe, workers: int, deadline: float, bar: Any,
                 executor: Executor | None = None) -> None:
        self.cache: dict[_Job, tuple[float, str]] = {}
        self.recipe = recipe
        self.deadline, self.bar = deadline, bar
        self.pool: Executor | None = executor
        self.owned = False  #: the pool is this evaluator's (shut down by close()), not the caller's
        if executor is None and workers > 1:  # forked workers inherit the prepared workloads; spawned ones
            start = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"  # prepare theirs
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(start),
                                            initializer=_build_workloads, initargs=(recipe,))
            self.owned = True

    def close(self) -> None:
        """Stop the worker processes of its own (a caller's executor is left running)."""
        if self.pool is not None and self.owned:
            self.pool.shutdown(cancel_futures=True)

    def count(self, workload: str) -> int:
        """Distinct simulations of ``workload`` so far."""
        return sum(job.workload == workload for job in self.cache)

    def run(self, jobs: Sequence[_Job], timed: bool = True) -> list[tuple[float, str]]:
        """Results of ``jobs`` in order; raises :class:`_OutOfTime` past the deadline when ``timed``."""
        todo = list(dict.fromkeys(j for j in jobs if j not in self.cache))
        if todo and timed and time.perf_counter() > self.deadline:
            raise _OutOfTime
        if self.bar is not None and todo:
            self.bar.total = (self.bar.total or 0) + len(todo)
            self.bar.refresh()
        if self.pool is None:
            for job in todo:
                self.cache[job] = _simulate(job)
                if self.bar is not None:
                    self.bar.update(1)
        else:
            futures: dict[Future[tuple[float, str]], _Job] = {}
            try:
                for job in todo:
                    if self.owned:  # its workers hold the workloads already
                        futures[self.pool.submit(_simulate, job)] = job
                    else:
                        futures[self.pool.submit(_simulate_with, self.recipe, job)] = job
                for future in as_completed(futures):
                    future.result()  # an error is raised as soon as it comes
                    if self.bar is not None:
                        self.bar.update(1)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
            for future, job in futures.items():  # stored in the jobs' order: the ranking breaks ties by it
                self.cache[job] = future.result()
        return [self.cache[j] for j in jobs]


def _complexity(cand: Sequence[int]) -> int:
    return sum(map(_settings, cand))


def _simplest(members: Sequence[int]) -> int:
    """The member of an option class that tries it: fewest settings, then first in OPTIONS."""
    return min(members, key=lambda o: (_settings(o), o))


class _Descent:
    """Coordinate descent over option classes on the target workload (see the module doc)."""

    def __init__(self, ev: _Evaluator, coords: dict[str, tuple[DataType, ...]], classes: list[list[list[int]]],
                 slow: list[set[int]], capacity: int, prune_factor: float | None) -> None:
        self.ev, self.classes, self.capacity, self.prune_factor = ev, classes, capacity, prune_factor
        self.names, self.types = list(coords), list(coords.values())
        self.active = [[_simplest(c) for c in per if prune_factor is None or _simplest(c) not in screened]
                       for per, screened in zip(classes, slow, strict=True)]
        self.sweeps = 0
        self.best: tuple[int, ...] = (0,) * len(coords)
        self.best_ms = math.inf

    def canonical(self, cand: tuple[int, ...]) -> tuple[int, ...]:
        """Each coordinate's option replaced by its class's simplest member."""
        return tuple(_simplest(next(c for c in per if o in c)) for per, o in zip(self.classes, cand, strict=True))

    def run(self, cands: Sequence[tuple[int, ...]], canonical: bool = True,
            timed: bool = True) -> list[tuple[float, str]]:
        """Evaluate candidates (one option per coordinate; in parallel, cached), keeping the fastest."""
        cands = [self.canonical(c) if canonical else c for c in cands]
        jobs = []
        for cand in cands:
            per_type = {t: o for types, o in zip(self.types, cand, strict=True) for t in types}
            jobs.append(_Job("target", self.capacity, tuple(per_type[t] for t in DATA_TYPES)))
        out = self.ev.run(jobs, timed)
        for cand, (ms, _) in zip(cands, out, strict=True):
            if (ms, _complexity(cand)) < (self.best_ms, _complexity(self.best)):
                self.best, self.best_ms = cand, ms
        return out

    def sweep(self, order: Sequence[int]) -> bool:
        """One pass over the coordinates in ``order``; True when it improved the best candidate."""
        self.sweeps += 1
        start_ms = self.best_ms
        for ci in order:
            best = self.best
            options = self.active[ci]
            times = [ms for ms, _ in self.run([best[:ci] + (o,) + best[ci + 1:] for o in options])]
            if self.prune_factor is not None:
                self.active[ci] = [o for o, ms in zip(options, times, strict=True)
                                   if ms <= self.prune_factor * min(times)]
        return self.best_ms < start_ms

    def verify(self) -> bool:
        """Simulate the other members of each chosen class at the best candidate; split classes whose
        members behave differently there. True when every member matched (the merge held)."""
        best = self.best
        cands, where = [], []
        for ci, option in enumerate(best):
            for m in next(c for c in self.classes[ci] if option in c):
                if m != option:
                    cands.append(best[:ci] + (m,) + best[ci + 1:])
                    where.append((ci, m))
        reference = self.run([best])[0][1]
        held = True
        for (ci, m), (_, digest) in zip(where, self.run(cands, canonical=False), strict=True):
            if digest != reference:
                held = False
                next(c for c in self.classes[ci] if m in c).remove(m)
                self.classes[ci].append([m])
                self.active[ci].append(m)
        return held

    def ranking(self, baseline_ms: float) -> pd.DataFrame:
        """Every evaluated target candidate, fastest first (ties: fewer settings first)."""
        rows = []
        for job, (ms, _) in self.ev.cache.items():
            if job.workload == "target":
                options = [job.options[DATA_TYPES.index(types[0])] for types in self.types]
                rows.append({**{n: option_label(OPTIONS[o]) for n, o in zip(self.names, options, strict=True)},
                             "median_ms": ms, "speedup": baseline_ms / ms, "settings": _complexity(options)})
        table = pd.DataFrame(rows).sort_values(["median_ms", "settings"], kind="stable")
        return table.reset_index(drop=True)


_PROBED: dict[tuple[Any, ...], tuple[list[list[list[int]]], list[set[int]]]] = {}  #: earlier probes' outcomes


def _probe(ev: _Evaluator, space: str, capacities: Sequence[int]) -> tuple[list[list[list[int]]], list[set[int]]]:
    """Per coordinate: the option classes (identical probe step traces at every probe capacity) and the
    options more than :data:`PROBE_SCREEN_FACTOR` times slower than the coordinate's fastest at every probe
    capacity. Remembered for later searches with the same profile, steps and probe capacities."""
    recipe = _RECIPE[0]
    key = (json.dumps(recipe.profile.to_dict(), sort_keys=True), recipe.steps, recipe.warmup_steps, space,
           tuple(capacities))
    if key not in _PROBED:
        coords, n, k = SPACES[space], len(OPTIONS), len(capacities)
        jobs = [_Job("probe", cap, tuple(o if t in types else 0 for t in DATA_TYPES))
                for types in coords.values() for o in range(n) for cap in capacities]
        results = ev.run(jobs, timed=False)
        classes, slow = [], []
        for ci in range(len(coords)):
            runs = [results[(ci * n + o) * k:(ci * n + o + 1) * k] for o in range(n)]
            groups: dict[tuple[str, ...], list[int]] = {}
            for o, run in enumerate(runs):
                groups.setdefault(tuple(digest for _, digest in run), []).append(o)
            fastest = [min(run[i][0] for run in runs) for i in range(k)]
            classes.append(list(groups.values()))
            slow.append({o for o, run in enumerate(runs)
                         if all(ms > PROBE_SCREEN_FACTOR * f for (ms, _), f in zip(run, fastest, strict=True))})
        _PROBED[key] = (classes, slow)
    classes, slow = _PROBED[key]
    return [[list(c) for c in per] for per in classes], [set(s) for s in slow]


def max_workers() -> int:
    """The most worker processes a search starts of its own: 4 per CPU core of this machine."""
    return 4 * (os.cpu_count() or 1)


def _check(model: str, ratio: float | None, capacity: int | None, model_kwargs: Mapping[str, Any] | None,
           space: str, numbers: Mapping[str, Any], profile: str | Profile,
           executor: Executor | None = None) -> tuple[Profile, dict[str, Any]]:
    """Validate every argument before any work; returns the profile and the model's knobs."""
    if executor is not None and not isinstance(executor, Executor):
        raise SearchError(f"executor must be a concurrent.futures.Executor (e.g. a Dask Client.get_executor()) or "
                          f"None, got {type(executor).__name__}")
    if executor is not None and numbers["workers"] is not None:
        raise SearchError(f"give workers={numbers['workers']!r} (processes of the search's own) or an executor, "
                          "not both")
    if not isinstance(model, str) or model not in ZOO:
        raise SearchError(f"unknown model {model!r}; valid: {', '.join(ZOO)}")
    if (ratio is None) == (capacity is None):
        raise SearchError("give exactly one of ratio (footprint / GPU capacity) and capacity (bytes)")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)
                              or not math.isfinite(ratio) or ratio <= 0):
        raise SearchError(f"ratio must be a positive finite number, got {ratio!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < BLOCK):
        raise SearchError(f"capacity must be an integer of at least one 2 MiB chunk ({BLOCK} B), got {capacity!r}")
    if space not in SPACES:
        raise SearchError(f"unknown space {space!r}; valid: {', '.join(SPACES)}")
    for name, low in (("workers", 1), ("steps", 1), ("warmup_steps", 0)):
        value = numbers[name]
        if name == "workers" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SearchError(f"{name} must be an integer >= {low}, got {value!r}")
        if name == "workers" and value > max_workers():
            raise SearchError(f"workers={value} is more than {max_workers()} processes (4 per CPU core here); for "
                              "more, pass a cluster's executor (e.g. a Dask Client.get_executor())")
    for name, low in (("budget_s", 0), ("prune_factor", 1)):
        value = numbers[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > low):
            raise SearchError(f"{name} must be a number > {low} or None, got {value!r}")
    if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
        raise SearchError(f"model_kwargs must be a mapping of the model's knobs, got {type(model_kwargs).__name__}")
    knobs = dict(model_kwargs or {})
    try:
        get_model(model, **knobs)  # cheap: checks the knobs, builds no module
        return load_profile(profile), knobs
    except (ValueError, OSError) as e:
        raise SearchError(str(e)) from None


def _seeds(coords: dict[str, tuple[DataType, ...]]) -> list[tuple[int, ...]]:
    """The presets that the space can express (each coordinate's types share one option)."""
    out = []
    for policy in presets.values():
        per = [{policy[t] for t in types} for types in coords.values()]
        if all(len(s) == 1 and next(iter(s)) in OPTIONS for s in per):
            out.append(tuple(OPTIONS.index(next(iter(s))) for s in per))
    return out


def search_policy(model: str, ratio: float | None = None, capacity: int | None = None, *,
                  model_kwargs: Mapping[str, Any] | None = None, space: str = "five-type", workers: int | None = None,
                  budget_s: float | None = None, profile: str | Profile = "h200", steps: int = 4,
                  warmup_steps: int = 2, prune_factor: float | None = 2.0, progress: bool = True,
                  executor: Executor | None = None) -> SearchResult:
    """Find the best per-type advice for ``model`` (a zoo name with ``model_kwargs``) on the simulator.

    Give ``ratio`` (footprint / GPU capacity) or ``capacity`` (simulated GPU bytes). Each candidate runs
    ``warmup_steps`` + ``steps`` steps and is scored by its median measured step, as
    :func:`um_lab.teaching.paper.run_grid` does. ``workers`` processes of the search's own simulate in parallel
    (default 2; 1: in this process); or give ``executor``, any :class:`concurrent.futures.Executor` (a Dask
    ``Client.get_executor()`` spreads the simulations over a cluster; it is left running), instead of
    ``workers``: each simulation is a picklable task whose worker traces the workloads once. The result is
    the same either way (only ``seconds`` differs). ``budget_s`` stops the
    descent (checked between batches) with the best so far and ``complete=False``; ``prune_factor=None``
    keeps every option class in every sweep. Bad input raises :class:`SearchError` before any work.
    """
    numbers = {"workers": workers, "steps": steps, "warmup_steps": warmup_steps, "budget_s": budget_s,
               "prune_factor": prune_factor}
    prof, knobs = _check(model, ratio, capacity, model_kwargs, space, numbers, profile, executor)
    start = time.perf_counter()
    recipe = _Recipe(prof, (model, knobs), steps, warmup_steps)
    _build_workloads(recipe)
    target, probe = (backend.prepare(case) for backend, case in (_WORKLOADS["target"], _WORKLOADS["probe"]))
    if capacity is None and ratio is None:  # _check refuses this; said again for the type checker
        raise SearchError("give a ratio or a capacity")
    cap = capacity if capacity is not None else int(target.footprint_bytes / float(ratio))  # type: ignore[arg-type]
    if cap < BLOCK:
        raise SearchError(f"ratio {ratio} leaves {cap} B of GPU capacity: less than one 2 MiB chunk")
    ratio = target.footprint_bytes / cap
    probe_caps = [max(BLOCK, int(probe.footprint_bytes / (ratio * f))) for f in (1.0, PROBE_RATIO_FACTOR)]
    coords = SPACES[space]
    size = [sum(target.placement.final.segment_bytes[t.value] for t in types) for types in coords.values()]
    order = sorted(range(len(coords)), key=lambda ci: -size[ci])
    bar = tqdm(total=0, desc=f"policy search {model} {ratio:.2f}x", unit="sim") if progress else None
    ev = _Evaluator(recipe, 2 if workers is None else workers,
                    start + budget_s if budget_s is not None else math.inf, bar, executor)
    try:
        descent = _Descent(ev, coords, *_probe(ev, space, probe_caps), cap, prune_factor)
        baseline_ms = descent.run([(0,) * len(coords), *_seeds(coords)], timed=False)[0][0]
        complete = True
        try:
            while descent.sweep(order) or not descent.verify():
                if bar is not None:
                    bar.set_postfix_str(f"best {baseline_ms / descent.best_ms:.3f}x")
        except _OutOfTime:
            complete = False
    finally:
        ev.close()
        if bar is not None:
            bar.close()
    speedup = baseline_ms / descent.best_ms
    labels = ", ".join(f"{n}: {option_label(OPTIONS[o])}" for n, o in zip(coords, descent.best, strict=True))
    policy = Policy(f"search: {model} {ratio:.2f}x",
                    {t: OPTIONS[o] for types, o in zip(coords.values(), descent.best, strict=True) for t in types},
                    f"Found by um_lab.sim.search ({space}, profile {prof.name}, {model} {knobs} at ratio"
                    f" {ratio:.2f}): {speedup:.3f}x over um-default on the simulator. {labels}.")
    return SearchResult(
        policy=policy, speedup=speedup, seconds=time.perf_counter() - start, evaluations=ev.count("target"),
        ranking=descent.ranking(baseline_ms), model=model, ratio=ratio, capacity_bytes=cap, space=space,
        baseline_ms=baseline_ms, best_ms=descent.best_ms, sweeps=descent.sweeps,
        classes={n: [[option_label(OPTIONS[o]) for o in c] for c in per]
                 for n, per in zip(coords, descent.classes, strict=True)},
        probe_evaluations=ev.count("probe"), complete=complete)
