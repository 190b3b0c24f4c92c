"""The layer-ahead scheduler with saved activations staged through pinned host memory, on the simulator
(``Session(budget=Budget(B, stage_activations=True))``, :mod:`um_lab.schedule.live.stage`).

**What is staged.** A storage of the intermediate-results type of at least
:data:`~um_lab.schedule.live.stage.MIN_STAGE_BYTES` that a forward op writes and a backward op reads: what
autograd saves for backward (the trace cannot tell a saved tensor from one merely alive across the phase
boundary, so this is an upper bound on the session's staged bytes). It is copied to the host after the
position that made it (the stager's pack hook) and back ahead of the backward position that first reads
it, a window of bytes at a time, on one copy stream at the profile's ``stage_copy_GBps``.

**The fixed pool.** The intermediate-results pool is never moved by the scheduler: its size is the peak of
live intermediate bytes with each staged storage counted only from its allocation to its last forward use
and from its first backward use to its free, plus two windows: when backward starts, up to a window of copies out
is still in flight (their device blocks held until they end) and a window of copies back is brought ahead
(:data:`WINDOWS_IN_FLIGHT`; with one window the simulated pool was 1.6-2.4 GiB under the measured one on every
GPT-2 row measured on the H200 on 2026-12-03, about one window of 2 GiB). The scheduler's plan
moves the other types on :func:`um_lab.sim.budget.derive_order`'s positions without their intermediate
ranges, under B less that pool and the optimizer's temporaries.

**Time.** :func:`um_lab.sim.budget.replay_plan` with the copy stream (its ``staging`` argument): a position's
copies out start once its ops are done; the host waits for the oldest while more than a window is in
flight; restores start once forward stages no more (its last copy out issued: the session's
``forward_done``) and are issued a window ahead of backward; a position's ops wait for its own. A restore also
waits for the compute issued before it (its device block comes from the compute stream's pool; the H200 showed
copies and kernels alternating in backward). The copy
stream and the scheduler's side stream are modelled apart (they share the host link on a GPU: an
optimistic assumption where both are busy).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator

import numpy as np

from um_lab.errors import BudgetTooSmall
from um_lab.schedule.costs import SLOTS, LinkCosts, worth_copying
from um_lab.schedule.ledger import BLOCK
from um_lab.schedule.order import Order, Position
from um_lab.schedule.plan import Plan, make_plan
from um_lab.schedule.staging import MIN_STAGE_BYTES, TAIL_ROUNDS, WINDOW_BYTES, tail_bytes, window_for_budget
from um_lab.sim.budget import (
    BudgetStep,
    DerivedOrder,
    StageCopies,
    budget_extra,
    budget_order,
    memoised,
    moved_by_type,
    replay_plan,
    resident_by_type,
    steady_records,
)
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.trace import PHASE_BWD, PHASE_FWD, StepTrace
from um_lab.types import DATA_TYPES, DataType, StepRecord

_ACT = DATA_TYPES.index(DataType.ACT)


@dataclasses.dataclass
class StagedSimulation:
    """A traced step under a budget with staged activations: the order the plan saw, the plan, the copies,
    the fixed pool and the steady step."""

    derived: DerivedOrder
    plan: Plan
    copies: StageCopies
    fixed_bytes: int
    step: BudgetStep


def staged_storages(trace: StepTrace, min_bytes: int = MIN_STAGE_BYTES) -> np.ndarray:
    """Indices of the storages staged (see the module docstring)."""
    fwd = np.zeros(len(trace.st_nbytes), bool)
    bwd = np.zeros(len(trace.st_nbytes), bool)
    for phase, seen in ((PHASE_FWD, fwd), (PHASE_BWD, bwd)):
        ops = np.flatnonzero(trace.op_phase == phase)
        for op in ops:
            seen[trace.acc_storage[trace.acc_ptr[op]:trace.acc_ptr[op + 1]]] = True
    alloc_fwd = (trace.st_alloc >= 0) & (trace.st_alloc < trace.n_ops)
    alloc_fwd[alloc_fwd] = trace.op_phase[trace.st_alloc[alloc_fwd]] == PHASE_FWD
    chosen = (trace.st_type == _ACT) & (trace.st_nbytes >= min_bytes) & ~trace.st_persistent & alloc_fwd & fwd & bwd
    return np.flatnonzero(chosen)


Uses = tuple[dict[int, int], dict[int, int]]  #: each staged storage's last forward op and first backward op


def _uses(trace: StepTrace, storages: set[int]) -> Uses:
    """Each storage's last forward op and first backward op."""
    last_fwd: dict[int, int] = {}
    first_bwd: dict[int, int] = {}
    for op in range(trace.n_ops):
        phase = int(trace.op_phase[op])
        for s in trace.acc_storage[trace.acc_ptr[op]:trace.acc_ptr[op + 1]].tolist():
            if s in storages:
                if phase == PHASE_FWD:
                    last_fwd[s] = op
                elif phase == PHASE_BWD:
                    first_bwd.setdefault(s, op)
    return last_fwd, first_bwd


#: windows of staging copies whose device blocks the pool holds at once (module docstring)
WINDOWS_IN_FLIGHT = 2


def fixed_pool_bytes(trace: StepTrace, staged: np.ndarray, window: int = WINDOW_BYTES, *,
                     uses: Uses | None = None) -> int:
    """The intermediate-results pool's peak with ``staged`` storages off the GPU between their last forward and
    first backward use, plus :data:`WINDOWS_IN_FLIGHT` ``window`` s (copies in flight), in whole blocks; never more
    than the peak without staging (a copy in flight only keeps a block that would have stayed anyway)."""
    n = trace.n_ops
    act = (trace.st_type == _ACT) & (trace.st_nbytes > 0)
    delta = np.zeros(n + 2, np.int64)
    full = np.zeros(n + 2, np.int64)
    starts = np.clip(trace.st_alloc, -1, n) + 1
    ends = np.clip(trace.st_free, 0, n + 1) + 1
    staged_set = set(int(s) for s in staged)
    last_fwd, first_bwd = uses if uses is not None else _uses(trace, staged_set)
    for s in np.flatnonzero(act).tolist():
        nbytes = int(trace.st_nbytes[s])
        if s in staged_set and s in last_fwd and s in first_bwd:
            delta[starts[s]] += nbytes
            delta[min(last_fwd[s] + 2, n + 1)] -= nbytes
            delta[first_bwd[s] + 1] += nbytes
        else:
            delta[starts[s]] += nbytes
        delta[min(ends[s], n + 1)] -= nbytes
        full[starts[s]] += nbytes
        full[min(ends[s], n + 1)] -= nbytes
    peak = min(int(np.cumsum(delta).max()) + WINDOWS_IN_FLIGHT * window, int(np.cumsum(full).max()))
    return -(-peak // BLOCK) * BLOCK


def stage_copies(trace: StepTrace, derived: DerivedOrder, staged: np.ndarray, *,
                 uses: Uses | None = None) -> StageCopies:
    """The staging copies per position of ``derived``."""
    n = len(derived.order.positions)
    out = [0] * n
    back = [0] * n
    last_fwd, first_bwd = uses if uses is not None else _uses(trace, set(int(s) for s in staged))
    # the forward and backward positions' first ops, in op order: the position holding an op is found by bisect
    starts = [s for s, p in zip(derived.op_start, derived.order.positions, strict=True) if p.phase != "optimizer"]

    def position_of(op: int) -> int:
        return max(0, bisect.bisect_right(starts, op) - 1)

    for s in staged.tolist():
        if s in last_fwd and s in first_bwd:
            nbytes = int(trace.st_nbytes[s])
            out[position_of(int(trace.st_alloc[s]))] += nbytes
            back[position_of(first_bwd[s])] += nbytes
    return StageCopies(tuple(out), tuple(back))


def without_intermediates(derived: DerivedOrder, layout: Layout) -> DerivedOrder:
    """``derived`` with every intermediate-results range dropped from its positions and segments (the pool the
    scheduler leaves alone)."""
    positions = [Position(p.phase, p.layer, [a for a in p.accesses if a.data_type is not DataType.ACT])
                 for p in derived.order.positions]
    segments = [s for s in derived.order.segments if int(layout.block_type[s[0] // BLOCK]) != _ACT]
    return dataclasses.replace(derived, order=Order(positions, segments))


def kept_tail(trace: StepTrace, staged: np.ndarray, keep_bytes: int) -> np.ndarray:
    """The staged storages partial staging keeps on the GPU: forward's last saves (by allocation) from where the
    saves still to come are ``keep_bytes`` or fewer, as :meth:`um_lab.schedule.live.stage.ActivationStager.pack` counts
    (a save straddling the line is kept)."""
    if keep_bytes <= 0 or not len(staged):
        return staged[:0]
    order = staged[np.argsort(trace.st_alloc[staged], kind="stable")]
    seen = np.cumsum(trace.st_nbytes[order].astype(np.int64))
    return order[seen > seen[-1] - keep_bytes]


def simulate_staged(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int,
                    lookahead: int = 2, remote_optimizer: bool = True, partial: bool = False,
                    remote_copies: bool = False) -> StagedSimulation:
    """Plan and steady step of ``trace`` under ``budget_bytes`` with staged activations (module docstring).
    Raises :class:`BudgetTooSmall` when the fixed pool, the optimizer's temporaries and one position's
    other data do not fit. ``remote_optimizer``: optimizer state the plan would move stays in host memory
    (the experimental ``remote_optimizer`` option, on by default; :mod:`um_lab.sim.remote_optim`). Memoised as
    :func:`~um_lab.sim.budget.simulate_budget` is (a pre-flight and its run simulate once). ``partial``: as
    the experimental ``partial_staging`` option, the room the plan leaves under B (less 5% of B) is forward's last
    saves kept on the GPU (:func:`kept_tail`), and the plan is made again with them in the fixed pool; again while
    the new plan leaves room (up to :data:`~um_lab.schedule.staging.TAIL_ROUNDS` rounds), as the session does.
    ``remote_copies``: remote state copied to device slots for its steps where their room is worth it, as the session's
    ``copy_remote_state`` (experimental, off)."""
    from um_lab.sim.profile import profile_sha256

    key = ("staged", trace.key, profile_sha256(profile), int(budget_bytes), int(lookahead),
           window_for_budget(budget_bytes), bool(remote_optimizer), bool(partial), bool(remote_copies))
    return memoised(key, lambda: _simulate_staged(trace, layout, profile, budget_bytes, lookahead, remote_optimizer,
                                                  partial, remote_copies))


def _simulate_staged(trace: StepTrace, layout: Layout, profile: Profile, budget_bytes: int,
                     lookahead: int, remote_optimizer: bool, partial: bool,
                     remote_copies: bool = False) -> StagedSimulation:
    derived = without_intermediates(budget_order(trace, layout, profile, budget_bytes), layout)
    staged = staged_storages(trace)
    window = window_for_budget(budget_bytes)  # as the session sizes it
    uses = _uses(trace, set(int(s) for s in staged))  # one pass over the trace's accesses serves both below
    scratch = -(-derived.optim_scratch_bytes // BLOCK) * BLOCK

    slots = 0  # the remote state copies' slots, in the fixed pool once a plan leaves state remote

    def plan_for(staged: np.ndarray) -> tuple[int, Plan]:
        fixed = fixed_pool_bytes(trace, staged, window, uses=uses) + slots
        usable = budget_bytes - fixed - scratch
        if usable < BLOCK:
            raise BudgetTooSmall(budget_bytes, fixed + scratch + BLOCK,
                                 "the intermediate-results pool staging leaves and the optimizer's temporaries")
        return fixed, make_plan(derived.order, usable, lookahead, remote_optimizer=remote_optimizer)

    fixed, plan = plan_for(staged)
    copying = remote_copies and remote_optimizer and bool(plan.remote_blocks)
    if copying:  # as the session's control: announced, then planned again with room for them; left in place
        # where there is none, or where that plan costs more link time (remote_state.worth_copying)
        before = fixed, plan
        slots = SLOTS * -(-max((sum(n for _, n in p.spans(DataType.OPTIM)) for p in derived.order.positions
                                if p.phase == "optimizer"), default=0) // BLOCK) * BLOCK
        try:
            fixed, plan = plan_for(staged)
        except BudgetTooSmall:
            copying = False
        if not copying or not worth_copying(before[1], plan, LinkCosts.from_profile(profile)):
            slots, copying = 0, False
            fixed, plan = before
    if partial:  # the room the plan leaves, as the session's control measures it (less its margin), in rounds
        every, keep = staged, 0
        eligible = int(trace.st_nbytes[every].sum())
        for _ in range(TAIL_ROUNDS):
            more = min(tail_bytes(plan.budget_bytes - plan.max_resident, budget_bytes), eligible - keep)
            if more <= 0:
                break
            keep += more
            staged = every[~np.isin(every, kept_tail(trace, every, keep))]
            fixed, plan = plan_for(staged)
    copies = dataclasses.replace(stage_copies(trace, derived, staged, uses=uses), window=window,
                                 GBps=profile.stage_copy_GBps)
    # the session copies remote optimizer state for its steps where the intermediate pool is fixed device memory
    return StagedSimulation(derived, plan, copies, fixed, replay_plan(derived, plan, profile, staging=copies,
                                                                      remote_copies=copying))


def staged_records(trace: StepTrace, layout: Layout, profile: Profile, steps: int, warmup_steps: int,
                   budget_bytes: int, capacity: int, policy_name: str, backend: str,
                   lookahead: int = 2, workspace_bytes: int = 0) -> Iterator[StepRecord]:
    """The SimBackend's records for a run under the policy ``layer-ahead-staged``: every step the steady step of
    :func:`simulate_staged`. Residency counts the fixed intermediate-results pool; the staged copies count in
    the intermediate type's bytes each way (pinned copies, not migrations: ``extra["budget"]["staged_bytes"]``). The
    plan is made under B less ``workspace_bytes`` (:mod:`um_lab.sim.workspaces`), reported with B."""
    simulated = simulate_staged(trace, layout, profile, budget_bytes - workspace_bytes, lookahead)
    plan, step = simulated.plan, simulated.step
    extra = {**budget_extra(plan, step, simulated.derived, budget_bytes), "fixed_bytes": simulated.fixed_bytes,
             "workspace_bytes": int(workspace_bytes),
             "staged_bytes": simulated.copies.staged_bytes, "window_bytes": simulated.copies.window,
             "over_budget": plan.max_resident + simulated.fixed_bytes + workspace_bytes > budget_bytes,
             "model": "sim.staged: the plan around the fixed intermediate pool, copies on a stream of their own"}
    resident = resident_by_type(plan, layout)
    resident[DataType.ACT.value] += simulated.fixed_bytes
    moved_in, moved_out = moved_by_type(plan, layout)
    moved_in[DataType.ACT.value] += simulated.copies.staged_bytes
    moved_out[DataType.ACT.value] += simulated.copies.staged_bytes
    return steady_records(trace, layout, plan, step, extra, resident, moved_in, moved_out, steps=steps,
                          warmup_steps=warmup_steps, capacity=capacity, policy_name=policy_name, backend=backend)
