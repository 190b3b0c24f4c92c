"""The layer-ahead scheduler's plan replayed on the simulator: the steady step's time.

:func:`plan_budget` makes the session's plan (:func:`um_lab.schedule.plan.make_plan`: Belady evictions,
look-ahead prefetches, the steady-state step) on a :class:`~um_lab.sim.budget_order.DerivedOrder`, so the moves
are the ones the real executor would replay. :func:`replay_plan` walks three steady steps on four clocks: the
training thread (each
position's hook cost and its ops' dispatch times), the mover thread that makes the prefetch calls
(``prefetch_call_us`` + ``prefetch_call_us_per_block`` each; with ``prefetch_host_sync`` a call first
waits until the side stream's earlier work is done), the side stream (evictions wait for the compute
queued before their position; transfers at the profile's ``scheduler_h2d_GBps`` to the GPU and
``scheduler_d2h_GBps`` to the host, the side-stream rates measured in training (where a profile has none,
the lone-prefetch rates ``prefetch_h2d_GBps`` / ``prefetch_d2h_GBps``), ``prefetch_block_us`` per block; both
directions share the stream, so they never overlap)
and the compute stream (each position's ops at their resident roofline times, after the prefetches it
waits for). The step time is the compute stream's, as the session's CUDA-event timer measures it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from um_lab.errors import BudgetTooSmall
from um_lab.schedule.ledger import BLOCK
from um_lab.schedule.plan import Plan, make_plan
from um_lab.schedule.staging import WINDOW_BYTES
from um_lab.sim.budget_order import DerivedOrder
from um_lab.sim.profile import Profile
from um_lab.sim.remote_optim import remote_extra_us, remote_state_bytes

STEADY_STEPS = 3  #: steady steps replayed; the last one's time is reported


@dataclasses.dataclass(frozen=True)
class StageCopies:
    """The staging copies of a step, by position: bytes out after ``out_bytes[i]``'s position, bytes back
    before ``in_bytes[i]``'s; ``GBps`` the copy rate (None: the profile's ``stage_copy_GBps``), ``window`` the
    bytes in flight / ahead."""

    out_bytes: tuple[int, ...]
    in_bytes: tuple[int, ...]
    GBps: float | None = None
    window: int = WINDOW_BYTES

    @property
    def staged_bytes(self) -> int:
        """Bytes copied to the host per step (as many come back)."""
        return sum(self.out_bytes)


@dataclasses.dataclass
class BudgetStep:
    """One simulated steady step under the budget: the step time and where it went."""

    wall_us: float
    compute_us: float  #: the positions' resident GPU time
    side_busy_us: float  #: time the side stream spent moving data (both directions)
    host_waits: int  #: positions whose prefetches the training thread had to wait to see issued
    calls: int  #: prefetch calls made per step
    remote_us: float = 0.0  #: GPU time the optimizer spent on state left in host memory
    remote_link_bytes: float = 0.0  #: bytes its kernels read and wrote over the link for it


def hook_us(profile: Profile, positions: float, tensors: float) -> float:
    """Host time of the scheduler's hooks at a position: ``scheduler_tensor_us`` per tensor they record where the
    trace counted them, else ``scheduler_hook_us`` per hook position (an optimizer chunk, an old trace)."""
    if tensors > 0:
        return profile.scheduler_tensor_us * tensors
    return profile.scheduler_hook_us * positions


def plan_budget(derived: DerivedOrder, budget_bytes: int, lookahead: int = 2, discard: bool = False,
                remote_optimizer: bool = False) -> Plan:
    """The scheduler's steady-state plan of ``derived`` under ``budget_bytes`` less the optimizer's
    temporaries (whole blocks); ``discard``: dead gradients discarded, as the experimental
    ``discard_gradients`` option; ``remote_optimizer``: optimizer state the plan would move left in host memory,
    as the experimental ``remote_optimizer`` option (on by default). Raises :class:`BudgetTooSmall` when one
    position cannot fit."""
    scratch = -(-derived.optim_scratch_bytes // BLOCK) * BLOCK
    usable = budget_bytes - scratch
    if usable < BLOCK:
        raise BudgetTooSmall(budget_bytes, scratch + BLOCK, "the optimizer's temporaries of one layer")
    return make_plan(derived.order, usable, lookahead, discard_segments=derived.grad_segments if discard else (),
                     remote_optimizer=remote_optimizer)


def restore_start(backward: Sequence[bool], out_bytes: Sequence[int]) -> int:
    """The position at which staged activations start coming back: the one after forward's last copy out
    (:meth:`~um_lab.schedule.live.stage.ActivationStager.forward_done`), backward's first at the latest."""
    first_back = next((i for i, b in enumerate(backward) if b), len(backward))
    last_out = max((i for i, nbytes in enumerate(out_bytes) if nbytes and not backward[i]), default=None)
    return first_back if last_out is None else min(last_out + 1, first_back)


def replay_plan(derived: DerivedOrder, plan: Plan, profile: Profile, *,
                evict_GBps: float | None = None, prefetch_GBps: float | None = None,
                staging: StageCopies | None = None,
                remote_copies: bool = False) -> BudgetStep:
    """The steady step's time on the four clocks of the module docstring (``evict_GBps``: the
    GPU->host rate, default the profile's ``scheduler_d2h_GBps``, else ``prefetch_d2h_GBps``; ``prefetch_GBps``:
    the host->GPU rate, default ``scheduler_h2d_GBps``, else ``prefetch_h2d_GBps``; ``staging``: saved
    activations copied through pinned memory on a fifth clock, the copy stream, as :mod:`um_lab.sim.staged`
    describes; ``remote_copies``: remote optimizer state copied to the device for its position's step, a
    position ahead, and back after it, on two more clocks at the profile's ``stage_copy_GBps``, as
    :mod:`um_lab.schedule.live.remote_state` does, instead of updated in place over the link)."""
    p = profile
    h2d = (prefetch_GBps or p.scheduler_h2d_GBps or p.prefetch_h2d_GBps) * 1e3  # bytes per microsecond
    d2h = (evict_GBps or p.scheduler_d2h_GBps or p.prefetch_d2h_GBps) * 1e3
    sync = p.prefetch_host_sync >= 0.5
    cpu = mover = side = gpu = 0.0
    next_pending: dict[int, tuple[float, float]] = {}
    wall = busy = 0.0
    waits = calls = 0
    n = len(derived.order.positions)
    copy = 0.0  # the staging copy stream's clock
    backward = [pos.phase == "backward" for pos in derived.order.positions]
    hooks = derived.hook_positions
    tensors = derived.hook_tensors or (0.0,) * n
    remote_us, remote_link = remote_extra_us(derived.remote_costs, plan.remote_blocks, n)  # state updated over the link
    copied = remote_state_bytes(derived.remote_costs, plan.remote_blocks, n) if remote_copies else [0] * n
    if remote_copies:
        remote_us, remote_link = [0.0] * n, 2.0 * sum(copied)
    copy_rate = p.stage_copy_GBps * 1e3
    first_back = next((i for i in range(n) if backward[i]), n)
    restores_from = restore_start(backward, staging.out_bytes if staging is not None else [0] * n)
    for _ in range(STEADY_STEPS):
        cpu += p.cpu_step_us
        t0 = max(gpu, cpu)
        pending, next_pending = next_pending, {}
        busy = 0.0
        waits = calls = 0
        in_flight: list[tuple[float, int]] = []  # copies to the host: (end, bytes)
        restored: dict[int, float] = {}  # backward position -> the end of its restores
        next_restore = 0
        copy_in = copy_out = 0.0  # the remote state copies' two streams
        copied_in: dict[int, float] = {}
        for i in range(n):
            cpu += hook_us(p, hooks[i] if hooks else 1.0, tensors[i])
            ready = 0.0
            for j in (i, i + 1):  # this position's copies in (if not issued yet), then the next one's
                if j < n and copied[j] and j not in copied_in:
                    copy_in = max(copy_in, cpu, gpu) + copied[j] / copy_rate
                    copied_in[j] = copy_in
            ready = max(ready, copied_in.get(i, 0.0))
            if staging is not None and (backward[i] or i == restores_from):  # a window ahead of backward, in its order
                rate = (staging.GBps or p.stage_copy_GBps) * 1e3
                first = i if backward[i] else first_back
                next_restore = max(next_restore, first)
                ahead = sum(staging.in_bytes[first:next_restore])
                while next_restore < n and backward[next_restore] and (next_restore == first
                                                                        or ahead < staging.window):
                    nbytes = staging.in_bytes[next_restore]
                    if nbytes:  # its device block comes from the compute stream's pool: it waits for compute so far
                        copy = max(copy, cpu, gpu) + nbytes / rate
                        restored[next_restore] = copy
                        ahead += nbytes
                    next_restore += 1
                ready = max(ready, restored.get(i, 0.0))
            for target in sorted(t for t in pending if t <= i):
                side_done, issued = pending.pop(target)
                if issued > cpu:
                    waits += 1
                    cpu = issued
                ready = max(ready, side_done)
            moves = [m for m in plan.moves[i] if m.kind != "touch"]
            if moves:
                compute_event = gpu if any(m.kind in ("evict", "discard") for m in moves) else 0.0
                mover = max(mover, cpu)
                if compute_event:
                    side = max(side, compute_event)
                targets: set[int] = set()
                for m in moves:
                    for _ptr, nbytes in m.spans:
                        blocks = -(-nbytes // BLOCK)
                        if sync:
                            mover = max(mover, side)
                        mover += p.prefetch_call_us + p.prefetch_call_us_per_block * blocks
                        if m.kind in ("discard", "populate"):  # no copy: the driver's page work only
                            rate = p.discard_GBps if m.kind == "discard" else p.discard_populate_GBps
                            took = nbytes / rate / 1e3
                        else:
                            took = nbytes / (h2d if m.kind == "prefetch" else d2h) + p.prefetch_block_us * blocks
                        side = max(side, mover) + took
                        busy += took
                        calls += 1
                    if m.to_gpu:
                        targets.add(m.target)
                for t in targets:
                    if t == i:
                        if mover > cpu:
                            waits += 1
                            cpu = mover
                        ready = max(ready, side)
                    elif t > i:
                        old = pending.get(t, (0.0, 0.0))
                        pending[t] = (max(old[0], side), max(old[1], mover))
                    else:
                        old = next_pending.get(t, (0.0, 0.0))
                        next_pending[t] = (max(old[0], side), max(old[1], mover))
            start = max(gpu, ready, cpu)
            cpu += derived.host_us[i]
            gpu = max(start + derived.compute_us[i] + remote_us[i], cpu + p.kernel_us)
            if copied[i]:
                copy_out = max(copy_out, gpu) + copied[i] / copy_rate
            if staging is not None and staging.out_bytes[i]:  # after the position's ops; the host throttles
                copy = max(copy, gpu) + staging.out_bytes[i] / ((staging.GBps or p.stage_copy_GBps) * 1e3)
                in_flight.append((copy, staging.out_bytes[i]))
                while sum(b for _, b in in_flight) > staging.window and len(in_flight) > 1:
                    cpu = max(cpu, in_flight.pop(0)[0])
        gpu = max(gpu, copy_out)  # the compute stream waits for the copies back at the optimizer's end
        wall = gpu - t0
        cpu = max(cpu, gpu)  # the step's end: the loss is read back
    return BudgetStep(wall, float(sum(derived.compute_us)), busy, waits, calls, float(sum(remote_us)), remote_link)
