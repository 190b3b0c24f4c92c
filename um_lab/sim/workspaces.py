"""cuDNN's workspaces in a budget session: room the CPU trace does not see.

A convolution's cuDNN kernels allocate workspaces in the intermediate-results pool (up to 302 MiB a call for ResNet-50
at batch 64 on an H100), and the caching allocator keeps segments large enough for them beside the live activations.
The CPU trace cannot see which workspaces cuDNN chooses, so for a model whose repeated layers convolve (dense,
overlapping windows: a ResNet's blocks, not a vision transformer's patch embedding or a depthwise convolution) a
budget session's pools are taken to hold :attr:`~um_lab.sim.profile.Profile.conv_pool_slack` times the model's own
intermediate-results bytes beyond its traced footprint. The memory planner counts that room in every candidate's
footprint, and the simulator plans the scheduler's moves under B less that room (the room is reported with the
budget: ``extra["budget"]["workspace_bytes"]``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from um_lab.types import DataType

_CONVOLVES: dict[str, bool] = {}
_LOCK = threading.Lock()


def overlapping_dense_conv(module: nn.Module) -> bool:
    """A convolution with one group whose windows overlap (some stride below its kernel's extent): cuDNN runs it as
    an implicit GEMM with a workspace; a patch embedding (stride = kernel) or a depthwise one does not count."""
    if not isinstance(module, nn.modules.conv._ConvNd) or module.groups != 1:  # noqa: SLF001
        return False
    return any(s < k for s, k in zip(module.stride, module.kernel_size, strict=False))


def layers_convolve(model: nn.Module) -> bool:
    """Whether one of ``model``'s repeated layers (:func:`um_lab.training.layers`) holds an
    :func:`overlapping_dense_conv`."""
    from um_lab.training import layers

    return any(overlapping_dense_conv(m) for _, layer in layers(model) for m in layer.modules())


def built_on_meta(case: Any) -> nn.Module:
    """``case``'s model built on the meta device where its constructor allows, else for real."""
    try:
        with torch.device("meta"):
            return case.build_model()
    except Exception:  # a constructor that computes with tensor values
        return case.build_model()


def workspace_bytes(case: Any, prepared: Any, profile: Any) -> int:
    """The room a budget session's pools hold for ``case``'s cuDNN workspaces beyond its traced footprint
    (``prepared``: the simulator's :class:`~um_lab.sim.backend.PreparedCase` of it): the profile's
    ``conv_pool_slack`` share of its intermediate-results bytes where its layers convolve, else 0."""
    key = prepared.trace.key
    with _LOCK:
        convolves = _CONVOLVES.get(key)
    if convolves is None:
        convolves = layers_convolve(built_on_meta(case))
        with _LOCK:
            _CONVOLVES[key] = convolves
    if not convolves:
        return 0
    return int(profile.conv_pool_slack * prepared.placement.final.segment_bytes.get(DataType.ACT, 0))
