"""The sizes staging of saved activations works with (pure: the live stager and the simulator share them)."""

from __future__ import annotations

#: tensors smaller than this stay on the GPU (their copies would cost more in calls than they free)
MIN_STAGE_BYTES = 1 << 20
#: bytes brought back ahead of what backward asks for, and bytes of copies to the host in flight before
#: the training thread waits for the oldest (so freed blocks can be reused and the pool does not grow)
WINDOW_BYTES = 1 << 30
#: a view is staged through its storage when the storage is at most this many times the view's own bytes
MAX_VIEW_SPREAD = 4
#: partial staging keeps this share of B free beyond the saves it keeps on the GPU (the caching allocator's
#: rounding of the pool's new segments)
TAIL_MARGIN_FRACTION = 0.05
#: less room than this under the plan: everything is staged
MIN_TAIL_BYTES = 64 << 20
#: the kept tail is sized again after each of this many steps while room is left (its saves reuse cached blocks)
TAIL_ROUNDS = 3


def tail_bytes(room_bytes: int, budget_bytes: int) -> int:
    """What partial staging keeps on the GPU when a plan leaves ``room_bytes`` free under ``budget_bytes``: the
    room less :data:`TAIL_MARGIN_FRACTION` of B, or 0 when that is under :data:`MIN_TAIL_BYTES`."""
    keep = int(room_bytes) - int(TAIL_MARGIN_FRACTION * budget_bytes)
    return keep if keep >= MIN_TAIL_BYTES else 0


#: the most a budget session's window may be (:func:`window_for_budget`)
BUDGET_WINDOW_MAX_BYTES = 2 << 30


def window_for_budget(budget_bytes: int) -> int:
    """The stager's window under a GPU budget: a tenth of it, between 64 MiB and :data:`BUDGET_WINDOW_MAX_BYTES`
    (the blocks of copies in flight stay on the GPU, in the pool the budget holds resident).

    A restore's device block comes from the caching allocator on the compute stream, so its copy waits for the
    compute issued before it; backward then needs ``window > (copy + compute) / copy`` layers of look-ahead or
    copies and kernels alternate: per layer at least (copy + compute) / window. On the H200 (GPT-2-large, 1 GiB,
    about 1.5 of its layers): copy engine and kernels each ~60% busy in backward."""
    return int(min(BUDGET_WINDOW_MAX_BYTES, max(64 << 20, budget_bytes // 10)))
