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
``if tensor:``), has no fake kernel or refuses the shapes it is given (a batch that does not fit the model) raises
:class:`TraceError`, naming the op and the module that ran it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from um_lab.models import ModelCase, check_optimizer
from um_lab.schedule.live.record import StepRecorder
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
from um_lab.sim.trace_build import SMALL_REAL_NUMEL as SMALL_REAL_NUMEL
from um_lab.sim.trace_build import TraceError as TraceError
from um_lab.sim.trace_build import (
    _context_free,
    _DataDependentOps,
    _explained,
    _fake_model,
    _tensor_args,
)
from um_lab.sim.trace_build import build_outside_fake as build_outside_fake
from um_lab.sim.trace_key import case_fingerprint as case_fingerprint
from um_lab.sim.trace_key import case_key
from um_lab.types import DATA_TYPES, DataType

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
    #: the layer-ahead scheduler's hook positions in this step's forward and backward, as its recorder opens
    #: them on the real model (:class:`um_lab.schedule.live.record.StepRecorder`: every module call, the
    #: continuations after a child returns, each backward): the positions whose hooks a budgeted step pays
    #: for. ``(0, 0)``: not counted.
    hook_positions: tuple[int, int] = (0, 0)
    #: the tensors the recorder's hooks record in forward and backward (module inputs and outputs, saved
    #: tensors, gradients): what the hooks' host time scales with. ``(0, 0)``: not counted.
    hook_tensors: tuple[int, int] = (0, 0)

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
        hook_positions, hook_tensors = _counted_step(case, model, batch, phase_box)
        phase_box["name"] = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

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
    return _finish(rec, case_key(case, seed), hook_positions, hook_tensors)


def _counted_step(case: ModelCase, model: torch.nn.Module, batch: tuple[Any, ...],
                  phase_box: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Forward and backward of the untraced first step, with the scheduler's hook positions and the tensors its
    hooks record counted: ((forward, backward) positions, (forward, backward) tensors). A model the recorder's
    hooks cannot run on (one that turns saved-tensor hooks off) runs the step again without them and counts none:
    the scheduler could not follow it either."""
    positions = _PositionCounter([model])
    positions.install()
    try:  # the hooks come off the model whatever the step does
        phase_box["name"] = "forward"
        with positions.recording() as order:
            loss = case.loss_fn(model, *batch)
        forward, forward_tensors = len(order.positions), positions.tensors
        phase_box["name"] = "backward"
        with positions.backward():
            loss.backward()
        return ((forward, len(order.positions) - forward),
                (forward_tensors, positions.tensors - forward_tensors))
    except Exception:  # noqa: BLE001 - the plain step below raises again what is the model's own
        model.zero_grad(set_to_none=True)
    finally:
        positions.remove()
    phase_box["name"] = "forward"
    loss = case.loss_fn(model, *batch)
    phase_box["name"] = "backward"
    loss.backward()
    return (0, 0), (0, 0)


class _PositionCounter(StepRecorder):
    """The scheduler's recorder with one placeholder range per tensor (fake tensors have no address): it opens
    the positions a real step's hooks open and counts the tensors they record (``tensors``), nothing else of use."""

    tensors = 0

    def _spans(self, tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
        spans = [(0, 1) for t in tensors if t.numel() > 0]
        self.tensors += len(spans)
        return spans


def _finish(rec: _Recorder, key: str, hook_positions: tuple[int, int] = (0, 0),
            hook_tensors: tuple[int, int] = (0, 0)) -> StepTrace:
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
        hook_positions=hook_positions,
        hook_tensors=hook_tensors,
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
