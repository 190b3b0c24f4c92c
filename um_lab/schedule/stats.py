"""The layer-ahead scheduler's numbers for one step, typed (pure).

A step's record keeps them as plain JSON under ``StepRecord.extra["budget"]`` (what the run log writes);
:attr:`um_lab.types.StepRecord.budget` and the scheduler's own decisions read them through
:class:`BudgetStats`, never by string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class BudgetStats:
    """One step under a GPU budget: the ledger's bytes, the plan's state and the host time it cost.

    Bytes are per step unless named otherwise; ``extra`` keeps every other number recorded (move timing,
    the plan's summary, experimental options' counters) as it was written.
    """

    budget_bytes: int = 0  #: B
    max_resident_ledger: int = 0  #: the most the ledger held GPU-resident during the step
    resident_at_end: int = 0
    managed_bytes: int = 0  #: managed bytes the ledger tracks
    prefetched_bytes: int = 0  #: moved to the GPU by the scheduler
    evicted_bytes: int = 0  #: pushed to the host by the scheduler
    discarded_bytes: int = 0
    populated_bytes: int = 0
    touched_bytes: int = 0  #: first written by a kernel where the plan did not foresee it
    first_touch_bytes: int = 0
    host_touched_bytes: int = 0
    unforeseen_bytes: int = 0  #: brought in on demand: ranges the plan did not foresee
    fixed_bytes: int = 0  #: pools kept resident, never moved (staged activations' working set)
    fixed_reserve_bytes: int = 0
    remote_bytes: int = 0  #: optimizer state updated in host memory over the link
    over_budget: bool = False  #: the ledger passed B
    planned: bool = False
    followed_plan: bool = False
    replanned: bool = False
    replan_reason: str = ""
    replan_ms: float = 0.0
    host_waits: int = 0  #: times the training thread waited for the mover
    host_wait_ms: float = 0.0
    executor_ms: float = 0.0  #: host time in the executor's part of the hooks (its ledger, plan and moves)
    #: host time in every hook the scheduler puts on the step (module, saved-tensor and gradient hooks, the
    #: optimizer's positions), ``executor_ms`` included: what the scheduler costs the training thread
    hooks_ms: float = 0.0
    staging: Mapping[str, Any] = dataclasses.field(default_factory=dict)  #: staged activations' numbers
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def staged_bytes(self) -> int:
        """Bytes of saved activations copied to the host this step (as many came back)."""
        return int(self.staging.get("staged_bytes", 0))

    @property
    def keep_tail_bytes(self) -> int:
        """How many bytes of forward's last saves partial staging was to keep on the GPU."""
        return int(self.staging.get("keep_tail_bytes", 0))

    @property
    def tail_kept_bytes(self) -> int:
        """How many bytes of forward's last saves stayed on the GPU."""
        return int(self.staging.get("tail_kept_bytes", 0))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BudgetStats:
        """The numbers of a step's ``extra["budget"]`` (unknown keys go to :attr:`extra`)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        fields = {k: v for k, v in data.items() if k in known and v is not None}
        fields["staging"] = dict(data.get("staging") or {})
        return cls(**fields, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form a run log writes (``extra``'s keys beside the typed ones)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["staging"] = dict(self.staging)
        return {**dict(self.extra), **out}
