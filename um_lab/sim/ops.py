"""Per-op knowledge for the tracer: which ops launch no kernel, which need no warning, operand
re-reads of GEMM-like ops, causal attention, and the CUDA kernel choices emulated on the CPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: Ops that launch no kernel (metadata, host-side scalars, profiler markers).
NO_KERNEL = {
    "prim.device", "aten._local_scalar_dense", "aten.lift_fresh", "aten.detach", "aten.alias",
    "profiler._record_function_enter_new", "profiler._record_function_exit", "aten.empty",
    "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten._has_compatible_shallow_copy_type",
}
#: Non-pointwise ops whose generic accounting (bytes in + out) is known to be right: no warning.
KNOWN_GENERIC = {
    "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten._log_softmax",
    "aten._log_softmax_backward_data", "aten._softmax", "aten._softmax_backward_data", "aten._safe_softmax",
    "aten.nll_loss_forward", "aten.nll_loss_backward", "aten.embedding", "aten.embedding_dense_backward",
    "aten.native_dropout", "aten.native_dropout_backward", "aten.cat", "aten.clone", "aten.copy_",
    "aten._to_copy", "aten.zero_", "aten.fill_", "aten.zeros", "aten.ones", "aten.zeros_like",
    "aten.ones_like", "aten.full", "aten.full_like", "aten.scalar_tensor", "aten.arange",
    "aten.constant_pad_nd", "aten.native_batch_norm", "aten.native_batch_norm_backward",
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit",
    "aten.cudnn_batch_norm", "aten.cudnn_batch_norm_backward", "aten.max_pool2d_with_indices",
    "aten.max_pool2d_with_indices_backward", "aten.avg_pool2d", "aten.avg_pool2d_backward",
    "aten.adaptive_avg_pool2d", "aten._adaptive_avg_pool2d", "aten._adaptive_avg_pool2d_backward",
    "aten.mean", "aten.sum", "aten.amax", "aten.threshold_backward", "aten.gelu_backward",
    "aten.tanh_backward", "aten.sigmoid_backward", "aten.where", "aten.tril", "aten.triu",
    "aten.bernoulli_", "aten.uniform_", "aten.normal_", "aten.index_select", "aten.gather",
    "aten.scatter_add", "aten.index_put_", "aten._unsafe_index_put", "aten.masked_fill",
    "aten.masked_fill_", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.stack",
    "aten.repeat", "aten.split_with_sizes_copy", "aten.randint", "aten.randn", "aten.rand",
    "aten.convolution_backward", "aten.max", "aten.min", "aten.var_mean", "aten.rsqrt",
}



class CudaKernelChoices(TorchFunctionMode):
    """Replace CPU-only decompositions by the fused ops CUDA would run (same memory behaviour)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if k.shape[-3] == q.shape[-3] and k.dim() == 4 and (mask is None or not causal):
                with torch._C.DisableTorchFunction():
                    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
                    out = torch.ops.aten._scaled_dot_product_efficient_attention(
                        q, k, v, mask, need_lse, p, causal, scale=kwargs.get("scale"))
                return out[0]
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if not inplace:
                if not training or p == 0:
                    return x
                with torch._C.DisableTorchFunction():
                    return torch.ops.aten.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) of ``t`` inside its storage."""
    item = t.element_size()
    if t.numel() == 0:
        lo = t.storage_offset() * item
        return lo, lo
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * item
    return lo, lo + span * item


def gemm_reuse(name: str, args: tuple) -> dict[int, float]:
    """For GEMM-like ops: arg position -> extent of the other output dimension (operand re-reads)."""
    try:
        if name in ("aten.mm", "aten.bmm"):
            a, b = args[0], args[1]
            return {0: float(b.shape[-1]), 1: float(a.shape[-2])}
        if name in ("aten.addmm", "aten.baddbmm"):
            a, b = args[1], args[2]
            return {1: float(b.shape[-1]), 2: float(a.shape[-2])}
        if name in ("aten.convolution", "aten._convolution", "aten.cudnn_convolution"):
            x, w = args[0], args[1]
            pixels = x.shape[0] * math.prod(x.shape[2:])
            return {0: float(w.shape[0]), 1: float(pixels)}
        if name == "aten.convolution_backward":
            go, x, w = args[0], args[1], args[2]
            pixels = go.shape[0] * math.prod(go.shape[2:])
            return {0: float(max(w.shape[1], w.shape[0])), 1: float(w.shape[0]), 2: float(pixels)}
        if name.startswith("aten._scaled_dot_product") or name.startswith("aten._efficient_attention"):
            q = args[0]
            return {1: float(q.shape[-2]), 2: float(q.shape[-2])}
    except (AttributeError, IndexError, TypeError):
        pass
    return {}


def is_causal_attention(name: str, args: tuple, kwargs: dict) -> bool:
    """True for fused attention ops called with ``is_causal=True``."""
    positions = {"aten._scaled_dot_product_efficient_attention": 6,
                 "aten._scaled_dot_product_efficient_attention_backward": 11,
                 "aten._scaled_dot_product_flash_attention": 4,
                 "aten._scaled_dot_product_flash_attention_backward": 11}
    if name not in positions:
        return False
    pos = positions[name]
    return bool(kwargs.get("is_causal", args[pos] if len(args) > pos else False))
