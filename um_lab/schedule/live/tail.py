"""Partial staging's kept tail: how many of forward's last saved activations stay on the GPU, sized in rounds
from the room a budget step's plan leaves.

Forward's last saves are the first backward reads, so a copy of them goes out and comes straight back
(:mod:`um_lab.schedule.live.stage`). After a step that followed its plan without a re-plan, :meth:`TailSizer.keep_more`
adds the room left under B, less a margin (:func:`~um_lab.schedule.live.stage.tail_bytes`), to the tail
(:attr:`~um_lab.schedule.live.stage.ActivationStager.keep_tail_bytes`), announces it to the executor as growth of the
fixed pool (:meth:`~um_lab.schedule.live.executor.BudgetExecutor.expect_fixed_growth`) and plans again at once.

The kept saves may reuse the pool's cached blocks, so the pool can grow by less than they hold, or grow steps
later (H200: ResNet-50's pool grew 1.95 GiB in one step, a round after the saves it holds were kept):
announced growth stays reserved until it comes. :meth:`TailSizer.settle_growth` (experimental, off) gives back what
has not come after :data:`SETTLE_STEPS` quiet steps (ResNet-50 at 1.32 kept 2.05-2.21 GiB, its pool
grew 0.6-1.6 GiB less than announced, and the step's ledger peak was 3.7-4.5 of 5.25 GiB).
"""

from __future__ import annotations

from um_lab.errors import BudgetTooSmall
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.stage import TAIL_ROUNDS, ActivationStager, tail_bytes
from um_lab.schedule.stats import BudgetStats

#: steps in a row that must run the whole kept tail, its announced growth outstanding and the fixed pool not
#: growing, before :meth:`TailSizer.settle_growth` gives that growth back
SETTLE_STEPS = 3
#: the most times announced growth is given back in one session (each may be followed by one more round)
SETTLE_LIMIT = 3
#: a step "kept the whole tail" when it kept at least this share of the bytes it was sized for (a save at the
#: tail's start is kept whole or not at all)
KEPT_FRACTION = 0.9


class TailSizer:
    """Sizes the stager's kept tail after each budget step (module docstring)."""

    def __init__(self, executor: BudgetExecutor, stager: ActivationStager) -> None:
        self.executor = executor
        self.stager = stager
        #: experimental, off: growth announced for the tail that does not come is given back (:meth:`settle_growth`)
        self.settle = False
        self._rounds = 0  # times the tail was sized (at most TAIL_ROUNDS); -1: no more room
        self._announced = 0  # growth announced for the tail (part of the executor's expected growth)
        self._quiet_steps = 0  # steps in a row that ran the whole tail with its growth outstanding and none coming
        self._settled = 0  # times announced growth was given back (at most SETTLE_LIMIT)
        self._fixed_seen = 0  # the fixed pool's bytes at the last step's end

    def after_step(self, step: BudgetStats, replanned: bool = False) -> tuple[bool, str]:
        """After each step (its numbers; ``replanned``: the step's plan was already made again): the
        pool's growth counts against the tail's announced growth first; then, when nothing re-planned, give back
        growth that is not coming, else size the tail one round more. Returns (replanned, reason)."""
        fixed = self.executor.ledger.fixed_bytes
        self._announced = max(0, self._announced - max(0, fixed - self._fixed_seen))
        self._fixed_seen = fixed
        if replanned:
            self._quiet_steps = 0
            return False, ""
        settled = self.settle_growth(step)
        return settled if settled[0] else self.keep_more(step)

    def keep_more(self, step: BudgetStats) -> tuple[bool, str]:
        """One round: the room is the smaller of what the plan leaves and what the step's ledger peak left, less the
        announced growth that has not come yet. Up to :data:`~um_lab.schedule.live.stage.TAIL_ROUNDS` rounds, until the
        room is under the minimum or the tail holds every save. Returns (replanned, reason)."""
        executor, stager, plan = self.executor, self.stager, self.executor.plan
        if not 0 <= self._rounds < TAIL_ROUNDS or plan is None or executor.plan_order is None \
                or not step.followed_plan:
            return False, ""
        self._rounds += 1
        budget = executor.ledger.budget_bytes
        grown = max(0, executor.ledger.fixed_bytes - plan.fixed_bytes)  # the pool's growth since the plan
        announced = executor.expected_growth  # the plan left room for it; what has come of it is in ``grown``
        room = min(plan.budget_bytes - plan.max_resident - max(0, grown - announced),
                   budget - executor.fixed_reserve - max(0, announced - grown)
                   - step.max_resident_ledger)
        more = min(tail_bytes(room, budget), stager.eligible_bytes - stager.keep_tail_bytes)
        if more <= 0:
            self._rounds = -1
            return False, ""
        stager.keep_tail_bytes += more
        executor.expect_fixed_growth(more)
        try:
            executor.set_order(executor.plan_order)
        except BudgetTooSmall:  # cannot happen with the room measured on this plan; back as before if it does
            stager.keep_tail_bytes -= more
            executor.expected_growth = announced
            self._rounds = -1
            return False, ""
        self._announced += more
        return True, "partial staging"

    def settle_growth(self, step: BudgetStats) -> tuple[bool, str]:
        """With :attr:`settle` on: the growth announced for the tail that is still outstanding after
        :data:`SETTLE_STEPS` steps in a row that followed the plan, kept the whole tail and did not grow the fixed
        pool is not coming (the pool's cached blocks held the kept saves). It is given back to the plan (planned
        again at once) and the tail may be sized one round more. At most :data:`SETTLE_LIMIT` times. Returns
        (replanned, reason)."""
        executor, stager, plan = self.executor, self.stager, self.executor.plan
        if not self.settle or plan is None or executor.plan_order is None or self._settled >= SETTLE_LIMIT:
            return False, ""
        outstanding = min(self._announced, executor.expected_growth)
        quiet = (outstanding > 0 and step.followed_plan
                 and executor.ledger.fixed_bytes <= plan.fixed_bytes
                 and step.keep_tail_bytes == stager.keep_tail_bytes > 0
                 and step.tail_kept_bytes >= KEPT_FRACTION * stager.keep_tail_bytes)
        self._quiet_steps = self._quiet_steps + 1 if quiet else 0
        if self._quiet_steps < SETTLE_STEPS:
            return False, ""
        executor.expected_growth -= outstanding
        self._announced = 0
        self._quiet_steps = 0
        self._settled += 1
        try:
            executor.set_order(executor.plan_order)
        except BudgetTooSmall:  # pragma: no cover - less reserved room only adds room
            executor.expected_growth += outstanding
            self._announced, self._settled = outstanding, self._settled - 1
            return False, ""
        if not 0 <= self._rounds < TAIL_ROUNDS:
            self._rounds = TAIL_ROUNDS - 1  # one more round may use the room given back
        return True, "partial staging: announced growth not needed"
