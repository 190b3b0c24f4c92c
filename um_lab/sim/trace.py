"""Capture one training step (forward, backward, optimizer step) without allocating its memory.

The model, optimizer and batch live in a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`: every
tensor has shapes, strides and a storage identity but no data, so a GPT-2-XL step traces on a laptop.
A :class:`~torch.utils._python_dispatch.TorchDispatchMode` records each ATen op that would launch a GPU
kernel: the storages it reads and writes (byte ranges), FLOPs, HBM bytes, and the points where storages
are allocated and freed. Storages are classified exactly as the real backend routes them to pools:

* ``param``: parameters and buffers; ``grad``: ``.grad`` tensors (pre-allocated, accumulated in place);
* ``optim``: optimizer state *and* anything allocated during ``optimizer.step()`` (the real backend
  runs the step inside the optim pool, so the foreach temporaries land there);
* ``input``: the batch (allocated at step start, freed at step end);
* ``act``: everything else allocated during forward and backward (activations, their gradients,
  backward temporaries).

The trace runs on the CPU, so CUDA kernel choices are emulated where they change memory: scaled
dot-product attention becomes the fused memory-efficient kernel (the H200 runs fp32 attention with it)
and dropout becomes ``native_dropout`` (a bool mask, as on CUDA). Adam-style optimizers use the
``foreach`` implementation, the CUDA default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from um_lab.models import ModelCase
from um_lab.types import DATA_TYPES, DataType

PHASES: tuple[str, ...] = ("fwd", "bwd", "opt")
#: Op kinds: memory-bound kernels, dense matmul (GEMM), convolution (TF32 on cuDNN by default), the
#: host-to-device copy of the batch, and fused attention.
OP_KINDS: tuple[str, ...] = ("memory", "matmul", "conv", "h2d_copy", "attention")
TYPE_INDEX: dict[DataType, int] = {t: i for i, t in enumerate(DATA_TYPES)}

#: Ops that launch no kernel (metadata, host-side scalars, profiler markers).
_NO_KERNEL = {
    "prim.device", "aten._local_scalar_dense", "aten.lift_fresh", "aten.detach", "aten.alias",
    "profiler._record_function_enter_new", "profiler._record_function_exit", "aten.empty",
    "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten._has_compatible_shallow_copy_type",
}
#: Non-pointwise ops whose generic accounting (bytes in + out) is known to be right: no warning.
_KNOWN_GENERIC = {
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


@dataclasses.dataclass
class StepTrace:
    """One training step as a sequence of kernel ops over classified storages (NumPy arrays).

    Ops: ``op_names``, ``op_phase`` (index into :data:`PHASES`), ``op_flops``, ``op_bytes`` (HBM bytes
    moved at roofline), ``op_kind`` (see :data:`OP_KINDS`: which roofline the op runs on). Op 0 is the
    host-to-device copy of the batch into the input pool.
    Accesses (CSR over ops, ``acc_ptr[i]:acc_ptr[i+1]``): ``acc_storage``, byte range ``acc_lo`` ..
    ``acc_hi`` inside the storage, ``acc_write`` (0 read, 1 write only, 2 read and write in place),
    ``acc_reuse`` (for GEMM operands: the extent of the
    other output dimension, i.e. how many output tiles re-read the operand; 1 otherwise).
    Storages: ``st_nbytes``, ``st_type`` (index into :data:`um_lab.types.DATA_TYPES`), ``st_alloc``
    (op index at which it is allocated; -1 = exists before the step), ``st_free`` (op index before
    which it is freed; ``n_ops`` = at step end or never), ``st_persistent`` (survives the step).
    """

    key: str
    op_names: list[str]
    op_phase: np.ndarray
    op_flops: np.ndarray
    op_bytes: np.ndarray
    op_kind: np.ndarray
    acc_ptr: np.ndarray
    acc_storage: np.ndarray
    acc_lo: np.ndarray
    acc_hi: np.ndarray
    acc_write: np.ndarray
    acc_reuse: np.ndarray
    st_nbytes: np.ndarray
    st_type: np.ndarray
    st_alloc: np.ndarray
    st_free: np.ndarray
    st_persistent: np.ndarray
    unknown_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def n_ops(self) -> int:
        """Number of kernel ops in the step (the input copy included)."""
        return len(self.op_names)

    def bytes_by_type(self, persistent_only: bool = False) -> dict[str, int]:
        """Storage bytes per data type name (all storages, or only persistent ones)."""
        sel = self.st_persistent if persistent_only else np.ones(len(self.st_nbytes), bool)
        return {t.value: int(self.st_nbytes[sel & (self.st_type == i)].sum())
                for i, t in enumerate(DATA_TYPES)}

    def peak_bytes(self) -> int:
        """Peak bytes of live storages over the step (tensors, before segment rounding)."""
        n = self.n_ops
        delta = np.zeros(n + 2, np.int64)
        np.add.at(delta, np.clip(self.st_alloc, -1, n) + 1, self.st_nbytes)
        np.add.at(delta, np.clip(self.st_free, 0, n) + 1, -self.st_nbytes * (self.st_free <= n - 1))
        return int(np.cumsum(delta).max())


class _CudaKernelChoices(TorchFunctionMode):
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


def _extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) of ``t`` inside its storage."""
    item = t.element_size()
    if t.numel() == 0:
        lo = t.storage_offset() * item
        return lo, lo
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * item
    return lo, lo + span * item


def _gemm_reuse(name: str, args: tuple) -> dict[int, float]:
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


def _is_causal_attention(name: str, args: tuple, kwargs: dict) -> bool:
    """True for fused attention ops called with ``is_causal=True``."""
    positions = {"aten._scaled_dot_product_efficient_attention": 6,
                 "aten._scaled_dot_product_efficient_attention_backward": 11,
                 "aten._scaled_dot_product_flash_attention": 4,
                 "aten._scaled_dot_product_flash_attention_backward": 11}
    if name not in positions:
        return False
    pos = positions[name]
    return bool(kwargs.get("is_causal", args[pos] if len(args) > pos else False))


class _Recorder(TorchDispatchMode):
    """Records kernel ops, storage accesses, allocations and frees (see :class:`StepTrace`)."""

    def __init__(self, classify_new: Callable[[], DataType]) -> None:
        super().__init__()
        self.classify_new = classify_new
        self.phase = 0
        self.storage_index: dict[int, int] = {}  # cdata -> storage index (live ones)
        self.refs: list[StorageWeakRef | None] = []
        self.nbytes: list[int] = []
        self.types: list[int] = []
        self.alloc: list[int] = []
        self.free: list[int] = []
        self.transient: list[int] = []  # storage indices that may die during the step
        self.ops: list[tuple[str, int, float, float, int]] = []
        self.acc: list[tuple[int, int, int, int, int, float]] = []
        self.unknown: dict[str, None] = {}

    # -- storages -------------------------------------------------------------------------------
    def register(self, t: torch.Tensor, dtype: DataType, alloc_at: int, transient: bool) -> int:
        """Register the storage of ``t`` (idempotent); return its index."""
        ref = StorageWeakRef(t.untyped_storage())
        idx = self.storage_index.get(ref.cdata)
        if idx is not None:
            return idx
        idx = len(self.nbytes)
        self.storage_index[ref.cdata] = idx
        self.refs.append(ref)
        self.nbytes.append(int(t.untyped_storage().nbytes()))
        self.types.append(TYPE_INDEX[dtype])
        self.alloc.append(alloc_at)
        self.free.append(-2)
        if transient:
            self.transient.append(idx)
        return idx

    def _collect_frees(self) -> None:
        now = len(self.ops)
        alive = []
        for idx in self.transient:
            ref = self.refs[idx]
            if ref is not None and ref.expired():
                self.free[idx] = now
                self.storage_index.pop(ref.cdata, None)
                self.refs[idx] = None
            else:
                alive.append(idx)
        self.transient = alive

    # -- ops ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        out = func(*args, **kwargs)
        if name in _NO_KERNEL:
            if name.startswith("aten.empty") or name.startswith("aten.new_empty"):
                self._collect_frees()
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.register(t, self.classify_new(), len(self.ops), True)
            return out
        try:
            self._record(func, name, args, kwargs, out)
        except Exception as e:  # never crash a trace on accounting: generic fallback
            self._warn(name, f"accounting failed ({type(e).__name__}: {e}); counted as zero-cost op")
        return out

    def _warn(self, name: str, why: str) -> None:
        if name not in self.unknown:
            self.unknown[name] = None
            warnings.warn(f"um_lab.sim.trace: {name}: {why}", stacklevel=3)

    def _record(self, func, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        schema_args = func._schema.arguments
        in_tensors: list[tuple[torch.Tensor, bool, int]] = []
        for pos, a in enumerate(args):
            write = bool(pos < len(schema_args) and schema_args[pos].alias_info is not None
                         and schema_args[pos].alias_info.is_write)
            for t in tree_flatten(a)[0]:
                if isinstance(t, torch.Tensor):
                    in_tensors.append((t, write, pos))
        for key, a in kwargs.items():
            write = any(s.name == key and s.alias_info is not None and s.alias_info.is_write
                        for s in schema_args)
            for t in tree_flatten(a)[0]:
                if isinstance(t, torch.Tensor):
                    in_tensors.append((t, write, -1))
        in_cdata = {StorageWeakRef(t.untyped_storage()).cdata for t, _, _ in in_tensors}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new_outs = [t for t in outs if StorageWeakRef(t.untyped_storage()).cdata not in in_cdata]
        mutates = any(w for _, w, _ in in_tensors)
        if not new_outs and not mutates:
            return  # a view or metadata op: no kernel
        self._collect_frees()
        op_index = len(self.ops)
        reuse = _gemm_reuse(name, args)
        hbm = 0.0
        for t, write, pos in in_tensors:
            idx = self.register(t, self.classify_new(), op_index, True)
            lo, hi = _extent_bytes(t)
            nb = t.numel() * t.element_size()
            hbm += nb * (2 if write else 1)
            self.acc.append((op_index, idx, lo, hi, 2 if write else 0, reuse.get(pos, 1.0)))
        for t in new_outs:
            idx = self.register(t, self.classify_new(), op_index, True)
            lo, hi = _extent_bytes(t)
            hbm += t.numel() * t.element_size()
            self.acc.append((op_index, idx, lo, hi, 1, 1.0))
        packet = func.overloadpacket
        kind = 0
        if packet in flop_registry:
            kind = 2 if "conv" in name else 4 if "attention" in name else 1
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            if _is_causal_attention(name, args, kwargs):
                flops *= 0.5  # causal kernels skip the masked half of the score matrix
        else:
            flops = float(sum(t.numel() for t in outs))
            known = torch.Tag.pointwise in func.tags or name in _KNOWN_GENERIC
            if not (known or name.startswith("aten._foreach")):
                self._warn(name, "unknown op; generic accounting (bytes of inputs and outputs)")
        self.ops.append((name, self.phase, flops, hbm, kind))

    def record_input_copy(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Op 0: the batch copied from host into the input pool (a write of each input storage)."""
        nbytes = 0.0
        for t in batch:
            idx = self.register(t, DataType.INPUT, len(self.ops), False)
            lo, hi = _extent_bytes(t)
            nbytes += t.numel() * t.element_size()
            self.acc.append((len(self.ops), idx, lo, hi, 1, 1.0))
        self.ops.append(("um_lab.input_h2d", 0, 0.0, nbytes, 3))


def _swap_sdpa_free(model: torch.nn.Module) -> None:
    """Ask Hugging Face models for SDPA attention (the fused kernel the GPU uses)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "_attn_implementation"):
        try:
            cfg._attn_implementation = "sdpa"
        except Exception:  # noqa: BLE001 - best effort only
            pass


def case_key(case: ModelCase) -> str:
    """A cache key for a model case: its name and size knobs."""
    text = f"{case.name}|{sorted((str(k), repr(v)) for k, v in case.info.items())}"
    return hashlib.sha1(text.encode()).hexdigest()[:16] + ":" + case.name


def trace_step(case: ModelCase, seed: int = 0) -> StepTrace:
    """Trace one steady-state training step of ``case`` without allocating its memory.

    A first step (untraced) creates the optimizer state and the gradients (kept with
    ``zero_grad(set_to_none=False)``, as the real backend does); the second step is recorded.
    """
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    torch.manual_seed(seed)
    with fake:
        model = case.build_model()
        model.train()
        _swap_sdpa_free(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = case.make_optimizer(params)
        for group in optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True
        batch = tuple(fake.from_tensor(b) for b in case.batch(seed))
    with fake, _CudaKernelChoices():
        loss = case.loss_fn(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        del loss

    phase_box = {"phase": 0}

    def classify_new() -> DataType:
        return DataType.OPTIM if phase_box["phase"] == 2 else DataType.ACT

    rec = _Recorder(classify_new)
    for t in list(model.parameters()) + list(model.buffers()):
        rec.register(t, DataType.PARAM, -1, False)
    for p in model.parameters():
        if p.grad is not None:
            rec.register(p.grad, DataType.GRAD, -1, False)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                rec.register(v, DataType.OPTIM, -1, False)
    rec.record_input_copy(batch)
    with fake, _CudaKernelChoices(), rec:
        rec.phase = phase_box["phase"] = 0
        loss = case.loss_fn(model, *batch)
        rec.phase = phase_box["phase"] = 1
        loss.backward()
        del loss
        rec.phase = phase_box["phase"] = 2
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        rec._collect_frees()
    return _finish(rec, case_key(case))


def _finish(rec: _Recorder, key: str) -> StepTrace:
    n = len(rec.ops)
    st_free = np.array(rec.free, np.int32)
    persistent = np.array([a < 0 for a in rec.alloc], bool)
    types = np.array(rec.types, np.int8)
    st_free[st_free == -2] = n  # alive at the end: freed at step end (transient) or never (persistent)
    acc = rec.acc
    acc_op = np.array([a[0] for a in acc], np.int64)
    order = np.argsort(acc_op, kind="stable")
    ptr = np.zeros(n + 1, np.int64)
    np.add.at(ptr, acc_op + 1, 1)
    ptr = np.cumsum(ptr)
    col = lambda i, dt: np.array([a[i] for a in acc], dt)[order] if acc else np.zeros(0, dt)  # noqa: E731
    return StepTrace(
        key=key,
        op_names=[o[0] for o in rec.ops],
        op_phase=np.array([o[1] for o in rec.ops], np.int8),
        op_flops=np.array([o[2] for o in rec.ops], np.float64),
        op_bytes=np.array([o[3] for o in rec.ops], np.float64),
        op_kind=np.array([o[4] for o in rec.ops], np.int8),
        acc_ptr=ptr,
        acc_storage=col(1, np.int32),
        acc_lo=col(2, np.int64),
        acc_hi=col(3, np.int64),
        acc_write=col(4, np.int8),
        acc_reuse=col(5, np.float64),
        st_nbytes=np.array(rec.nbytes, np.int64),
        st_type=types,
        st_alloc=np.array(rec.alloc, np.int32),
        st_free=st_free,
        st_persistent=persistent,
        unknown_ops=list(rec.unknown),
    )


_CACHE: dict[str, StepTrace] = {}
_CACHE_LOCK = threading.Lock()


def cached_trace(case: ModelCase, seed: int = 0) -> StepTrace:
    """:func:`trace_step`, memoised per (model name, size knobs): sweeps trace each model once."""
    key = case_key(case)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    trace = trace_step(case, seed)
    with _CACHE_LOCK:
        _CACHE[key] = trace
    return trace


def clear_trace_cache() -> None:
    """Forget all cached traces."""
    with _CACHE_LOCK:
        _CACHE.clear()
