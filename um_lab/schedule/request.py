"""Which runs train under a GPU budget, and how many bytes it is: one answer for every backend.

A run uses the layer-ahead scheduler when its spec gives a budget (``RunSpec.budget``: bytes, or a
fraction of the footprint) or its policy is the scheduled policy ``layer-ahead``
(:data:`um_lab.policy.SCHEDULED`). :func:`resolve_budget` turns that into bytes, checked before anything
is allocated: a budget above the limit the backend gives (the safety cap on a GPU, the simulated capacity
on the simulator) or below one 2 MiB block raises :class:`~um_lab.errors.BudgetError`.
"""

from __future__ import annotations

from collections.abc import Iterable

from um_lab.errors import BudgetError, gib
from um_lab.policy import Advice, Policy, is_scheduled, stages_activations
from um_lab.schedule.ledger import BLOCK
from um_lab.types import DataType, RunSpec


def uses_budget(spec: RunSpec, policy: Policy | str) -> bool:
    """True when the run trains under the layer-ahead scheduler (a budget given, or ``layer-ahead``)."""
    return spec.has_budget or is_scheduled(policy)


def stages(spec: RunSpec, policy: Policy | str) -> bool:
    """True when the run's saved activations are staged through pinned host memory: its budget says so
    (``Budget(..., stage_activations=True)``) or its policy is ``layer-ahead-staged``."""
    return uses_budget(spec, policy) and (
        (spec.budget is not None and spec.budget.stage_activations) or stages_activations(policy))


def lookahead(spec: RunSpec) -> int:
    """How many positions ahead the run's scheduler prefetches (its budget's, else the default)."""
    return spec.budget.lookahead if spec.budget is not None else 2


def resolve_budget(spec: RunSpec, policy: Policy | str, footprint_bytes: int, *, default_bytes: int | None,
                   limit_bytes: int | None, limit_name: str) -> int | None:
    """The run's budget in bytes (None: no scheduler).

    ``spec.budget`` in bytes as given, or its fraction times ``footprint_bytes``; else, for
    ``layer-ahead``, ``default_bytes`` (the simulator's capacity; None on a GPU, where a budget must be
    given). Raises :class:`BudgetError` when no budget can be found, or when it is below one 2 MiB block
    or above ``limit_bytes`` (``limit_name`` says what that limit is)."""
    if not uses_budget(spec, policy):
        return None
    if spec.budget is not None:
        budget = spec.budget.resolve(footprint_bytes)
    elif default_bytes is not None:
        budget = int(default_bytes)
    else:
        raise BudgetError("the layer-ahead scheduler needs a GPU budget here: give one in bytes "
                          "(RunSpec(budget='8GiB'), --budget 8GiB) or as a fraction of the footprint "
                          "(RunSpec(budget='0.5x'), --budget 0.5x)")
    if budget < BLOCK:
        raise BudgetError(f"a GPU budget of {budget} B is below one 2 MiB block ({BLOCK} B): nothing could "
                          "be resident; give a larger budget")
    if limit_bytes is not None and budget > limit_bytes:
        raise BudgetError(f"the GPU budget of {budget} B ({gib(budget)}) is above {limit_name} "
                          f"({limit_bytes} B, {gib(limit_bytes)}): a budget bounds GPU-resident "
                          "bytes below it; nothing was allocated")
    return budget


#: What a budget session gives each data type its policy leaves unadvised: pages prefer the host and stay
#: mapped for the GPU, so only the scheduler's prefetches make data GPU-resident; a range it did not foresee
#: is read over the link instead of faulting in behind the ledger's back (measured on the H200, ResNet-50 at
#: ratio 2: CUPTI residency 3.70 GB with it against 6.39 GB without, for B = 3.72 GB; about 3,000 GPU page
#: faults per step without, 7 with).
HOST_RESIDENT_ADVICE = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))


def with_host_advice(policy: Policy, keep: Iterable[DataType] = ()) -> Policy:
    """``policy`` with :data:`HOST_RESIDENT_ADVICE` for every data type it gives no advice (same name), but
    the types in ``keep`` (pools the scheduler leaves resident: their pages are placed where the GPU first
    touches them)."""
    kept = frozenset(keep)
    return Policy(policy.name, {t: HOST_RESIDENT_ADVICE if a.is_default and t not in kept else a
                                for t, a in policy.advice.items()}, policy.description)
