"""Policy comparisons: run every model x policy x oversubscription ratio and tabulate them.

``from um_lab.sweep import compare`` (it runs each configuration through :class:`um_lab.runner.Run`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from um_lab.backend import Backend, cuda_available, get_backend, resolve_backend_name
from um_lab.errors import CudaUnavailableError
from um_lab.models import ModelCase
from um_lab.policy import Policy, get_policy
from um_lab.runlog import check_writable, prepare_run_dir, resolve_out_dir, timestamp
from um_lab.summary import summarize, with_speedup
from um_lab.types import RunSpec

BASELINE_POLICY = "um-default"

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
    out_dir: str | os.PathLike[str] | None = None,
    baseline: str = BASELINE_POLICY,
    progress: bool | Any = False,
    keep_going: bool = False,
    backend_instance: Backend | None = None,
    band: bool = False,
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
    start, with ``error``) and goes on.
    ``band=True`` (sim only): each run's step time also at the fast and slow ends of the profile constants'
    ranges (:mod:`um_lab.sim.band`; columns band_fast_ms, band_slow_ms, speedup_band_lo/hi, and
    ranking_flips: the run's place among its cell's policies changes inside the band).
    Columns: model, policy, ratio, backend, steps, median_ms, mean_ms, p90_ms, speedup_vs_<baseline>,
    migrated_bytes, htod_bytes, dtoh_bytes, gpu_page_faults, evictions, remote_bytes, ..., status, run_dir.
    """
    from um_lab.runner import Run  # runner imports sizing and the backends: only when comparing

    model_items = _normalise_models(models, model_kwargs)
    policy_objs = [get_policy(p) for p in policies]
    if baseline not in [p.name for p in policy_objs]:
        policy_objs.insert(0, get_policy(baseline))
    ratio_list = list(ratios) or [None]
    backend_name = backend_instance.name if backend_instance is not None else resolve_backend_name(backend)
    if backend_name == "cuda" and any(r is not None for r in ratio_list):
        raise ValueError("oversubscription ratios are simulated (backend 'sim'); on cuda size the model "
                         "instead (um_lab.sizing.size_for_ratio) and keep it under the safety cap")
    if band and backend_name != "sim":
        raise ValueError("uncertainty bands are the simulator's (profile constants' ranges): use backend='sim'")
    if backend_name == "cuda" and backend_instance is None and not cuda_available():
        raise CudaUnavailableError("no CUDA GPU (or a CPU build of torch) in this process")
    out_dir = check_writable(resolve_out_dir(out_dir))
    sweep_dir = prepare_run_dir(out_dir, f"compare-{timestamp()}-{uuid.uuid4().hex[:6]}")
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
                    try:
                        active = Run(spec, case, policy, sweep_dir, backend=shared_backend)
                    except Exception as e:  # refused before any step (bad size, over the safety cap)
                        if not keep_going:
                            raise
                        rows.append({**row, **summarize(()), "status": "refused",
                                     "error": f"{type(e).__name__}: {e}", "run_dir": None})
                        if bar is not None:
                            bar.update(1)
                        continue
                    try:
                        for _ in active:
                            pass
                    except Exception as e:
                        if not keep_going:
                            raise
                        row["error"] = f"{type(e).__name__}: {e}"
                    if band and active.status == "complete":
                        from um_lab.sim.band import band_ms

                        row["band_fast_ms"], row["band_slow_ms"] = band_ms(
                            spec, active.case, policy, shared_backend.profile,
                            getattr(shared_backend, "prefetch_stream", "compute"))
                    rows.append({**row, **active.summary(), "status": active.status,
                                 "run_dir": str(active.path)})
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None and progress is True:
            bar.close()
    table = with_speedup(pd.DataFrame(rows), baseline)
    if band and "band_fast_ms" in table:
        from um_lab.sim.band import with_band

        table = with_band(table, baseline)
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

