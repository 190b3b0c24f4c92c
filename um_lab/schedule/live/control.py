"""What a :class:`~um_lab.cuda.session.Session` with a budget adds: hooks, the scheduler's
executor, and the budgeted training step.

The budgeted step differs from the plain one in three ways: hooks record the order of use and drive
the executor; the optimizer is stepped one layer at a time (each layer's gradients zeroed in place
after its step) so its working set is one layer, not the whole model; and the policy's whole-type
phase prefetches are skipped (the scheduler moves the data). After each step the recorded order is
planned for the next one when it changed (``extra["budget"]["replanned"]``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from um_lab.errors import BudgetError, BudgetTooSmall
from um_lab.experimental import ISSUE_MODES
from um_lab.schedule.ledger import BLOCK, Span
from um_lab.schedule.live.executor import BudgetExecutor
from um_lab.schedule.live.mover import InlineMover, ThreadMover
from um_lab.schedule.live.pinned import another_like
from um_lab.schedule.live.record import (
    OPTIMIZER_CHUNK_DIVISOR,
    StepRecorder,
    check_chunkable,
    optimizer_chunks,
    own_tensors,
    step_optimizer_in_chunks,
    tensor_span,
    tensors_in,
)
from um_lab.schedule.live.remote_state import (
    SLOTS,
    CopySlots,
    LinkCosts,
    RemoteStateCopies,
    chunk_state_bytes,
    worth_copying,
)
from um_lab.schedule.live.stage import ActivationStager
from um_lab.schedule.live.streams import StreamOps
from um_lab.schedule.live.tail import TailSizer
from um_lab.schedule.order import Order
from um_lab.schedule.stats import BudgetStats
from um_lab.segments import Runtime, Segment
from um_lab.types import DataType


class BudgetControl:
    """The budget parts of a session (see the module docstring)."""

    def __init__(self, budget_bytes: int, runtime: Runtime, device: int, streams: StreamOps,
                 segments: Callable[[], Sequence[Segment]], *, lookahead: int = 2, cover_unknown: bool = False,
                 generation: Callable[[], int] | None = None,
                 keep_tensor: Callable[[torch.Tensor], bool] | None = None, issue: str = "thread",
                 thread_init: Callable[[], None] | None = None, discard_gradients: bool = False,
                 batch_calls: bool = False,
                 stager: ActivationStager | None = None, fixed_types: Iterable[DataType] = (),
                 host_written_types: Iterable[DataType] = (), remote_optimizer: bool = False,
                 partial_staging: bool = False, link_costs: LinkCosts | None = None) -> None:
        if issue not in ISSUE_MODES:
            raise BudgetError(f"budget_issue must be one of {ISSUE_MODES}, got {issue!r}")
        mover = ThreadMover(runtime, streams, thread_init) if issue == "thread" else InlineMover(runtime, streams)
        self.executor = BudgetExecutor(budget_bytes, runtime, device, streams, segments, lookahead=lookahead,
                                       cover_unknown=cover_unknown, generation=generation, mover=mover,
                                       discard_gradients=discard_gradients, batch_calls=batch_calls,
                                       fixed_types=fixed_types,
                                       host_written_types=host_written_types, remote_optimizer=remote_optimizer)
        self.keep_tensor = keep_tensor
        self.stager = stager
        #: partial staging: forward's last saves kept on the GPU where the plan leaves room (:mod:`tail`)
        self.tail = TailSizer(self.executor, stager) if partial_staging and stager is not None else None
        #: experimental, off: remote optimizer state copied to device slots for its chunk's step and back
        #: (:mod:`remote_state`) where the intermediate-results pool is fixed device memory (staged activations) and
        #: the slots' room is worth it; off, the optimizer's kernels update it in place over the link. On the H200 it
        #: made GPT-2-XL at 2 faster (1,271 against 1,440 ms) but GPT-2-XL at 3 slower (2,412 against 1,865): the
        #: pool grew after the slots were weighed and the plan then moved 7.2 GB a step
        #: how remote-state copies are weighed against updating the state in place (None: never copied)
        self.link_costs = link_costs
        self.copy_remote_state = False
        self._ops_out = another_like(stager.ops) if stager is not None else None
        self._slot_bytes = 0  # each copy slot's size, announced to the plan (0: none yet); -1: refused
        self._slots: CopySlots | None = None
        self._zero_hooks: dict[int, Any] = {}  # parameter id -> its zeroing hook's handle
        self._owed_zero: set[int] = set()  # ids of parameters whose gradient must read as zero next backward
        self._pending_zero: set[int] = set()
        self.recorder: StepRecorder | None = None
        self._roots: list[nn.Module] = []
        self._chunks: dict[int, list[tuple[str, list[nn.Parameter]]]] = {}
        self.pending_error: BudgetTooSmall | None = None
        self.last_order: Order | None = None
        self._steps_under_plan = 0
        self._replanned_for_unforeseen: int | None = None  # what the last re-plan for unforeseen ranges saw
        self._tolerated_unforeseen = 0  # unforeseen bytes a new plan did not reduce: no reason to re-plan
        self._stepped = False  # a step ran under the scheduler since it last woke: the pools hold what a step needs
        #: nothing to schedule: every byte the session holds fits B, so steps run without hooks or moves
        #: (:meth:`can_idle`); the session re-advises its pools while it lasts
        self.idle = False

    @property
    def partial_staging(self) -> bool:
        """Whether forward's last saves are kept on the GPU where the plan leaves room
        (:mod:`~um_lab.schedule.live.tail`)."""
        return self.tail is not None

    @property
    def settle_tail_growth(self) -> bool:
        """Experimental, off: growth announced for the kept tail that does not come is given back to the plan
        (:attr:`~um_lab.schedule.live.tail.TailSizer.settle`; only with partial staging)."""
        return self.tail is not None and self.tail.settle

    @settle_tail_growth.setter
    def settle_tail_growth(self, on: bool) -> None:
        if self.tail is not None:
            self.tail.settle = bool(on)

    @property
    def budget_bytes(self) -> int:
        """The budget on GPU-resident managed bytes."""
        return self.executor.ledger.budget_bytes

    def watch(self, modules: Sequence[nn.Module]) -> None:
        """Hook ``modules`` (re-hooks when the set changed)."""
        if list(modules) == self._roots and self.recorder is not None:
            return
        if self.recorder is not None:
            self.recorder.remove()
        self._roots = list(modules)
        self._chunks.clear()
        self._slots, self._slot_bytes = None, 0  # sized again for the new chunks
        self.recorder = StepRecorder(self._roots, listener=self.executor, classify=self.executor.classify,
                                     keep=self.keep_tensor, saver=self.stager)
        self.recorder.install()

    def _trainable(self) -> list[nn.Parameter]:
        """The watched models' parameters that take gradients, each once."""
        seen: set[int] = set()
        out = []
        for p in (p for m in self._roots for p in m.parameters()):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _hook_for_zeroing(self, params: Sequence[nn.Parameter]) -> None:
        """Give each of ``params`` its zeroing hook (once; one unfrozen or added later gets it now)."""
        for p in params:
            if id(p) not in self._zero_hooks:
                self._zero_hooks[id(p)] = p.register_hook(self._zero_on_first_gradient(p))

    def _zero_on_first_gradient(self, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
        """A gradient hook: zero ``p.grad`` before the first accumulation of a step when it is owed a zero
        (its contents may have been discarded since the last optimizer step)."""
        key = id(p)
        pending = self._pending_zero

        def hook(grad: torch.Tensor) -> None:
            if key in pending:
                pending.discard(key)
                if p.grad is not None:
                    p.grad.zero_()

        return hook

    def _remove_zero_hooks(self) -> None:
        for handle in self._zero_hooks.values():
            handle.remove()
        self._zero_hooks.clear()
        self._owed_zero.clear()
        self._pending_zero.clear()

    def _zero_unused_gradients(self) -> None:
        """After backward: gradients owed a zero that got no accumulation this step (a module skipped) are
        made resident through the executor first (their blocks may be discarded: a populate, never a GPU
        write to discarded pages), then zeroed."""
        if not self._pending_zero:
            return
        grads = [p.grad for p in self._trainable() if id(p) in self._pending_zero and p.grad is not None]
        self._pending_zero.clear()
        if grads:
            self.executor.make_resident(self._spans(grads))
            for g in grads:
                g.zero_()

    def _stop_discarding(self) -> None:
        """Gradients accumulate across steps from now on: plan without discards (before the step runs)."""
        executor = self.executor
        executor.discard_gradients = False
        if executor.plan_order is not None:
            try:
                executor.set_order(executor.plan_order)
            except BudgetTooSmall as e:  # pragma: no cover - the same positions fit with discards
                self.pending_error = e

    def close(self) -> None:
        """Take the hooks off, drop the models and parameters it holds, and stop the mover after it issued
        what it holds (its side stream synchronised): call before the session frees managed memory."""
        try:
            self._remove_zero_hooks()
            if self.recorder is not None:
                self.recorder.remove()
                self.recorder = None
        finally:
            self._roots = []
            self._chunks.clear()
            self._slots = None
            try:
                self.executor.close()
            finally:
                if self.stager is not None:
                    self.stager.close()

    # ---- outside a step ----

    def finish_moves(self) -> float:
        """Wait until every move of the last step was issued and has completed on the side stream (before
        measured residency is read: the ledger counts a move when it is issued); returns the ms waited."""
        began = time.perf_counter()
        self.executor.mover.drain()
        self.executor.streams.synchronize_side()
        if self.stager is not None:
            self.stager.ops.synchronize()
        return (time.perf_counter() - began) * 1e3

    def settle(self, tensors: Iterable[torch.Tensor]) -> int:
        """The GPU just wrote ``tensors`` (a model placed, gradients created): record the touch, then push
        everything resident to the host so the first step starts from nothing resident. Returns bytes."""
        self.executor.touch_now(self._spans(tensors))
        return self.executor.evict_all()

    def inputs_written(self, tensors: Iterable[torch.Tensor]) -> None:
        """An input batch was copied to the GPU: record the touch (evicting to stay under the budget)."""
        self.executor.touch_now(self._spans(tensors))

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise :class:`~um_lab.errors.UnsupportedOptimizer` unless the optimizer can be stepped one layer
        at a time (torch.optim.SGD, Adam, AdamW)."""
        check_chunkable(optimizer)

    def check_layers(self, module: nn.Module) -> None:
        """Raise :class:`BudgetTooSmall` before any step when one layer's parameters and gradients alone
        exceed the budget (optimizer state, unknown before the first step, is checked by the plan)."""
        for name, m in module.named_modules():
            own = own_tensors(m) + [p.grad for p in m.parameters(recurse=False) if p.grad is not None]
            if not own:
                continue
            need = self.executor.ledger.bytes_of(self.executor.blocks(self._spans(own)))
            if need > self.budget_bytes:
                raise BudgetTooSmall(self.budget_bytes, need, f"the parameters and gradients of {name or 'the model'}")

    # ---- the step ----

    def run_step(self, pools: Any, closure: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                 *, zero_grad: bool, before_optimizer: Callable[[], object] | None, backward_thread: str,
                 check_loss: Callable[[Any], None]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Forward, backward and a layer-by-layer optimizer step under the budget; returns the loss and
        ``extra["budget"]``. Any exception leaves hooks idle and the session usable."""
        if self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise error
        recorder = self.recorder
        if recorder is None:
            raise BudgetTooSmall(self.budget_bytes, 0, "a model: place() or attach() one first")
        executor = self.executor
        if not zero_grad and executor.discard_gradients:
            self._stop_discarding()
        discarding = executor.discard_gradients and zero_grad
        trainable = self._trainable() if discarding else []
        self._hook_for_zeroing(trainable)
        executor.begin_step()
        copier: RemoteStateCopies | None = None
        try:
            with recorder.recording():
                with pools.route(DataType.ACT):
                    loss = closure()
                    if self.stager is not None:
                        self.stager.forward_done()  # copies back start (their blocks from this pool)
            check_loss(loss)
            self._pending_zero |= self._owed_zero
            self._owed_zero.clear()
            with recorder.backward():
                loss = pools.backward(loss, DataType.ACT, backward_thread)  # detached: graph freed
            self._zero_unused_gradients()
            recorder.active = True
            if before_optimizer is not None:
                began = time.perf_counter()
                grads = [p.grad for m in self._roots for p in m.parameters() if p.grad is not None]
                recorder.open_position("optimizer", "(before optimizer)",
                                       [(DataType.GRAD, s) for s in self._spans(grads)])
                recorder.hook_ms += (time.perf_counter() - began) * 1e3
                with pools.route(DataType.ACT):
                    before_optimizer()
            copier = self._remote_copier(optimizer, pools)
            step_optimizer_in_chunks(
                optimizer, self._chunks_of(optimizer),
                before_chunk=lambda name, params: recorder.optimizer_position(name, params, optimizer),
                after_chunk=lambda name, params, index: recorder.touched(
                    cast(int, index), DataType.OPTIM, self._state_spans(optimizer, params)),
                zero_grad=zero_grad and not discarding,  # discarding: zeroed by the hooks next backward
                around_chunk=lambda params: pools.route(self._optimizer_pool(optimizer, params)),
                around_step=copier.around_step if copier is not None else None)
            copies = copier.finish() if copier is not None else None
        except BaseException:
            if copier is not None:
                copier.abort()
            executor.abort()
            if self.stager is not None:
                self.stager.end_step()
            raise
        finally:
            recorder.active = False
            if discarding:  # after the optimizer, or an error anywhere in the step: every gradient owes a zero
                self._owed_zero = {id(p) for p in trainable}
        try:
            extra = executor.end_step()
        finally:  # also when a move failed: the next step starts with an empty arena
            staging = self.stager.end_step() if self.stager is not None else None
        extra["hooks_ms"] = recorder.hook_ms
        if staging is not None:
            extra["staging"] = staging
        if copies is not None:
            extra["remote_copies"] = copies
        t0 = time.perf_counter()
        numbers = BudgetStats.from_dict(extra)
        extra["replanned"], extra["replan_reason"] = self._replan(recorder.order, numbers)
        if self.tail is not None:
            sized = self.tail.after_step(numbers, replanned=extra["replanned"])
            if sized[0]:
                extra["replanned"], extra["replan_reason"] = sized
        reserved, why = self._reserve_copy_slots(optimizer)  # also right after a re-plan that made state remote
        extra["replanned"] = extra["replanned"] or reserved
        if why:
            extra["replan_reason"] = f"{extra['replan_reason']}, {why}" if extra["replan_reason"] else why
        extra["replan_ms"] = (time.perf_counter() - t0) * 1e3 if extra["replanned"] else 0.0
        self._stepped = True
        extra["held_bytes"] = self.held_bytes()
        if executor.plan is not None:
            extra["plan"] = executor.plan.summary()
        return loss, extra

    # ---- idle: nothing to schedule ----

    def can_idle(self) -> bool:
        """True when the next step needs no scheduler: a step ran under it (so the pools hold what a step
        allocates) or it idles already, and every byte the session's pools hold fits B, so resident bytes stay
        under B whatever the step does. Experimental options that act inside a step (discarding gradients, partial
        staging) keep it busy."""
        return ((self.idle or self._stepped) and self.pending_error is None and not self.executor.discard_gradients
                and self.tail is None and self.held_bytes() <= self.budget_bytes)

    def held_bytes(self) -> int:
        """The most that could be resident now: every live segment of the session's pools (and every block
        the ledger knows, where segments are not known)."""
        return max(self.executor.live_bytes(), self.executor.ledger.total_bytes)

    def start_idling(self) -> None:
        """Steps run without the scheduler from now on (the session calls :meth:`idle_numbers` for them)."""
        self.idle = True

    def wake(self) -> None:
        """Schedule again: what is resident is unknown to the ledger after idle steps, so the next step starts
        from nothing resident and learns a plan again."""
        self.idle = False
        self._stepped = False
        self.executor.residency_unknown = True

    def idle_optimizer_step(self, pools: Any, optimizer: torch.optim.Optimizer, zero_grad: bool) -> None:
        """An idle step's optimizer step: in the same chunks as a scheduled one, so its temporaries stay as small."""
        step_optimizer_in_chunks(optimizer, self._chunks_of(optimizer), zero_grad=zero_grad,
                                 around_chunk=lambda params: pools.route(self._optimizer_pool(optimizer, params)))

    def idle_numbers(self) -> dict[str, Any]:
        """``extra["budget"]`` of an idle step: every byte the pools hold counts as resident (an upper bound;
        ``over_budget`` when they passed B, and the session then wakes the scheduler)."""
        held = self.held_bytes()
        over = held > self.budget_bytes
        numbers = BudgetStats(budget_bytes=self.budget_bytes, max_resident_ledger=held, resident_at_end=held,
                              managed_bytes=held, over_budget=over, planned=True, followed_plan=True)
        return {**numbers.to_dict(), "idle": True, "held_bytes": held, "positions": 0, "unplanned_positions": 0,
                "ahead_bytes": 0}

    def _optimizer_pool(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> DataType:
        """Where a chunk's optimizer step allocates: the optimizer-state pool while some parameter of the chunk
        has no state yet (the step creates it there); once all have, the intermediate-results pool, empty between
        backward and the next forward, whose cached blocks take the chunk's temporaries (AdamW's ``sqrt(v) + eps``).
        In the optimizer-state pool they stayed cached beside the state, so the pools held more than the state
        needs; with staged activations they were also written and read over the host link every step."""
        if not all(optimizer.state.get(p) for p in params):
            return DataType.OPTIM
        return DataType.ACT

    def _copying(self) -> bool:
        """Whether remote optimizer state is to be copied for its steps under the plan being followed."""
        executor, plan = self.executor, self.executor.plan
        return bool(self.copy_remote_state and self.stager is not None and plan is not None and plan.remote_blocks
                    and DataType.ACT in executor.fixed_types)

    def _reserve_copy_slots(self, optimizer: torch.optim.Optimizer) -> tuple[bool, str]:
        """Once a plan leaves optimizer state remote: announce the copy slots (:mod:`remote_state`) as growth of
        the fixed pool and plan again with room for them, before they exist. Returns (replanned, reason); a
        budget too small for them leaves the state updated in place."""
        executor = self.executor
        if self._slot_bytes or not self._copying() or executor.plan_order is None:
            return False, ""
        slot = chunk_state_bytes(optimizer, [params for _, params in self._chunks_of(optimizer)])
        slot = -(-slot // BLOCK) * BLOCK  # each slot a segment of whole blocks
        if slot <= 0:
            return False, ""
        before = executor.plan
        assert before is not None
        executor.expect_fixed_growth(SLOTS * slot)
        try:
            plan = executor.set_order(executor.plan_order)
        except BudgetTooSmall:
            plan = None
        if plan is None or self.link_costs is None or not worth_copying(before, plan, self.link_costs):
            # no room, or room only by moving data the plan kept resident (evicted at a third of the link's rate
            # or less) or by leaving more state remote than the copies save: the state is updated in place
            executor.expected_growth = max(0, executor.expected_growth - SLOTS * slot)  # (a re-plan may use some)
            self._slot_bytes = -1
            if plan is None:
                return False, "remote copies: no room"
            executor.set_order(executor.plan_order)
            return True, "remote copies refused"
        self._slot_bytes = slot
        return True, "remote copies"

    def _remote_copier(self, optimizer: torch.optim.Optimizer, pools: Any) -> RemoteStateCopies | None:
        """This step's copies of remote optimizer state (None: nothing remote under the plan followed, no slots
        announced yet, or :attr:`copy_remote_state` off). The slots are allocated the first time, in the
        intermediate-results pool the plan left room for."""
        if self._slot_bytes <= 0 or not self._copying() or not self.executor.following_plan:
            return None
        stager, ops_out, plan = self.stager, self._ops_out, self.executor.plan
        assert stager is not None and ops_out is not None and plan is not None
        if self._slots is None:
            with pools.route(DataType.ACT):
                self._slots = CopySlots(self._slot_bytes, lambda n: stager.ops.empty_like_on_device(
                    torch.Size((n,)), (1,), torch.uint8))
        remote, ledger = plan.remote_blocks, self.executor.ledger
        return RemoteStateCopies(optimizer, [params for _, params in self._chunks_of(optimizer)],
                                 lambda t: bool(ledger.blocks([tensor_span(t)]) & remote),
                                 stager.ops, ops_out, self._slots)

    def _chunks_of(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, list[nn.Parameter]]]:
        key = id(optimizer)
        if key not in self._chunks:
            self._chunks[key] = optimizer_chunks(self._roots, optimizer,
                                                 max_bytes=max(1, self.budget_bytes // OPTIMIZER_CHUNK_DIVISOR))
        return self._chunks[key]

    def _replan(self, order: Order, step: BudgetStats) -> tuple[bool, str]:
        """Plan on ``order`` when the plan is out of date (:func:`plan_outdated`) or its discards wait for new
        gradient addresses; returns whether it did and why ("" when the plan is kept). A budget too small for
        the new plan is raised at the start of the next step, before anything runs.

        When a plan made because of unforeseen ranges foresees about as little in the step that follows it
        (at least half as many bytes unforeseen: the allocator hands out other addresses every step, as in
        ResNet-50), that amount is tolerated from then on: re-planning every step cost 0.3-0.6 s of host
        time per ResNet-50 step on the H200 and gained nothing."""
        self.last_order = order
        unforeseen = step.unforeseen_bytes
        replanned_for = self._replanned_for_unforeseen
        if self._steps_under_plan == 0 and replanned_for is not None and step.followed_plan:
            # the first step under a plan made for unforeseen ranges: did the new plan help?
            self._tolerated_unforeseen = unforeseen if unforeseen >= replanned_for / 2 else 0
        self._steps_under_plan += 1
        plan = self.executor.plan
        grew = plan is not None and self.executor.ledger.fixed_bytes > plan.fixed_bytes
        reason = "discards" if self.executor.discards_suspended else "fixed pool grew" if grew else plan_outdated(
            self.executor.plan_order, order, step, self.budget_bytes, tolerated_unforeseen=self._tolerated_unforeseen)
        if not reason:
            return False, ""
        try:
            self.executor.set_order(order)
        except BudgetTooSmall as e:
            self.pending_error = e
            return False, f"{reason} (budget too small: raised next step)"
        self._steps_under_plan = 0
        self._replanned_for_unforeseen = unforeseen if reason == "unforeseen" else None
        if reason != "unforeseen":
            self._tolerated_unforeseen = 0
        return True, reason


    def _spans(self, tensors: Iterable[torch.Tensor | None]) -> list[Span]:
        keep = self.keep_tensor
        return [tensor_span(t) for t in tensors_in(list(tensors))
                if t.numel() > 0 and (keep is None or keep(t))]

    def _state_spans(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> list[Span]:
        return self._spans(v for p in params for v in optimizer.state.get(p, {}).values()
                           if isinstance(v, torch.Tensor))


#: a followed plan is kept until the ranges it did not foresee (brought in on demand) pass this share of B
REPLAN_UNFORESEEN_FRACTION = 0.02


def plan_outdated(planned: Order | None, order: Order, step: BudgetStats, budget_bytes: int, *,
                  tolerated_unforeseen: int = 0) -> str:
    """Why the step just run (``order``, its numbers ``step``) needs a new plan, or ""
    when it does not: ``"no plan"`` yet, ``"positions changed"`` (another order of positions), ``"left the
    plan"``, or ``"unforeseen"``: the plan failed to foresee more than ``REPLAN_UNFORESEEN_FRACTION`` of B
    beyond ``tolerated_unforeseen``. Ranges that merely moved a little (the caching allocator handing out
    nearby addresses) keep the plan: planning a large model takes seconds of host time (measured on the
    H200: 12 s per GPT-2-large step when every step re-planned), and the executor brings in what the plan
    missed on demand."""
    if planned is None:
        return "no plan"
    if planned.keys() != order.keys():
        return "positions changed"
    if all(sorted(a.spans()) == sorted(b.spans()) for a, b in zip(planned.positions, order.positions, strict=True)):
        return ""
    if not step.followed_plan:
        return "left the plan"
    limit = REPLAN_UNFORESEEN_FRACTION * budget_bytes + tolerated_unforeseen
    return "unforeseen" if step.unforeseen_bytes > limit else ""
