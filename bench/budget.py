"""Benchmark (GPU): training under a GPU budget with the layer-ahead scheduler (Session(budget=B)).

    python bench/budget.py                       # gpt2-large (bs 4 x 1024) and resnet50, footprint/B = 1.5, 2, 3
    python bench/budget.py --models gpt2-large --ratios 2 --steps 8 --telemetry
    python bench/budget.py --quick               # ~60 s smoke run: a small MLP and a small CNN at ratio 2
    python bench/budget.py --models gpt2-large --ratios 1.5 --time-moves   # where the side stream's time goes
    python bench/budget.py --models gpt2-large --ratios 2 --issue thread inline   # who issues the prefetches
    python bench/budget.py --models gpt2-large --ratios 2 --batch-calls off on --time-moves   # one call per range?

For each model: one run with no budget (``fit_step_ms``; ``footprint_bytes`` = the peak of live managed
bytes), then one run per ratio with B = footprint / ratio. A row per ratio (the budget table's schema):
``step_ms`` (median of the steps after the first two: the first learns the order, the second may
re-plan), ``crossing_bytes`` (the ledger's prefetched + evicted bytes per step, median), ``bound_ms`` =
max(fit_step_ms, crossing_bytes / 47 GB/s), ``over_bound`` = step_ms / bound_ms (also against the
measured primitives: ``primitive_bound_ms``, ``over_primitive_bound``), ``max_resident_ledger``
(the ledger's highest resident bytes over the measured steps), ``max_resident_cupti`` (with
``--telemetry``: the highest CUPTI-measured resident bytes at a step's end, once the step's moves have
completed, a lower bound: HtoD records can be lost in bursts; else null; per step in ``cupti_resident_all``
with ``gpu_page_faults_all``). With ``--telemetry`` the session synchronises the side stream after each step
(``finish_moves_ms``), outside the step's time: such rows' ``step_ms`` is not comparable with rows without it.
``sim_step_ms``: the simulator's step (um_lab.sim.budget) at the row's
own budget, filled after the measurement (``--no-sim`` leaves it null). ``fsdp2_step_ms``,
``fsdp2_peak_bytes``: the peer, PyTorch FSDP2 with CPUOffloadPolicy on the same model and batch
(``--fsdp2``: bench/peers.py in a process of its own; else null). ``--peers``: every peer of
bench/peers.py beside the rows (``peers``; ``best_peer_ms``: the fastest whose peak reserved memory fits B).

    python bench/budget.py --predict             # no GPU: the simulator's rows (bench/results/budget_predicted.json)
    python bench/budget.py --predict --peers     # no GPU: the simulator's everything-fits and checkpointing peers

Safety: nothing here oversubscribes the card. ``limit`` = ``--max-managed-fraction`` (default 0.5) x the
free GPU memory when the bench starts. Before each session ``torch.cuda.mem_get_info()`` is read again and
the session's cap on live managed bytes is ``min(limit, um_lab.cuda.allocator.default_cap(free, total))``
(free memory now minus the reserve), so the shim refuses any segment past it before CUDA is called. The
bench's own counter, a session listener run after every step, reads the absolute live managed total (every
live segment of the process, not only this session's) and aborts the model (``ManagedLimitExceeded``) once
it passes 0.8 x that cap, before the shim's refusal can be reached. After each session the managed bytes
``Session.close()`` reports still held must be 0, else the model is aborted too (``ManagedBytesLeft``).
A budget only moves data between the GPU and the host; it never raises the managed total.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from um_lab import experimental  # noqa: E402
from um_lab.cuda.allocator import default_cap  # noqa: E402
from um_lab.cuda.session import Session  # noqa: E402
from um_lab.cuda.telemetry import Telemetry  # noqa: E402
from um_lab.models import ModelCase, custom, get_model  # noqa: E402
from um_lab.schedule.config import Budget  # noqa: E402
from um_lab.types import DataType  # noqa: E402

LINK_BYTES_PER_S = 47e9  #: managed prefetch host->GPU measured on the H200 (DESIGN.md)
GiB = 1 << 30

MODELS: dict[str, dict[str, Any]] = {
    "gpt2-large": {"batch_size": 4, "seq_len": 1024},
    "gpt2-xl": {"batch_size": 2, "seq_len": 1024},
    "resnet50": {"batch_size": 64},
}
QUICK_MODELS = ("mlp-small", "cnn-small")


SAFETY_FRACTION = 0.8  #: the bench's own counter aborts once live managed bytes pass this fraction of the cap


class ManagedLimitExceeded(RuntimeError):
    """The bench's own counter saw more live managed bytes than 0.8 x the session's cap: the model is aborted."""


class ManagedBytesLeft(RuntimeError):
    """A session closed with managed bytes still held (``Session.close()`` returned more than 0)."""


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current GPU now (the CPU test replaces it)."""
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def session_cap(limit: int) -> int:
    """The cap for the next session: ``min(limit, default_cap(free, total))`` with memory read now."""
    free, total = device_memory()
    return min(limit, default_cap(free, total))


def small_cnn(batch_size: int = 32, channels: int = 128, image: int = 64) -> ModelCase:
    """A plain CNN (conv/bn/relu blocks) that needs no torchvision: the quick run's CNN."""
    def build() -> torch.nn.Module:
        c = channels
        blocks: list[torch.nn.Module] = [torch.nn.Conv2d(3, c, 3, padding=1)]
        for _ in range(6):
            blocks += [torch.nn.BatchNorm2d(c), torch.nn.ReLU(), torch.nn.Conv2d(c, c, 3, padding=1)]
        blocks += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(c, 10)]
        return torch.nn.Sequential(*blocks)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(batch_size, 3, image, image, generator=g), torch.randint(0, 10, (batch_size,), generator=g)

    return custom("cnn-small", build, batch,
                  lambda model, x, y: torch.nn.functional.cross_entropy(model(x), y))


def build_case(name: str) -> ModelCase:
    """A zoo model at the bench's size, or one of the quick run's small models."""
    if name == "mlp-small":
        return get_model("mlp", width=2048, depth=8, batch_size=512)
    if name == "cnn-small":
        return small_cnn()
    return get_model(name, **MODELS.get(name, {}))


#: extra Session arguments (the CPU test of this script passes a fake driver here)
SESSION_KWARGS: dict[str, Any] = {}
#: ``--advice``: ``host`` (the session's default, ``budget_host_advice=True``): the pools prefer the host and are
#: mapped for the GPU, so only the scheduler's prefetches make data resident; ``none``: no advice (the
#: earlier default), what the scheduler did not foresee faults in behind the ledger
ADVICE_CHOICES = ("host", "none")


def host_advice(advice: str) -> bool:
    """``Session(budget_host_advice=...)`` for an ``--advice`` choice."""
    if advice not in ADVICE_CHOICES:
        raise ValueError(f"advice must be one of {ADVICE_CHOICES}, got {advice!r}")
    return advice == "host"


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """One budget row's session options (each a ``--flag on off`` of the script): how moves are issued (``issue``),
    discarding dead gradients (``discard``), batched calls (``batch_calls``), the pools' advice (``advice``),
    staged activations (``stage``), the intermediate pool in device memory (``device_act``; None: the session's
    default), optimizer state left remote (``remote``), partial staging (``partial``), remote state copied for
    its chunk's step (``copies``) and growth announced for partial staging's kept tail given back when it does
    not come (``settle``); the experimental ones through :func:`um_lab.experimental.options`."""

    issue: str = "thread"
    discard: bool = False
    batch_calls: bool = False
    advice: str = "host"
    stage: bool = False
    device_act: bool | None = None
    remote: bool = True
    partial: bool = False
    copies: bool = False
    settle: bool = False

    def row_fields(self) -> dict[str, Any]:
        """The row's columns for these options (as the results files name them)."""
        return {"issue": self.issue, "discard": self.discard, "batch_calls": self.batch_calls, "advice": self.advice,
                "stage_activations": self.stage,
                "device_activations": self.stage if self.device_act is None else self.device_act,
                "remote_optimizer": self.remote, "partial_staging": self.partial, "remote_copies": self.copies,
                "settle_tail_growth": self.settle}


def on_word(flag: bool) -> str:
    """``on`` or ``off``."""
    return "on" if flag else "off"


def option_grid(issues: tuple[str, ...] = ("thread",), discards: tuple[bool, ...] = (False,),
                batches: tuple[bool, ...] = (False,),
                advices: tuple[str, ...] = ("host",), stages: tuple[bool, ...] = (False,),
                device_acts: tuple[bool | None, ...] = (None,),
                remotes: tuple[bool, ...] = (True,), partials: tuple[bool, ...] = (False,),
                copies_opts: tuple[bool, ...] = (False,), settles: tuple[bool, ...] = (False,)) -> list[RowOptions]:
    """Every combination of the choices, in the script's order; the staging choices (device pool, partial staging)
    only with staging on, the copies only with staging and remote state on, settling only with partial staging."""
    return [RowOptions(i, d, b, a, st, da, ro, pa, co, se)
            for i in issues for d in discards for b in batches for a in advices for st in stages
            for da in (device_acts if st else (None,)) for ro in remotes
            for pa in (partials if st else (False,)) for co in (copies_opts if st and ro else (False,))
            for se in (settles if st and pa else (False,))]


def run_session(case: ModelCase, steps: int, limit: int, *, budget: int | None = None,
                telemetry: bool = False, time_moves: bool = False,
                options: RowOptions = RowOptions()) -> dict[str, Any]:
    """Train ``steps`` steps in one session (``options``: the budget's, unused without ``budget``); returns the
    records, the session's cap and the peak of live managed bytes above the session's start (segments, read after
    every step: the caching allocator keeps a step's segments, so this is the step's peak). The safety rules are in
    the module docstring."""
    cap = session_cap(limit)
    abort_at = int(SAFETY_FRACTION * cap)
    torch.manual_seed(0)
    model = case.build_model()
    records = []
    peak = 0
    # flushed at each step's end, after the session waited for the step's moves: the residency of that point
    o = options
    with experimental.options(host_advice=host_advice(o.advice), budget_issue=o.issue, discard_gradients=o.discard,
                              batch_calls=o.batch_calls,
                              device_activations=o.device_act if o.stage else None, remote_optimizer=o.remote,
                              partial_staging=o.partial and o.stage, copy_remote_state=o.copies,
                              settle_tail_growth=o.settle):
        lab = Session("um-default", cap_bytes=cap, telemetry=Telemetry(flush="step") if telemetry else False,
                      evacuate_on_close=False,
                      budget=None if budget is None else Budget(budget, stage_activations=o.stage), **SESSION_KWARGS)
    lab.open()
    try:
        if time_moves and lab.budget is not None:  # a diagnostic the session does not expose
            lab.budget.executor.time_moves()
        batch_used = lab.budget is not None and lab.budget.executor.batch_calls  # off where CUDA lacks it
        base = lab.stats()["live_total"]

        def guard(record: Any) -> None:  # the bench's own counter, beside the shim's cap: after every step
            live = int(lab.stats()["live_total"])
            if live > abort_at:
                raise ManagedLimitExceeded(f"{case.name}: live managed bytes reached {live} B after step "
                                           f"{record.step}, above {SAFETY_FRACTION} x the cap {cap} B")

        lab.add_listener(guard)
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        for step in range(steps):
            batch = lab.inputs(*case.batch(step))
            batch = batch if isinstance(batch, tuple) else (batch,)
            records.append(lab.step(lambda batch=batch, model=model: case.loss_fn(model, *batch), opt))
            peak = max(peak, lab.stats()["live_total"] - base)
            if budget is not None:
                records[-1].extra["live_by_type"] = lab.live_bytes()
            if budget is not None and lab._pools is not None and torch.cuda.is_available():  # a diagnostic
                records[-1].extra["act_pool"] = pool_usage(lab._pools.pool_id(DataType.ACT))
        del opt, model, batch  # nothing of the run outlives the session: close frees every segment
    finally:
        left = lab.close()
    if left != 0:
        raise ManagedBytesLeft(f"{case.name}: {left} managed bytes still held after the session closed")
    return {"records": records, "peak_bytes": peak, "cap_bytes": cap,
            "batch_calls": batch_used}


def pool_usage(pool_id: tuple[int, int]) -> dict[str, int]:
    """One torch pool's caching-allocator state now: bytes reserved and allocated, its segments, and its largest
    free block (a diagnostic of why a fixed pool grows: fragmentation, or more live tensors)."""
    segments = torch.cuda.memory.memory_snapshot(mempool_id=pool_id, include_traces=False)
    free_blocks = [b["size"] for seg in segments for b in seg.get("blocks", []) if b.get("state") == "inactive"]
    return {"reserved": sum(seg["total_size"] for seg in segments),
            "allocated": sum(seg["allocated_size"] for seg in segments), "segments": len(segments),
            "largest_free": max(free_blocks, default=0)}


def fill_sim(rows: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    """``sim_step_ms`` of each measured row: the simulator at the row's own budget (the measured footprint /
    ratio), and the simulator's numbers beside it (``sim`` sub-dict); a failure is recorded as ``sim_error``."""
    for row in rows:
        if row.get("budget_bytes") is None or "plan" in row:  # a planned row carries the planner's prediction
            continue
        rates = row.get("move_timing") or {}
        measured_GBps = (rates.get("to_gpu", {}).get("GBps"), rates.get("to_host", {}).get("GBps"))
        try:
            sim = simulate_row(row["model"], row["ratio"], row["budget_bytes"], row.get("discard", False),
                               measured_GBps=measured_GBps, stage=bool(row.get("stage_activations")),
                               remote=row.get("remote_optimizer", True) is not False,
                               partial=bool(row.get("partial_staging")), copies=bool(row.get("remote_copies")))
        except Exception as e:  # e.g. a budget the simulated order cannot fit: recorded, the row stays
            row["sim_error"] = f"{type(e).__name__}: {e}"
            continue
        row["sim_step_ms"] = sim["sim_step_ms"]
        row["sim"] = sim
        at_rates = (f"; {sim['sim_step_ms_measured_rates']:.1f} ms at the measured move rates"
                    if "sim_step_ms_measured_rates" in sim else "")
        say(f"  ratio {row['ratio']}: simulated {sim['sim_step_ms']:.1f} ms at B {row['budget_bytes'] / GiB:.2f} GiB"
            + at_rates)


def move_rates(budgets: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind of move (``to_gpu``, ``to_host``, ``discard``, ``populate``), the median over steps of the
    side stream's bytes, milliseconds and calls, the host time of the calls (``move_timing`` of each step),
    and the rate they imply."""
    out: dict[str, dict[str, float]] = {}
    kinds = sorted({k for b in budgets for k in b.get("move_timing", {})})
    for kind in kinds:
        steps = [b["move_timing"].get(kind, {"bytes": 0, "ms": 0.0, "host_ms": 0.0, "calls": 0}) for b in budgets
                 if "move_timing" in b]
        gb = statistics.median(t["bytes"] for t in steps) / 1e9
        ms = statistics.median(t["ms"] for t in steps)
        host_ms = statistics.median(t["host_ms"] for t in steps)
        out[kind] = {"GB": round(gb, 4), "ms": round(ms, 1), "host_ms": round(host_ms, 1),
                     "calls": int(statistics.median(t["calls"] for t in steps)),
                     "GBps": round(gb / (ms / 1e3), 2) if ms > 0 else float("nan")}
    return out


def measured(records: list[Any], skip: int) -> list[Any]:
    """The records after the first ``skip`` (at least the last one)."""
    return records[skip:] or records[-1:]


#: a budget row's step time is the median of the steps from the second after its last re-plan (the first on a
#: new plan makes its one-time moves: optimizer state left remote goes to the host then) and after the first idle
#: step (which brings the pools to the GPU once), at least of the last 3
SETTLE_STEPS, LEAST_MEASURED = 2, 3


def settled_from(records: list[Any], skip: int = 2) -> int:
    """Index of the first record a budget row measures: past ``skip``, :data:`SETTLE_STEPS` past the last
    step that ended in a re-plan and past the first step of the scheduler's last idle stretch, with at least
    :data:`LEAST_MEASURED` records left where there are that many."""
    budgets = [r.extra.get("budget") or {} for r in records]
    replans = [i for i, b in enumerate(budgets) if b.get("replanned")]
    idled = [i for i, b in enumerate(budgets) if b.get("idle") and not (i and budgets[i - 1].get("idle"))]
    start = max(skip, replans[-1] + SETTLE_STEPS if replans else 0, idled[-1] + 1 if idled else 0)
    return max(0, min(start, len(records) - LEAST_MEASURED))


def cupti_max(records: list[Any]) -> int | None:
    """The highest CUPTI-measured resident total over ``records`` (None: not measured)."""
    totals = [sum(r.resident_bytes.values()) for r in records if r.resident_bytes]
    return max(totals) if totals else None


def bench_model(name: str, ratios: list[float], steps: int, limit: int, telemetry: bool,
                say: Callable[[str], None], issues: tuple[str, ...] = ("thread",),
                discards: tuple[bool, ...] = (True,), time_moves: bool = False,
                batches: tuple[bool, ...] = (False,),
                advices: tuple[str, ...] = ("host",), stages: tuple[bool, ...] = (False,),
                device_acts: tuple[bool | None, ...] = (None,),
                remotes: tuple[bool, ...] = (True,), partials: tuple[bool, ...] = (False,),
                copies_opts: tuple[bool, ...] = (False,), settles: tuple[bool, ...] = (False,), repeat: int = 0,
                row_done: Callable[[list[dict[str, Any]]], None] | None = None, precision: str = "fp32",
                planned: bool = False, machine_sim: Any = None) -> list[dict[str, Any]]:
    """The no-budget run and one budget run per ratio for one model in ``precision``: its rows. ``planned``: each
    row trains as the memory planner chooses at its B (um_lab.sim.planner: the layers recomputed, activations
    staged or not; the row's ``plan``, and its predicted step as ``sim_step_ms``); with ``machine_sim`` (a
    simulator on a profile fitted to this machine) that plan priced again on it before the row runs
    (``machine_calibrated_ms``). ``row_done(rows)`` hears the rows so far after each one (the script writes them
    then, so a run stopped by a time limit keeps them)."""
    from um_lab.training import with_training

    case = with_training(build_case(name), precision)
    fit = run_session(case, steps, limit, telemetry=telemetry)
    fit_ms = statistics.median(r.wall_ms for r in measured(fit["records"], 2))
    footprint = int(fit["peak_bytes"])
    say(f"{name}: footprint {footprint / GiB:.2f} GiB, fit step {fit_ms:.1f} ms")
    rows = []
    grid = option_grid(issues, discards, batches, advices, stages, device_acts, remotes, partials,
                       copies_opts, settles)
    for ratio, options in ((r, o) for r in ratios for o in grid):
        budget = int(footprint / ratio)
        row_case, plan = case, None
        if planned:
            from um_lab.sim.planner import plan_memory

            plan = plan_memory(build_case(name), budget, precision=precision, backend=sim_backend())
            say(f"  planner: {plan.describe()}")
            row_case = with_training(build_case(name), precision, plan.recompute)
            options = dataclasses.replace(options, stage=plan.stage_activations)
        row: dict[str, Any] = {"model": name, "precision": precision, "footprint_bytes": footprint,
                               "budget_bytes": budget, "ratio": ratio,
                               **options.row_fields(), "repeat": repeat, "fit_step_ms": fit_ms,
                               "fsdp2_step_ms": None, "fsdp2_peak_bytes": None,
                               "sim_step_ms": plan.step_ms if plan is not None else None}
        if plan is not None:
            row["plan"] = {"recompute": plan.recompute, "stage_activations": plan.stage_activations,
                           "layers": plan.layers, "predicted_step_ms": plan.step_ms,
                           "predicted_footprint_bytes": plan.footprint_bytes}
            if machine_sim is not None:
                from um_lab.sim.planner import price_plan

                row["machine_calibrated_ms"] = price_plan(build_case(name), plan, machine_sim)
                say(f"  on this machine's fitted profile: {row['machine_calibrated_ms'] or float('nan'):.1f} ms")
        t0 = time.perf_counter()
        try:
            out = run_session(row_case, steps, limit, budget=budget, telemetry=telemetry, time_moves=time_moves,
                              options=options)
        except (ManagedLimitExceeded, ManagedBytesLeft):
            raise  # a safety abort stops the model, not only this row
        except Exception as e:  # a budget too small for one layer, or a refusal: recorded, not hidden
            row.update({"step_ms": None, "error": f"{type(e).__name__}: {e}"})
            rows.append(row)
            if row_done is not None:
                row_done(rows)
            say(f"  ratio {ratio}: {row['error']}")
            continue
        first = settled_from(out["records"])
        recs = out["records"][first:]
        budgets = [r.extra["budget"] for r in recs]
        step_ms = statistics.median(r.wall_ms for r in recs)
        stagings = [b.get("staging") or {} for b in budgets]
        # optimizer state left in host memory crosses at least twice (read, written back), as a moved block does
        crossing = int(statistics.median(
            b["prefetched_bytes"] + b["evicted_bytes"] + st.get("staged_bytes", 0) + st.get("restored_bytes", 0)
            + 2 * b.get("remote_bytes", 0) for b, st in zip(budgets, stagings, strict=True)))
        bound_ms = max(fit_ms, crossing / LINK_BYTES_PER_S * 1e3)
        prefetched = int(statistics.median(b["prefetched_bytes"] for b in budgets))
        evicted = int(statistics.median(b["evicted_bytes"] for b in budgets))
        staged = int(statistics.median(st.get("staged_bytes", 0) for st in stagings))
        restored = int(statistics.median(st.get("restored_bytes", 0) for st in stagings))
        remote_bytes = int(statistics.median(b.get("remote_bytes", 0) for b in budgets))
        primitive_bound = primitive_bound_ms(fit_ms, prefetched, evicted, staged, restored, remote_bytes)
        row.update({
            "step_ms": step_ms, "crossing_bytes": crossing, "bound_ms": bound_ms, "over_bound": step_ms / bound_ms,
            "primitive_bound_ms": primitive_bound, "over_primitive_bound": step_ms / primitive_bound,
            "max_resident_ledger": max(b["max_resident_ledger"] for b in budgets),
            "max_resident_cupti": cupti_max(recs),
            "prefetched_bytes": prefetched, "evicted_bytes": evicted,
            "staged_bytes": staged, "restored_bytes": restored, "staging_all": stagings, "remote_bytes": remote_bytes,
            "remote_copied_bytes": int(statistics.median((b.get("remote_copies") or {}).get("bytes_in", 0)
                                                         for b in budgets)),
            "remote_copied_bytes_all": [(r.extra["budget"].get("remote_copies") or {}).get("bytes_in", 0)
                                        for r in out["records"]],
            "discarded_bytes": int(statistics.median(b.get("discarded_bytes", 0) for b in budgets)),
            "populated_bytes": int(statistics.median(b.get("populated_bytes", 0) for b in budgets)),
            "touched_bytes": max(b["touched_bytes"] for b in budgets),
            "fixed_bytes_all": [r.extra["budget"].get("fixed_bytes", 0) for r in out["records"]],
            "act_pool_all": [r.extra.get("act_pool") for r in out["records"]],
            "followed_plan": all(b["followed_plan"] for b in budgets),
            "idle_steps": sum(bool(b.get("idle")) for b in budgets),  # everything fit B: no scheduler at work
            "held_bytes_all": [r.extra["budget"].get("held_bytes") for r in out["records"]],
            "realign_bytes_all": [r.extra["budget"].get("realign_bytes", 0) for r in out["records"]],
            "host_touched_bytes_all": [r.extra["budget"].get("host_touched_bytes", 0) for r in out["records"]],
            "live_bytes_by_type": out["records"][-1].extra.get("live_by_type"),
            "host_waits": max(b.get("host_waits", 0) for b in budgets),
            "host_wait_ms": statistics.median(b.get("host_wait_ms", 0.0) for b in budgets),
            "executor_ms": statistics.median(b.get("executor_ms", 0.0) for b in budgets),
            "hooks_ms": statistics.median(b.get("hooks_ms", 0.0) for b in budgets),
            "over_budget_steps": sum(bool(b["over_budget"]) for b in budgets),
            "step_ms_all": [r.wall_ms for r in out["records"]], "measured_from_step": first,
            "session_cap_bytes": out["cap_bytes"],
            "replan_ms_all": [r.extra["budget"].get("replan_ms", 0.0) for r in out["records"]],
            "unforeseen_bytes_all": [r.extra["budget"].get("unforeseen_bytes", 0) for r in out["records"]],
            "replan_reasons_all": [r.extra["budget"].get("replan_reason", "") for r in out["records"]],
            "cupti_resident_all": [sum(r.resident_bytes.values()) if r.resident_bytes else None
                                   for r in out["records"]],
            "gpu_page_faults_all": [r.gpu_page_faults for r in out["records"]],
            "batch_calls": out["batch_calls"],
            "run_s": time.perf_counter() - t0,
        })
        if time_moves:
            row["move_timing"] = move_rates(budgets)
            say("    side stream per step: " + ", ".join(
                f"{k} {v['GB']:.1f} GB in {v['ms']:.0f} ms ({v['GBps']:.1f} GB/s, {v['calls']} calls, "
                f"host {v['host_ms']:.0f} ms)"
                for k, v in row["move_timing"].items()))
        if options.stage:
            row["tail_kept_bytes"] = int(statistics.median(st.get("tail_kept_bytes", 0) for st in stagings))
            say(f"    staging: {staged / GiB:.2f} GiB to the host, {restored / GiB:.2f} GiB back per step; late "
                f"restores {max(st.get('late_restores', 0) for st in stagings)}, host waits for copies "
                f"{statistics.median(st.get('throttle_ms', 0.0) for st in stagings):.0f} ms, pinned "
                f"{max(st.get('pinned_bytes', 0) for st in stagings) / GiB:.2f} GiB")
        rows.append(row)
        if row_done is not None:
            row_done(rows)
        o = options
        say(f"  ratio {ratio} ({o.issue}, discard {on_word(o.discard)}, batch calls {on_word(o.batch_calls)}, "
            f"advice {o.advice}, staging {on_word(o.stage)}, "
            f"device activations {'on' if row['device_activations'] else 'off'}, "
            f"remote optimizer {on_word(o.remote)} ({remote_bytes / GiB:.2f} GiB), "
            f"partial staging {on_word(o.partial)} ({row.get('tail_kept_bytes', 0) / GiB:.2f} GiB kept), "
            f"remote copies {on_word(o.copies)} ({row['remote_copied_bytes'] / GiB:.2f} GiB), "
            f"settle tail growth {on_word(o.settle)}): "
            f"B {budget / GiB:.2f} GiB, "
            f"step {step_ms:.1f} ms, bound {bound_ms:.1f} ms "
            f"(x{row['over_bound']:.2f}), crossing {crossing / GiB:.2f} GiB/step, ledger max "
            f"{row['max_resident_ledger'] / GiB:.2f} GiB, idle steps {row['idle_steps']} (fixed pool by step: "
            + ", ".join(f"{f / GiB:.2f}" for f in row["fixed_bytes_all"]) + f" GiB), followed plan "
            f"{row['followed_plan']}; training thread: "
            f"{row['hooks_ms']:.0f} ms in the scheduler's hooks, {row['executor_ms']:.0f} ms of it in its executor, "
            f"{row['host_wait_ms']:.0f} ms of that waiting for the mover")
    return rows


FIRST_EVICT_GBPS = 3.65  #: GPU->host prefetch of pages never host-resident before (DESIGN.md): the slow end
#: the GPU->host rate at which the simulator reproduces both quick rows measured on the H200 (mlp-small 65.4 ms:
#: 6.79 GB/s, cnn-small 105.7 ms: 6.83 GB/s, at their measured budgets): fitted on those two rows, a second variant
QUICK_IMPLIED_EVICT_GBPS = 6.8


def simulate_row(name: str, ratio: float, budget_bytes: int | None = None, discard: bool = False,
                 measured_GBps: tuple[float | None, float | None] = (None, None), *, stage: bool = False,
                 remote: bool = True, partial: bool = False, copies: bool = False) -> dict[str, Any]:
    """The simulator's prediction for one row (um_lab.sim.budget; CPU only): B = ``budget_bytes``, else the
    simulated footprint / ``ratio``. ``sim_step_ms`` uses the profile's rates (GPU->host 18 GB/s, a page's
    later cycles); ``sim_step_ms_first_evictions`` prices every eviction at the first-time rate (3.65 GB/s),
    ``sim_step_ms_quick_implied_rate`` at the rate fitted on the two quick rows measured on the H200 (6.8 GB/s).
    ``measured_GBps`` (host->GPU, GPU->host: the side stream's rates a ``--time-moves`` run measured) adds
    ``sim_step_ms_measured_rates``, the plan replayed at those rates: a check of the model's structure (what
    waits for what), not a prediction, since the rates come from the run it is compared with. ``stage``,
    ``remote``, ``partial`` and ``copies``: the row's staging, remote optimizer state, partial staging and copies
    (:func:`um_lab.sim.staged.simulate_staged`; staged copies count twice in the crossing, as in a measured row)."""
    from um_lab.sim.budget import replay_plan, simulate_budget
    from um_lab.sim.staged import simulate_staged
    from um_lab.types import RunSpec

    sim = sim_backend()
    case = build_case(name)
    prepared = sim.prepare(case)
    budget = int(budget_bytes if budget_bytes is not None else prepared.footprint_bytes / ratio)
    fit = [r.wall_ms for r in sim.run(RunSpec(model="mlp", steps=2, warmup_steps=0), case, "um-default")][-1]
    stage_copies = None
    copied = False  # remote state copied for its steps (the simulator took the slots)
    staged_extra: dict[str, Any] = {}
    if stage:
        staged = simulate_staged(prepared.trace, prepared.placement.final, sim.profile, budget,
                                 remote_optimizer=remote, partial=partial, remote_copies=copies)
        derived, plan, step, stage_copies = staged.derived, staged.plan, staged.step, staged.copies
        copied = copies and plan.remote_bytes > 0 and step.remote_us == 0
        staged_extra = {"sim_staged_bytes": stage_copies.staged_bytes, "sim_fixed_bytes": staged.fixed_bytes,
                        "sim_remote_link_bytes": step.remote_link_bytes, "sim_remote_copied": copied}
        crossing = plan.prefetched_bytes + plan.evicted_bytes + 2 * stage_copies.staged_bytes + 2 * plan.remote_bytes
    else:
        result = simulate_budget(prepared.trace, prepared.placement.final, sim.profile, budget, discard=discard,
                                 remote_optimizer=remote)
        derived, plan, step = result.derived, result.plan, result.step
        crossing = plan.prefetched_bytes + plan.evicted_bytes
    slow = replay_plan(derived, plan, sim.profile, evict_GBps=FIRST_EVICT_GBPS, staging=stage_copies,
                       remote_copies=copied)
    quick_rate = replay_plan(derived, plan, sim.profile, evict_GBps=QUICK_IMPLIED_EVICT_GBPS, staging=stage_copies,
                             remote_copies=copied)
    sim_bound = max(fit, crossing / LINK_BYTES_PER_S * 1e3)
    at_measured = {}
    if all(r is not None and math.isfinite(r) and r > 0 for r in measured_GBps):
        replayed = replay_plan(derived, plan, sim.profile, prefetch_GBps=measured_GBps[0],
                               evict_GBps=measured_GBps[1], staging=stage_copies, remote_copies=copied)
        at_measured = {"sim_step_ms_measured_rates": replayed.wall_us / 1e3,
                       "sim_measured_rates_GBps": list(measured_GBps)}
    return {"model": name, "ratio": ratio, "sim_footprint_bytes": prepared.footprint_bytes, "sim_budget_bytes": budget,
            "sim_step_ms": step.wall_us / 1e3, "sim_step_ms_first_evictions": slow.wall_us / 1e3,
            "sim_step_ms_quick_implied_rate": quick_rate.wall_us / 1e3,
            "sim_fit_step_ms": fit, "sim_crossing_bytes": crossing, "sim_bound_ms": sim_bound,
            "sim_over_bound": step.wall_us / 1e3 / sim_bound, "sim_compute_ms": step.compute_us / 1e3,
            "sim_side_busy_ms": step.side_busy_us / 1e3, "sim_positions": len(plan.keys),
            "sim_prefetch_calls": step.calls, "sim_plan_steady": plan.steady, "sim_stage": stage,
            "sim_remote_optimizer": remote, "sim_partial_staging": partial, **staged_extra, **at_measured}


_SIM: dict[str, Any] = {}


def sim_backend() -> Any:
    """The script's one simulator (its traces and plans are cached)."""
    from um_lab.sim.backend import SimBackend

    return _SIM.setdefault("sim", SimBackend())


def predict_planned(models: list[str], ratios: list[float], precisions: list[str],
                    say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The memory planner's rows (no GPU): at each model's simulated footprint / ratio in each precision, what
    it recomputes and stages and its predicted step, beside the candidates it weighed."""
    from um_lab.sim.planner import plan_memory

    rows = []
    for name, precision, ratio in ((n, p, r) for n in models for p in precisions for r in ratios):
        t0 = time.perf_counter()
        plan = plan_memory(build_case(name), 1 / ratio, precision=precision, backend=sim_backend())
        rows.append({"model": name, "precision": precision, "ratio": ratio, **plan.to_dict(),
                     "predicted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                     "sim_16bit_rates": bool(sim_backend().profile.matmul_16bit_tflops),
                     "plan_s": time.perf_counter() - t0})
        say(f"{plan.describe()} [{rows[-1]['plan_s']:.0f} s]")
    return rows


def merge_predicted(path: Path, key: str, predictor: Callable[..., Any], keep: Callable[[dict[str, Any]], bool],
                    rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` under ``key`` of the predictions file ``path`` (described by ``predictor``'s docstring),
    beside that key's earlier rows that ``keep`` keeps and the file's other keys."""
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = [r for r in old.get(key, {}).get("rows", []) if keep(r)]
    old[key] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": "simulated: the h200 profile", "what": " ".join((predictor.__doc__ or "").split()),
                "rows": kept + rows}
    path.write_text(json.dumps(old, indent=1) + "\n")


def predict(models: list[str], ratios: list[float], say: Callable[[str], None],
            settings: tuple[tuple[bool, bool, bool], ...] = ((False, True, False),),
            copies: bool = False) -> list[dict[str, Any]]:
    """Predicted rows (no GPU): the simulator at each model's simulated footprint / ratio, once per setting
    (staging, remote optimizer state, partial staging); ``copies``: remote state copied (experimental)."""
    rows = []
    for name, ratio, (stage, remote, partial) in ((n, r, st) for n in models for r in ratios for st in settings):
        t0 = time.perf_counter()
        try:
            row = simulate_row(name, ratio, stage=stage, remote=remote, partial=partial, copies=copies)
            row.update(stage_activations=stage, remote_optimizer=remote, partial_staging=partial,
                       remote_copies=copies and stage and remote)
        except Exception as e:  # a model the simulator cannot build here: recorded, not hidden
            rows.append({"model": name, "ratio": ratio, "error": f"{type(e).__name__}: {e}"})
            say(f"{name} ratio {ratio}: {rows[-1]['error']}")
            continue
        row["sim_s"] = time.perf_counter() - t0
        rows.append(row)
        say(f"{name} ratio {ratio}: footprint {row['sim_footprint_bytes'] / GiB:.2f} GiB, B "
            f"{row['sim_budget_bytes'] / GiB:.2f} GiB: {row['sim_step_ms']:.1f} ms "
            f"({row['sim_step_ms_first_evictions']:.1f} at first-time evictions), "
            f"fit {row['sim_fit_step_ms']:.1f}, bound {row['sim_bound_ms']:.1f} (x{row['sim_over_bound']:.2f})")
    return rows


def predict_peers(models: list[str], ratios: list[float], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The simulator's step and managed footprint of the peers it can run (no GPU): each model in fp32 and bf16,
    with nothing recomputed (the everything-fits step) and with every layer recomputed (activation
    checkpointing), and at each ratio whether the peer fits B = that precision's everything-fits footprint /
    ratio. Without the profile's 16-bit rates a bf16 step is costed at fp32 rates (``sim_16bit_rates`` false):
    an upper bound."""
    from um_lab.training import with_training
    from um_lab.types import RunSpec

    sim = sim_backend()
    has_16bit = bool(sim.profile.matmul_16bit_tflops)
    rows: list[dict[str, Any]] = []
    for name in models:
        fits_footprint: dict[str, int] = {}
        for precision in ("fp32", "bf16"):
            for recompute in ("none", "every-layer"):
                t0 = time.perf_counter()
                case = with_training(build_case(name), precision, recompute)
                footprint = int(sim.prepare(case).footprint_bytes)
                spec = RunSpec(model="mlp", steps=2, warmup_steps=0, precision=precision, recompute=recompute)
                step = [r.wall_ms for r in sim.run(spec, case, "um-default")][-1]
                if recompute == "none":
                    fits_footprint[precision] = footprint
                row = {"model": name, "precision": precision, "recompute": recompute,
                       "peer": "everything fits" if recompute == "none" else "activation checkpointing",
                       "sim_step_ms": step, "sim_footprint_bytes": footprint, "sim_16bit_rates": has_16bit,
                       "fits_at_ratio": {str(r): footprint <= fits_footprint[precision] / r for r in ratios},
                       "sim_s": time.perf_counter() - t0}
                rows.append(row)
                say(f"{name} {precision} recompute={recompute}: {step:.1f} ms, footprint "
                    f"{footprint / GiB:.2f} GiB, fits at {[r for r in ratios if row['fits_at_ratio'][str(r)]]}")
    return rows


def on_off(ap: argparse.ArgumentParser, flag: str, default: str, what: str) -> None:
    """An option taking ``on``, ``off`` or both (a row each)."""
    ap.add_argument(flag, nargs="+", choices=["on", "off"], default=[default], help=f"{what}; both: a row each")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the JSON (merging rows of other models already in it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2-large", "resnet50"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[1.5, 2.0, 3.0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--telemetry", action="store_true", help="CUPTI residency per step (max_resident_cupti)")
    ap.add_argument("--issue", nargs="+", choices=["thread", "inline"], default=["thread"],
                    help="who makes the prefetch calls (a row per choice): a mover thread, or the training thread")
    on_off(ap, "--discard", "off", "discard dead gradients, not copy them (Session(budget_discard=...))")
    on_off(ap, "--batch-calls", "off", "consecutive prefetches to one location as one cudaMemPrefetchBatchAsync "
           "(experimental.options(batch_calls=...))")
    on_off(ap, "--stage", "off", "stage saved activations through pinned host memory "
           "(Budget(..., stage_activations=...))")
    ap.add_argument("--device-act", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                    help="with --stage on: the intermediate-results pool in plain device memory "
                         "(Session(budget_device_activations=...); auto: the session's default, on with staging); "
                         "several: a row each")
    on_off(ap, "--remote-optim", "on", "Session(budget_remote_optimizer=...): optimizer state the plan would move "
           "stays in host memory, updated there (on, the default) or is prefetched in and out (off)")
    on_off(ap, "--remote-copies", "off", "with --stage on and --remote-optim on: remote optimizer state copied to "
           "device slots for its chunk's step and back (BudgetControl.copy_remote_state, experimental) or updated in "
           "place over the link (off, the session's default); --predict takes the first")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each model's rows (with its fit run, and the FSDP2 peer with --fsdp2) this many times "
                         "in turn: repeats interleaved, each row records its 'repeat'")
    on_off(ap, "--settle-tail", "off", "with --partial-stage on: growth announced for the kept tail that does not "
           "come is given back to the plan (BudgetControl.settle_tail_growth, experimental)")
    on_off(ap, "--partial-stage", "off", "Session(budget_partial_staging=...) with --stage on: forward's last saves "
           "kept on the GPU where the plan leaves room")
    ap.add_argument("--advice", nargs="+", choices=ADVICE_CHOICES, default=["host"],
                    help="host (the default, Session(budget_host_advice=True)): unadvised pools prefer the host and "
                         "are mapped for the GPU, so only the scheduler's prefetches make data resident; none: no "
                         "advice, what the scheduler did not foresee faults in")
    ap.add_argument("--time-moves", action="store_true",
                    help="time every move on the side stream (two events a call): rows get move_timing, the bytes, "
                         "ms, calls and rate per direction per step")
    ap.add_argument("--max-managed-fraction", type=float, default=0.5,
                    help="limit on live managed bytes, as a fraction of free GPU memory at start (<= 0.9)")
    ap.add_argument("--quick", action="store_true", help="~60 s smoke run: small MLP and CNN, ratio 2, 4 steps")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget.json")
    ap.add_argument("--peers", action="store_true",
                    help="every peer (bench/peers.py, each in a process of its own) beside each model's rows: their "
                         "steps and peaks in 'peers', the fastest that fits B in best_peer_ms; with --predict: the "
                         "peers' predicted rows (key 'peers')")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                    help="the rows' precision (autocast, fp32 master weights); several: each its own fit run and rows")
    ap.add_argument("--recompute", choices=["none", "auto"], default="none",
                    help="auto: each row trains as the memory planner chooses at its B (what it recomputes, whether "
                         "activations are staged); with --predict: the planner's predicted rows (key 'planned')")
    ap.add_argument("--predict", action="store_true",
                    help="no GPU: the simulator's predictions only (default out: bench/results/budget_predicted.json)")
    ap.add_argument("--no-sim", action="store_true", help="measured rows without sim_step_ms")
    ap.add_argument("--machine-calibrate", action="store_true",
                    help="with --recompute auto: before any row, fit the profile's host, GPU, link and scheduler "
                         "constants to this machine (um_lab.sim.machine_calibration) and price each row's plan on it "
                         "too (machine_calibrated_ms; the fit in the file's machine_calibration)")
    ap.add_argument("--peer-steps", type=int, default=4, help="with --peers: each peer's measured steps")
    ap.add_argument("--fsdp2", action="store_true",
                    help="the peer: FSDP2 with CPUOffloadPolicy on the same model (bench/peers.py, a process "
                         "of its own) fills fsdp2_step_ms and fsdp2_peak_bytes")
    args = ap.parse_args(argv)
    # the options a row names are on by its own choice (each row records them): their warnings only cluttered logs
    warnings.filterwarnings("ignore", message=r"budget_\w+=True is experimental", category=RuntimeWarning)
    if not 0 < args.max_managed_fraction <= 0.9:
        ap.error("--max-managed-fraction must be in (0, 0.9]")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.quick:
        args.models, args.ratios, args.steps = list(QUICK_MODELS), [2.0], 4
        if args.out == ap.get_default("out"):
            args.out = ROOT / "bench" / "results" / "budget_quick.json"
    default_out = args.out == ap.get_default("out")
    predicted_out = ROOT / "bench" / "results" / "budget_predicted.json" if default_out else args.out
    if args.machine_calibrate and (args.recompute != "auto" or args.predict):
        ap.error("--machine-calibrate prices the planner's rows on a GPU: it needs --recompute auto, not --predict")
    if args.predict and args.peers:
        merge_predicted(predicted_out, "peers", predict_peers, lambda r: r["model"] not in args.models,
                        predict_peers(args.models, args.ratios, print))
        return 0
    if args.predict and args.recompute == "auto":
        merge_predicted(predicted_out, "planned", predict_planned,
                        lambda r: r["model"] not in args.models or r["precision"] not in args.precision,
                        predict_planned(args.models, args.ratios, args.precision, print))
        return 0
    if args.predict:
        write_merged(predicted_out, args.models, {"device": "simulated: the h200 profile (um_lab.sim.budget)"},
                     predict(args.models, args.ratios, print, tuple(
                         (st == "on", ro == "on", st == "on" and pa == "on") for st in args.stage
                         for ro in args.remote_optim for pa in (args.partial_stage if st == "on" else ["off"])),
                             copies=args.remote_copies[0] == "on"))
        return 0
    if not torch.cuda.is_available():
        print("bench/budget.py needs a CUDA GPU (the scheduler's CPU tests are tests/test_budget_*.py; "
              "--predict runs the simulator alone)")
        return 2
    free, total = device_memory()
    limit = int(free * args.max_managed_fraction)
    device = torch.cuda.get_device_name()
    print(f"{device}: free {free / GiB:.1f} of {total / GiB:.1f} GiB; live managed bytes limited to "
          f"{limit / GiB:.1f} GiB (each session: min(that, the default cap then); the bench aborts at "
          f"{SAFETY_FRACTION} x the session's cap)")
    rows: list[dict[str, Any]] = []
    header: dict[str, Any] = {"device": device, "steps": args.steps, "managed_limit_bytes": limit}
    machine_sim = None
    if args.machine_calibrate:
        from um_lab.sim.backend import SimBackend
        from um_lab.sim.machine_calibration import fit_machine, measure_machine_probes

        fitted = fit_machine(sim_backend().profile, measure_machine_probes())
        machine_sim = SimBackend(fitted.profile)
        header["machine_calibration"] = {"scales": {k: round(v, 4) for k, v in fitted.scales.items()},
                                         "probes": fitted.probes}
        print(f"machine calibrated: {header['machine_calibration']['scales']}", flush=True)
    for name in args.models:
        try:
            for repeat, precision in ((r, p) for r in range(args.repeats) for p in args.precision):
                model_rows = bench_model(
                    name, args.ratios, args.steps, limit, args.telemetry, print, tuple(args.issue),
                    tuple(d == "on" for d in args.discard), args.time_moves, tuple(b == "on" for b in args.batch_calls),
                    tuple(args.advice),
                    tuple(st == "on" for st in args.stage),
                    tuple(None if d == "auto" else d == "on" for d in args.device_act),
                    remotes=tuple(r == "on" for r in args.remote_optim),
                    partials=tuple(p == "on" for p in args.partial_stage),
                    copies_opts=tuple(c == "on" for c in args.remote_copies),
                    settles=tuple(c == "on" for c in args.settle_tail), repeat=repeat,
                    row_done=lambda so_far, done=rows: write_merged(args.out, args.models, header, done + so_far),
                    precision=precision, planned=args.recompute == "auto", machine_sim=machine_sim)
                if not args.no_sim:
                    fill_sim(model_rows, print)
                rows += model_rows
                write_merged(args.out, args.models, header, rows)  # with the simulator's columns
                if args.fsdp2:
                    fill_fsdp2(model_rows, name, args.steps, print)
                    write_merged(args.out, args.models, header, rows)
                if args.peers:
                    fill_peers(model_rows, name, precision, args.peer_steps, print)
                    write_merged(args.out, args.models, header, rows)
        except (ManagedLimitExceeded, ManagedBytesLeft) as e:
            print(f"ABORTED {name}: {e}")
            rows.append({"model": name, "error": f"aborted: {e}"})
        except ImportError as e:
            print(f"skipped {name}: {e}")
    write_merged(args.out, args.models, header, rows)
    return 0


PEER_TIMEOUT_S = 300  #: a peer's process is stopped after this long (its entry keeps the error)


def run_peer(name: str, peer: str, precision: str, steps: int) -> dict[str, Any]:
    """One peer (bench/peers.py) in a fresh process: its JSON line, or ``{"error": ...}``."""
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--model", name, "--peer", peer,
           "--precision", precision, "--steps", str(steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {PEER_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()
        return {"error": tail[-1][:300] if tail else f"exit status {done.returncode}"}
    return json.loads(lines[-1])


def best_peer(peers: dict[str, dict[str, Any]], budget_bytes: int) -> tuple[str | None, float | None]:
    """The fastest peer whose peak reserved GPU memory is at most ``budget_bytes``: (name, step ms)."""
    fitting = [(p["step_ms"], name) for name, p in peers.items()
               if p.get("step_ms") is not None and p.get("peak_reserved_bytes") is not None
               and p["peak_reserved_bytes"] <= budget_bytes]
    if not fitting:
        return None, None
    ms, name = min(fitting)
    return name, ms


def fill_peers(rows: list[dict], name: str, precision: str, steps: int, say: Any) -> None:
    """Every peer of bench/peers.py on ``name`` in ``precision`` (one process each), into each row's ``peers``
    (step, peak allocated and reserved bytes), with ``best_peer`` / ``best_peer_ms``: the fastest that fits the
    row's B; a failure is recorded in the peer's entry, not raised."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    assert spec is not None and spec.loader is not None
    names = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(names)
    peers = {}
    for peer in names.PEERS:
        out = run_peer(name, peer, precision, steps)
        peers[peer] = {k: out.get(k) for k in ("step_ms", "step_ms_all", "peak_allocated_bytes",
                                               "peak_reserved_bytes", "error", "loss") if k in out}
        say(f"  peer {peer} ({precision}): " + (f"step {out['step_ms']:.1f} ms, peak reserved "
                                                 f"{out['peak_reserved_bytes'] / GiB:.2f} GiB" if "step_ms" in out
                                                 else out["error"]))
    for row in rows:
        if row.get("budget_bytes") is None:
            continue
        row["peers"] = peers
        row["best_peer"], row["best_peer_ms"] = best_peer(peers, row["budget_bytes"])
        if row.get("step_ms") is not None and row["best_peer_ms"] is not None:
            row["over_best_peer"] = row["step_ms"] / row["best_peer_ms"]


def fill_fsdp2(rows: list[dict], name: str, steps: int, say: Any) -> None:
    """The FSDP2 peer alone (bench/peers.py ``fsdp2-offload``, fp32) into each row's ``fsdp2_step_ms`` and
    ``fsdp2_peak_bytes`` (peak allocated); a failure is recorded as ``fsdp2_error``, not raised."""
    out = run_peer(name, "fsdp2-offload", "fp32", steps)
    if "error" in out:
        say(f"  fsdp2 peer: {out['error']}")
        for row in rows:
            row["fsdp2_error"] = out["error"]
        return
    say(f"  fsdp2 (CPUOffloadPolicy): step {out['step_ms']:.1f} ms, GPU peak {out['peak_allocated_bytes']} B")
    for row in rows:
        row.update(fsdp2_step_ms=out["step_ms"], fsdp2_peak_bytes=out["peak_allocated_bytes"])


def primitive_bound_ms(fit_ms: float, prefetched_bytes: int, evicted_bytes: int, staged_bytes: int = 0,
                       restored_bytes: int = 0, remote_bytes: int = 0) -> float:
    """The bound from the primitives measured on the H200 (the h200 profile): max(fit step, bytes in at
    the managed host->GPU prefetch rate + bytes out at the GPU->host rate, the two directions did not
    overlap in the probe; + staged activations at the profile's staging copy rate each way; + optimizer state
    left in host memory read once at the remote read rate and written once at the remote write rate)."""
    from um_lab.sim.profile import load_profile

    profile = load_profile("h200")
    move_s = prefetched_bytes / (profile.prefetch_h2d_GBps * 1e9) + evicted_bytes / (profile.prefetch_d2h_GBps * 1e9)
    move_s += (staged_bytes + restored_bytes) / (profile.stage_copy_GBps * 1e9)
    move_s += remote_bytes / (profile.remote_GBps * 1e9) + remote_bytes / (profile.remote_write_GBps * 1e9)
    return max(fit_ms, move_s * 1e3)


def write_merged(out: Path, models: list[str], header: dict, rows: list[dict]) -> None:
    """Write ``rows`` to ``out``, keeping the rows of other models an earlier run left there."""
    old = json.loads(out.read_text()) if out.exists() else {}
    kept = [r for r in old.get("rows", []) if r.get("model") not in models]
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **header,
              "link_bytes_per_s": LINK_BYTES_PER_S, "rows": kept + rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
