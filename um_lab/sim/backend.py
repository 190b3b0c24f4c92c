"""``SimBackend``: the Backend protocol on the simulator (CPU only, deterministic).

    from um_lab.sim import SimBackend
    from um_lab.models import get_model
    from um_lab.types import RunSpec
    for rec in SimBackend().run(RunSpec(model="mlp", oversubscription_ratio=1.5, steps=5),
                                get_model("mlp"), "um-default"):
        print(rec.step, rec.wall_ms, rec.evictions)
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from um_lab.backend_base import BackendBase
from um_lab.errors import BudgetError, HostMemoryRefused, PolicyError, SpecError
from um_lab.models import ModelCase
from um_lab.models import check_case as check_model_case
from um_lab.policy import Policy, get_policy
from um_lab.schedule.request import resolve_budget, stages, uses_budget
from um_lab.sim.access import OpBlocks, expand, page_mask
from um_lab.sim.placement import BLOCK, Placement, place
from um_lab.sim.profile import Profile, load_profile, profile_sha256
from um_lab.sim.roofline import op_host_us, op_times_us
from um_lab.sim.stepper import readmostly_write_us, run_step
from um_lab.sim.trace import StepTrace, cached_trace, case_key, forget_trace
from um_lab.sim.uvm import PREFETCH_STREAMS, AdviceTable, StepStats, UvmModel
from um_lab.sim.workspaces import workspace_bytes
from um_lab.sizing import available_host_bytes
from um_lab.types import DATA_TYPES, RunSpec, StepRecord, positive_ratio, whole_bytes


@dataclasses.dataclass
class PreparedCase:
    """A traced and placed model case, with per-layout block accesses (independent of policy)."""

    trace: StepTrace
    placement: Placement
    op_blocks: list[OpBlocks]
    base_us: np.ndarray
    host_us: np.ndarray

    @property
    def footprint_bytes(self) -> int:
        """Live managed bytes in the steady state (all pools' segments)."""
        return int(sum(self.placement.final.segment_bytes.values()))


def case_bytes(n: int) -> str:
    """``n`` bytes for a message: MiB below a GiB, else GiB."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class SimBackend(BackendBase):
    """The simulated backend: trace once per model configuration, then simulate any policy/capacity."""

    name = "sim"
    simulates_capacity = True  # RunSpec.capacity_bytes / oversubscription_ratio set the simulated GPU
    reports_uncertainty_band = True  # compare(band=True): each run at both ends of the profile's ranges

    def __init__(self, profile: str | Profile = "h200", prefetch_stream: str = "compute") -> None:
        """``profile``: a packaged profile name, a profile JSON path or a :class:`Profile`;
        ``prefetch_stream``: ``"compute"`` (as the real backend issues them) or ``"copy"`` (overlap)."""
        if prefetch_stream not in PREFETCH_STREAMS:
            raise ValueError(f"prefetch_stream must be one of {PREFETCH_STREAMS}, got {prefetch_stream!r}")
        self.profile = load_profile(profile).check()
        self.prefetch_stream = prefetch_stream
        self._prepared: dict[str, PreparedCase] = {}
        self._lock = threading.Lock()

    @property
    def measures_residency(self) -> bool:
        """Records carry the simulated GPU-resident bytes per type."""
        return True

    @classmethod
    def check_case(cls, case: ModelCase) -> None:
        """Refuse a case before anything is made for it: a knob the model library cannot build or an
        optimizer that needs a closure (:func:`um_lab.models.check_case`: :class:`ModelConfigError`), an input
        batch that does not fit in host memory (:class:`HostMemoryRefused`), a step that cannot be traced
        (:class:`~um_lab.errors.TraceError`; the trace is cached, so the run reuses it)."""
        check_model_case(case)
        check_batch_fits_host(case)
        cached_trace(case)

    def environment(self) -> dict[str, Any]:
        """The simulated device and the calibration profile: its name, a SHA-256 of its constants and its
        origin (:attr:`~um_lab.sim.profile.Profile.origin`: packaged, a user's file by path and the SHA-256
        of its bytes, or built in code)."""
        return {"device": {"name": "cpu (simulated GPU)"}, "calibration_profile": self.profile.name,
                "calibration_profile_sha256": profile_sha256(self.profile),
                "calibration_profile_origin": self.profile.origin}

    def prepare(self, case: ModelCase) -> PreparedCase:
        """Trace, place and expand ``case`` (cached per model configuration).

        A size whose arrays would not fit in host memory raises :class:`HostMemoryRefused` before they
        are built: the batch (the trace makes it for real) before tracing, the per-op block accesses and
        the driver model's state (which grow with the step's traffic) after tracing and again after
        placement, before they are expanded; a trace refused there is dropped from the trace cache.
        """
        with self._lock:
            hit = self._prepared.get(case_key(case))
        if hit is not None:
            return hit
        check_batch_fits_host(case)
        trace = cached_trace(case)
        try:
            check_host_memory(host_bytes_to_simulate(trace), f"the simulation of {case.name}")
            placement = place(trace)
            check_host_memory(host_bytes_to_simulate(trace, len(placement.layouts), placement.final.n_blocks),
                              f"the simulation of {case.name}")
        except HostMemoryRefused:
            forget_trace(case)  # a refused size's trace is not kept in the cache
            raise
        p = self.profile
        blocks = [expand(trace, layout, p) for layout in placement.layouts]
        prepared = PreparedCase(trace, placement, blocks, op_times_us(trace, self.profile),
                                op_host_us(trace, self.profile))
        with self._lock:
            self._prepared[trace.key] = prepared
        return prepared

    def capacity_for(self, spec: RunSpec, footprint: int) -> int:
        """Simulated GPU capacity: ``capacity_bytes``, else footprint / ratio, else the profile's card."""
        if spec.capacity_bytes is not None and spec.oversubscription_ratio is not None:
            raise SpecError("give capacity_bytes or oversubscription_ratio, not both", "capacity_bytes")
        if spec.capacity_bytes is not None:
            cap = whole_bytes("capacity_bytes", spec.capacity_bytes)
        elif spec.oversubscription_ratio is not None:
            cap = int(footprint / positive_ratio("oversubscription_ratio", spec.oversubscription_ratio))
        else:
            cap = int(self.profile.gpu_memory_bytes)
        if cap < BLOCK:
            if spec.capacity_bytes is not None:
                raise SpecError(f"capacity_bytes={spec.capacity_bytes!r} is below one 2 MiB chunk of GPU memory: give "
                                "at least 2 MiB", "capacity_bytes")
            raise SpecError(f"oversubscription_ratio={spec.oversubscription_ratio!r} leaves {case_bytes(footprint)} of "
                            f"data a simulated GPU of {cap} B, below one 2 MiB chunk: use a smaller ratio",
                            "oversubscription_ratio")
        return cap

    def preflight(self, spec: RunSpec, case: ModelCase, policy: Policy) -> dict[str, Any] | None:
        """Before the run's folder is written: the simulated capacity a ratio or capacity gives
        (:class:`~um_lab.errors.SpecError` below one chunk), and a run with a GPU budget: the budget in bytes,
        checked against that capacity (and a budget too small for one layer refused,
        :class:`~um_lab.errors.BudgetError`); None without a budget."""
        if not uses_budget(spec, policy):
            if spec.oversubscription_ratio is not None or spec.capacity_bytes is not None:
                self.capacity_for(spec, self.prepare(case).footprint_bytes)
            return None
        from um_lab.sim.budget import simulate_budget
        from um_lab.sim.staged import simulate_staged

        prepared = self.prepare(case)
        capacity = self.capacity_for(spec, prepared.footprint_bytes)
        budget = self._budget(spec, prepared, policy, capacity)
        assert budget is not None
        simulate = simulate_staged if stages(spec, policy) else simulate_budget  # the model run() uses
        simulate(prepared.trace, prepared.placement.final, self.profile, budget - workspace_bytes(case, prepared,
                                                                                                  self.profile))
        return {"budget_bytes": budget, "footprint_bytes": prepared.footprint_bytes, "capacity_bytes": capacity}

    def run(self, spec: RunSpec, case: ModelCase,
            policy: Policy | str | Mapping[str, Any]) -> Iterator[StepRecord]:
        """Yield one :class:`StepRecord` per step (warm-up steps first, ``warmup=True``). A run with a GPU budget
        (or the policy ``layer-ahead``: by default the simulated capacity) is simulated by
        :mod:`um_lab.sim.budget` (the layer-ahead scheduler's plan and its step time)."""
        policy = _as_policy(policy)
        prepared = self.prepare(case)
        capacity = self.capacity_for(spec, prepared.footprint_bytes)
        budget = self._budget(spec, prepared, policy, capacity)
        if budget is not None and stages(spec, policy):  # saved activations staged too (sim.staged)
            from um_lab.sim.staged import staged_records

            return staged_records(prepared.trace, prepared.placement.final, self.profile, spec.steps,
                                  spec.warmup_steps, budget, capacity, policy.name, self.name,
                                  workspace_bytes=workspace_bytes(case, prepared, self.profile))
        if budget is not None:  # the layer-ahead scheduler instead of the driver's demand paging (sim.budget)
            from um_lab.sim.budget import budget_records

            return budget_records(prepared.trace, prepared.placement.final, self.profile, spec.steps,
                                  spec.warmup_steps, budget, capacity, policy.name, self.name,
                                  workspace_bytes=workspace_bytes(case, prepared, self.profile))
        return self._records(spec, prepared, policy, capacity)

    @staticmethod
    def _budget(spec: RunSpec, prepared: PreparedCase, policy: Policy, capacity: int) -> int | None:
        """The run's budget (None: none), refused when the policy also gives advice: the simulator models
        the scheduler alone (um_lab.sim.budget), so advice under a budget would be silently ignored."""
        budget = resolve_budget(spec, policy, prepared.footprint_bytes, default_bytes=capacity // BLOCK * BLOCK,
                                limit_bytes=capacity, limit_name="the simulated GPU capacity")
        if budget is not None and not all(policy[t].is_default for t in DATA_TYPES):
            raise BudgetError(f"the simulator models a GPU budget without memory advice, and policy {policy.name!r} "
                              "gives some: use the policy layer-ahead (or um-default) with a budget on sim; on a "
                              "GPU the advice and the budget work together")
        return budget

    def op_ms(self, case: ModelCase, policy: Policy | str | Mapping[str, Any],
              steps: int = 2) -> tuple[float, dict[str, tuple[int, float]]]:
        """Simulated GPU time per traced op name at the profile's full capacity: ``(step ms, {op name:
        (count, ms)})`` for the last of ``steps`` steps (a diagnostic: which ops a policy slows)."""
        policy = _as_policy(policy)
        prepared = self.prepare(case)
        op_us = np.zeros(prepared.trace.n_ops)
        wall_us = 0.0
        for _, _, stats in self._steps(prepared, policy, int(self.profile.gpu_memory_bytes), steps, op_us):
            wall_us = float(stats.wall_us)
        by_op: dict[str, tuple[int, float]] = {}
        for name, us in zip(prepared.trace.op_names, op_us.tolist(), strict=True):
            n, ms = by_op.get(name, (0, 0.0))
            by_op[name] = (n + 1, ms + us / 1e3)
        return wall_us / 1e3, by_op

    def _records(self, spec: RunSpec, prepared: PreparedCase, policy: Policy,
                 capacity: int) -> Iterator[StepRecord]:
        for step, li, stats in self._steps(prepared, policy, capacity, spec.warmup_steps + spec.steps):
            yield _record(self.name, step, step < spec.warmup_steps, stats, prepared, li, capacity, policy)

    def _steps(self, prepared: PreparedCase, policy: Policy, capacity: int, steps: int,
               op_us: np.ndarray | None = None) -> Iterator[tuple[int, int, StepStats]]:
        """Simulate ``steps`` steps on a fresh driver model of ``capacity`` bytes: ``(step, layout index,
        stats)`` each. A step that starts from the previous one's driver state on the same layout repeats it
        exactly and is not simulated again, unless ``op_us`` is given (each op's GPU time, filled by every
        step: :func:`~um_lab.sim.stepper.run_step`)."""
        advice = AdviceTable.from_policy(policy)
        final = prepared.placement.final
        model = UvmModel(self.profile, advice, capacity, final.n_blocks)
        model.block_type[:] = final.block_type
        initialise(model, prepared)
        rm_us = [readmostly_write_us(prepared.trace, ob, final.block_type, advice, self.profile)
                 for ob in prepared.op_blocks]
        last: tuple[str, int, StepStats] | None = None
        for step in range(steps):
            li = min(step, len(prepared.placement.layouts) - 1)
            digest = model.state_digest() if op_us is None else None
            if last is not None and last[0] == digest and last[1] == li:
                yield step, li, last[2]  # same state, same layout: the step repeats exactly
                continue
            stats = run_step(model, prepared.trace, prepared.placement.layouts[li], prepared.op_blocks[li],
                             prepared.base_us, rm_us[li], self.prefetch_stream, prepared.host_us, op_us=op_us)
            if digest is not None:
                last = (digest, li, stats)
            yield step, li, stats


#: Host bytes per (access, 2 MiB block) entry of :func:`~um_lab.sim.access.expand`: kept per layout, and
#: the extra while one layout is expanded (measured with tracemalloc: 40 and 113 B on GPT-2)
ENTRY_KEPT_BYTES, ENTRY_EXPAND_BYTES = 40, 120
#: Host bytes per simulated 2 MiB VA block: the driver model's state (26 B) and a step's temporaries
BLOCK_STATE_BYTES = 64


def batch_bytes(case: ModelCase) -> int | None:
    """Bytes of ``case``'s input batch, built on the meta device (None: its factory needs real tensors)."""
    try:
        with torch.device("meta"):
            batch = case.make_batch(torch.Generator())
        if not all(t.is_meta for t in batch):
            return None
        return sum(t.numel() * t.element_size() for t in batch)
    except Exception:  # a user's batch factory that cannot run on meta: not checked before tracing
        return None


def host_bytes_to_simulate(trace: StepTrace, layouts: int = 1, n_blocks: int | None = None) -> int:
    """Host bytes the simulator needs for ``trace`` beyond the trace itself: the per-op block accesses of
    ``layouts`` replayed steps (an upper bound on their entries: each access's 2 MiB blocks) and the
    driver model's per-block state (``n_blocks``, default: the trace's peak bytes in 2 MiB blocks)."""
    entries = int(((trace.acc_hi - trace.acc_lo + BLOCK - 1) // BLOCK + 1).sum())
    blocks = n_blocks if n_blocks is not None else -(-trace.peak_bytes() // BLOCK)
    return entries * (ENTRY_KEPT_BYTES * layouts + ENTRY_EXPAND_BYTES) + blocks * BLOCK_STATE_BYTES


def check_batch_fits_host(case: ModelCase) -> None:
    """Refuse (:class:`HostMemoryRefused`) a case whose input batch, which the trace makes for real, is
    larger than the host memory available; cheap (the batch is sized on the meta device)."""
    needed = batch_bytes(case)
    if needed is not None:
        check_host_memory(needed, f"the input batch of {case.name} (the trace makes it for real)")


def check_host_memory(needed: int, what: str) -> None:
    """Raise :class:`HostMemoryRefused` when ``needed`` bytes exceed the host memory available now."""
    available = available_host_bytes()
    if available is not None and needed > available:
        raise HostMemoryRefused(int(needed), int(available), what)


def _as_policy(policy: Policy | str | Mapping[str, Any]) -> Policy:
    if isinstance(policy, Policy | str):
        return get_policy(policy)
    if isinstance(policy, Mapping):
        return Policy.from_dict(policy)
    raise PolicyError("policy",
                      f"must be a Policy, a preset name or a policy dict, got {type(policy).__name__}")


def initialise(model: UvmModel, prepared: PreparedCase) -> None:
    """Before the first step: parameters, gradients and optimizer state are written by the GPU
    (model moved to the GPU, gradients pre-allocated, state created), in allocation order."""
    trace = prepared.trace
    layout = prepared.placement.layouts[0]
    persistent = np.flatnonzero(trace.st_persistent & (trace.st_nbytes > 0))
    protect = np.zeros(len(model.gpu), bool)
    for s in persistent:
        lo = int(layout.st_va[s])
        hi = lo + int(trace.st_nbytes[s])
        first, last = lo // BLOCK, (hi - 1) // BLOCK
        blocks = np.arange(first, last + 1, dtype=np.int64)
        blo = np.maximum(lo, blocks * BLOCK) - blocks * BLOCK
        bhi = np.minimum(hi, (blocks + 1) * BLOCK) - blocks * BLOCK
        mask = page_mask(blo, bhi)
        model.access(blocks, mask, mask, np.zeros(len(blocks)), protect)
    model._reset_counters()


def _per_type(values: np.ndarray) -> dict[str, int]:
    return {t.value: int(v) for t, v in zip(DATA_TYPES, values, strict=True)}


def _record(backend: str, step: int, warmup: bool, stats: StepStats, prepared: PreparedCase, layout_index: int,
            capacity: int, policy: Policy) -> StepRecord:
    layout = prepared.placement.layouts[layout_index]
    return StepRecord(
        step=step,
        wall_ms=float(stats.wall_us) / 1e3,
        live_bytes={t.value: int(layout.segment_bytes[t.value]) for t in DATA_TYPES},
        cap_bytes=None,
        gpu_capacity_bytes=int(capacity // BLOCK * BLOCK),
        backend=backend,
        policy=policy.name,
        loss=None,
        warmup=warmup,
        resident_bytes=_per_type(stats.resident),
        htod_bytes=_per_type(stats.htod),
        dtoh_bytes=_per_type(stats.dtoh),
        gpu_page_faults=int(stats.faults),
        evictions=int(stats.evictions),
        remote_bytes=int(stats.remote_bytes),
        telemetry="simulated",
        extra={"fault_ms": float(stats.fault_us) / 1e3, "remote_ms": float(stats.remote_us) / 1e3,
               "trace_ops": prepared.trace.n_ops},
    )
