"""Step timing and cuBLAS warm-up for :class:`~um_lab.cuda.session.Session`."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """CUDA events on a GPU; a wall clock on the CPU (fake-driver tests)."""

    def __init__(self, device: torch.device | None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._loss_host: torch.Tensor | None = None
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, loss: torch.Tensor) -> tuple[float, float]:
        """End the step: its time in ms and the loss's value.

        On a GPU the loss is copied into a reused pinned host buffer before the end event, so the one
        synchronisation on that event also delivers the loss (``float(loss)`` would be a second
        device-to-host round trip, from managed memory, after the step)."""
        value = loss.detach()
        if not self.cuda:
            return (time.perf_counter() - self._t0) * 1e3, float(value)
        host = None
        if value.is_cuda:
            host = self._loss_host
            if host is None or host.dtype != value.dtype:
                host = self._loss_host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value.reshape(()), non_blocking=True)
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)), float(value if host is None else host)


def warm_up_outside_pools(device: torch.device) -> None:
    """Create cuBLAS handles and workspaces now, in ordinary memory, not in a managed pool."""
    a = torch.ones(64, 64, device=device, requires_grad=True)
    b = torch.ones(64, 64, device=device)
    (torch.nn.functional.linear(a, b, b[0]) @ b).sum().backward()  # autograd's device thread
    with torch.autograd.set_multithreading_enabled(False):
        (torch.nn.functional.linear(a, b, b[0]) @ b).sum().backward()  # this thread
    torch.bmm(a.detach()[None], b[None])
    torch.cuda.synchronize(device)
