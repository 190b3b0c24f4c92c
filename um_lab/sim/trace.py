"""Capture one training step (forward, backward, optimizer step) without allocating its memory.

The model is built outside fake mode (:func:`build_outside_fake`): a tensor its constructor makes stays real while it
is small (its values are there to read, e.g. drop-path rates from ``torch.linspace(...).tolist()``) and lives on
the meta device when it is large. Its parameters and buffers then become fake tensors
(:class:`~torch._subclasses.fake_tensor.FakeTensorMode`), and so do the optimizer and the batch: every tensor has
shapes, strides and a storage identity but no data, so a GPT-2-XL step traces on a laptop.
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

Ops whose output size depends on tensor values (``nonzero``, boolean-mask indexing, ``torch.where(mask)``,
``masked_select``, ``unique``; ``bincount`` with a ``minlength``) are sized as if every element were selected (an
upper bound: what a mask that keeps every element, such as a label or padding mask, really selects).
A one-element random draw gets a real value, and so does what a step computes from it, so a step may read it
(LayerDrop's ``if torch.rand([]) < p``). Any other op that needs a value (``.item()``, ``.tolist()``,
``if tensor:``) or has no fake kernel raises :class:`TraceError`, naming the op and the module that ran it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from um_lab.errors import ModelConfigError
from um_lab.models import ModelCase, check_optimizer
from um_lab.sim.ops import (
    KNOWN_GENERIC,
    NO_KERNEL,
    READ_ONCE,
    CudaKernelChoices,
    ask_for_sdpa,
    conv_workspace,
    extent_bytes,
    is_causal_attention,
    read_fields,
    remote_reads,
)
from um_lab.types import DATA_TYPES, DataType

T = TypeVar("T")

PHASES: tuple[str, ...] = ("fwd", "bwd", "opt")  #: ``op_phase`` values, in the order of policy.STEP_PHASES
PHASE_FWD, PHASE_BWD, PHASE_OPT = range(3)
#: Op kinds: memory-bound kernels, dense matmul (GEMM), convolution (TF32 on cuDNN by default), the
#: host-to-device copy of the batch, and fused attention.
OP_KINDS: tuple[str, ...] = ("memory", "matmul", "conv", "h2d_copy", "attention")
KIND_MEMORY, KIND_MATMUL, KIND_CONV, KIND_H2D_COPY, KIND_ATTENTION = range(5)
#: ``acc_write`` codes: the op reads the range, only writes it (a fresh output), or updates it in place.
ACC_READ, ACC_WRITE_ONLY, ACC_READ_WRITE = range(3)
TYPE_INDEX: dict[DataType, int] = {t: i for i, t in enumerate(DATA_TYPES)}

@dataclasses.dataclass
class StepTrace:
    """One training step as a sequence of kernel ops over classified storages (NumPy arrays).

    Ops: ``op_names``, ``op_phase`` (index into :data:`PHASES`), ``op_flops``, ``op_bytes`` (HBM bytes
    moved at roofline), ``op_kind`` (see :data:`OP_KINDS`: which roofline the op runs on). Op 0 is the
    host-to-device copy of the batch into the input pool.
    Accesses (CSR over ops, ``acc_ptr[i]:acc_ptr[i+1]``): ``acc_storage``, byte range ``acc_lo`` ..
    ``acc_hi`` inside the storage, ``acc_write`` (0 read, 1 write only, 2 read and write in place),
    ``acc_reuse`` and ``acc_reread`` (how a kernel re-reads the operand when it is remote: the extent of the
    output dimension it is re-read along, the class of :data:`um_lab.sim.ops.REREAD_CLASSES`), and
    ``acc_volume`` (bytes read per pass per byte of the operand: a convolution's im2col'd input),
    ``acc_gemm_k`` / ``acc_gemm_n`` (a 2-d GEMM's K and N for its B operand's shape model; 0 otherwise). An operand
    read by two kernels of one op (a convolution's backward) has one access per kernel.
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
    acc_reread: np.ndarray
    acc_volume: np.ndarray
    acc_gemm_k: np.ndarray
    acc_gemm_n: np.ndarray
    st_nbytes: np.ndarray
    st_type: np.ndarray
    st_alloc: np.ndarray
    st_free: np.ndarray
    st_persistent: np.ndarray
    unknown_ops: list[str] = dataclasses.field(default_factory=list)
    #: per op, the host-only ops (views, metadata, allocations: no kernel) dispatched since the previous
    #: kernel op; they cost host time only (``Profile.cpu_view_op_us``). ``None``: not counted.
    op_host_only: np.ndarray | None = None
    #: per op, True where a GEMM, convolution or attention kernel computes in a 16-bit float (autocast):
    #: it runs on the profile's 16-bit tensor-core rates. ``None``: none does.
    op_16bit: np.ndarray | None = None

    @property
    def n_ops(self) -> int:
        """Number of kernel ops in the step (the input copy included)."""
        return len(self.op_names)

    def bytes_by_type(self, persistent_only: bool = False) -> dict[str, int]:
        """Storage bytes per data type name (all storages, or only persistent ones)."""
        sel = self.st_persistent if persistent_only else np.ones(len(self.st_nbytes), bool)
        return {t.value: int(self.st_nbytes[sel & (self.st_type == i)].sum())
                for i, t in enumerate(DATA_TYPES)}

    def peak_bytes(self, data_type: DataType | None = None) -> int:
        """Peak bytes of live storages over the step (tensors, before segment rounding): of all of them, or of
        one data type's."""
        n = self.n_ops
        selected = slice(None) if data_type is None else self.st_type == TYPE_INDEX[data_type]
        nbytes = self.st_nbytes[selected].astype(np.int64)
        alloc, free = self.st_alloc[selected], self.st_free[selected]
        delta = np.zeros(n + 2, np.int64)
        np.add.at(delta, np.clip(alloc, -1, n) + 1, nbytes)
        np.add.at(delta, np.clip(free, 0, n) + 1, -nbytes * (free <= n - 1))
        return int(np.cumsum(delta).max())


#: CPU attention kernels a trace meets when a module calls SDPA below Python (nn.MultiheadAttention):
#: on CUDA these are fused attention kernels, so they are costed as such.
_CPU_FLASH = frozenset({"aten._scaled_dot_product_flash_attention_for_cpu",
                        "aten._scaled_dot_product_flash_attention_for_cpu_backward"})


class _Recorder(TorchDispatchMode):
    """Records kernel ops, storage accesses, allocations and frees (see :class:`StepTrace`)."""

    def __init__(self, classify_new: Callable[[], DataType]) -> None:
        super().__init__()
        self.classify_new = classify_new
        self.phase = PHASE_FWD
        self.storage_index: dict[int, int] = {}  # cdata -> storage index (live ones)
        self.refs: list[StorageWeakRef | None] = []
        self.nbytes: list[int] = []
        self.types: list[int] = []
        self.alloc: list[int] = []
        self.free: list[int] = []
        self.transient: list[int] = []  # storage indices that may die during the step
        self.ops: list[tuple[str, int, float, float, int, bool]] = []
        self.acc: list[tuple[int, int, int, int, int, float, int, float, float, float]] = []
        self.unknown: dict[str, None] = {}
        self.host_only = 0  # host-only ops since the last kernel op
        self.host_only_before: dict[int, int] = {}  # op index -> host-only ops dispatched just before it

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

    def register_workspace(self, nbytes: int, op_index: int) -> int:
        """A scratch buffer op ``op_index`` allocates in the current pool and frees when it ends."""
        idx = len(self.nbytes)
        self.refs.append(None)
        self.nbytes.append(int(nbytes))
        self.types.append(TYPE_INDEX[self.classify_new()])
        self.alloc.append(op_index)
        self.free.append(op_index + 1)
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
        if name in NO_KERNEL:
            self.host_only += 1
            if name.startswith("aten.empty") or name.startswith("aten.new_empty"):
                self._collect_frees()
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.register(t, self.classify_new(), len(self.ops), True)
            return out
        n_acc, n_ops = len(self.acc), len(self.ops)
        try:
            self._record(func, name, args, kwargs, out)
        except Exception as e:  # never crash a trace on accounting: a zero-cost op, its accesses dropped
            del self.acc[n_acc:], self.ops[n_ops:]
            self.ops.append((name, self.phase, 0.0, 0.0, KIND_MEMORY, False))
            self._warn(name, f"accounting failed ({type(e).__name__}: {e}); counted as zero-cost op")
        if len(self.ops) > n_ops:
            self.host_only_before[n_ops] = self.host_only
            self.host_only = 0
        else:
            self.host_only += 1  # a view or metadata op
        return out

    def _warn(self, name: str, why: str) -> None:
        if name not in self.unknown:
            self.unknown[name] = None
            warnings.warn(f"um_lab.sim.trace: {name}: {why}", stacklevel=3)

    def _record(self, func, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        in_tensors = _tensor_args(func, args, kwargs)
        in_cdata = {StorageWeakRef(t.untyped_storage()).cdata for t, _, _ in in_tensors}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new_outs = [t for t in outs if StorageWeakRef(t.untyped_storage()).cdata not in in_cdata]
        mutates = any(w for _, w, _ in in_tensors)
        if not new_outs and not mutates:
            return  # a view or metadata op: no kernel
        self._collect_frees()
        op_index = len(self.ops)
        rereads = remote_reads(name, args)
        hbm = 0.0
        for t, write, pos in in_tensors:
            idx = self.register(t, self.classify_new(), op_index, True)
            lo, hi = extent_bytes(t)
            nb = t.numel() * t.element_size()
            hbm += nb * (2 if write else 1)
            ways = rereads.get(pos, [(1.0, READ_ONCE, 1.0)])
            code = ACC_READ_WRITE if write else ACC_READ
            for k, way in enumerate(ways):  # one access per kernel that reads it
                reuse, reread, volume, gemm_k, gemm_n = read_fields(way)
                self.acc.append((op_index, idx, lo, hi, code if k == 0 else ACC_READ, reuse, reread, volume,
                                 gemm_k, gemm_n))
        for t in new_outs:
            idx = self.register(t, self.classify_new(), op_index, True)
            lo, hi = extent_bytes(t)
            hbm += t.numel() * t.element_size()
            self.acc.append((op_index, idx, lo, hi, ACC_WRITE_ONLY, 1.0, READ_ONCE, 1.0, 0.0, 0.0))
        workspace = conv_workspace(name, args)
        if workspace is not None:  # the filter's copy: written by the transform, read by the kernel
            nbytes, (reuse, reread, volume) = workspace
            idx = self.register_workspace(nbytes, op_index)
            self.acc.append((op_index, idx, 0, nbytes, ACC_WRITE_ONLY, 1.0, READ_ONCE, 1.0, 0.0, 0.0))
            self.acc.append((op_index, idx, 0, nbytes, ACC_READ, reuse, reread, volume, 0.0, 0.0))
        packet = func.overloadpacket
        kind = KIND_MEMORY
        if name in _CPU_FLASH:  # what CUDA runs as fused (efficient) attention, where no mode could swap it
            kind = KIND_ATTENTION
            q, k, v = (args[1], args[2], args[3]) if name.endswith("_backward") else (args[0], args[1], args[2])
            flops = float(sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)
                          if name.endswith("_backward") else sdpa_flop_count(q.shape, k.shape, v.shape))
            at = 7 if name.endswith("_backward") else 4
            if kwargs.get("is_causal", args[at] if len(args) > at else False):
                flops *= 0.5
        elif name == "aten._grouped_mm":  # one GEMM per group (experts): rows of A against their group's B
            kind = KIND_MATMUL
            a, b, o = args[0], args[1], outs[0]
            flops = 2.0 * o.numel() * a.shape[-1] / (o.shape[0] if a.dim() == 2 and b.dim() == 2 else 1)
        elif packet in flop_registry:
            kind = KIND_CONV if "conv" in name else KIND_ATTENTION if "attention" in name else KIND_MATMUL
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            if is_causal_attention(name, args, kwargs):
                flops *= 0.5  # causal kernels skip the masked half of the score matrix
        else:
            flops = float(sum(t.numel() for t in outs))
            known = torch.Tag.pointwise in func.tags or name in KNOWN_GENERIC
            if not (known or name.startswith("aten._foreach")):
                self._warn(name, "unknown op; generic accounting (bytes of inputs and outputs)")
        half = kind != KIND_MEMORY and any(t.dtype in (torch.bfloat16, torch.float16) for t in outs[:1])
        self.ops.append((name, self.phase, flops, hbm, kind, half))

    def record_input_copy(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Op 0: the batch copied from host into the input pool (a write of each input storage)."""
        nbytes = 0.0
        for t in batch:
            idx = self.register(t, DataType.INPUT, len(self.ops), False)
            lo, hi = extent_bytes(t)
            nbytes += t.numel() * t.element_size()
            self.acc.append((len(self.ops), idx, lo, hi, ACC_WRITE_ONLY, 1.0, READ_ONCE, 1.0, 0.0, 0.0))
        self.ops.append(("um_lab.input_h2d", PHASE_FWD, 0.0, nbytes, KIND_H2D_COPY, False))


class TraceError(ModelConfigError):
    """A model's training step cannot be traced on fake tensors: ``op`` (an ATen op) needs tensor values the
    trace does not have, or has no fake kernel. ``module`` names where it ran (its path in the model and its
    class; the class alone while the model is being built), ``phase`` when (``build``, ``forward``,
    ``backward``, ``optimizer step``); ``model`` is the case's name."""

    def __init__(self, model: str, op: str, module: str | None, phase: str, reason: str) -> None:
        self.model, self.op, self.module, self.phase, self.reason = model, op, module, phase, reason
        where = f" in {module}" if module else ""
        super().__init__(f"model {model!r} cannot be traced: {op} ({phase}{where}) {reason}", "model")

    def __reduce__(self):
        return (type(self), (self.model, self.op, self.module, self.phase, self.reason))


def _context_free(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, whose :class:`TraceError` leaves without the fake-tensor error it replaced: that one holds
    torch's op objects, which do not pickle, and a Dask worker pickles an error with its context."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except TraceError as e:
            e.__context__ = None
            raise

    return wrapper


#: A tensor a model's constructor makes with at most this many elements is real (its values can be read,
#: e.g. drop-path rates from ``torch.linspace(0, rate, depth).tolist()`` or a relative-position index); a
#: larger one lives on the meta device (no memory).
SMALL_REAL_NUMEL = 1 << 16


class _ValuesNeeded(Exception):
    """Raised inside a build or a step for an op that needs the values of a tensor that has none."""

    def __init__(self, op: str, reason: str) -> None:
        self.op, self.reason = op, reason
        super().__init__(f"{op} {reason}")


def _op_name(func: Any) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


class _SmallRealBuild(TorchDispatchMode):
    """Runs a model's constructor: each op first runs on meta copies of its inputs (sizes only); when its
    inputs are real and its outputs small (:data:`SMALL_REAL_NUMEL`) it runs for real, else its meta outputs
    stand (a large tensor, or one computed from one). Reading the values of a meta tensor raises
    :class:`_ValuesNeeded`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        on_meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)
        meta_flat = [t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t for t in flat]
        meta_args, meta_kwargs = tree_unflatten(meta_flat, spec)
        if "device" in {a.name for a in func._schema.arguments}:  # a factory: size it on meta
            meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
        try:
            out = func(*meta_args, **meta_kwargs)
        except Exception as e:  # noqa: BLE001 - no meta kernel, or the op reads values
            if on_meta:
                raise _ValuesNeeded(_op_name(func), f"reads the values of a tensor the model's constructor made "
                                                    f"too large to keep (more than {SMALL_REAL_NUMEL} elements: it "
                                                    f"has none; {type(e).__name__})") from e
            return func(*args, **kwargs)
        if on_meta:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or sum(t.numel() for t in outs) <= SMALL_REAL_NUMEL:
            return func(*args, **kwargs)  # small: real values
        return out


@_context_free
def build_outside_fake(case: ModelCase) -> torch.nn.Module:
    """``case``'s model built outside fake mode: small tensors real, large ones on the meta device (see
    :class:`_SmallRealBuild`). A constructor that needs the values of a large tensor raises
    :class:`TraceError` naming the op and the module class being built."""
    try:
        with _SmallRealBuild():
            model = case.build_model()
    except _ValuesNeeded as e:
        raise TraceError(case.name, e.op, _module_at(e.__traceback__, {}), "build", e.reason) from None
    if not isinstance(model, torch.nn.Module):
        raise TraceError(case.name, "build_model", None, "build",
                         f"returned {type(model).__name__}, not an nn.Module")
    return model


def _to_fake(model: torch.nn.Module, fake: FakeTensorMode) -> None:
    """Replace ``model``'s parameters, buffers and tensor attributes by fake tensors of the same shapes,
    strides and dtypes (in place; a tensor held in two places stays one tensor)."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, kept alive; its fake)

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)][1]
        if t.is_meta:
            with fake:
                data = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        else:
            data = fake.from_tensor(t.detach())
        hit: torch.Tensor
        if isinstance(t, torch.nn.Parameter):
            hit = torch.nn.Parameter(data, requires_grad=t.requires_grad)
            hit.__dict__.update({k: v for k, v in vars(t).items() if k != "_is_param"})
        else:
            hit = data.requires_grad_(t.requires_grad) if t.requires_grad else data
        memo[id(t)] = (t, hit)
        return hit

    for module in model.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for name, t in list(store.items()):
                if t is not None:
                    store[name] = convert(t)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                module.__dict__[name] = convert(value)


def _fake_model(case: ModelCase, fake: FakeTensorMode) -> torch.nn.Module:
    model = build_outside_fake(case)
    _to_fake(model, fake)
    return model


#: random draws whose single value a step may read (LayerDrop: ``if torch.rand([]) < p: skip the layer``)
_SCALAR_DRAWS = frozenset({"aten.rand", "aten.uniform_", "aten.randn", "aten.normal_", "aten.bernoulli_",
                           "aten.bernoulli"})


class _DataDependentOps(TorchDispatchMode):
    """Sizes the ops whose output size depends on values (see the module's notes) as if every element were
    selected; sits between the recorder (which records the op as called) and the fake mode.

    A one-element random draw also gets a real value (the real op on the CPU, from a generator seeded with the
    trace's seed, so a trace is repeatable), and so does each small op computed from such values and plain
    numbers: a step can then read it (``.item()``, ``if tensor:``), as LayerDrop does. An op that writes a
    valued tensor in place and cannot be computed forgets every value (reading one then raises TraceError).
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from torch.utils.weak import WeakTensorKeyDictionary

        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real CPU value
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name == "aten._local_scalar_dense" and args and args[0] in self.values:
            with _disable_current_modes():
                return self.values[args[0]].item()
        if not self.values and name not in _SCALAR_DRAWS:
            return self._dispatch(func, name, args, kwargs)
        written = [t for t, write, _ in _tensor_args(func, args, kwargs) if write and t in self.values]
        out = self._dispatch(func, name, args, kwargs)
        value = None
        if isinstance(out, torch.Tensor) and out.numel() <= 1:
            with _disable_current_modes():  # real CPU tensors, outside the fake mode
                try:
                    value = self._real(func, name, args, kwargs, out)
                except Exception:  # noqa: BLE001 - no value: reading it raises the usual TraceError
                    value = None
        if isinstance(value, torch.Tensor) and value.shape == out.shape:
            self.values[out] = value
        elif written:  # a value changed that cannot be followed: views of it would go stale too
            self.values.clear()
        return out

    def _real(self, func, name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        """The op's result on real CPU tensors, or None when an input has no value."""
        if name in ("aten.rand", "aten.randn"):
            make = torch.rand if name == "aten.rand" else torch.randn
            return make(tuple(out.shape), generator=self.generator, dtype=out.dtype)
        flat, spec = tree_flatten((args, kwargs))
        real = []
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                if t in self.values:
                    real.append(self.values[t])
                elif i == 0 and name in _SCALAR_DRAWS and not (name == "aten.bernoulli"
                                                               and func._overloadname == "default"):
                    real.append(torch.empty(t.shape, dtype=t.dtype))  # the draw writes or ignores its values
                else:
                    return None
            else:
                real.append(torch.device("cpu") if isinstance(t, torch.device) else t)
        real_args, real_kwargs = tree_unflatten(real, spec)
        if name in _SCALAR_DRAWS:
            real_kwargs = {**real_kwargs, "generator": self.generator}
        value = func(*real_args, **real_kwargs)
        return value if isinstance(value, torch.Tensor) else None

    def _dispatch(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "aten.nonzero":
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._unsafe_index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            indices = []  # tensors, or None for a dim not indexed
            for i in args[1]:  # a mask indexes with the positions it selects (each of its dims)
                if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                    indices += [torch.empty((i.numel(),), dtype=torch.long, device=i.device)] * i.dim()
                else:
                    indices.append(i)
            return func(args[0], indices, *args[2:], **kwargs)
        if name == "aten.masked_select":
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            return torch.empty((int(np.prod(shape)),), dtype=args[0].dtype, device=args[0].device)
        if name in ("aten._unique2", "aten._unique"):  # torch.unique without dim: at most numel values
            x = args[0]
            values = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            inverse = torch.empty(x.shape, dtype=torch.long, device=x.device)
            if name == "aten._unique":
                return values, inverse
            return values, inverse, torch.empty((x.numel(),), dtype=torch.long, device=x.device)
        if name == "aten.bincount":
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            if minlength > 0:  # values assumed below minlength (a count per class or expert)
                weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
                dtype = torch.long if weights is None else torch.promote_types(weights.dtype, torch.float)
                return torch.empty((int(minlength),), dtype=dtype, device=args[0].device)
        if name == "aten._grouped_mm" and args[0].dtype not in (torch.bfloat16, torch.float16):
            # the fake kernel takes 16-bit inputs only; the CPU and CUDA kernels take fp32 too (a mixture of
            # experts in fp32: Hugging Face's default experts implementation). Its shapes, in the input's dtype.
            half = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args]
            out = func(*half, **{**kwargs, "out_dtype": None})
            return torch.empty_strided(out.shape, out.stride(), dtype=kwargs.get("out_dtype") or args[0].dtype,
                                       device=out.device)
        try:
            return func(*args, **kwargs)
        except _FAKE_LIMITS as e:
            raise _ValuesNeeded(name, _why(e)) from e


def _tensor_args(func: Any, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool, int]]:
    """Every tensor an op takes (in lists too): ``(tensor, written in place, position)``, position -1 for a
    keyword argument."""
    schema_args = func._schema.arguments
    found: list[tuple[torch.Tensor, bool, int]] = []
    for pos, a in enumerate(args):
        write = bool(pos < len(schema_args) and schema_args[pos].alias_info is not None
                     and schema_args[pos].alias_info.is_write)
        found += [(t, write, pos) for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    for key, a in kwargs.items():
        write = any(s.name == key and s.alias_info is not None and s.alias_info.is_write for s in schema_args)
        found += [(t, write, -1) for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)]
    return found


def _why(e: Exception) -> str:
    from torch._subclasses import fake_tensor as ft

    if isinstance(e, ft.DataDependentOutputException):
        return ("reads tensor values (.item(), .tolist(), a tensor used as a Python bool or int), which a fake "
                "trace has none of")
    if isinstance(e, ft.DynamicOutputShapeException):
        return "has an output size that depends on tensor values, and no size rule in the tracer"
    return f"has no fake-tensor kernel ({type(e).__name__})"


def _fake_limits() -> tuple[type[Exception], ...]:
    from torch._subclasses import fake_tensor as ft

    return (ft.DataDependentOutputException, ft.DynamicOutputShapeException, ft.UnsupportedOperatorException)


_FAKE_LIMITS = _fake_limits()


def _module_at(tb: Any, names: dict[int, str]) -> str | None:
    """The innermost module whose method is on the traceback ``tb``: its path in the model (``names``: id of
    a module -> its name) and class, or its class alone."""
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, torch.nn.Module):
            found = obj
        tb = tb.tb_next
    if found is None:
        return None
    name = names.get(id(found))
    cls = type(found).__qualname__.rsplit("<locals>.", 1)[-1]
    return f"{name or '<model>'} ({cls})" if name is not None else cls


@contextlib.contextmanager
def _explained(case: ModelCase, model: torch.nn.Module, phase_box: dict[str, Any]) -> Iterator[None]:
    """Turn an op the trace cannot run into a :class:`TraceError` naming it, the module and the phase."""
    try:
        yield
    except _ValuesNeeded as e:
        names = {id(m): n for n, m in model.named_modules()}
        raise TraceError(case.name, e.op, _module_at(e.__traceback__, names), phase_box["name"], e.reason) from None
    except _FAKE_LIMITS as e:
        names = {id(m): n for n, m in model.named_modules()}
        func = getattr(e, "func", None)
        raise TraceError(case.name, _op_name(func) if func is not None else type(e).__name__,
                         _module_at(e.__traceback__, names), phase_box["name"], _why(e)) from None


def case_key(case: ModelCase, seed: int = 0) -> str:
    """The trace cache's key for ``case`` traced with ``seed``: a digest of everything that changes its
    step (:func:`case_fingerprint`) and the case's name. Memoised on the case while its name, info and
    factories stay the same objects (and a module given to ``custom`` keeps its shapes)."""
    memo: dict[int, tuple[tuple[Any, ...], str]] = case.__dict__.setdefault("_um_lab_trace_keys", {})
    stamp = _stamp(case)
    hit = memo.get(seed)
    if hit is not None and len(hit[0]) == len(stamp) and all(
            a is b or (isinstance(a, str) and a == b) for a, b in zip(hit[0], stamp, strict=True)):
        return hit[1]
    key = hashlib.sha256(case_fingerprint(case, seed).encode()).hexdigest()[:24] + ":" + case.name
    memo[seed] = (stamp, key)
    return key


def _stamp(case: ModelCase) -> tuple[Any, ...]:
    """What :func:`case_key`'s memo is valid for: the case's factories (by identity), name and info, and the
    shapes of a module given to ``custom`` (it can be changed in place)."""
    template = getattr(case.build_model, "__um_lab_template__", None)
    shapes = _module_text(template) if isinstance(template, torch.nn.Module) else ""
    return (case.build_model, case.make_batch, case.loss_fn, case.make_optimizer, case.name,
            _value_text(case.info), shapes)


def case_fingerprint(case: ModelCase, seed: int = 0) -> str:
    """Text that changes whenever ``case``'s traced step can: its name and info, the model's modules (class,
    the code of its ``forward``, settings) and parameters and buffers (names, shapes, dtypes, which train),
    the optimizer (class, hyper-parameters, parameter groups), the batch's shapes and dtypes, the loss
    function's code and captured values, and ``seed``. The model, optimizer and batch are built on fake
    tensors (no memory; the model built by :func:`build_outside_fake`); an optimizer whose ``step()`` needs a closure is
    refused here (:class:`~um_lab.errors.OptimizerNeedsClosure`)."""

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _fake_model(case, fake)
        with fake:
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = case.make_optimizer(params)
            check_optimizer(case, optimizer)
            batch = case.batch(seed)
    index = {id(p): i for i, p in enumerate(params)}
    groups = [(sorted((str(k), _value_text(v)) for k, v in group.items() if k != "params"),
               [index.get(id(p), -1) for p in group.get("params", ())])
              for group in getattr(optimizer, "param_groups", ())]
    parts = [
        f"name={case.name!r}",
        f"info={_value_text(case.info)}",
        f"model={_module_text(model)}",
        f"optimizer={_type_text(type(optimizer))}|{groups}|{_value_text(getattr(optimizer, 'defaults', None))}",
        f"batch={[_value_text(t) for t in batch]}",
        f"loss={_callable_text(case.loss_fn)}",
        f"seed={seed}",
    ]
    return "\n".join(parts)


def _code_text(code: Any) -> str:
    """A digest of a code object: its bytecode, constants (nested code too) and names."""
    consts = [_code_text(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    text = f"{code.co_code.hex()}|{consts}|{code.co_names}|{code.co_varnames}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _type_text(cls: type) -> str:
    """A class by its module, name and the code of its ``forward`` / ``step`` / ``__call__``."""
    codes = []
    for attr in ("forward", "step", "__call__"):
        fn = getattr(cls, attr, None)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(f"{attr}:{_code_text(code)}")
    return f"{cls.__module__}.{cls.__qualname__}[{','.join(codes)}]"


def _module_text(model: torch.nn.Module) -> str:
    """A model's structure: each module's class and settings, each parameter's and buffer's name, shape,
    dtype and whether it trains (tied ones by where they are tied)."""
    lines = []
    for name, module in model.named_modules(remove_duplicate=False):
        settings = {k: v for k, v in vars(module).items() if not k.startswith("_")
                    and isinstance(v, bool | int | float | str | type(None) | tuple)}
        try:
            extra = module.extra_repr()
        except Exception:  # noqa: BLE001 - a module whose repr needs data: its class and settings stand
            extra = "?"
        lines.append(f"{name}:{_type_text(type(module))}:{extra}:{_value_text(settings)}")
    seen: dict[int, str] = {}
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            if t is None:
                continue
            tied = seen.setdefault(id(t), name)
            lines.append(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
                         + (f":tied={tied}" if tied != name else ""))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _value_text(value: Any, depth: int = 0) -> str:
    """A value as it can change a trace: scalars and text by value, tensors by shape and dtype, containers
    by their items, callables by their code, other objects by their class."""
    if depth > 4:
        return "..."
    if isinstance(value, bool | int | float | complex | str | bytes | type(None)):
        return repr(value)[:200]
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{_value_text(k, depth + 1)}:{_value_text(v, depth + 1)}"
                              for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return "[" + ",".join(_value_text(v, depth + 1) for v in list(items)[:64]) + "]"
    if isinstance(value, torch.nn.Module):
        return f"module:{_module_text(value)}"
    if isinstance(value, type):
        return _type_text(value)
    if callable(value):
        return _callable_text(value, depth + 1)
    return type(value).__qualname__


def _callable_text(fn: Any, depth: int = 0) -> str:
    """A callable by its code: a function's bytecode, defaults and captured values; a partial's function
    and arguments; a bound method's function and its object's class; another callable by its class."""
    import functools
    import inspect

    if depth > 4:
        return "..."
    if isinstance(fn, functools.partial):
        return (f"partial({_callable_text(fn.func, depth + 1)},{_value_text(fn.args, depth + 1)},"
                f"{_value_text(fn.keywords, depth + 1)})")
    if inspect.ismethod(fn):
        return f"method({_callable_text(fn.__func__, depth + 1)},{type(fn.__self__).__qualname__})"
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = [_value_text(c.cell_contents, depth + 1) if c.cell_contents is not fn else "self"
                 for c in (fn.__closure__ or ()) if _has_contents(c)]
        return (f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}:{_code_text(code)}:"
                f"{_value_text(fn.__defaults__, depth + 1)}:{_value_text(fn.__kwdefaults__, depth + 1)}:{cells}")
    if isinstance(fn, type):
        return _type_text(fn)
    return _type_text(type(fn))


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@_context_free
def trace_step(case: ModelCase, seed: int = 0) -> StepTrace:
    """Trace one steady-state training step of ``case`` without allocating its memory.

    A first step (untraced) creates the optimizer state and the gradients (kept with
    ``zero_grad(set_to_none=False)``, as the real backend does); the second step is recorded. The model is
    built by :func:`build_outside_fake`; an op the trace cannot run raises :class:`TraceError`. ``seed`` seeds
    the model's initialisation, the batch and any random value the step reads; the caller's random state is
    left as it was.

    The trace runs in a thread of its own, with the caller's context variables but torch's default per-thread
    settings (gradients on, no autocast): the frees it records are the moments tensors die, and a sampling
    profiler that holds the calling thread's frames (a Dask worker's) would keep tensors alive past their last
    use and make two traces of one step differ.
    """
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["trace"] = _trace_step(case, seed)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="um_lab-trace",
                              daemon=True)
    thread.start()
    while thread.is_alive():  # in short waits, so that Ctrl-C reaches the caller (the trace then ends alone)
        thread.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["trace"]


def _trace_step(case: ModelCase, seed: int) -> StepTrace:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _traced(case, seed)


def _traced(case: ModelCase, seed: int) -> StepTrace:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(case, fake)
    phase_box = {"phase": 0, "name": "forward"}
    with fake:
        model.train()
        ask_for_sdpa(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = case.make_optimizer(params)
        check_optimizer(case, optimizer)  # an optimizer that needs a closure: refused, not traced
        for group in optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True
        batch = tuple(fake.from_tensor(b) for b in case.batch(seed))
    with _explained(case, model, phase_box), fake, CudaKernelChoices(), _DataDependentOps(seed):
        phase_box["name"] = "forward"
        loss = case.loss_fn(model, *batch)
        phase_box["name"] = "backward"
        loss.backward()
        phase_box["name"] = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        del loss

    def classify_new() -> DataType:
        return DataType.OPTIM if phase_box["phase"] == PHASE_OPT else DataType.ACT

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
    with _explained(case, model, phase_box), fake, CudaKernelChoices(), _DataDependentOps(seed), rec:
        rec.phase = phase_box["phase"] = PHASE_FWD
        phase_box["name"] = "forward"
        loss = case.loss_fn(model, *batch)
        rec.phase = phase_box["phase"] = PHASE_BWD
        phase_box["name"] = "backward"
        loss.backward()
        del loss
        rec.phase = phase_box["phase"] = PHASE_OPT
        phase_box["name"] = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        rec._collect_frees()
    return _finish(rec, case_key(case, seed))


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
        acc_reread=col(6, np.int8),
        acc_volume=col(7, np.float64),
        acc_gemm_k=col(8, np.float64),
        acc_gemm_n=col(9, np.float64),
        st_nbytes=np.array(rec.nbytes, np.int64),
        st_type=types,
        st_alloc=np.array(rec.alloc, np.int32),
        st_free=st_free,
        st_persistent=persistent,
        unknown_ops=list(rec.unknown),
        op_host_only=np.array([rec.host_only_before.get(i, 0) for i in range(n)], np.int32),
        op_16bit=np.array([o[5] for o in rec.ops], bool) if any(o[5] for o in rec.ops) else None,
    )


_CACHE: dict[str, StepTrace] = {}
_CACHE_LOCK = threading.Lock()


def cached_trace(case: ModelCase, seed: int = 0) -> StepTrace:
    """:func:`trace_step`, memoised per :func:`case_key` (everything that changes the step: the model's
    structure, the optimizer and its settings, the batch, the loss, the seed): sweeps trace each model once,
    and two cases that share a name but differ in any of these get their own traces."""
    key = case_key(case, seed)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    trace = trace_step(case, seed)
    with _CACHE_LOCK:
        _CACHE[key] = trace
    return trace


def forget_trace(case: ModelCase, seed: int = 0) -> None:
    """Drop ``case``'s trace from the :func:`cached_trace` cache, if it is there (a size the simulator
    refused: its trace would only hold host memory)."""
    key = case_key(case, seed)
    with _CACHE_LOCK:
        _CACHE.pop(key, None)


def clear_trace_cache() -> None:
    """Forget all cached traces."""
    with _CACHE_LOCK:
        _CACHE.clear()
