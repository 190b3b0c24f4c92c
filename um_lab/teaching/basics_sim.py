"""The simulator's side of the Unified Memory basics (:mod:`um_lab.teaching.basics`): one managed buffer driven
through :class:`um_lab.sim.uvm.UvmModel` with the H200 profile, step by step, reporting what the driver
model did (faults, migrations, remote bytes, evictions) and where the data is after each step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from um_lab.policy import Advice, Policy
from um_lab.sim.placement import BIG_PAGE, BLOCK
from um_lab.sim.profile import Profile, load_profile
from um_lab.sim.uvm import FULL_MASK, PAGE, AdviceTable, UvmModel, popcount
from um_lab.types import DATA_TYPES, DataType

MiB = 1 << 20
BUFFER_TYPE = DataType.INPUT  #: the data type the simulated buffer is filed under (its advice slot)
NO_ADVICE = Advice()
ZERO_COPY = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))


def result_row(case: str, step: str, ms: float, nbytes: int | None, **extra: Any) -> dict[str, Any]:
    """One row of an experiment's table: case, step, time and bandwidth (buffer bytes / time), and ``extra``."""
    gbps = nbytes / (ms * 1e6) if nbytes and ms > 0 else float("nan")
    return {"case": case, "step": step, "time_ms": round(ms, 4), "GBps": round(gbps, 2), **extra}


class SimBuffer:
    """One managed buffer in the simulator's UM driver model, with one :class:`Advice`."""

    def __init__(self, nbytes: int, advice: Advice = NO_ADVICE, *, cpu_written: bool = True,
                 capacity_bytes: int | None = None, profile: str | Profile = "h200") -> None:
        """``cpu_written``: the CPU filled the buffer first (its pages start on the host); else never touched.
        ``capacity_bytes``: the simulated GPU's memory (default: the profile's card)."""
        self.p = load_profile(profile)
        self.advice = advice
        self.n = max(1, -(-nbytes // BLOCK))
        self.nbytes = self.n * BLOCK
        table = AdviceTable.from_policy(Policy("basics", {BUFFER_TYPE: advice}))
        self.m = UvmModel(self.p, table, capacity_bytes or self.p.gpu_memory_bytes, self.n)
        self.m.block_type[:] = DATA_TYPES.index(BUFFER_TYPE)
        if cpu_written:
            self.m.cpu[:] = FULL_MASK
        self.blocks = np.arange(self.n, dtype=np.int64)

    def gpu_pass(self, write: bool = False) -> float:
        """A kernel reads (or overwrites) the whole buffer; returns its time in microseconds.

        Like the training stepper: roofline time or remote time (they overlap), plus fault servicing, plus
        one fault per written 4 KiB page of read_mostly data. Waves of half the GPU memory at most.
        """
        p, m = self.p, self.m
        wave = max(1, min(self.n, m.capacity_chunks // 2))
        protect = np.zeros(self.n, bool)
        t = p.kernel_us
        for lo in range(0, self.n, wave):
            b = self.blocks[lo:lo + wave]
            k = len(b)
            mask = np.full(k, FULL_MASK, np.uint32)
            wmask = mask if write else np.zeros(k, np.uint32)
            per_block = np.full(k, float(BLOCK))
            protect[b] = True
            fault, remote = m.access(b, mask, wmask, per_block * (not write), protect, per_block * write)
            protect[b] = False
            rm_us = 0.0
            if write and self.advice.read_mostly:
                m.invalidate_host_copies(b, wmask)
                rm_us = k * BLOCK / PAGE * p.readmostly_write_fault_us
            t += max(k * BLOCK / (p.hbm_GBps * 1e3), remote) + fault + rm_us
        return t

    def prefetch_to_gpu(self) -> float:
        """``cudaMemPrefetchAsync`` of the buffer to the GPU; returns the call + copy time in microseconds."""
        _, per_block, t_evict = self.m.prefetch_to_gpu(self.blocks)
        return self.p.prefetch_call_us + self.n * self.p.prefetch_call_us_per_block + t_evict + float(per_block.sum())

    def step(self, case: str, step: str, action: Callable[[], float], **extra: Any) -> dict[str, Any]:
        """Run ``action`` (returns microseconds) and report it with the driver model's counters."""
        m = self.m
        before = (int(m.htod.sum()), int(m.dtoh.sum()), m.faults, m.evictions, m.remote_bytes)
        us = action()
        after = (int(m.htod.sum()), int(m.dtoh.sum()), m.faults, m.evictions, m.remote_bytes)
        d = [a - b for a, b in zip(after, before, strict=True)]
        dup = int(popcount(m.gpu & m.cpu).astype(np.int64).sum()) * BIG_PAGE
        on_gpu = int(popcount(m.gpu).astype(np.int64).sum()) * BIG_PAGE
        return result_row(case, step, us / 1e3, self.nbytes, **extra, faults=int(d[2]), htod_MiB=d[0] / MiB,
                    dtoh_MiB=d[1] / MiB, remote_MiB=round(d[4] / MiB, 2), evictions=int(d[3]),
                    on_gpu_MiB=on_gpu / MiB, duplicated_MiB=dup / MiB)


def sim_page_faults(nbytes: int) -> list[dict[str, Any]]:
    """The simulator's first GPU touch of fresh memory and of CPU-written data: faults and migration."""
    fresh = SimBuffer(nbytes, cpu_written=False)
    host = SimBuffer(nbytes)
    return [fresh.step("fresh memory", "GPU write 1", lambda: fresh.gpu_pass(write=True)),
            fresh.step("fresh memory", "GPU write 2", lambda: fresh.gpu_pass(write=True)),
            host.step("CPU-written data", "GPU read 1", host.gpu_pass),
            host.step("CPU-written data", "GPU read 2", host.gpu_pass)]


def sim_prefetch(nbytes: int) -> list[dict[str, Any]]:
    """The simulator's demand faults against a prefetch before the first GPU read."""
    demand, pre = SimBuffer(nbytes), SimBuffer(nbytes)
    return [demand.step("demand faults", "GPU read", demand.gpu_pass),
            pre.step("prefetch first", "prefetch to GPU", pre.prefetch_to_gpu),
            pre.step("prefetch first", "GPU read", pre.gpu_pass)]


def sim_read_mostly(nbytes: int) -> list[dict[str, Any]]:
    """The simulator's read-mostly: GPU reads keep a copy; a GPU write collapses it."""
    rows = []
    for case, advice in (("no advice", NO_ADVICE), ("read_mostly", Advice(read_mostly=True))):
        b = SimBuffer(nbytes, advice)
        rows += [b.step(case, "GPU read 1", b.gpu_pass), b.step(case, "GPU read 2", b.gpu_pass),
                 b.step(case, "GPU write", functools.partial(b.gpu_pass, write=True))]
    return rows


def sim_zero_copy(nbytes: int, passes: int) -> list[dict[str, Any]]:
    """The simulator's preferred cpu + accessed by gpu: remote reads, nothing migrates."""
    rows = []
    for case, advice in (("no advice", NO_ADVICE), ("preferred cpu + accessed_by gpu", ZERO_COPY)):
        b = SimBuffer(nbytes, advice)
        rows += [b.step(case, f"GPU read {i + 1}", b.gpu_pass) for i in range(passes)]
    return rows


def sim_preferred(nbytes: int, ratio: float) -> list[dict[str, Any]]:
    """The simulator's preferred location gpu / cpu on a GPU too small for the buffer."""
    if nbytes / ratio < BLOCK:
        raise ValueError(f"a {nbytes // MiB} MiB buffer on a GPU {ratio:g}x too small is below one 2 MiB chunk: "
                         "use a larger size or a smaller ratio")
    rows = []
    for memory, capacity in (("fits", None), (f"buffer / {ratio:g} (simulated)", int(nbytes / ratio))):
        for case, advice in (("no advice", NO_ADVICE), ("preferred gpu", Advice(preferred_location="gpu")),
                             ("preferred cpu", Advice(preferred_location="cpu"))):
            b = SimBuffer(nbytes, advice, capacity_bytes=capacity)
            rows += [b.step(case, f"GPU read {i}", b.gpu_pass, gpu_memory=memory) for i in (1, 2)]
    return rows
