"""The memory planner: how a model trains inside a GPU budget at the least predicted step time.

Fitting a model into a budget B trades compute for link traffic. For each candidate the planner asks the
simulator (:mod:`um_lab.sim.budget`, :mod:`um_lab.sim.staged`) what one training step costs:

* which layers recompute their activations in backward: the first *k* of the model's repeated layers
  (their activations are kept longest), *k* from none to every layer;
* what happens to the saved activations of the other layers: the layer-ahead scheduler moves them out and
  back ahead of use, or they are staged through pinned host memory;
* optimizer state the plan would move in and out is updated in host memory over the link (the scheduler's
  default), so it never crosses twice.

A candidate's footprint is what the pools would hold (:func:`um_lab.sim.budget.budget_footprint`), plus, for a model
with convolutions, cuDNN's workspaces, which the CPU trace does not see (:mod:`um_lab.sim.workspaces`); a candidate that
moves data is simulated under B less that room, which the workspaces' segments take from what the scheduler plans
(staged, from its fixed intermediate-results pool). A candidate whose footprint fits B moves nothing: on a GPU the
scheduler idles (no hooks, the pools' own advice), so its step is the recompute's alone, simulated as a plain step.
Where one fits, the planner takes it: the least recompute that fits. Only where none fits does it take the candidate
with the least predicted step, which the scheduler then follows; that step carries the scheduler's host time per
tensor its hooks record (:attr:`~um_lab.sim.profile.Profile.scheduler_tensor_us`) but not the link reads of
activations rebuilt under the budget's host advice; measured on an H100 (GPT-2-large, fp32, ratio 2), a plan that
moved nothing but did not let the scheduler idle ran at 1.5x its prediction. Every candidate weighed is kept in the
plan (:attr:`MemoryPlan.candidates`) with its predicted step, footprint and bytes that cross the link.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

from um_lab.errors import BudgetTooSmall, SpecError, gib
from um_lab.types import Recompute, check_precision

#: how many evenly spaced layer counts the coarse search weighs before it refines the smallest that fits
GRID_POINTS = 6
#: steps simulated for a plain step: the last one is steady (the first two still fault pages in)
PLAIN_STEPS = 3
#: a candidate fits when its footprint in a budget session leaves this share of B free (for a model with
#: convolutions the footprint also counts the profile's :attr:`~um_lab.sim.profile.Profile.conv_pool_slack`)
FIT_MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class PlanCandidate:
    """One plan the planner weighed: the first ``recompute_layers`` layers recomputed, activations
    ``staged`` or not, and what the simulator predicts for it (``step_ms`` None: it cannot keep B);
    ``footprint_bytes``: what its pools hold in a budget session (:func:`um_lab.sim.budget.budget_footprint`)."""

    recompute_layers: int
    staged: bool
    footprint_bytes: int
    step_ms: float | None
    crossing_bytes: int = 0
    why_not: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The planner's choice for one model, precision and budget (:func:`plan_memory`)."""

    model: str
    precision: str
    budget_bytes: int
    layers: int  #: the model's repeated layers (what recompute counts)
    recompute: Recompute  #: ``"none"``, ``"every-layer"`` or the number of leading layers recomputed
    stage_activations: bool
    step_ms: float  #: the predicted step of the chosen plan
    footprint_bytes: int  #: the chosen plan's footprint
    crossing_bytes: int  #: what the chosen plan moves over the link per step (0: nothing moves)
    fit_step_ms: float  #: the predicted everything-fits step (nothing recomputed, no budget)
    fit_footprint_bytes: int
    candidates: tuple[PlanCandidate, ...]
    workspace_bytes: int = 0  #: the chosen plan's room for cuDNN's workspaces (:mod:`um_lab.sim.workspaces`)

    @property
    def idles(self) -> bool:
        """Nothing moves and the footprint fits B (with :data:`FIT_MARGIN` free): on a GPU the scheduler idles."""
        return (self.crossing_bytes == 0 and not self.stage_activations
                and self.footprint_bytes <= self.budget_bytes * (1 - FIT_MARGIN))

    def describe(self) -> str:
        """One line: what is recomputed, what moves, the predicted step against the everything-fits one."""
        what = {"none": "nothing recomputed", "every-layer": f"every layer ({self.layers}) recomputed"}.get(
            str(self.recompute), f"the first {self.recompute} of {self.layers} layers recomputed")
        moves = (("activations staged through pinned host memory" if self.stage_activations
                  else "the scheduler moves the rest") if self.crossing_bytes > 0
                 else "nothing moves, the scheduler idles" if self.idles else "nothing moves, the scheduler follows it")
        if self.workspace_bytes:
            moves += f" (with {gib(self.workspace_bytes)} for cuDNN's workspaces)"
        return (f"{self.model} ({self.precision}) in {gib(self.budget_bytes)}: {what}, {moves}; predicted step "
                f"{self.step_ms:.1f} ms ({self.step_ms / self.fit_step_ms:.2f}x the everything-fits "
                f"{self.fit_step_ms:.1f} ms)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        d = dataclasses.asdict(self)
        d["candidates"] = [dataclasses.asdict(c) for c in self.candidates]
        return d


def count_layers(case: Any) -> int:
    """How many repeated layers ``case``'s model has (:func:`um_lab.training.layers`), built on the meta
    device where its constructor allows, else for real."""
    from um_lab.sim.workspaces import built_on_meta
    from um_lab.training import layers

    return len(layers(built_on_meta(case)))


_PLANS: dict[tuple[Any, ...], MemoryPlan] = {}
_LOCK = threading.Lock()


def plan_memory(case: Any, budget: Any, *, precision: str = "fp32", backend: Any = None,
                progress: Callable[[str], None] | None = None) -> MemoryPlan:
    """Plan how ``case`` (a :class:`~um_lab.models.ModelCase`, nothing recomputed) trains in ``precision``
    within ``budget``: bytes, a size such as ``"8GiB"``, a fraction of its everything-fits footprint
    (``"0.5x"``) or a :class:`~um_lab.schedule.config.Budget`. ``backend``: the
    :class:`~um_lab.sim.backend.SimBackend` whose profile prices the candidates (default: a new one on the H200
    profile). ``progress`` hears one line per candidate.
    Raises :class:`~um_lab.errors.BudgetTooSmall` when no candidate keeps B."""
    from um_lab.schedule.config import Budget
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.budget import budget_footprint
    from um_lab.sim.profile import profile_sha256
    from um_lab.training import with_training

    check_precision(precision)
    if case.info.get("recompute") not in (None, "none", 0):
        raise SpecError(f"the planner chooses what {case.name} recomputes: give it the case with nothing "
                        "recomputed", "recompute")
    config = budget if isinstance(budget, Budget) else Budget(budget)
    sim = backend if backend is not None else SimBackend()
    say = progress or (lambda line: None)
    base = with_training(case, precision, "none")
    fit = sim.prepare(base)
    budget_bytes = config.resolve(fit.footprint_bytes)
    key = (fit.trace.key, profile_sha256(sim.profile), budget_bytes)
    with _LOCK:
        hit = _PLANS.get(key)
    if hit is not None:
        return hit
    fit_step = _plain_step_ms(sim, case, precision, 0)
    n_layers = count_layers(case)

    @functools.cache
    def footprint(k: int) -> int:  # as held in a budget session (the optimizer stepped in chunks), workspaces too
        p = _prepared(sim, case, precision, k)
        return budget_footprint(p.trace, p.placement.final, sim.profile, budget_bytes) + _room(sim, case, precision, k)

    def fits(k: int) -> bool:
        return footprint(k) <= budget_bytes * (1 - FIT_MARGIN)

    grid = sorted({round(n_layers * i / GRID_POINTS) for i in range(GRID_POINTS + 1)})
    fitting_k = [k for k in grid if fits(k)]
    if fitting_k and fitting_k[0] > 0:  # refine the least recompute that fits between two grid points
        lo, hi = grid[grid.index(fitting_k[0]) - 1], fitting_k[0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        fitting_k.insert(0, hi)
    least_fit = fitting_k[0] if fitting_k else None
    weighed = [k for k in sorted(set(grid) | set(fitting_k)) if least_fit is None or k <= least_fit]
    candidates = []
    for k in weighed:
        for staged in ((False,) if least_fit == k else (False, True)):
            idle = not staged and fits(k)  # the scheduler idles: a plain step
            step_ms, crossing, why_not = _priced(sim, case, precision, k, staged, idle, budget_bytes)
            c = PlanCandidate(k, staged, footprint(k), step_ms, crossing, why_not)
            candidates.append(c)
            if idle:
                say(f"recompute {k}/{n_layers} layers: footprint {gib(footprint(k))} fits B, plain step "
                    f"{step_ms:.1f} ms")
                continue
            say(f"recompute {k}/{n_layers} layers, staged {'on' if staged else 'off'}: footprint "
                f"{gib(c.footprint_bytes)}, " + (f"step {c.step_ms:.1f} ms, {gib(c.crossing_bytes)} cross"
                                                 if c.step_ms is not None else "cannot keep the budget"))
    feasible = [c for c in candidates if c.step_ms is not None]
    if not feasible:
        raise BudgetTooSmall(budget_bytes, min(c.footprint_bytes for c in candidates),
                             f"{case.name} with any layers recomputed")
    fitting = [c for c in feasible if fits(c.recompute_layers)]  # the scheduler idles: see the docstring
    best = min(fitting or feasible, key=lambda c: (c.step_ms, c.recompute_layers))
    recompute: Recompute = {0: "none", n_layers: "every-layer"}.get(best.recompute_layers, best.recompute_layers)
    plan = MemoryPlan(case.name, precision, budget_bytes, n_layers, recompute, best.staged, float(best.step_ms or 0),
                      best.footprint_bytes, best.crossing_bytes, fit_step, fit.footprint_bytes, tuple(candidates),
                      _room(sim, case, precision, best.recompute_layers))
    with _LOCK:
        _PLANS[key] = plan
    return plan


def _trained(case: Any, precision: str, k: int) -> Any:
    """``case`` in ``precision`` with its first ``k`` layers recomputed."""
    from um_lab.training import with_training

    return with_training(case, precision, k if k else "none")


def _prepared(sim: Any, case: Any, precision: str, k: int) -> Any:
    """:func:`_trained`, prepared by ``sim`` (which caches it)."""
    return sim.prepare(_trained(case, precision, k))


def _plain_step_ms(sim: Any, case: Any, precision: str, k: int) -> float:
    """The steady step with the first ``k`` layers recomputed, nothing moving and no scheduler running."""
    from um_lab.types import RunSpec

    spec = RunSpec(model="mlp", steps=PLAIN_STEPS, warmup_steps=0)
    return [r.wall_ms for r in sim.run(spec, _trained(case, precision, k), "um-default")][-1]


def _room(sim: Any, case: Any, precision: str, k: int) -> int:
    """The room cuDNN's workspaces take in a budget session of ``case`` with ``k`` layers recomputed
    (:func:`um_lab.sim.workspaces.workspace_bytes`)."""
    from um_lab.sim.workspaces import workspace_bytes

    return workspace_bytes(_trained(case, precision, k), _prepared(sim, case, precision, k), sim.profile)


def _priced(sim: Any, case: Any, precision: str, k: int, staged: bool, idle: bool,
            budget_bytes: int) -> tuple[float | None, int, str]:
    """(predicted step in ms, bytes that cross the link, why not) of one candidate: the plain step where the
    scheduler idles, else the scheduler's plan under B less the workspaces' room (:func:`_room`), staged or
    not; a step of None with the reason (against B) where that plan cannot keep the budget."""
    from um_lab.sim.budget import simulate_budget
    from um_lab.sim.staged import simulate_staged

    if idle:
        return _plain_step_ms(sim, case, precision, k), 0, ""
    p = _prepared(sim, case, precision, k)
    room = _room(sim, case, precision, k)
    usable_bytes = budget_bytes - room
    try:
        if staged:
            st = simulate_staged(p.trace, p.placement.final, sim.profile, usable_bytes)
            crossing = st.plan.prefetched_bytes + st.plan.evicted_bytes + 2 * st.copies.staged_bytes \
                + 2 * st.plan.remote_bytes
            return st.step.wall_us / 1e3, int(crossing), ""
        b = simulate_budget(p.trace, p.placement.final, sim.profile, usable_bytes)
        crossing = b.plan.prefetched_bytes + b.plan.evicted_bytes + 2 * b.plan.remote_bytes
        return b.step.wall_us / 1e3, int(crossing), ""
    except BudgetTooSmall as e:  # said against B, the room for the workspaces counted in what it needs
        return None, 0, str(BudgetTooSmall(budget_bytes, e.needed + room, e.what))


def price_plan(case: Any, plan: MemoryPlan, backend: Any) -> float | None:
    """``plan``'s predicted step (its recompute and staging, at its B) on ``backend``'s profile, e.g. one fitted to
    the machine that runs it (:func:`um_lab.sim.machine_calibration.fit_machine`): the plain step where the plan
    lets the scheduler idle, else the scheduler's. ``case``: the one :func:`plan_memory` planned (nothing
    recomputed). None where that profile's plan cannot keep B."""
    named = {"none": 0, "every-layer": plan.layers}
    k = named[plan.recompute] if isinstance(plan.recompute, str) else plan.recompute
    if not isinstance(k, int):
        raise SpecError(f"price_plan prices the planner's own plans (recompute: a count); got {plan.recompute!r}",
                        "plan")
    return _priced(backend, case, plan.precision, k, plan.stage_activations, plan.idles, plan.budget_bytes)[0]


def planned_budget(plan: MemoryPlan, lookahead: int = 2) -> Any:
    """The :class:`~um_lab.schedule.config.Budget` a run under ``plan`` trains with (its bytes and staging)."""
    from um_lab.schedule.config import Budget

    return Budget(plan.budget_bytes, lookahead=lookahead, stage_activations=plan.stage_activations)
