"""Registered tensors of a session: enumerate them, and copy them out of managed memory on close."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from um_lab.cuda.allocator import ManagedPools


def is_tensor(value: Any) -> bool:
    """True for a ``torch.Tensor``."""
    return isinstance(value, torch.Tensor)


def module_tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    """A module's parameters, then its buffers."""
    yield from module.parameters()
    yield from module.buffers()


def evacuate(pools: ManagedPools, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer],
             on_device: Callable[[torch.Tensor], bool]) -> None:
    """Copy the modules' parameters, buffers and gradients and the optimizers' state out of managed
    memory into ordinary CUDA memory (``on_device``: the tensor is on the session's GPU)."""
    index = pools.source.index()

    def managed(t: torch.Tensor) -> bool:
        return on_device(t) and index.data_type_of(t.data_ptr()) is not None

    with torch.no_grad():
        for module in modules:
            for tensor in module_tensors(module):
                if managed(tensor):
                    tensor.data = tensor.data.clone()
            for p in module.parameters():
                if p.grad is not None and managed(p.grad):
                    p.grad = p.grad.clone()
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if is_tensor(value) and managed(value):
                        state[key] = value.clone()
