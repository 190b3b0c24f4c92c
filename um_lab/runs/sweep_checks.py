"""The checks a comparison makes of its input before anything runs.

:func:`um_lab.runs.sweep.compare` refuses bad models, batch sizes, policies, ratios and executors with these,
then checks each model against the backend and every run's pre-flight; :func:`check_export_path` is the
check of an export file (the CLI's ``--csv`` / ``--parquet``). Each raises um_lab's own error, naming what
is wrong, while nothing has run yet.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from um_lab.backend import resolve_backend_name
from um_lab.backend_base import Backend
from um_lab.errors import ModelConfigError, OutputExistsError, PolicyError, SpecError
from um_lab.models import ModelCase, case_for_spec, check_case
from um_lab.policy import Policy, check_preset_name, get_policy
from um_lab.runs.runlog import RunDirError
from um_lab.training import with_training
from um_lab.types import RunSpec

ModelsArg = Sequence[str | ModelCase] | Mapping[str, Mapping[str, Any]] | str | ModelCase


def normalise_models(models: ModelsArg, model_kwargs: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """[(label, str name with kwargs | ModelCase)], validating names up front."""
    from um_lab.models import ZOO

    if isinstance(models, (str, ModelCase)):
        models = [models]
    items: list[tuple[str, Any]] = []
    pairs: list[tuple[Any, dict[str, Any] | None]]
    if isinstance(models, Mapping):
        pairs = [(name, dict(kw)) for name, kw in models.items()]
    else:
        pairs = [(m, dict(model_kwargs or {})) if isinstance(m, str) else (m, None) for m in models]
    for model, kwargs in pairs:
        if isinstance(model, ModelCase):
            items.append((model.name, model))
        elif model not in ZOO:
            raise ModelConfigError(f"unknown model {model!r}; valid: {', '.join(ZOO)}")
        else:
            items.append((model, kwargs))
    if not items:
        raise ModelConfigError("compare() needs at least one model")
    labels = [label for label, _ in items]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:  # each (model, ratio) is one cell of the table: a second one would run again and collide
        raise ModelConfigError(f"model {', '.join(map(repr, twice))} is given more than once; give each model once "
                               "(to compare sizes of one model, give each a ModelCase of its own name, e.g. "
                               "um_lab.models.custom)", "models")
    return items


def checked_ratios(ratios: Sequence[float | None]) -> list[float | None]:
    """The ratios (``[None]`` when empty), each once: a ratio given twice is refused, naming it."""
    if ratios is None or isinstance(ratios, (int, float)):  # one ratio
        ratios = [ratios]
    ratio_list = list(ratios) or [None]
    seen: list[float | None] = []
    for ratio in ratio_list:
        if ratio in seen:
            shown = "None (the profile's card)" if ratio is None else repr(ratio)
            raise SpecError(f"ratio {shown} is given more than once; give each ratio once", "ratios")
        seen.append(ratio)
    return ratio_list


def checked_batch_size(batch_size: int | None, model_items: list[tuple[str, Any]]) -> None:
    """Refuse ``batch_size`` when a model's knobs set another ``batch_size`` (one of them would be dropped)."""
    if batch_size is None:
        return
    for label, kwargs in model_items:
        if isinstance(kwargs, dict) and "batch_size" in kwargs and kwargs["batch_size"] != batch_size:
            raise SpecError(f"batch_size={batch_size} and {label}'s knob batch_size={kwargs['batch_size']!r} "
                            "disagree: give the batch size once", "batch_size")


def checked_policies(policies: Sequence[str | Policy], baseline: str) -> list[Policy]:
    """The policies, the baseline first when missing; a policy may not reuse a preset's name with other
    advice (it would stand in for the preset, the baseline included) nor share a name with another."""
    if isinstance(policies, (str, Policy)):  # one policy, not a sequence of its characters
        policies = [policies]
    objs: list[Policy] = []
    for policy in [check_preset_name(get_policy(p), baseline) for p in policies]:
        same = [p for p in objs if p.name == policy.name]
        if same and same[0].advice != policy.advice:
            raise PolicyError("name", f"two different policies are named {policy.name!r}; rename one")
        if not same:
            objs.append(policy)
    if baseline not in [p.name for p in objs]:
        objs.insert(0, get_policy(baseline))
    return objs


def check_export_path(path: str | os.PathLike[str], force: bool = False) -> Path:
    """Raise :class:`~um_lab.runs.runlog.RunDirError` unless a table can be written to ``path`` (a file, its
    folder created if needed), and :class:`~um_lab.errors.OutputExistsError` when it exists, unless ``force``
    (then it is left as it is until the table replaces it): checked before the first run."""
    path = Path(path)
    if path.is_dir():
        raise RunDirError(f"cannot write the table to {path}: it is a folder; give a file name")
    if path.exists() and not force:
        raise OutputExistsError(path, f"{path} already exists: give another file name, or replace it with --force "
                                      "(API: force=True). Nothing was run.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with open(path, "a"):
                pass
        else:
            with open(path, "x"):
                pass
            path.unlink()
    except OSError as e:
        raise RunDirError(f"cannot write the table to {path} ({e.strerror or e}). Nothing was run.") from None
    return path


def check_executor_backend(backend: str, backend_instance: Backend | None) -> None:
    """With an executor, each worker builds its own backend by name: only the simulator's can be (a GPU stays
    with the process that holds it), and a backend object cannot be sent."""
    if backend_instance is not None:
        raise SpecError("a backend_instance cannot be sent to an executor's workers (each builds its own "
                        "backend): give backend='sim', or leave executor=None to run on this instance",
                        "executor")
    resolved = resolve_backend_name(backend)
    if resolved != "sim":
        shown = f"{backend!r} (here {resolved!r})" if backend != resolved else repr(resolved)
        raise SpecError(f"backend {shown} cannot run on an executor: only the simulator (backend='sim') runs in "
                        "a worker; leave executor=None to run here", "executor")


def check_cases(model_items: list[tuple[str, Any]], specs: Mapping[tuple[str, Any], RunSpec],
                 kind: type[Backend], keep_going: bool) -> dict[str, ModelCase | None]:
    """Every model's knobs and the backend's check of it (:meth:`~um_lab.backend_base.Backend.check_case`; on the
    simulator its input batch against host memory) before any run; with ``keep_going`` a bad model is left
    to its runs, which record why they could not run (its case is None)."""
    cases: dict[str, ModelCase | None] = {}
    for label, model in model_items:
        spec = next(s for (name, _), s in specs.items() if name == label)
        try:
            case = check_case(with_training(model, spec.precision, spec.recompute) if isinstance(model, ModelCase)
                              else case_for_spec(spec))
            kind.check_case(case)
            cases[label] = case
        except Exception:
            if not keep_going:
                raise
            cases[label] = None
    return cases


def check_cells(cells: Sequence[tuple[str, Any, float | None, Policy, RunSpec]],
                 cases: Mapping[str, ModelCase | None], backend: Backend, kind: type[Backend]) -> list[Any]:
    """Every run of the comparison before the first one: the backend's pre-flight of each (on the simulator a
    GPU budget that cannot hold one layer; on a GPU a size over the safety cap) and, on a backend that
    simulates capacity, the capacity each ratio gives the model (a ratio so small or large that no GPU
    size follows). The simulator's traces and budget plans made here are the runs' own (cached). Returns each
    cell's pre-flight result for its run (False: nothing to record)."""
    footprints: dict[str, int] = {}
    results: list[Any] = []
    for label, _, ratio, policy, spec in cells:
        case = cases[label]
        if case is None:
            results.append(True)
            continue
        try:
            checked = backend.preflight(spec, case, policy)
            results.append(False if checked is None else checked)
            if kind.simulates_capacity and (spec.oversubscription_ratio is not None or spec.capacity_bytes is not None):
                if label not in footprints:
                    footprints[label] = _footprint(backend, case)
                try:
                    backend.capacity_for(spec, footprints[label])
                except OverflowError:
                    raise SpecError(f"oversubscription ratio {ratio!r} gives {label} a simulated GPU too large to "
                                    "represent; give a ratio >= 0.001", "oversubscription_ratio") from None
        except Exception as e:
            shown = "none" if ratio is None else f"{ratio:g}"
            e.add_note(f"refused before the first run of the comparison: {label} under {policy.name} at ratio "
                       f"{shown}. Nothing was run.")
            raise
    return results


def _footprint(backend: Backend, case: ModelCase) -> int:
    """The model's live bytes as a backend that simulates capacity divides by a ratio: the simulator's
    prepared case (the run's own, cached), else the memory estimate (:func:`um_lab.sizing.estimate_memory`)."""
    from um_lab.sim.backend import SimBackend

    if isinstance(backend, SimBackend):
        return backend.prepare(case).footprint_bytes
    from um_lab.sizing import estimate_memory

    return estimate_memory(case).total_bytes
