"""Optimizer state left in host memory, copied to the device for its chunk's step and back after it.

A plan with remote optimizer state (``Session(budget_remote_optimizer=True)``) leaves the state it would
otherwise move in host memory, where the optimizer's kernels read and write it over the link. Those kernels
reach the link's rate in neither direction: on the H200, GPT-2-XL at footprint/B = 2 spent 380 ms of GPU time
in AdamW for 6.4 GB of remote state (43 ms when all of it was resident; session 20 call 1). Here each chunk's
remote state tensors are copied instead into device temporaries on one side stream, a chunk ahead, and back
after the chunk's step on another, so the two directions run at once and overlap the steps.

The temporaries come from the pool the chunk's step allocates in: the resident intermediate-results pool
(fixed in the ledger and idle after backward), so the budget counts them in that pool's reserved bytes; the
remote blocks themselves are only copied, never made resident. The state dict holds the temporaries only
while the optimizer steps the chunk; the originals are back in it on any exit (an exception leaves them as
they were before the chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from um_lab.budget.pinned import CopyOps


@dataclasses.dataclass
class RemoteCopyStats:
    """One optimizer phase's copies of remote state (``extra["budget"]["remote_copies"]``)."""

    tensors: int = 0  #: state tensors copied in (and back)
    bytes_in: int = 0  #: bytes copied from host memory to the device
    bytes_out: int = 0  #: bytes copied back
    throttle_ms: float = 0.0  #: host time waiting for copies back (too many temporaries held)


@dataclasses.dataclass
class _Chunk:
    entries: list[tuple[dict[str, Any], str, torch.Tensor]]  # (state dict, key, the original remote tensor)
    temps: list[torch.Tensor]
    ready: Any  # the last copy in's event (one stream: the earlier ones are done by then)


class RemoteStateCopies:
    """The copies for one optimizer phase over ``chunks`` (each a list of parameters, in stepping order).

    ``is_remote(t)``: whether a state tensor lies (partly) in the plan's remote blocks. ``ops_in`` and
    ``ops_out`` copy on two side streams (a CUDA stream runs its copies in order, one direction at a time).
    ``max_held_bytes``: temporaries held at once before the host waits for the oldest copy back."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: Sequence[list[nn.Parameter]],
                 is_remote: Callable[[torch.Tensor], bool], ops_in: CopyOps, ops_out: CopyOps,
                 max_held_bytes: int) -> None:
        self.optimizer = optimizer
        self.chunks = list(chunks)
        self.is_remote = is_remote
        self.ops_in, self.ops_out = ops_in, ops_out
        self.max_held_bytes = int(max_held_bytes)
        self.stats = RemoteCopyStats()
        self._incoming: dict[int, _Chunk] = {}
        self._outgoing: list[tuple[Any, list[torch.Tensor]]] = []  # (last copy back's event, its temporaries)

    def _entries(self, index: int) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """Chunk ``index``'s remote state tensors (scalars such as AdamW's step count are left alone)."""
        out = []
        for p in self.chunks[index]:
            state = self.optimizer.state.get(p) or {}
            out += [(state, key, value) for key, value in state.items() if isinstance(value, torch.Tensor)
                    and value.dim() > 0 and value.numel() > 0 and self.is_remote(value)]
        return out

    def _bring(self, index: int) -> None:
        """Issue chunk ``index``'s copies in (once)."""
        if index in self._incoming or index >= len(self.chunks):
            return
        entries = self._entries(index)
        temps, ready = [], None
        for _, _, value in entries:
            temp = self.ops_in.empty_like_on_device(value.shape, value.stride(), value.dtype)
            ready = self.ops_in.copy_on_side(temp, value)
            temps.append(temp)
            self.stats.tensors += 1
            self.stats.bytes_in += value.numel() * value.element_size()
        self._incoming[index] = _Chunk(entries, temps, ready)

    def _release_done(self) -> None:
        while self._outgoing and self.ops_out.is_done(self._outgoing[0][0]):
            self._outgoing.pop(0)

    def _throttle(self) -> None:
        self._release_done()
        held = sum(t.numel() * t.element_size() for c in self._incoming.values() for t in c.temps)
        held += sum(t.numel() * t.element_size() for _, temps in self._outgoing for t in temps)
        if held <= self.max_held_bytes:
            return
        began = time.perf_counter()
        while held > self.max_held_bytes and self._outgoing:
            event, temps = self._outgoing.pop(0)
            self.ops_out.host_wait(event)
            held -= sum(t.numel() * t.element_size() for t in temps)
        self.stats.throttle_ms += (time.perf_counter() - began) * 1e3

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
        self._outgoing.append((done, chunk.temps))
        self._throttle()

    def finish(self) -> dict[str, Any]:
        """After the optimizer phase: the compute stream waits for every copy back (the next step's work,
        and the next phase's copies in, come after them); the temporaries are let go. Returns the stats."""
        if self._outgoing:
            self.ops_out.compute_wait(self._outgoing[-1][0])
        self._outgoing.clear()
        self._incoming.clear()
        return dataclasses.asdict(self.stats)

    def abort(self) -> None:
        """After a failed phase: wait for every copy issued, then let the temporaries go."""
        self.ops_in.synchronize()
        self.ops_out.synchronize()
        self._outgoing.clear()
        self._incoming.clear()
