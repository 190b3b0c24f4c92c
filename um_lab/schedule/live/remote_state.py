"""Optimizer state left in host memory, copied to the device for its chunk's step and back after it.

A plan with remote optimizer state (the experimental ``remote_optimizer`` option, on by default) leaves the
state it would otherwise move in host memory, where the optimizer's kernels read and write it over the link.
Those kernels reach the link's rate in neither direction: on the H200, GPT-2-XL at footprint/B = 2 spent
380 ms of GPU time in AdamW for 6.4 GB of remote state (43 ms when all of it was resident). Here each chunk's
remote state tensors are copied instead into a device slot on one side stream, a chunk ahead, and back after
the chunk's step on another, so the two directions run at once and overlap the steps.

The slots (:class:`CopySlots`, :data:`SLOTS` of them, each as large as the largest chunk's state) are allocated
once in the resident intermediate-results pool, which the ledger counts as fixed: the plan leaves room for them
before they exist (announced growth), so the ledger never passes B when they come. A first version took its
temporaries from the pool's cache instead; the pool grew under a plan and the ledger passed B on the GPU test's
MLP. Chunk ``i`` uses slot ``i % SLOTS``: its copies in wait (on the GPU) for the copies
back out of chunk ``i - SLOTS``, so a chunk's copies in, the step before it and the copies back of the one
before that run at once. The remote blocks are only copied, never made resident. The state dict holds the
slot views only while the optimizer steps the chunk; the originals are back in it on any exit (an exception
leaves them as they were before the chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from um_lab.schedule.costs import SLOTS, LinkCosts, link_cost_ms, worth_copying  # noqa: F401 - importable here too
from um_lab.schedule.live.pinned import CopyOps

_ALIGN = 512


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // _ALIGN) * _ALIGN


def chunk_state_bytes(optimizer: torch.optim.Optimizer, chunks: Sequence[list[nn.Parameter]]) -> int:
    """The largest chunk's optimizer-state tensors (scalars left out), each aligned as a slot holds them: the
    size of one slot."""
    best = 0
    for params in chunks:
        held = sum(_aligned(v.numel() * v.element_size()) for p in params
                   for v in (optimizer.state.get(p) or {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        best = max(best, held)
    return best


class CopySlots:
    """:data:`SLOTS` device buffers of ``slot_bytes`` (``allocate(nbytes)``: a uint8 device tensor, allocated in
    the pool the session routes to), kept across steps, and the last copy back out of each."""

    def __init__(self, slot_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.slot_bytes = int(slot_bytes)
        self.buffers = [allocate(self.slot_bytes) for _ in range(SLOTS)]
        self.released: list[Any] = [None] * SLOTS

    @property
    def nbytes(self) -> int:
        """Device bytes the slots hold."""
        return SLOTS * self.slot_bytes


@dataclasses.dataclass
class RemoteCopyStats:
    """One optimizer phase's copies of remote state (``extra["budget"]["remote_copies"]``)."""

    tensors: int = 0  #: state tensors copied in (and back)
    bytes_in: int = 0  #: bytes copied from host memory to the device
    bytes_out: int = 0  #: bytes copied back
    in_place_tensors: int = 0  #: remote tensors updated in place (not dense, or their chunk outgrew a slot)
    slot_bytes: int = 0  #: device bytes the slots hold


@dataclasses.dataclass
class _Chunk:
    entries: list[tuple[dict[str, Any], str, torch.Tensor]]  # (state dict, key, the original remote tensor)
    temps: list[torch.Tensor]
    ready: Any  # the last copy in's event (one stream: the earlier ones are done by then)


class RemoteStateCopies:
    """The copies for one optimizer phase over ``chunks`` (each a list of parameters, in stepping order).

    ``is_remote(t)``: whether a state tensor lies (partly) in the plan's remote blocks. ``ops_in`` and
    ``ops_out`` copy on two side streams (a CUDA stream runs its copies in order, one direction at a time);
    ``slots`` hold the device copies."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: Sequence[list[nn.Parameter]],
                 is_remote: Callable[[torch.Tensor], bool], ops_in: CopyOps, ops_out: CopyOps,
                 slots: CopySlots) -> None:
        self.optimizer = optimizer
        self.chunks = list(chunks)
        self.is_remote = is_remote
        self.ops_in, self.ops_out = ops_in, ops_out
        self.slots = slots
        self.stats = RemoteCopyStats(slot_bytes=slots.nbytes)
        self._incoming: dict[int, _Chunk] = {}
        self._last_out: Any = None

    def _entries(self, index: int) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """Chunk ``index``'s remote state tensors (scalars such as AdamW's step count are left alone)."""
        out = []
        for p in self.chunks[index]:
            state = self.optimizer.state.get(p) or {}
            out += [(state, key, value) for key, value in state.items() if isinstance(value, torch.Tensor)
                    and value.dim() > 0 and value.numel() > 0 and self.is_remote(value)]
        return out

    def _bring(self, index: int) -> None:
        """Issue chunk ``index``'s copies in (once), into slot ``index % SLOTS``."""
        if index in self._incoming or index >= len(self.chunks):
            return
        entries = self._entries(index)
        dense = [e for e in entries if e[2].is_contiguous()]
        if sum(_aligned(v.numel() * v.element_size()) for _, _, v in dense) > self.slots.slot_bytes:
            dense = []  # the chunk outgrew its slot (state added since the slots were sized): in place
        self.stats.in_place_tensors += len(entries) - len(dense)
        slot = index % SLOTS
        if dense and self.slots.released[slot] is not None:
            self.ops_in.side_wait(self.slots.released[slot])  # its last copies back out of the slot come first
        buffer, offset = self.slots.buffers[slot], 0
        temps, ready = [], None
        for _, _, value in dense:
            nbytes = value.numel() * value.element_size()
            temp = buffer[offset:offset + nbytes].view(value.dtype).view(value.shape)
            offset += _aligned(nbytes)
            ready = self.ops_in.copy_on_side(temp, value)
            temps.append(temp)
            self.stats.tensors += 1
            self.stats.bytes_in += nbytes
        self._incoming[index] = _Chunk(dense, temps, ready)

    @contextlib.contextmanager
    def around_step(self, index: int, params: list[nn.Parameter]) -> Iterator[None]:
        """Around chunk ``index``'s ``optimizer.step()``: its remote state swapped for device copies (the next
        chunk's copies issued first), copied back after the step."""
        self._bring(index)
        self._bring(index + 1)
        chunk = self._incoming.pop(index)
        if not chunk.entries:
            yield
            return
        self.ops_in.compute_wait(chunk.ready)
        for (state, key, _), temp in zip(chunk.entries, chunk.temps, strict=True):
            state[key] = temp
        try:
            yield
        finally:
            for state, key, original in chunk.entries:
                state[key] = original
        done = None
        for (_, _, original), temp in zip(chunk.entries, chunk.temps, strict=True):
            done = self.ops_out.copy_on_side(original, temp)
            self.stats.bytes_out += temp.numel() * temp.element_size()
        self.slots.released[index % SLOTS] = done
        self._last_out = done

    def finish(self) -> dict[str, Any]:
        """After the optimizer phase: the compute stream waits for the copies back (the next step's work, and
        the next phase's copies in, come after them). Returns the stats."""
        if self._last_out is not None:
            self.ops_out.compute_wait(self._last_out)
        self.slots.released = [None] * SLOTS
        self._incoming.clear()
        return dataclasses.asdict(self.stats)

    def abort(self) -> None:
        """After a failed phase: wait for every copy issued."""
        self.ops_in.synchronize()
        self.ops_out.synchronize()
        self.slots.released = [None] * SLOTS
        self._incoming.clear()
