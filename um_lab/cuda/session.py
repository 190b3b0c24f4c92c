"""Session: wrap ordinary PyTorch training so every CUDA tensor lives in managed memory, per type.

::

    with um_lab.Session("um-default") as lab:      # cap: free GPU memory minus a reserve
        model = lab.place(model)                    # parameters and buffers -> param pool
        opt = lab.attach(model, opt)                # gradients -> grad pool, optimizer state -> optim
        for x, y in batches:
            x, y = lab.inputs(x, y)                 # -> input pool
            record = lab.step(lambda: loss_fn(model(x), y), opt)   # forward + backward -> act pool

Backward runs on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), routed like
forward; the experimental ``backward_thread="worker"`` runs it on autograd's own device thread instead (a
hook on the loss begins routing that thread into the act pool and an engine callback ends it; measured
slower on a launch-bound step). An exception or Ctrl-C anywhere in a step ends the routing.
Gradients are pre-allocated in the grad pool and accumulated in place (``zero_grad(set_to_none=False)``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from um_lab import experimental
from um_lab.cuda.allocator import ManagedPools, PoolAPI, Runtime, Segment, SegmentSource, TorchPoolAPI, default_cap
from um_lab.cuda.evacuate import evacuate
from um_lab.cuda.evacuate import is_tensor as _is_tensor
from um_lab.cuda.evacuate import module_tensors as _module_tensors
from um_lab.cuda.staging import InputStaging
from um_lab.cuda.step_timer import StepTimer as _StepTimer
from um_lab.cuda.step_timer import warm_up_outside_pools as _warm_up_outside_pools
from um_lab.cuda.telemetry import Telemetry, check_telemetry_mode, open_telemetry
from um_lab.errors import BudgetError, BudgetTooSmall, InputError, SessionStateError, gib
from um_lab.listeners import Listenable, RecordListeners
from um_lab.policy import PREFETCH_BEFORE, Location, Policy, get_policy
from um_lab.schedule.config import Budget, as_budget
from um_lab.types import DataType, StepRecord

if TYPE_CHECKING:
    from um_lab.schedule.live.control import BudgetControl
    from um_lab.schedule.live.remote_state import LinkCosts


class Session(Listenable):
    """A managed-memory training session on one GPU (see the module docstring).

    ``policy``: the advice per data type (a :class:`~um_lab.policy.Policy` or a preset's name).
    ``device``: the GPU index (default: the current one). ``cap_bytes``: the safety cap on live managed
    bytes (default: free GPU memory at open minus a reserve); a managed segment that would cross it is
    refused with :class:`~um_lab.errors.OversubscriptionRefused`, nothing allocated.
    ``allow_oversubscription=True`` lifts that refusal (for your own machine: on a shared GPU it can hang
    the card). ``telemetry``: measured residency per data type (CUPTI; ``"auto"`` where it can be).
    ``evacuate_on_close``: move registered models and optimizers to ordinary CUDA memory on close.

    ``budget`` (a :class:`~um_lab.schedule.config.Budget` in bytes, or bytes) keeps GPU-resident managed bytes
    at most ``B`` while total managed bytes stay under the cap: the layer-ahead scheduler
    (:mod:`um_lab.schedule`) learns the order of use in the first step, then prefetches the next layers' data
    on a side stream and pushes data that is done with to the host; the optimizer is stepped one layer at a
    time, and the policy's phase prefetches are left to the scheduler. Each record's ``extra["budget"]``
    holds the scheduler's numbers. The ledger sees data at layer boundaries (each layer's parameters,
    gradients, optimizer state, inputs, outputs and saved tensors): temporaries a layer makes and frees
    inside itself are not tracked, and a kernel's first write to a block the plan did not foresee is
    recorded after the fact (``touched_bytes``; ``over_budget`` when it took the ledger above ``B``).
    Unadvised pools prefer the host under a budget, so only the scheduler's prefetches make data
    resident. ``Budget(..., stage_activations=True)`` copies the activations forward saves for backward to
    pinned host memory on a stream of their own and back ahead of backward (:mod:`um_lab.schedule.live.stage`);
    the intermediate-results pool is then plain device memory, a fixed part of ``B``. Without a budget
    nothing changes: no hooks are installed.

    Switches that may change or vanish are set with :func:`um_lab.experimental.options` around the
    constructor; the session keeps the ones in force (``options``).
    ``remove = lab.add_listener(callback)`` calls ``callback(record)`` with each step's record at the end of
    :meth:`step` (rules in :mod:`um_lab.listeners`); ``last_record`` is the current state.
    """

    _open_lock = threading.Lock()
    _open_session: Session | None = None

    def __init__(
        self,
        policy: Policy | str = "um-default",
        *,
        device: int | None = None,
        cap_bytes: int | None = None,
        allow_oversubscription: bool = False,
        telemetry: bool | str | Telemetry = False,
        budget: Budget | int | str | None = None,
        evacuate_on_close: bool = True,
        _pool_api: PoolAPI | None = None,
        _runtime: Runtime | None = None,
        _source: SegmentSource | None = None,
        _device_memory: tuple[int, int] | None = None,
    ) -> None:
        self.policy = get_policy(policy)
        self.options = options = experimental.current()
        self.budget_config = as_budget(budget)
        self.gpu_budget_bytes = self.budget_config.resolve(None) if self.budget_config is not None else None
        self.budget_lookahead = self.budget_config.lookahead if self.budget_config is not None else 2
        staged = self.budget_config is not None and self.budget_config.stage_activations
        self.budget_stage_activations = staged
        self.budget_device_activations = staged if options.device_activations is None else options.device_activations
        if options.partial_staging and not staged:
            raise InputError("the experimental partial_staging option keeps part of the staged activations on the "
                             "GPU: it needs Budget(..., stage_activations=True)", "partial_staging")
        if self.budget_device_activations and not staged:
            raise InputError("the experimental device_activations option keeps the intermediate-results pool in "
                             "device memory, which the scheduler cannot move: it needs "
                             "Budget(..., stage_activations=True)", "device_activations")
        self._budget: BudgetControl | None = None
        if cap_bytes is not None and (isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0):
            raise InputError(f"cap_bytes must be a non-negative int or None, got {cap_bytes!r}", "cap_bytes")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise InputError(f"device must be a non-negative GPU index, got {device!r}", "device")
        self.allow_oversubscription = bool(allow_oversubscription)
        self.evacuate_on_close = evacuate_on_close
        self.backward_thread = options.backward_thread
        self.stage_inputs = options.stage_inputs
        self._staging: InputStaging | None = None
        self._telemetry_mode = check_telemetry_mode(telemetry)
        self.telemetry: Telemetry | None = None  # measured residency (CUPTI), see um_lab.cuda.telemetry
        self._requested_cap = cap_bytes
        self._requested_device = device
        self._pool_api = _pool_api
        self._runtime = _runtime
        self._source = _source
        self._device_memory = _device_memory
        self._pools: ManagedPools | None = None
        self._real = _pool_api is None
        self._warm_threads: set[int] = set()
        self._modules: list[nn.Module] = []
        self._trainable: list[nn.Parameter] = []  # the registered modules' parameters, for the per-step check
        self._prefetch_plan: tuple[Policy, dict[str, tuple[DataType, ...]], tuple[DataType, ...]] | None = None
        self._timer: _StepTimer | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self.device: torch.device | None = None
        self.cap_bytes: int | None = None
        self.gpu_capacity_bytes = 0
        self.baseline_live_bytes = 0
        self.steps_done = 0
        self.last_record: StepRecord | None = None
        self._listeners = RecordListeners()

    # ---- lifecycle ----

    @property
    def is_open(self) -> bool:
        """True between :meth:`open` and :meth:`close`."""
        return self._pools is not None

    def open(self) -> Session:
        """Check the GPU, set the cap, warm up cuBLAS outside the pools, create the pools."""
        if self.is_open:
            raise SessionStateError("this session is already open")
        with Session._open_lock:
            if Session._open_session is not None:
                raise SessionStateError("another um_lab Session is open in this process; close it first")
            Session._open_session = self
        try:
            self._open()
        except BaseException:
            with Session._open_lock:
                Session._open_session = None
            raise
        return self

    def _open(self) -> None:
        fake = self._pool_api is not None
        if fake:
            index = self._requested_device or 0
            self.device = torch.device("cpu")
            free, total = self._device_memory or (64 << 30, 80 << 30)
            source = self._source or SegmentSource()
            if self._runtime is None:
                raise SessionStateError("a fake pool API needs a fake runtime too (_runtime=...)")
            runtime = self._runtime
        else:
            from um_lab.cuda import driver

            driver.require_cuda()
            index = torch.cuda.current_device() if self._requested_device is None else self._requested_device
            if index >= torch.cuda.device_count():
                raise ValueError(f"device {index} does not exist; {torch.cuda.device_count()} GPU(s) visible")
            torch.cuda.set_device(index)
            info = driver.device_info(index)
            driver.check_device(info)
            free, total = info.free_bytes, info.total_bytes
            self.device = torch.device("cuda", index)
            source = self._source or SegmentSource()
            source.configure(*driver.shim_function_addresses())
            runtime = self._runtime or driver.CudaRuntime()
            _warm_up_outside_pools(self.device)
            self._warm_threads = {threading.get_ident()}
        self.gpu_capacity_bytes = total
        self.baseline_live_bytes = source.stats()["live_total"]
        cap = self._requested_cap if self._requested_cap is not None else default_cap(free, total)
        self.cap_bytes = cap
        budget = self.gpu_budget_bytes
        if budget is not None and not self.allow_oversubscription and budget > cap:
            raise BudgetError(f"gpu_budget_bytes={budget} B ({gib(budget)}) is above the safety cap of "
                              f"{cap} B ({gib(cap)}): a budget can only be smaller than the managed "
                              "memory the card may hold")
        pools = ManagedPools(index, self._pool_api or TorchPoolAPI(), runtime, source)
        pools.open(self._pool_policy(self.policy), cap, self.allow_oversubscription,
                   device_types=(DataType.ACT,) if self.budget_device_activations else ())
        self._pools = pools
        if budget is not None:
            self._budget = self._new_budget_control(budget, index, runtime, pools)
        self.telemetry = open_telemetry(self._telemetry_mode, index)

    def close(self) -> int:
        """Release every pool and free every managed segment no tensor holds any more.

        Registered models and optimizers are first moved to ordinary CUDA memory (unless
        ``evacuate_on_close=False``), so they stay usable. Returns managed bytes still held by
        tensors the caller keeps (0 normally); they are freed once those tensors die.
        """
        if not self.is_open:
            return 0
        pools = self._pools
        assert pools is not None
        try:
            try:
                self._close_budget()  # first: no prefetch may be queued or in flight once segments are freed
            finally:
                if self.evacuate_on_close:
                    try:
                        evacuate(pools, self._modules, self._optimizers, self._is_device)
                    except Exception as e:  # e.g. no room for the copies: still release the pools
                        warnings.warn(f"could not move the model out of managed memory ({e}); its tensors "
                                      "stay in managed segments until they are deleted", RuntimeWarning,
                                      stacklevel=2)
                self._modules.clear()
                self._trainable = []  # it held every parameter (and so its gradient) past close
                self._optimizers.clear()
                gc.collect()
                if self._real and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                    torch.cuda.synchronize(self.device)
                    torch._C._cuda_clearCublasWorkspaces()  # a workspace created in a pool would pin it
        finally:
            try:
                pools.close()
            finally:
                self._close_bookkeeping()
        return self._report_residual(pools)

    def _close_budget(self) -> None:
        """Hooks off, the mover drained and stopped, its side stream synchronised (before anything is freed)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.close()

    def _close_bookkeeping(self) -> None:
        try:
            if self.telemetry is not None:
                self.telemetry.close()
        finally:
            self._pools = None
            self._staging = None  # its pinned buffer goes back to torch's host cache
            with Session._open_lock:
                if Session._open_session is self:
                    Session._open_session = None

    def _report_residual(self, pools: ManagedPools) -> int:
        residual = pools.source.stats()["live_total"] - self.baseline_live_bytes
        if residual > 0:
            warnings.warn(
                f"{residual} managed bytes are still held by tensors you keep (inputs, losses, "
                "activations); they are freed once those tensors are deleted and "
                "torch.cuda.empty_cache() runs.",
                ResourceWarning,
                stacklevel=2,
            )
        return max(0, residual)

    def __enter__(self) -> Session:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> ManagedPools:
        if self._pools is None:
            raise SessionStateError("the session is not open; use `with Session(...) as lab:` or .open()")
        return self._pools

    # ---- placing training data ----

    def place(self, module: nn.Module) -> nn.Module:
        """Move ``module``'s parameters and buffers into the param pool; returns the module."""
        pools = self._require_open()
        if module not in self._modules:  # registered first: a refused move is still evacuated on close
            self._modules.append(module)
        with pools.route(DataType.PARAM):
            module.to(self.device)
            index = pools.source.index()
            for tensor in _module_tensors(module):
                if index.data_type_of(tensor.data_ptr()) is not DataType.PARAM and self._is_device(tensor):
                    tensor.data = tensor.data.clone()
        if self._budget is not None:
            if self._budget.idle:
                self._wake_budget()
            self._budget.watch(self._modules)
            self._budget.settle(_module_tensors(module))
        return module

    def attach(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Pre-allocate ``module``'s gradients in the grad pool and adopt ``optimizer``'s state.

        Parameters added to ``module`` later are not checked by :meth:`step`: attach it again."""
        pools = self._require_open()
        if self._budget is not None:  # before anything is placed or allocated
            self._budget.check_optimizer(optimizer)
        if module not in self._modules:
            self.place(module)
        self._ensure_grads(module)
        existing = [v for st in optimizer.state.values() for v in st.values() if _is_tensor(v)]
        if existing:
            with pools.route(DataType.OPTIM):
                index = pools.source.index()
                for state in optimizer.state.values():
                    for key, value in state.items():
                        if _is_tensor(value) and self._is_device(value):
                            if index.data_type_of(value.data_ptr()) is not DataType.OPTIM:
                                state[key] = value.clone()
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        self._trainable = [p for m in self._modules for p in m.parameters()]
        if self._budget is not None:
            if self._budget.idle:
                self._wake_budget()
            self._budget.watch(self._modules)
            self._budget.settle([p.grad for p in module.parameters() if p.grad is not None] +
                                [v for st in optimizer.state.values() for v in st.values() if _is_tensor(v)])
            self._budget.check_layers(module)
        return optimizer

    def inputs(self, *tensors: Any) -> Any:
        """Copy tensors to the GPU into the input pool (non-tensors pass through).

        With ``stage_inputs`` (the default) pageable host tensors go through a reused pinned buffer and
        a non-blocking copy (:mod:`um_lab.cuda.staging`): the call returns once the batch is in the
        buffer, so the caller may change its tensors at once, and the GPU copy overlaps the next launches.

        Returns one value for one argument, else a tuple.
        """
        pools = self._require_open()
        if self._staging is None and self.stage_inputs and self._real and self.device is not None:
            self._staging = InputStaging(self.device)
        if self._staging is not None:
            out = self._staging.copy(tensors, lambda: pools.route(DataType.INPUT))
        else:
            with pools.route(DataType.INPUT):
                out = tuple(t.to(self.device, copy=True) if _is_tensor(t) else t for t in tensors)
        if self._budget is not None and not self._budget.idle:
            self._budget.inputs_written(t for t in out if _is_tensor(t))
        return out[0] if len(out) == 1 else out

    def _ensure_grads(self, module: nn.Module) -> None:
        pools = self._require_open()
        params = [p for p in module.parameters() if p.requires_grad]
        index = pools.source.index()
        def in_grad_pool(g: torch.Tensor) -> bool:
            return not self._is_device(g) or index.data_type_of(g.data_ptr()) is DataType.GRAD

        missing = [p for p in params if p.grad is None or not in_grad_pool(p.grad)]
        if not missing:
            return
        with pools.route(DataType.GRAD):
            for p in missing:
                grad = torch.zeros_like(p, memory_format=torch.preserve_format)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad

    def _is_device(self, tensor: torch.Tensor) -> bool:
        """True for tensors on this session's GPU (never with a fake driver: nothing is managed)."""
        return self._real and self.device is not None and tensor.device == self.device

    # ---- the training step ----

    def step(
        self,
        closure: Callable[[], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        zero_grad: bool = True,
        before_optimizer: Callable[[], object] | None = None,
    ) -> StepRecord:
        """One training step: ``closure()`` (forward, returns the loss), backward, ``optimizer.step()``.

        ``before_optimizer`` runs between backward and the optimizer step (gradient clipping,
        unscaling); its temporaries go to the act pool.

        Timed with CUDA events; the policy's prefetches run at the phase boundaries. Returns the
        step's :class:`StepRecord`, after passing it to each listener (:meth:`add_listener`). A listener
        that raises makes ``step`` raise that error; the step still counts (``steps_done``,
        ``last_record``) and the session stays usable. With
        ``telemetry`` on, the measured fields are filled after the end event has synchronised,
        outside ``wall_ms`` (their cost on this thread: ``extra["telemetry_ms"]``); by default CUPTI
        is flushed by a background thread, so records still in flight count in the next step.
        """
        pools = self._require_open()
        if optimizer not in self._optimizers:
            raise SessionStateError("attach the optimizer first: opt = lab.attach(model, opt)")
        if any(p.grad is None and p.requires_grad for p in self._trainable):
            for module in self._modules:
                if any(p.grad is None for p in module.parameters() if p.requires_grad):
                    self._ensure_grads(module)  # the caller set gradients to None: re-create them in place
                    if self._budget is not None:  # at new addresses: the plan's discards no longer fit them
                        self._budget.executor.suspend_discards()
        if self._real and self.device is not None and threading.get_ident() not in self._warm_threads:
            _warm_up_outside_pools(self.device)  # cuBLAS handles are per thread
            self._warm_threads.add(threading.get_ident())
        if self._timer is None:
            self._timer = _StepTimer(self.device)  # its events are reused: stop() synchronises
        timer = self._timer
        timer.start()
        budget_extra: dict[str, Any] | None = None
        budget = self._budget
        if budget is not None and budget.can_idle():
            if not budget.idle:
                self._idle_budget()
            loss = self._plain_step(closure, optimizer, zero_grad, before_optimizer, policy_moves=False,
                                    optimizer_step=lambda: budget.idle_optimizer_step(pools, optimizer, zero_grad))
            budget_extra = budget.idle_numbers()
            if budget_extra["over_budget"]:  # the pools grew past B: the scheduler plans again from the next step
                self._wake_budget()
        elif budget is not None:
            if budget.idle:
                self._wake_budget()
            loss, budget_extra = budget.run_step(
                pools, closure, optimizer, zero_grad=zero_grad, before_optimizer=before_optimizer,
                backward_thread=self.backward_thread, check_loss=_check_loss)
        else:
            loss = self._plain_step(closure, optimizer, zero_grad, before_optimizer, policy_moves=True)
        wall_ms, loss_value = timer.stop(loss)
        record = StepRecord(
            step=self.steps_done,
            wall_ms=wall_ms,
            live_bytes=pools.source.live_bytes(),
            cap_bytes=None if self.allow_oversubscription else self.cap_bytes,
            gpu_capacity_bytes=self.gpu_capacity_bytes,
            backend="cuda",
            policy=self.policy.name,
            loss=loss_value,
            telemetry="unavailable: telemetry not enabled",
        )
        if budget_extra is not None:
            budget_extra["host_advice"] = self.options.host_advice  # the pools' advice, beside the policy's name
            budget_extra["device_activations"] = self.budget_device_activations
            budget_extra["remote_optimizer"] = self.options.remote_optimizer
            record.extra["budget"] = budget_extra
        if self.telemetry is not None:  # after the end event's synchronize: not in wall_ms
            if self._budget is not None and budget_extra is not None:  # residency once the step's moves are done
                budget_extra["finish_moves_ms"] = self._budget.finish_moves()
            self._fill_telemetry(record, pools.source.segments())
        self.steps_done += 1
        self.last_record = record
        self._listeners.emit(record)
        return record

    def _fill_telemetry(self, record: StepRecord, segments: list[Segment]) -> None:
        """CUPTI's measured fields for the managed segments; segments of plain device memory are resident by
        construction and are added to ``resident_bytes`` (their bytes also in ``extra["device_memory_bytes"]``)."""
        assert self.telemetry is not None
        self.telemetry.fill(record, [s for s in segments if s.managed])
        device: dict[str, int] = {}
        for s in segments:
            if not s.managed:
                device[s.data_type.value] = device.get(s.data_type.value, 0) + s.size
        if device:
            record.extra["device_memory_bytes"] = device
            if record.resident_bytes is not None:
                record.resident_bytes = {t: n + device.get(t, 0) for t, n in record.resident_bytes.items()}

    def _new_budget_control(self, budget: int, index: int, runtime: Runtime, pools: ManagedPools) -> BudgetControl:
        """The scheduler's parts: CUDA streams on a GPU, recording fakes (and covering blocks) on the CPU."""
        from um_lab.schedule.live.control import BudgetControl  # imported only with a budget
        from um_lab.schedule.live.stage import new_stager, window_for_budget
        from um_lab.schedule.live.streams import CudaStreams, RecordingStreams, StreamOps

        source = pools.source
        device = self.device
        options = self.options
        streams: StreamOps = (CudaStreams(device) if self._real and device is not None
                              else RecordingStreams())

        def select_device() -> None:
            torch.cuda.set_device(index)

        can_discard = getattr(runtime, "can_discard", None)
        discard = options.discard_gradients and callable(can_discard) and bool(can_discard())
        can_batch = getattr(runtime, "can_prefetch_batch", None)
        batch_calls = options.batch_calls and callable(can_batch) and bool(can_batch())
        control = BudgetControl(budget, runtime, index, streams, source.segments, lookahead=self.budget_lookahead,
                             cover_unknown=not self._real, generation=source.generation if self._real else None,
                             keep_tensor=self._is_device if self._real else None, issue=options.budget_issue,
                             thread_init=select_device if self._real else None, discard_gradients=discard,
                             batch_calls=batch_calls,
                             stager=new_stager(source, self.device if self._real else None, window_for_budget(budget))
                             if self.budget_stage_activations else None,
                             fixed_types=self._budget_resident_types(),
                             host_written_types=self._host_preferred_types(),
                             remote_optimizer=options.remote_optimizer,
                             partial_staging=options.partial_staging,
                             link_costs=_link_costs())
        control.settle_tail_growth = options.settle_tail_growth
        control.copy_remote_state = options.copy_remote_state
        return control

    @property
    def budget(self) -> BudgetControl | None:
        """The scheduler's state with ``gpu_budget_bytes`` (ledger, plan, hooks); None without a budget."""
        return self._budget

    def _plain_step(self, closure: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, zero_grad: bool,
                    before_optimizer: Callable[[], object] | None, *, policy_moves: bool,
                    optimizer_step: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward, backward and the optimizer step in the pools (``optimizer_step`` instead of stepping and zeroing
        the whole optimizer at once); ``policy_moves``: with the policy's prefetches."""
        pools = self._require_open()
        if policy_moves:
            self._prefetch_phase("forward")
        with pools.route(DataType.ACT):
            loss = closure()
        _check_loss(loss)
        if policy_moves:
            self._prefetch_phase("backward")
        loss = pools.backward(loss, DataType.ACT, self.backward_thread)  # detached: graph freed
        if before_optimizer is not None:
            with pools.route(DataType.ACT):
                before_optimizer()
        if policy_moves:
            self._prefetch_phase("optimizer")
        if optimizer_step is not None:
            optimizer_step()
        else:
            with pools.route(DataType.OPTIM):
                optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=False)
        if policy_moves:
            self._prefetch_to_cpu_after_use()
        return loss

    def _idle_budget(self) -> None:
        """Everything the session holds fits its budget: steps run without the scheduler, and the pools it advised
        to prefer the host get the policy's own advice and come to the GPU once (a GPU write lands there again)."""
        pools = self._require_open()
        assert self._budget is not None
        self._budget.finish_moves()
        advised = self._pool_policy(self.policy)
        pools.set_policy(self.policy)
        for t in DataType:
            if advised[t] != self.policy[t]:
                pools.prefetch(t, "gpu")
        self._budget.start_idling()

    def _wake_budget(self) -> None:
        """The scheduler plans again (the pools grew, or a model or policy changed): its advice back."""
        assert self._budget is not None
        self._budget.wake()
        self._require_open().set_policy(self._pool_policy(self.policy))

    def _prefetch_phase(self, phase: str) -> None:
        pools = self._require_open()
        for t in self._plan()[0][phase]:
            pools.prefetch(t, "gpu")

    def _prefetch_to_cpu_after_use(self) -> None:
        pools = self._require_open()
        for t in self._plan()[1]:
            pools.prefetch(t, "cpu")

    def _plan(self) -> tuple[dict[str, tuple[DataType, ...]], tuple[DataType, ...]]:
        """The policy's prefetches: types to the GPU before each phase, types to the host after the step
        (worked out once per policy, not per step)."""
        plan = self._prefetch_plan
        if plan is None or plan[0] is not self.policy:
            to_gpu = {phase: tuple(t for t in types if self.policy[t].prefetch == "to-gpu-before-use")
                      for phase, types in PREFETCH_BEFORE.items()}
            to_cpu = tuple(t for t in DataType if self.policy[t].prefetch == "to-cpu-after-use")
            plan = self._prefetch_plan = (self.policy, to_gpu, to_cpu)
        return plan[1], plan[2]

    @contextlib.contextmanager
    def allocating(self, data_type: DataType | str) -> Iterator[None]:
        """Route this thread's CUDA allocations into ``data_type``'s pool (e.g. extra buffers)."""
        with self._require_open().route(DataType.parse(data_type)):
            yield

    # ---- policy and inspection ----

    def set_policy(self, policy: Policy | str) -> int:
        """Switch policy mid-session: new segments and all live ones get the new advice. Under a budget the
        scheduler's ledger learns which pools now prefer the host, and the plan is made again.

        Returns the number of live segments re-advised.
        """
        pools = self._require_open()
        new, old = get_policy(policy), self.policy
        if self._budget is not None and self._budget.idle:
            self._budget.wake()  # the pools get the budget's advice again below
        count = pools.set_policy(self._pool_policy(new))
        self.policy = new
        if self._budget is not None:  # the ledger's host-written pools, and remote optimizer state, follow
            try:
                self._budget.executor.set_host_written_types(self._host_preferred_types())
            except BudgetTooSmall:  # the new advice leaves a layer that cannot fit: the old one back
                self.policy = old
                pools.set_policy(self._pool_policy(old))
                self._budget.executor.set_host_written_types(self._host_preferred_types())
                raise
        return count

    def _pool_policy(self, policy: Policy) -> Policy:
        """The advice the pools get: ``policy``, under a budget with host advice (the default) its unadvised types
        preferring the host (:func:`um_lab.schedule.request.with_host_advice`)."""
        if self.gpu_budget_bytes is None or not self.options.host_advice:
            return policy
        from um_lab.schedule.request import with_host_advice

        return with_host_advice(policy, keep=self._budget_resident_types())

    def _host_preferred_types(self) -> tuple[DataType, ...]:
        """The types whose pools prefer the host under this session's advice: a GPU write to a page of theirs
        that is not resident lands in host memory (mapped remotely), so the budget's ledger counts only its
        own prefetches as making them resident."""
        advice = self._pool_policy(self.policy)
        return tuple(t for t in DataType if advice[t].preferred_location is Location.CPU)

    def _budget_resident_types(self) -> tuple[DataType, ...]:
        """The pools a budget session leaves GPU-resident, never moved: the intermediate-results pool when saved
        activations are staged (what is left in it is a layer's working set)."""
        return (DataType.ACT,) if self.gpu_budget_bytes is not None and self.budget_stage_activations else ()

    def live_bytes(self) -> dict[str, int]:
        """Live managed bytes per data type."""
        return self._require_open().source.live_bytes()

    def data_type_of(self, tensor: torch.Tensor) -> DataType | None:
        """Which pool holds ``tensor`` (None: not in managed memory)."""
        return self._require_open().source.data_type_of(tensor.data_ptr())

    def stats(self) -> dict[str, Any]:
        """The segment source's counters (allocations, frees, refusals, live bytes)."""
        return self._require_open().source.stats()


def _link_costs() -> LinkCosts:
    """The host link's costs as the packaged calibration profile measured them."""
    from um_lab.schedule.live.remote_state import LinkCosts
    from um_lab.sim.profile import load_profile

    return LinkCosts.from_profile(load_profile("h200"))


def _check_loss(loss: Any) -> None:
    """Raise TypeError unless the step closure returned a scalar loss tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            "the step closure must return a scalar loss tensor that requires grad, got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
        )


