"""Per-op knowledge for the tracer: which ops launch no kernel, which need no warning, how ops read
remote operands, causal attention, and the CUDA kernel choices emulated on the CPU."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

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



def cuda_runs_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  mask: torch.Tensor | None) -> bool:
    """Whether CUDA's ``scaled_dot_product_attention`` takes its memory-efficient kernel for these inputs (the
    checks of PyTorch's ``sdp_utils`` that a training step meets): the last dimension of q, k, v and the mask
    dense (stride 1), head dimensions a multiple of 4 (fp32) or 8 (16-bit). Otherwise it runs the unfused
    math path, which keeps the attention matrix for the backward."""
    align = 4 if q.dtype == torch.float32 else 8
    return (all(t.stride(-1) == 1 for t in (q, k, v)) and (mask is None or mask.stride(-1) == 1)
            and q.shape[-1] % align == 0 and v.shape[-1] % align == 0)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
                   scale: float | None) -> torch.Tensor:
    """CUDA's unfused attention (``_scaled_dot_product_attention_math``) in the aten ops it runs: both operands
    scaled by the square root of the scale, the mask added, a safe softmax, dropout with a boolean mask."""
    s = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    attn = torch.matmul(q * s, k.transpose(-2, -1) * s)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=attn.dtype).masked_fill_(~mask, -math.inf)
        attn.add_(mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if p > 0:
        attn = torch.ops.aten.native_dropout(attn, p, True)[0]
    return torch.matmul(attn, v)


class CudaKernelChoices(TorchFunctionMode):
    """Replace CPU-only decompositions by the ops CUDA would run (same memory behaviour): attention by the
    memory-efficient kernel where CUDA takes it, else by CUDA's math path; dropout by ``native_dropout``."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if k.shape[-3] == q.shape[-3] and k.dim() == 4 and (mask is None or not causal):
                with torch._C.DisableTorchFunction():
                    if not cuda_runs_efficient_attention(q, k, v, mask):
                        return math_attention(q, k, v, mask, p, kwargs.get("scale"))
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
    item = int(t.element_size())
    lo = int(t.storage_offset()) * item
    if t.numel() == 0:
        return lo, lo
    span = 1 + sum((int(s) - 1) * abs(int(st)) for s, st in zip(t.shape, t.stride(), strict=True))
    return lo, lo + span * item


#: How a kernel reads an operand that lives in host memory (remote), i.e. how many times it crosses the
#: link: :func:`um_lab.sim.access.link_passes` turns (class, reuse, volume) into passes with the profile's
#: tiles and factors, which come from the H200 microbenchmarks (``bench/uvm_primitives.py``,
#: ``bench/conv_in_step.py``). GEMM layouts are cuBLAS's: NT is ``x @ W.T`` (nn.Linear forward), NN ``a @ b``
#: (backward ``grad_y @ W``, GPT-2's Conv1D forward), TN ``grad_y.T @ x``; the A operand of NT and NN is
#: re-read per tile of the output's columns (measured for NT; for NN seen in a per-op profile of GPT-2-small
#: with remote activations on the H200). CONV_IGEMM(_1X1): an operand of a k x k (1x1)
#: convolution's implicit GEMM, read ``volume`` times its bytes per pass (the im2col'd input: R*S / stride^2)
#: and re-read once per tile of the other GEMM dimension.
#: COL_REDUCE: the input of a column reduction (a sum over leading dims), read at ``remote_colreduce_GBps``.
#: GEMM_XWT(_BIAS) / GEMM_XW(_BIAS): the B operand (a weight, as a rule) of a 2-d ``mm`` / ``addmm`` in the
#: layout ``x @ W^T`` (nn.Linear's forward, GPT-2's Conv1D input gradient) or ``x @ W`` (nn.Linear's input
#: gradient, Conv1D's forward), with or without a fused bias: passes from the shape model of
#: :mod:`um_lab.sim.gemm_passes` (the read carries the GEMM's K and N). Batched GEMMs keep the tile classes.
(READ_ONCE, GEMM_A, GEMM_NT_B, GEMM_NN, GEMM_TN, CONV_1X1, CONV_1X1_BWD_FILTER, NORM_STATS, CONV_IGEMM,
 CONV_IGEMM_1X1, COL_REDUCE, GEMM_XWT, GEMM_XWT_BIAS, GEMM_XW, GEMM_XW_BIAS) = range(15)
REREAD_CLASSES: tuple[str, ...] = ("once", "gemm_a", "gemm_nt_b", "gemm_nn", "gemm_tn", "conv_1x1",
                                   "conv_1x1_bwd_filter", "norm_stats", "conv_igemm", "conv_igemm_1x1",
                                   "col_reduce", "gemm_xwt", "gemm_xwt_bias", "gemm_xw", "gemm_xw_bias")
#: Traced names of a convolution's forward op.
CONV_FORWARD = frozenset({"aten.convolution", "aten._convolution", "aten.cudnn_convolution"})
#: Traced names of a batch norm's forward and backward ops.
BATCH_NORM = {"aten.native_batch_norm", "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional",
               "aten.cudnn_batch_norm"}
BATCH_NORM_BWD = {"aten.native_batch_norm_backward", "aten.cudnn_batch_norm_backward"}
#: One way a kernel reads an operand: (reuse, re-read class, volume), and for the GEMM_XW* classes also the
#: GEMM's K and N (:data:`GemmRead`).
Read = tuple[float, int, float]
GemmRead = tuple[float, int, float, float, float]
AnyRead = Read | GemmRead


def read_fields(way: AnyRead) -> GemmRead:
    """A read as (reuse, class, volume, gemm K, gemm N); K and N are 0 for reads that are not GEMM_XW*."""
    if len(way) == 5:
        return way
    reuse, cls, volume = way[:3]
    return float(reuse), int(cls), float(volume), 0.0, 0.0


def is_column_reduction(args: tuple) -> bool:
    """A ``sum`` over some leading dims that keeps the last one (a bias gradient: each thread walks a
    column, with few requests in flight)."""
    x = args[0]
    dims = args[1] if len(args) > 1 else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not dims:
        return False
    last = x.dim() - 1
    kept = {d % x.dim() for d in dims}
    return last not in kept

def _transposed(t: torch.Tensor) -> bool:
    """True for a column-major matrix (a ``.t()`` view): cuBLAS reads it as a transposed operand."""
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1


def _gemm_class(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """Re-read classes of the A and B operands of ``a @ b`` from their layouts."""
    if _transposed(a):
        return GEMM_TN, GEMM_TN
    if _transposed(b):
        return GEMM_A, GEMM_NT_B
    return GEMM_A, GEMM_NN


class ConvGeometry(NamedTuple):
    """A convolution's implicit-GEMM view: batch, channels in / out (per group), input and output pixels
    per image, filter taps R*S (1 for a 1x1 filter), and filter bytes."""

    batch: int
    c_in: int
    c_out: int
    in_pixels: int
    out_pixels: int
    taps: int
    filter_bytes: int

    @property
    def im2col(self) -> float:
        """Bytes of the im2col'd input per byte of input: each input element feeds taps / stride^2 outputs."""
        return self.taps * self.out_pixels / self.in_pixels


def _per_dim(value: Any, nd: int) -> list[int]:
    """A conv argument (int, or one or ``nd`` values) as ``nd`` ints."""
    if isinstance(value, list | tuple):
        return [int(v) for v in value] if len(value) == nd else [int(value[0])] * nd
    return [int(value)] * nd


def conv_geometry(x: torch.Tensor, w: torch.Tensor, stride: Any, padding: Any, dilation: Any,
                  groups: int) -> ConvGeometry:
    """The geometry of ``conv(x, w)`` (2-d or any-d, NC... layout)."""
    spatial = x.shape[2:]
    k = w.shape[2:]
    nd = len(spatial)
    st, pad, dil = (_per_dim(v, nd) for v in (stride, padding, dilation))
    out = [(spatial[i] + 2 * pad[i] - dil[i] * (k[i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    g = max(1, int(groups))
    return ConvGeometry(int(x.shape[0]), int(x.shape[1]) // g, int(w.shape[0]) // g, math.prod(spatial),
                        max(1, math.prod(out)), math.prod(k), w.numel() * w.element_size())


def conv_reads(backward: bool, geo: ConvGeometry,
               output_mask: tuple[bool, ...] = (True, True)) -> dict[int, list[AnyRead]]:
    """How a cuDNN convolution re-reads its operands, as implicit GEMMs (measured in a training step
    with remote activations: ``bench/conv_in_step.py``).

    Forward (M = output pixels, N = c_out, K = c_in * taps): the im2col'd input once per N tile, the
    filter once per M tile. Backward: the data gradient (M = input pixels, N = c_in, K = c_out * taps)
    reads the output gradient (im2col'd: taps per byte) once per N tile and the filter once per M tile;
    the filter gradient (M = c_out, N = c_in * taps, K = output pixels) reads the output gradient once per
    N tile and the im2col'd input once per M tile. A k x k filter is read through a copy in cuDNN's
    workspace (:func:`conv_workspace`); a 1x1 filter directly, per pixel tile (classes conv_1x1).
    Positions: forward (x 0, w 1), backward (grad_y 0, x 1, w 2).
    """
    pixels_out = float(geo.batch * geo.out_pixels)
    pixels_in = float(geo.batch * geo.in_pixels)
    one = geo.taps == 1
    igemm = CONV_IGEMM_1X1 if one else CONV_IGEMM  # cuDNN picks other kernels (tiles) for 1x1 filters
    if not backward:
        reads: dict[int, list[AnyRead]] = {0: [(float(geo.c_out), igemm, geo.im2col)]}
        reads[1] = [(pixels_out, CONV_1X1, 1.0)] if one else [(1.0, READ_ONCE, 1.0)]
        return reads
    grad_input, grad_weight = bool(output_mask[0]), bool(output_mask[1])
    reads = {0: [], 1: [], 2: [(1.0, READ_ONCE, 1.0)]}
    if grad_input:
        reads[0].append((float(geo.c_in), igemm, float(geo.taps)))
        if one:
            reads[2] = [(pixels_in, CONV_1X1_BWD_FILTER, 1.0)]
    if grad_weight:
        reads[0].append((float(geo.c_in * geo.taps), igemm, 1.0))
        reads[1].append((float(geo.c_out), igemm, geo.im2col))
    return {pos: r for pos, r in reads.items() if r}


def _forward_geometry(name: str, args: tuple) -> ConvGeometry:
    if name == "aten.cudnn_convolution":  # (x, w, padding, stride, dilation, groups, ...)
        return conv_geometry(args[0], args[1], args[3], args[2], args[4], args[5])
    return conv_geometry(args[0], args[1], args[3], args[4], args[5], args[8])  # convolution, _convolution


def is_dense_conv(name: str, args: tuple) -> bool:
    """True for a forward or backward convolution that cuDNN runs as an implicit GEMM: not transposed and
    one group (the tiles were measured on those; depthwise and grouped ones use direct kernels)."""
    if name == "aten.cudnn_convolution":  # (x, w, padding, stride, dilation, groups, ...)
        return int(args[5]) == 1
    if name in CONV_FORWARD:  # (x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
        return not args[6] and int(args[8]) == 1
    if name == "aten.convolution_backward":  # (gy, x, w, bias_sizes, stride, padding, dilation, transposed,
        return not args[7] and int(args[9]) == 1  # output_padding, groups, output_mask)
    return False


def conv_workspace(name: str, args: tuple) -> tuple[int, Read] | None:
    """(bytes, how it is read) of the k x k filter copy cuDNN reads from its workspace, which the step
    allocates in the activation pool: once per tile of output pixels (forward) or input pixels (data
    gradient); ``None`` for other ops, 1x1 filters, a backward without a data gradient, and
    convolutions that are not dense (:func:`is_dense_conv`)."""
    try:
        if not is_dense_conv(name, args):
            return None
        if name in CONV_FORWARD:
            geo = _forward_geometry(name, args)
            extent = geo.batch * geo.out_pixels
        elif name == "aten.convolution_backward":
            if not args[10][0]:
                return None
            geo = conv_geometry(args[1], args[2], args[4], args[5], args[6], args[9])
            extent = geo.batch * geo.in_pixels
        else:
            return None
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    if geo.taps == 1:
        return None
    return geo.filter_bytes, (float(extent), CONV_IGEMM, 1.0)


def _weight_read(name: str, a: torch.Tensor, b: torch.Tensor, cls_b: int) -> AnyRead:
    """How a 2-d GEMM's B operand is read: by the shape model (``x @ W^T`` or ``x @ W``) for ``mm`` and
    ``addmm``, with the old tile classes for batched GEMMs."""
    m = float(a.shape[-2])
    if name not in ("aten.mm", "aten.addmm") or cls_b not in (GEMM_NT_B, GEMM_NN):
        return (m, cls_b, 1.0)
    bias = name == "aten.addmm"
    if cls_b == GEMM_NT_B:
        cls = GEMM_XWT_BIAS if bias else GEMM_XWT
    else:
        cls = GEMM_XW_BIAS if bias else GEMM_XW
    return (m, cls, 1.0, float(a.shape[-1]), float(b.shape[-1]))


def remote_reads(name: str, args: tuple) -> dict[int, list[AnyRead]]:
    """Arg position -> the ways a kernel reads that operand more than once when it is remote.

    ``reuse`` is the extent of the output dimension the operand is re-read along (a GEMM's A operand once
    per tile of B's columns, B once per tile of A's rows). Measured on the H200 (bench/uvm_primitives.py):
    cuBLAS GEMMs and 1x1 convolution filters are re-read per tile (the L2 does not keep remote operands);
    training-mode batch norm reads its input twice; convolutions: :func:`conv_reads`.
    Positions not listed are read once.
    """
    try:
        if name in ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"):
            i = 1 if name in ("aten.addmm", "aten.baddbmm") else 0
            a, b = args[i], args[i + 1]
            ca, cb = _gemm_class(a, b)
            return {i: [(float(b.shape[-1]), ca, 1.0)], i + 1: [_weight_read(name, a, b, cb)]}
        if name in CONV_FORWARD:
            if not is_dense_conv(name, args):
                return {}  # transposed or grouped: read once (not measured)
            return conv_reads(False, _forward_geometry(name, args))
        if name == "aten.convolution_backward":
            if not is_dense_conv(name, args):
                return {}
            geo = conv_geometry(args[1], args[2], args[4], args[5], args[6], args[9])
            return conv_reads(True, geo, tuple(args[10]))
        if name in BATCH_NORM:
            return {0: [(1.0, NORM_STATS, 1.0)]}
        if name in BATCH_NORM_BWD:  # not measured: assumed to read both twice, as the forward does
            return {0: [(1.0, NORM_STATS, 1.0)], 1: [(1.0, NORM_STATS, 1.0)]}
        if name == "aten.native_layer_norm_backward":  # the weight gradient's column pass re-reads both
            return {0: [(1.0, NORM_STATS, 1.0)], 1: [(1.0, NORM_STATS, 1.0)]}
        if name == "aten.sum" and is_column_reduction(args):
            return {0: [(1.0, COL_REDUCE, 1.0)]}
        if name.startswith("aten._scaled_dot_product") or name.startswith("aten._efficient_attention"):
            q = args[0]
            return {1: [(float(q.shape[-2]), GEMM_NT_B, 1.0)], 2: [(float(q.shape[-2]), GEMM_NN, 1.0)]}
    except (AttributeError, IndexError, TypeError, ValueError, ZeroDivisionError):
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


def ask_for_sdpa(model: torch.nn.Module) -> None:
    """Ask Hugging Face models for SDPA attention (the fused kernel the GPU uses)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "_attn_implementation"):
        try:
            cfg._attn_implementation = "sdpa"
        except Exception:  # noqa: BLE001 - best effort only
            pass


@contextlib.contextmanager
def data_free_init() -> Iterator[None]:
    """Initialisers that need no tensor data while a model is built on fake tensors (torch 2.13's
    ``trunc_normal_`` asks whether any value fell outside its bounds: a data-dependent question).

    The swap is global, so builds that use it take turns; real tensors still get the original."""
    from torch._subclasses.fake_tensor import FakeTensor

    with _INIT_LOCK:
        original = torch.nn.init.trunc_normal_

        def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                          b: float = 2.0, generator: torch.Generator | None = None) -> torch.Tensor:
            if not isinstance(tensor, FakeTensor):
                return original(tensor, mean, std, a, b, generator=generator)
            with torch.no_grad():
                return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

        torch.nn.init.trunc_normal_ = trunc_normal_
        try:
            yield
        finally:
            torch.nn.init.trunc_normal_ = original


_INIT_LOCK = threading.Lock()
