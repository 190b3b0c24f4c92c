"""The stager's device side: copies between device and pinned host memory on a side stream (:class:`CopyOps`:
CUDA, or synchronous CPU copies in tests) and the pinned host memory they land in (:class:`PinnedArena`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from um_lab import units

#: pinned host memory is allocated in chunks of this size (a tensor larger than a chunk gets its own)
ARENA_CHUNK_BYTES = 256 << 20
_ALIGN = 512


class CopyOps(Protocol):
    """The device calls the stager makes (CUDA, or synchronous CPU copies in tests)."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` the device can copy to and from asynchronously."""

    def empty_like_on_device(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised device tensor (allocated on the compute stream)."""

    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy ``src`` into ``dst`` on the side stream after the compute stream's work so far. Returns an event
        for the copy's end; the caller keeps the device tensor alive until then (see :class:`ActivationStager`)."""

    def is_done(self, event: Any) -> bool:
        """True once ``event`` has completed (the host does not wait)."""

    def compute_wait(self, event: Any) -> None:
        """The compute (current) stream waits for ``event``."""

    def side_wait(self, event: Any) -> None:
        """The side stream waits for ``event`` (of another stream) before its next copies."""

    def host_wait(self, event: Any) -> None:
        """The host waits for ``event``."""

    def synchronize(self) -> None:
        """The host waits for everything issued on the side stream."""


class CudaCopyOps:
    """:class:`CopyOps` on a GPU: one side stream for the copies in both directions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty_like_on_device(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def is_done(self, event: Any) -> bool:
        return bool(event.query())

    def compute_wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def side_wait(self, event: Any) -> None:
        self.stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()


class CpuCopyOps:
    """:class:`CopyOps` without a GPU (tests): plain tensors, copies done at once, no events."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty_like_on_device(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=dtype)

    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def is_done(self, event: Any) -> bool:
        return True

    def compute_wait(self, event: Any) -> None:
        pass

    def side_wait(self, event: Any) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def another_like(ops: CopyOps) -> CopyOps:
    """Copy ops of the same kind on a stream of their own (CUDA), or another set of CPU copy ops."""
    return CudaCopyOps(ops.device) if isinstance(ops, CudaCopyOps) else CpuCopyOps()


class PinnedArena:
    """Pinned host memory handed out in order and taken back all at once each step (:meth:`reset`):
    allocated the first time a step needs it, then reused, so later steps pin nothing new."""

    def __init__(self, ops: CopyOps, limit_bytes: int, chunk_bytes: int = ARENA_CHUNK_BYTES) -> None:
        self.ops = ops
        self.limit_bytes = int(limit_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self._chunks: list[torch.Tensor] = []
        self._chunk = 0  # the chunk handing out now
        self._offset = 0  # the next free byte in it

    @property
    def pinned_bytes(self) -> int:
        """Host bytes pinned so far."""
        return sum(c.numel() for c in self._chunks)

    def reset(self) -> None:
        """Everything handed out is free again (call once nothing still reads or writes it)."""
        self._chunk, self._offset = 0, 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of pinned host memory (uint8), or None when that would pass the limit."""
        while self._chunk < len(self._chunks):
            chunk = self._chunks[self._chunk]
            if self._offset + nbytes <= chunk.numel():
                out = chunk[self._offset:self._offset + nbytes]
                self._offset += -(-nbytes // _ALIGN) * _ALIGN
                return out
            self._chunk, self._offset = self._chunk + 1, 0
        size = max(nbytes, self.chunk_bytes)
        if self.pinned_bytes + size > self.limit_bytes:
            return None
        self._chunks.append(self.ops.pinned(size))
        self._chunk, self._offset = len(self._chunks) - 1, 0
        return self.take(nbytes)


def available_host_bytes() -> int:
    """Host memory this process can still use (:func:`um_lab.units.available_host_bytes`; 0 if unknown)."""
    return units.available_host_bytes() or 0
