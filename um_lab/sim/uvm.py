"""The Unified Memory driver model: residency, faults, migration, eviction and advice, per VA block.

State, one entry per 2 MiB VA block (NumPy arrays): ``gpu`` and ``cpu`` are uint32 masks of the 64 KiB
big pages with a valid copy on each side (both set = read-duplicated), ``mig_time`` orders blocks by
when data last migrated in (eviction is least-recently-*migrated-in*, advice ignored), and the GPU
holds at most ``capacity_chunks`` 2 MiB root chunks (a block with any GPU page holds one).

A GPU access to a page without a GPU copy is decided in the order of the open nvidia-uvm driver:

1. ``accessed_by`` includes the GPU and the page lives on the host: the GPU keeps a mapping (also
   after eviction), so it reads/writes remotely, without a fault or a migration.
2. ``read_mostly`` and the op only reads the page: fault, duplicate it to the GPU (host copy kept).
3. never populated: populate at the preferred location when that is the CPU (then 5), else on the GPU.
4. preferred location GPU, or no preference: fault and migrate to the GPU.
5. preferred location CPU: stay on the host, map remotely (zero-copy).

Faults are serviced in batches (``fault_batch_size``) with a cost per batch and per block plus the
transfer; the prefetcher pulls a whole block in once more than ``density_threshold`` of it would be
resident. GPU writes to ``read_mostly`` data fault once per 4 KiB page and kernel and collapse the
duplicates (calibrated on the H200, where this made training 100-1,500x slower). Explicit prefetches
(``to-gpu-before-use`` at the start of the phase that uses a type, ``to-cpu-after-use`` after the
step) run on the compute stream as the real backend issues them (or a copy stream that overlaps compute:
``SimBackend(prefetch_stream="copy")``), migrate regardless of the preferred location, and may evict.
Remote accesses run at the host-link bandwidth, overlapping the kernel's own compute.

Eviction order and the oversubscription ratio (``tests/test_sim_monotone.py``). Least-recently-
migrated-in is first-in-first-out, and hits do not refresh a chunk. Two consequences the driver shares:

* Belady's anomaly: FIFO is not a stack algorithm (a larger memory need not hold a superset of what a smaller
  one holds), so at some ratios a smaller GPU evicts fewer chunks and the step runs faster, e.g. ResNet-50
  bs 128 with ``offload-optimizer``: 2.04 s at 1.5x, 1.92 s at 2.0x (6171 -> 5814 evictions per step).
* The domino: when a step touches its blocks in the order of the step before, each miss evicts the oldest
  chunk, which is the next block the step needs; once a step does not fit, every block it touches moves
  every step, whatever the deficit. GPT-2-medium bs 8 x 1024 under ``um-default`` migrates its whole
  34.4 GiB footprint each step and takes 6.10 s from 1.05x to 1.5x (LRU would move less at 1.05x).

Here a block goes to the back of the queue whenever pages migrate into it; the driver source reads as
moving a root chunk only when its block first becomes resident. That stricter rule makes the anomalies
larger on small models (ResNet-18 bs 8 at 64 px, um-default: 69.9 ms at 1.55x, 31.9 ms at 1.6x).
Two more departures: blocks that eviction skips because the current op uses them also go to the back of
the queue (LRU-like), and a prefetch larger than the free memory keeps its first blocks in address order
and protects blocks already resident, where the driver would end up holding the last ones and could evict
blocks of the same prefetch.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from um_lab.policy import PREFETCH_BEFORE, STEP_PHASES, Policy
from um_lab.sim.placement import BIG_PAGE, BLOCK, PAGES_PER_BLOCK
from um_lab.sim.profile import Profile
from um_lab.types import DATA_TYPES, DataType

PREF_NONE, PREF_GPU, PREF_CPU = 0, 1, 2
FULL_MASK = np.uint32(0xFFFFFFFF)
PAGE = 4096
#: Phase (index into :data:`um_lab.policy.STEP_PHASES`, as ``trace.op_phase``) before which a type's
#: ``to-gpu-before-use`` prefetch is issued: the real session's table, :data:`um_lab.policy.PREFETCH_BEFORE`.
PREFETCH_PHASE: dict[DataType, int] = {
    t: STEP_PHASES.index(phase) for phase, types in PREFETCH_BEFORE.items() for t in types
}
#: Where explicit prefetches run: on the compute stream (what the real backend does: kernels after
#: the prefetch wait for it) or on a copy stream (kernels wait only for the blocks they touch).
PREFETCH_STREAMS = ("compute", "copy")


_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits per element of a uint32 array (big pages in a mask); NumPy 1.x fallback included."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x)
    x = np.ascontiguousarray(x, np.uint32)
    return _BYTE_BITS[x.view(np.uint8)].reshape(*x.shape, 4).sum(axis=-1, dtype=np.uint8)


@dataclasses.dataclass(frozen=True)
class AdviceTable:
    """A policy as small arrays indexed by data type (order of :data:`um_lab.types.DATA_TYPES`)."""

    preferred: np.ndarray
    gpu_mapped: np.ndarray
    read_mostly: np.ndarray
    prefetch_to_gpu: np.ndarray
    prefetch_to_cpu: np.ndarray

    @classmethod
    def from_policy(cls, policy: Policy) -> AdviceTable:
        """Translate a :class:`Policy` (already validated) into arrays."""
        adv = [policy[t] for t in DATA_TYPES]
        code = {"none": PREF_NONE, "gpu": PREF_GPU, "cpu": PREF_CPU}
        return cls(
            preferred=np.array([code[a.preferred_location] for a in adv], np.int8),
            gpu_mapped=np.array(["gpu" in a.accessed_by for a in adv], bool),
            read_mostly=np.array([a.read_mostly for a in adv], bool),
            prefetch_to_gpu=np.array([a.prefetch == "to-gpu-before-use" for a in adv], bool),
            prefetch_to_cpu=np.array([a.prefetch == "to-cpu-after-use" for a in adv], bool),
        )


@dataclasses.dataclass
class StepStats:
    """What one simulated step did (per-type arrays in DATA_TYPES order, bytes)."""

    wall_us: float
    htod: np.ndarray
    dtoh: np.ndarray
    resident: np.ndarray
    faults: int
    evictions: int
    remote_bytes: float
    fault_us: float
    remote_us: float


class UvmModel:
    """Residency state of all VA blocks and the rules that change it (see module doc)."""

    def __init__(self, profile: Profile, advice: AdviceTable, capacity_bytes: int, n_blocks: int) -> None:
        if capacity_bytes < BLOCK:
            raise ValueError(f"GPU capacity must be at least one 2 MiB chunk, got {capacity_bytes} B")
        self.p = profile
        self.a = advice
        self.capacity_chunks = int(capacity_bytes // BLOCK)
        self.gpu = np.zeros(n_blocks, np.uint32)
        self.cpu = np.zeros(n_blocks, np.uint32)
        self.mig_time = np.zeros(n_blocks, np.int64)
        self.arrival = np.zeros(n_blocks, np.float64)
        self.used = 0
        self.clock = 0
        self.fifo_blk = np.zeros(1024, np.int64)
        self.fifo_time = np.zeros(1024, np.int64)
        self.fifo_len = 0
        self.head = 0
        self.block_type = np.zeros(n_blocks, np.int8)
        self._reset_counters()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        n = len(DATA_TYPES)
        self.htod = np.zeros(n, np.int64)
        self.dtoh = np.zeros(n, np.int64)
        self.faults = 0
        self.evictions = 0
        self.remote_bytes = 0.0
        self.fault_us = 0.0
        self.remote_us = 0.0

    def state_digest(self) -> str:
        """A digest of everything the next step depends on (residency and eviction order)."""
        h = hashlib.sha1()
        h.update(self.gpu.tobytes())
        h.update(self.cpu.tobytes())
        resident = np.flatnonzero(self.gpu)
        h.update(resident[np.argsort(self.mig_time[resident], kind="stable")].tobytes())
        return h.hexdigest()

    def _note_migrated_in(self, blocks: np.ndarray) -> None:
        k = len(blocks)
        if k == 0:
            return
        times = self.clock + np.arange(1, k + 1)
        self.clock += k
        self.mig_time[blocks] = times
        if self.fifo_len + k > len(self.fifo_blk):
            self._compact_fifo(extra=k)
        self.fifo_blk[self.fifo_len:self.fifo_len + k] = blocks
        self.fifo_time[self.fifo_len:self.fifo_len + k] = times
        self.fifo_len += k

    def _compact_fifo(self, extra: int) -> None:
        blk = self.fifo_blk[self.head:self.fifo_len]
        tim = self.fifo_time[self.head:self.fifo_len]
        valid = (self.mig_time[blk] == tim) & (self.gpu[blk] != 0)
        blk, tim = blk[valid], tim[valid]
        size = max(1024, 2 * (len(blk) + extra))
        self.fifo_blk = np.zeros(size, np.int64)
        self.fifo_time = np.zeros(size, np.int64)
        self.fifo_blk[:len(blk)] = blk
        self.fifo_time[:len(blk)] = tim
        self.fifo_len = len(blk)
        self.head = 0

    def evict(self, count: int, protect: np.ndarray | None) -> tuple[int, float]:
        """Evict up to ``count`` chunks, least recently migrated in first, skipping ``protect``.

        Returns (chunks evicted, microseconds spent writing them back to the host). First in, first out
        (the driver's order), so the victims at one capacity are not a subset of those at a smaller one:
        a smaller GPU can evict fewer chunks per step (Belady's anomaly; the module doc has an example).
        """
        victims: list[np.ndarray] = []
        found = 0
        keep: list[tuple[np.ndarray, np.ndarray]] = []
        while found < count and self.head < self.fifo_len:
            end = min(self.fifo_len, self.head + max(256, 2 * (count - found)))
            blk = self.fifo_blk[self.head:end]
            tim = self.fifo_time[self.head:end]
            valid = (self.mig_time[blk] == tim) & (self.gpu[blk] != 0)
            prot = protect[blk] if protect is not None else np.zeros(len(blk), bool)
            choose = valid & ~prot
            idx = np.flatnonzero(choose)[: count - found]
            stop = (idx[-1] + 1) if len(idx) and found + len(idx) >= count else len(blk)
            chosen = blk[idx]
            victims.append(chosen)
            found += len(chosen)
            skipped = valid[:stop] & prot[:stop]
            if skipped.any():
                keep.append((blk[:stop][skipped], tim[:stop][skipped]))
            self.head += stop
        for blk, _ in keep:  # protected blocks in use now: they go to the back of the queue
            self._note_migrated_in(blk)
        if not victims:
            return 0, 0.0
        v = np.unique(np.concatenate(victims)) if len(victims) > 1 else victims[0]
        if len(v) == 0:
            return 0, 0.0
        moved = self._move_to_host(v)
        self.evictions += len(v)
        t = moved / (self.p.evict_d2h_GBps * 1e3) + len(v) * self.p.evict_chunk_us
        return len(v), t

    def _move_to_host(self, blocks: np.ndarray) -> float:
        """Move GPU-resident ``blocks`` to the host (their chunks freed); returns bytes copied."""
        only_gpu = self.gpu[blocks] & ~self.cpu[blocks]
        nbytes = popcount(only_gpu).astype(np.int64) * BIG_PAGE
        np.add.at(self.dtoh, self.block_type[blocks], nbytes)
        self.cpu[blocks] |= self.gpu[blocks]
        self.gpu[blocks] = 0
        self.used -= len(blocks)
        return float(nbytes.sum())

    def _make_room(self, need: int, protect: np.ndarray) -> float:
        """Evict so that ``need`` more chunks fit; returns the time spent."""
        excess = self.used + need - self.capacity_chunks
        if excess <= 0:
            return 0.0
        _, t = self.evict(excess, protect)
        return t

    # -- GPU accesses ---------------------------------------------------------------------------
    def access(self, blocks: np.ndarray, mask: np.ndarray, wmask: np.ndarray, remote_bytes: np.ndarray,
               protect: np.ndarray, remote_write_bytes: np.ndarray | None = None,
               inplace_bytes: np.ndarray | None = None) -> tuple[float, float]:
        """A kernel touches ``mask`` pages of ``blocks``; return (fault stall us, remote access us).

        ``remote_bytes`` / ``remote_write_bytes``: per block, the bytes the kernel would read / write
        over the host link if the block were remote. A kernel's remote time is the longest of its read
        stream, its write stream and both together at ``remote_rw_GBps`` (measured in-step: the two
        directions overlap only in part), or at ``remote_inplace_GBps`` when all it reads and writes is
        updated in place (``inplace_bytes`` per block: an optimizer's foreach update). ``protect``: a
        boolean array over all blocks, True for this op's blocks (not evicted for it).
        """
        miss = mask & ~self.gpu[blocks]
        sel = miss != 0
        if not sel.any():
            return 0.0, 0.0
        a = self.a
        bb = blocks[sel]
        mm = miss[sel]
        wm = wmask[sel]
        ty = self.block_type[bb]
        pref = a.preferred[ty]
        cpu = self.cpu[bb]
        unpop = mm & ~cpu
        pop_cpu = np.where(pref == PREF_CPU, unpop, np.uint32(0)).astype(np.uint32)
        pop_gpu = unpop & ~pop_cpu
        if pop_cpu.any():
            self.cpu[bb] |= pop_cpu
            cpu = cpu | pop_cpu
        oncpu = mm & cpu
        mapped = a.gpu_mapped[ty]
        rm = a.read_mostly[ty]
        # accessed_by=gpu: a page on the host (evicted ones included) is read remotely from then on and never
        # migrates back, so what is remote depends on what the first steps evicted (a smaller GPU can end
        # with less, or cheaper, data remote), and remote reads at link speed can cost less than the
        # evict-and-fault-back cycle they replace: two ways a larger ratio can run faster.
        remote = np.where(mapped | ((pref == PREF_CPU) & ~rm), oncpu, np.uint32(0)).astype(np.uint32)
        rest = oncpu & ~remote
        dup = np.where(rm, rest & ~wm, np.uint32(0)).astype(np.uint32)
        mig = rest & ~dup
        # density prefetcher: a block more than half resident comes in whole (host-resident pages)
        movable = ~mapped & (pref != PREF_CPU) | rm
        gpu_now = self.gpu[bb]
        share = popcount(gpu_now | mig | dup | pop_gpu)
        dense = (share > self.p.density_threshold * PAGES_PER_BLOCK) & movable
        if dense.any():
            more = np.where(dense, cpu & ~gpu_now & ~remote, np.uint32(0)).astype(np.uint32)
            dup = dup | np.where(rm, more, np.uint32(0)).astype(np.uint32)
            mig = mig | np.where(rm, np.uint32(0), more).astype(np.uint32)
        bring = pop_gpu | mig | dup
        remote_us = 0.0
        if remote.any():
            frac = popcount(remote) / np.maximum(popcount(mask[sel]), 1)
            rbytes = float((remote_bytes[sel] * frac).sum())
            wbytes = float((remote_write_bytes[sel] * frac).sum()) if remote_write_bytes is not None else 0.0
            self.remote_bytes += rbytes + wbytes
            ibytes = float((inplace_bytes[sel] * frac).sum()) if inplace_bytes is not None else 0.0
            in_place = ibytes > 0 and ibytes >= 0.99 * max(rbytes, wbytes)
            both = self.p.remote_inplace_GBps if in_place else self.p.remote_rw_GBps
            remote_us = max(rbytes / (self.p.remote_GBps * 1e3), wbytes / (self.p.remote_write_GBps * 1e3),
                            (rbytes + wbytes) / (both * 1e3))
            self.remote_us += remote_us
        if not bring.any():
            return 0.0, remote_us
        sb = bring != 0
        bb, bring, mig, dup, pop_gpu, ty = bb[sb], bring[sb], mig[sb], dup[sb], pop_gpu[sb], ty[sb]
        new_chunk = self.gpu[bb] == 0
        t = self._make_room(int(new_chunk.sum()), protect)
        self.gpu[bb] |= bring
        self.cpu[bb] &= ~(mig | pop_gpu)
        self.used += int(new_chunk.sum())
        self._note_migrated_in(bb)
        moved = popcount(mig | dup).astype(np.int64) * BIG_PAGE
        np.add.at(self.htod, ty, moved)
        frac_mig = popcount(mig | dup) / PAGES_PER_BLOCK
        frac_pop = popcount(pop_gpu) / PAGES_PER_BLOCK
        n_faults = int(np.maximum(1, np.rint((frac_mig + frac_pop) * self.p.faults_per_block)).sum())
        self.faults += n_faults
        batches = -(-n_faults // self.p.fault_batch_size)
        t += (batches * self.p.fault_batch_us + float(frac_mig.sum()) * self.p.fault_block_us
              + float(frac_pop.sum()) * self.p.populate_block_us
              + float(moved.sum()) / (self.p.fault_xfer_GBps * 1e3))
        if self.used > self.capacity_chunks:  # one op needs more than the GPU holds: thrash
            _, te = self.evict(self.used - self.capacity_chunks, None)
            t += te
        self.fault_us += t
        return t, remote_us

    def invalidate_host_copies(self, blocks: np.ndarray, wmask: np.ndarray) -> None:
        """GPU writes collapse read duplicates: the host copies of written pages become invalid."""
        self.cpu[blocks] &= ~wmask

    # -- explicit prefetches --------------------------------------------------------------------
    def prefetch_to_gpu(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """``cudaMemPrefetchAsync`` of ``blocks`` to the GPU (evicting others as needed).

        Returns (blocks moved, copy-stream time of each, eviction time before the copies).
        """
        if len(blocks) == 0:
            return blocks, np.zeros(0), 0.0
        protect = np.zeros(len(self.gpu), bool)
        protect[blocks] = True
        need_new = blocks[self.gpu[blocks] == 0]
        t_evict = self._make_room(len(need_new), protect)
        room = self.capacity_chunks - self.used
        if len(need_new) > room:  # the set does not fit: prefetch in VA order until full
            allowed = np.ones(len(blocks), bool)
            new_pos = np.flatnonzero(self.gpu[blocks] == 0)
            allowed[new_pos[max(room, 0):]] = False
            blocks = blocks[allowed]
        rm = self.a.read_mostly[self.block_type[blocks]]
        moving = self.cpu[blocks] & ~self.gpu[blocks]
        new_chunk = self.gpu[blocks] == 0
        moved_bytes = popcount(moving).astype(np.int64) * BIG_PAGE
        np.add.at(self.htod, self.block_type[blocks], moved_bytes)
        touched = (moving != 0) | new_chunk
        self.gpu[blocks] = FULL_MASK
        self.cpu[blocks] &= np.where(rm, FULL_MASK, np.uint32(0)).astype(np.uint32)
        self.used += int(new_chunk.sum())
        self._note_migrated_in(blocks[touched])
        per_block = moved_bytes / (self.p.prefetch_h2d_GBps * 1e3) + touched * self.p.prefetch_block_us
        return blocks, per_block, t_evict

    def prefetch_to_cpu(self, blocks: np.ndarray) -> float:
        """``cudaMemPrefetchAsync`` of ``blocks`` to the host; returns the copy-stream time."""
        blocks = blocks[self.gpu[blocks] != 0]
        if len(blocks) == 0:
            return 0.0
        moved = self._move_to_host(blocks)
        return moved / (self.p.prefetch_d2h_GBps * 1e3) + len(blocks) * self.p.prefetch_block_us

    def resident_by_type(self) -> np.ndarray:
        """GPU-resident bytes per data type."""
        out = np.zeros(len(DATA_TYPES), np.int64)
        np.add.at(out, self.block_type, popcount(self.gpu).astype(np.int64) * BIG_PAGE)
        return out
