"""How the scheduler prices its use of the host link (pure; the costs come from the calibration profile)."""

from __future__ import annotations

import dataclasses
from typing import Any

from um_lab.schedule.plan import Plan


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """How the scheduler prices a plan's use of the host link (from the calibration profile: see
    :meth:`from_profile`): ms per GB of remote optimizer state updated in place and copied in and back, and
    the rates of its moves to the GPU and to the host."""

    update_ms_per_GB: float
    copy_ms_per_GB: float
    prefetch_GBps: float
    evict_GBps: float

    @classmethod
    def from_profile(cls, profile: Any) -> LinkCosts:
        """The costs a calibration profile (:class:`um_lab.sim.profile.Profile`) measured."""
        return cls(profile.remote_update_ms_per_GB, profile.remote_copy_ms_per_GB, profile.plan_prefetch_GBps,
                   profile.plan_evict_GBps)


def link_cost_ms(plan: Plan, copying: bool, costs: LinkCosts) -> float:
    """A steady step's link time under ``plan`` as ``costs`` price it: its moves, and its remote optimizer
    state copied (``copying``) or updated in place."""
    gb = 1e-9
    remote = plan.remote_bytes * gb * (costs.copy_ms_per_GB if copying else costs.update_ms_per_GB)
    return (plan.prefetched_bytes * gb * 1e3 / costs.prefetch_GBps + plan.evicted_bytes * gb * 1e3 / costs.evict_GBps
            + remote)


def worth_copying(in_place: Plan, copying: Plan, costs: LinkCosts) -> bool:
    """Whether the plan with room for the copy slots (``copying``: more state remote, perhaps more moves) costs
    less link time than the plan without them, its remote state updated in place (:func:`link_cost_ms`)."""
    return link_cost_ms(copying, True, costs) < link_cost_ms(in_place, False, costs)


#: device slots the chunks' copies rotate through (a chunk's copies in, the step before it, the copies back of
#: the one before that)
SLOTS = 3
