"""The layer-ahead scheduler on the simulator: its plan on a traced step, and its step time.

Three steps, each its own module, composed here: **Order**, the traced step's ops grouped into the scheduler's
positions (:mod:`um_lab.sim.budget_order`: :class:`DerivedOrder`, :func:`derive_order`, :func:`budget_order`);
**Plan**, the same planner as the session (:func:`plan_budget`, in :mod:`um_lab.sim.budget_replay`); **Time**, the
steady step replayed on the host, mover, side-stream and compute clocks (:func:`replay_plan`, also in
:mod:`um_lab.sim.budget_replay`). This module holds what the :class:`~um_lab.sim.backend.SimBackend` and the
planner use: :func:`simulate_budget` (all three, memoised through :mod:`um_lab.sim.budget_memo`),
:func:`budget_footprint`, and the step records (:func:`budget_records`, :func:`steady_records`,
:func:`budget_extra`, :func:`resident_by_type`, :func:`moved_by_type`). It re-exports the names of the other
three modules that code imports from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from um_lab.schedule.ledger import BLOCK
from um_lab.schedule.plan import Plan
from um_lab.sim.budget_memo import memoised
from um_lab.sim.budget_order import DerivedOrder, budget_order, derive_order
from um_lab.sim.budget_replay import (
    STEADY_STEPS,
    BudgetStep,
    StageCopies,
    plan_budget,
    replay_plan,
    restore_start,
)
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.trace import StepTrace
from um_lab.types import DATA_TYPES, DataType, StepRecord

__all__ = ["STEADY_STEPS", "BudgetSimulation", "BudgetStep", "DerivedOrder", "StageCopies",
           "budget_extra", "budget_footprint", "budget_order", "budget_records", "derive_order", "memoised",
           "moved_by_type", "plan_budget", "replay_plan", "resident_by_type", "restore_start", "simulate_budget",
           "steady_records"]


@dataclasses.dataclass
class BudgetSimulation:
    """A traced step under a budget: its order, the scheduler's plan and the steady step."""

    derived: DerivedOrder
    plan: Plan
    step: BudgetStep


def budget_footprint(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int) -> int:
    """Live managed bytes of ``trace``'s step in a session with a GPU budget of ``budget_bytes``: the pools' segments
    as without a budget, but the optimizer stepped in chunks, so its pool holds its state and the temporaries of
    about :attr:`~um_lab.sim.profile.Profile.optimizer_cached_chunks` chunks instead of one whole step's."""
    derived = budget_order(trace, layout, profile, budget_bytes)
    segments = layout.segment_bytes
    optim = int(segments.get(DataType.OPTIM, 0))
    state = trace.bytes_by_type(persistent_only=True).get(DataType.OPTIM.value, 0)
    held = state + profile.optimizer_cached_chunks * derived.optim_scratch_bytes
    return int(sum(segments.values()) - optim + min(optim, -(-int(held) // BLOCK) * BLOCK))


def simulate_budget(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int,
                    lookahead: int = 2, discard: bool = False, remote_optimizer: bool = True) -> BudgetSimulation:
    """Order, plan and steady step of ``trace`` placed by ``layout`` (the steady one) under ``budget_bytes``
    (memoised per trace, profile constants, budget, look-ahead and ``discard``; a pre-flight and the run that
    follows plan once). Raises :class:`BudgetTooSmall`."""
    from um_lab.sim.profile import profile_sha256

    def compute() -> BudgetSimulation:
        derived = budget_order(trace, layout, profile, budget_bytes)
        plan = plan_budget(derived, budget_bytes, lookahead, discard, remote_optimizer)
        return BudgetSimulation(derived, plan, replay_plan(derived, plan, profile))

    key = ("budget", trace.key, profile_sha256(profile), int(budget_bytes), int(lookahead), bool(discard),
           bool(remote_optimizer))
    return memoised(key, compute)


def budget_records(trace: StepTrace, layout: Layout, profile: Profile, steps: int, warmup_steps: int,
                   budget_bytes: int, capacity: int, policy_name: str, backend: str,
                   lookahead: int = 2, workspace_bytes: int = 0) -> Iterator[StepRecord]:
    """The SimBackend's records for a run under the layer-ahead scheduler on ``trace`` placed by ``layout``:
    every step the steady step (the first step, which learns the order on a GPU, is not modelled apart). The plan
    is made under B less ``workspace_bytes`` (:mod:`um_lab.sim.workspaces`), reported with B."""
    simulated = simulate_budget(trace, layout, profile, budget_bytes - workspace_bytes, lookahead)
    derived, plan, step = simulated.derived, simulated.plan, simulated.step
    moved_in, moved_out = moved_by_type(plan, layout)
    extra = {**budget_extra(plan, step, derived, budget_bytes), "workspace_bytes": int(workspace_bytes)}
    return steady_records(trace, layout, plan, step, extra,
                          resident_by_type(plan, layout), moved_in, moved_out, steps=steps,
                          warmup_steps=warmup_steps, capacity=capacity, policy_name=policy_name, backend=backend)


def steady_records(trace: StepTrace, layout: Layout, plan: Plan, step: BudgetStep, extra: dict[str, Any],
                   resident: dict[str, int], moved_in: dict[str, int], moved_out: dict[str, int], *, steps: int,
                   warmup_steps: int, capacity: int, policy_name: str, backend: str) -> Iterator[StepRecord]:
    """One :class:`StepRecord` per step (warm-up steps first), each the simulated steady ``step`` of ``plan``:
    resident and moved bytes per type and ``extra["budget"]`` as given."""
    live = {t.value: int(layout.segment_bytes[t.value]) for t in DATA_TYPES}
    for i in range(warmup_steps + steps):
        yield StepRecord(step=i, wall_ms=step.wall_us / 1e3, live_bytes=live, cap_bytes=None,
                         gpu_capacity_bytes=int(capacity // BLOCK * BLOCK), backend=backend, policy=policy_name,
                         warmup=i < warmup_steps, resident_bytes=dict(resident), htod_bytes=dict(moved_in),
                         dtoh_bytes=dict(moved_out), gpu_page_faults=0,
                         evictions=sum(len(m.blocks) for m in plan.evictions()),
                         remote_bytes=int(step.remote_link_bytes),
                         telemetry="simulated", extra={"budget": dict(extra), "trace_ops": trace.n_ops})


def budget_extra(plan: Plan, step: BudgetStep, derived: DerivedOrder, budget_bytes: int) -> dict[str, Any]:
    """``StepRecord.extra["budget"]`` on the simulator: the plan's totals and where the time went."""
    summary = plan.summary()
    return {**summary, "budget_bytes": budget_bytes, "planned_budget_bytes": plan.budget_bytes,
            "optim_scratch_bytes": derived.optim_scratch_bytes, "followed_plan": True, "planned": True,
            "over_budget": plan.max_resident > plan.budget_bytes, "compute_ms": step.compute_us / 1e3,
            "side_busy_ms": step.side_busy_us / 1e3, "remote_optimizer_ms": step.remote_us / 1e3,
            "host_waits": step.host_waits, "prefetch_calls": step.calls,
            "model": "sim.budget: steady-state plan replayed on host, mover, side-stream and compute clocks"}


def _block_types(layout: Layout) -> np.ndarray:
    return layout.block_type


def resident_by_type(plan: Plan, layout: Layout) -> dict[str, int]:
    """GPU-resident bytes per data type when the steady step starts (its end, too)."""
    types = _block_types(layout)
    out = {t.value: 0 for t in DATA_TYPES}
    for b in plan.start_resident:
        if 0 <= b < len(types):
            out[DATA_TYPES[int(types[b])].value] += BLOCK
    return out


def moved_by_type(plan: Plan, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes prefetched to the GPU and evicted to the host per data type in the steady step."""
    types = _block_types(layout)
    moved_in = {t.value: 0 for t in DATA_TYPES}
    moved_out = {t.value: 0 for t in DATA_TYPES}
    for moves in plan.moves:
        for m in moves:
            target = moved_in if m.kind == "prefetch" else moved_out if m.kind == "evict" else None  # link bytes
            if target is None or not m.blocks:
                continue
            per_block = m.nbytes / len(m.blocks)
            for b in m.blocks:
                target[DATA_TYPES[int(types[b])].value] += int(per_block)
    return moved_in, moved_out
