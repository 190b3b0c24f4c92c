"""Saved activations staged through pinned host memory: the path around managed memory's slow GPU→host
prefetch (10-16 GB/s on the H200 at any call size, ``bench/results/uvm_call_size.json``).

Autograd's saved-tensor hooks see every tensor forward keeps for backward. :class:`ActivationStager`
copies each large one that lives in the intermediate-results pool into pinned host memory on a stream of
its own (the pack hook), so the GPU block is free for reuse once forward drops it, and copies it back in
backward (the unpack hook), a window of bytes ahead of the tensor autograd asks for, so the copies overlap
the backward kernels. Autograd reads a saved tensor only through unpack, so nothing reads the staged copy
behind the stager's back (the reason this is safe where discarding managed pages is not: a managed block can
hold tensors nobody announced); an in-place write to the original after the pack is refused at unpack, as
autograd's own version check would (saved-tensor hooks turn that check off), and a handle kept past its step
is refused too (:class:`StaleSavedTensor`).

A saved tensor that does not fill its storage densely (q, k and v split out of one attention projection) is
staged through its whole storage when that is at most :data:`MAX_VIEW_SPREAD` times its own bytes: the storage
is copied once for every view saved of it, and each view is rebuilt on the copy back with its own offset and
strides, so backward sees the same layout bit for bit. Otherwise it stays on the GPU (``kept_bytes``).

Host memory comes from :class:`~um_lab.schedule.live.pinned.PinnedArena`, allocated once and reused every
step, capped by ``host_limit_bytes``; past it, tensors stay on the GPU (counted in ``kept_bytes``).

**Partial staging** (``keep_tail_bytes``): the last saves of forward are the first that backward reads, so a copy
of them would go out and come straight back. With ``keep_tail_bytes = K`` the saves of a step after the first
that come within ``K`` bytes of the end of the previous step's eligible saves stay on the GPU (``tail_kept_bytes``):
the link carries ``2 K`` bytes less per step, and the intermediate-results pool holds about ``K`` more. The
copies back start when forward stops staging (its first kept save, or its end: :meth:`ActivationStager.forward_done`),
so they run under the tail's forward and backward kernels (on the H200, started at the first staged one,
ResNet-50 at ratio 2 ran slower kept than staged in full; started at backward's first unpack, the link
idled through forward's tail).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from um_lab.errors import UmLabError
from um_lab.schedule.live.pinned import CopyOps, CpuCopyOps, CudaCopyOps, PinnedArena, available_host_bytes
from um_lab.schedule.staging import (  # noqa: F401 - the stager's constants, importable here too
    BUDGET_WINDOW_MAX_BYTES,
    MAX_VIEW_SPREAD,
    MIN_STAGE_BYTES,
    MIN_TAIL_BYTES,
    TAIL_MARGIN_FRACTION,
    TAIL_ROUNDS,
    WINDOW_BYTES,
    tail_bytes,
    window_for_budget,
)
from um_lab.types import DataType


class StaleSavedTensor(UmLabError, RuntimeError):
    """Backward reached a staged tensor of an earlier step, whose host memory has been reused since."""


@dataclass
class StagingStats:
    """One step's staging (``extra["budget"]["staging"]``)."""

    staged_tensors: int = 0
    staged_bytes: int = 0  #: copied to the host in forward (bytes that crossed the link GPU→host)
    shared_tensors: int = 0  #: saved again while already staged (one copy serves both)
    restored_bytes: int = 0  #: copied back in backward (host→GPU)
    kept_bytes: int = 0  #: saves kept on the GPU although eligible: the host limit was reached, or a sparse view
    tail_kept_bytes: int = 0  #: saves kept on the GPU as forward's last ``keep_tail_bytes`` (partial staging)
    keep_tail_bytes: int = 0  #: the setting this step ran with
    view_tensors: int = 0  #: saves staged through their storage (views that do not fill it densely)
    late_restores: int = 0  #: restores that backward asked for before the window had issued them
    throttle_ms: float = 0.0  #: host time waiting for copies to the host (the window was full)
    pinned_bytes: int = 0  #: pinned host memory held by the arena


class _View:
    """A saved view staged through its storage's :class:`_Staged` copy: where in it the view lies."""

    __slots__ = ("base", "offset", "shape", "stride", "dtype", "source", "version")

    def __init__(self, base: _Staged, t: torch.Tensor) -> None:
        self.base = base
        self.offset, self.shape, self.stride, self.dtype = t.storage_offset(), t.shape, tuple(t.stride()), t.dtype
        self.source: weakref.ref[torch.Tensor] = weakref.ref(t)
        self.version = t._version


class _Staged:
    """A saved tensor (or a saved view's whole storage, as bytes) while its only copy is on the host."""

    __slots__ = ("host", "shape", "stride", "dtype", "nbytes", "index", "device_copy", "ready", "handed", "saves",
                 "step", "source", "version")

    def __init__(self, host: torch.Tensor, src: torch.Tensor, index: int, step: int,
                 source: torch.Tensor | None = None) -> None:
        self.host = host
        self.step = step  #: the stager's step it belongs to: its host memory is reused after that step
        #: to catch in-place writes after the pack (a view's storage: the first view saved, which keeps it alive)
        self.source: weakref.ref[torch.Tensor] = weakref.ref(src if source is None else source)
        self.version = (src if source is None else source)._version
        self.shape, self.stride, self.dtype = src.shape, tuple(src.stride()), src.dtype
        self.nbytes = src.numel() * src.element_size()
        self.index = index
        self.device_copy: torch.Tensor | None = None  #: brought back, not yet handed to backward
        self.ready: Any = None  #: the event of the copy back
        self.handed = 0  #: times handed to backward
        self.saves = 1  #: saved variables it serves: its device copy is kept until each had it


def _dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill its storage span with no gaps or overlaps (a permuted contiguous
    tensor): its host copy can keep its strides."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class ActivationStager:
    """Stage saved activations through pinned host memory (see the module docstring).

    A device tensor a side-stream copy reads (the source of a copy out) or writes (a device copy brought back)
    is kept referenced here until the copy's event has completed, so its block cannot be handed out again
    while the copy runs. ``Tensor.record_stream`` would say the same to the caching allocator, but a block
    with recorded streams that is freed while any pool routing is active (``beginAllocateToPool``: every
    routed phase of a session) has its release deferred until no routing is active, and is released only by
    an allocation made outside every pool, which a session's step never makes: the intermediate-results pool
    then took new segments every step (H200: it filled any budget, twice the footprint too).

    ``eligible(t)`` says whether a saved tensor may be staged (the session passes: it lives in the
    intermediate-results pool); tensors under ``min_bytes`` (default :data:`MIN_STAGE_BYTES`) stay. Use
    :meth:`saving` around forward (or :meth:`pack` / :meth:`unpack` from saved-tensor hooks of one's own, as
    the budget's recorder does), then :meth:`end_step` after the step (its numbers)."""

    def __init__(self, ops: CopyOps, eligible: Callable[[torch.Tensor], bool], *, host_limit_bytes: int,
                 min_bytes: int | None = None, window_bytes: int | None = None) -> None:
        self.ops = ops
        self.eligible = eligible
        self.min_bytes = MIN_STAGE_BYTES if min_bytes is None else int(min_bytes)
        self.window_bytes = WINDOW_BYTES if window_bytes is None else int(window_bytes)
        self.arena = PinnedArena(ops, host_limit_bytes)
        self._staged: list[_Staged] = []
        self._by_key: dict[tuple[Any, ...], _Staged] = {}
        self._to_host: list[tuple[Any, int, torch.Tensor]] = []  # (event, bytes, source) of copies out not known done
        self._restoring: list[tuple[Any, torch.Tensor]] = []  # (event, device copy) of copies back not known done
        self._cursor = -1  # backward's next staged tensor: bringing ahead starts here and goes down
        self._step = 0  # counts end_step calls: a handle from an earlier step is refused at unpack
        #: forward's last this many bytes of eligible saves stay on the GPU (partial staging; module docstring)
        self.keep_tail_bytes = 0
        self._eligible_seen = 0  # eligible bytes saved so far this step (each tensor or storage once)
        self._last_eligible = 0  # the same over the last step
        self._tail: dict[tuple[Any, ...], weakref.ref[torch.Tensor]] = {}  # saves kept in the tail this step
        self.stats = StagingStats()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Forward inside this stages what it saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def end_step(self) -> dict[str, Any]:
        """The step's numbers; forgets the step's tensors (their host memory is reused by the next step:
        the copies of both steps are ordered on one side stream)."""
        self.stats.pinned_bytes = self.arena.pinned_bytes
        self.stats.keep_tail_bytes = self.keep_tail_bytes
        out = asdict(self.stats)
        self._last_eligible, self._eligible_seen = self._eligible_seen, 0
        self._tail.clear()
        self._release_done()
        if self._to_host or self._restoring:  # copies still running read or write blocks about to be let go
            self.ops.synchronize()
        self._staged.clear()
        self._by_key.clear()
        self._to_host.clear()
        self._restoring.clear()
        self._cursor = -1
        self._step += 1
        self.arena.reset()
        self.stats = StagingStats()
        return out

    def close(self) -> None:
        """Wait for every copy, then drop the host memory (and give PyTorch's cached pinned memory back)."""
        self.ops.synchronize()
        self.end_step()
        self.arena = PinnedArena(self.ops, self.arena.limit_bytes)
        release = getattr(torch._C, "_host_emptyCache", None)
        if callable(release) and torch.cuda.is_available():
            release()

    # ---- hooks ----

    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor pack hook: ``t`` itself when it stays, else a handle while its copy is on the host."""
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or not self.eligible(t):
            return t
        if not _dense(t):
            return self._pack_view(t, nbytes)
        # the same tensor saved again (an output that is also the next op's input); a dead tensor's
        # address may already hold another one, hence the weak reference
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        known = self._by_key.get(key)
        if known is not None and known.source() is t:
            self.stats.shared_tensors += 1
            known.saves += 1
            return known
        if self._kept_in_tail(key, t, nbytes, view=False):
            return t
        staged = self._stage(t, nbytes, key)
        if staged is None:
            self.stats.kept_bytes += nbytes
            return t
        return staged

    def _stage(self, t: torch.Tensor, nbytes: int, key: tuple[Any, ...],
               source: torch.Tensor | None = None) -> _Staged | None:
        """Copy dense ``t`` to the arena on the side stream (None: the host limit is reached)."""
        raw = self.arena.take(nbytes)
        if raw is None:
            return None
        host = raw.view(t.dtype).as_strided(t.shape, t.stride())  # dense: its span is its bytes
        staged = _Staged(host, t, len(self._staged), self._step, source)
        done = self.ops.copy_on_side(host, t)
        self._staged.append(staged)
        self._by_key[key] = staged
        self._cursor = staged.index
        self.stats.staged_tensors += 1
        self.stats.staged_bytes += nbytes
        self._throttle(done, nbytes, t)
        return staged

    def _pack_view(self, t: torch.Tensor, nbytes: int) -> Any:
        """Stage a view that does not fill its storage densely through the whole storage (one copy per storage)."""
        storage = t.untyped_storage()
        sbytes = storage.nbytes()
        if sbytes > MAX_VIEW_SPREAD * nbytes:
            self.stats.kept_bytes += nbytes
            return t
        key = ("storage", storage.data_ptr(), sbytes, t._version)
        known = self._by_key.get(key)
        if known is not None and known.source() is not None:  # a sibling view: the first one keeps the storage
            self.stats.shared_tensors += 1
            known.saves += 1
            return _View(known, t)
        if self._kept_in_tail(key, t, sbytes, view=True):
            return t
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (sbytes,), (1,))
        staged = self._stage(whole, sbytes, key, source=t)
        if staged is None:
            self.stats.kept_bytes += nbytes
            return t
        self.stats.view_tensors += 1
        return _View(staged, t)

    @property
    def eligible_bytes(self) -> int:
        """Bytes of saves the last step could stage (each tensor or storage once): the most a tail can keep."""
        return self._last_eligible

    def _kept_in_tail(self, key: tuple[Any, ...], t: torch.Tensor, nbytes: int, *, view: bool) -> bool:
        """True when the save ``t`` (``key``: the tensor, or with ``view`` its storage) stays on the GPU in forward's
        tail: kept already (counted once: the same tensor, or any live view of the same storage) or now."""
        kept = self._tail.get(key)
        if kept is not None and (kept() is not None if view else kept() is t):
            return True
        if self._in_tail(nbytes):
            if not self._tail:  # forward's first kept save: every staged one is out or on its way
                self.forward_done()
            self._tail[key] = weakref.ref(t)
            return True
        return False

    def forward_done(self) -> None:
        """Forward staged all it will: start the copies back now, the last staged first, a window ahead (they queue
        behind the copies out on the side stream). Called at forward's first kept save and when forward returns;
        the link is otherwise idle while the host runs forward's tail and backward's start (H200:
        ResNet-50 at ratio 1.32, ~45 ms of a ~200 ms step with no copy either way)."""
        if self._staged and not self.stats.restored_bytes:
            self._bring_ahead(len(self._staged))

    def _in_tail(self, nbytes: int) -> bool:
        """Count ``nbytes`` of eligible saves; True when they lie in forward's last ``keep_tail_bytes`` (as the
        last step's saves tell: forward saves the same way every step) and stay on the GPU."""
        self._eligible_seen += nbytes
        if self.keep_tail_bytes <= 0 or self._last_eligible <= 0:
            return False
        if self._eligible_seen <= self._last_eligible - self.keep_tail_bytes:
            return False
        self.stats.tail_kept_bytes += nbytes
        return True

    def unpack(self, saved: Any) -> torch.Tensor:
        """The saved-tensor unpack hook: the tensor back on the device (brought ahead, with the next ones)."""
        if isinstance(saved, torch.Tensor):
            self.forward_done()  # backward's first unpack, of a kept tensor, when forward_done was not called
            return saved
        if isinstance(saved, _View):
            self._check_source(saved.source(), saved.version)
            whole = self._restore(saved.base)
            return torch.empty(0, dtype=saved.dtype, device=whole.device).set_(
                whole.untyped_storage(), saved.offset, saved.shape, saved.stride)
        return self._restore(saved)

    @staticmethod
    def _check_source(source: torch.Tensor | None, version: int) -> None:
        if source is not None and source._version != version:
            raise RuntimeError("a tensor saved for backward was modified by an in-place operation after it was "
                               "saved (it was staged to the host when saved; the gradient would be wrong)")

    def _restore(self, staged: _Staged) -> torch.Tensor:
        """``staged`` back on the device for one of its saves (brought ahead, with the next ones)."""
        self._release_done()
        if staged.step != self._step:
            raise StaleSavedTensor("backward reached a tensor saved in an earlier training step: staged activations "
                                   "live until the end of their step (keep no graph across steps)")
        self._check_source(staged.source(), staged.version)
        if staged.device_copy is None:  # not brought ahead (or a save autograd unpacks again)
            self.stats.late_restores += 1
            self._bring(staged)
        self._bring_ahead(staged.index)
        self.ops.compute_wait(staged.ready)
        out = staged.device_copy
        assert out is not None
        staged.handed += 1
        if staged.handed >= staged.saves:
            staged.device_copy = None  # from here autograd's references alone keep it
        return out

    # ---- moves ----

    def _release_done(self) -> None:
        """Let go of the device tensors whose copies have completed (the side stream runs them in order)."""
        while self._to_host and self.ops.is_done(self._to_host[0][0]):
            self._to_host.pop(0)
        while self._restoring and self.ops.is_done(self._restoring[0][0]):
            self._restoring.pop(0)

    def _throttle(self, done: Any, nbytes: int, source: torch.Tensor) -> None:
        self._release_done()
        self._to_host.append((done, nbytes, source))
        in_flight = sum(n for _, n, _ in self._to_host)
        if in_flight <= self.window_bytes:
            return
        began = time.perf_counter()
        while in_flight > self.window_bytes and len(self._to_host) > 1:
            event, n, _ = self._to_host.pop(0)
            self.ops.host_wait(event)
            in_flight -= n
        self.stats.throttle_ms += (time.perf_counter() - began) * 1e3

    def _bring(self, staged: _Staged) -> None:
        device_copy = self.ops.empty_like_on_device(staged.shape, staged.stride, staged.dtype)
        # written on the side stream: its block may not be reused before the copy ends, even when backward never
        # takes it (brought ahead for a tensor autograd does not unpack, or a step that failed)
        staged.ready = self.ops.copy_on_side(device_copy, staged.host)
        self._restoring.append((staged.ready, device_copy))
        staged.device_copy = device_copy
        self.stats.restored_bytes += staged.nbytes
        held = sum(t.numel() * t.element_size() for _, t in self._restoring)
        if held > 2 * self.window_bytes:  # the host ran far ahead of the copies back: wait for the oldest
            began = time.perf_counter()
            while held > 2 * self.window_bytes and len(self._restoring) > 1:
                event, t = self._restoring.pop(0)
                self.ops.host_wait(event)
                held -= t.numel() * t.element_size()
            self.stats.throttle_ms += (time.perf_counter() - began) * 1e3

    def _bring_ahead(self, index: int) -> None:
        """Bring back the staged tensors below ``index`` (backward's next ones) while the window has room."""
        self._cursor = min(self._cursor, index - 1)
        ahead = 0
        i = self._cursor
        while i >= 0 and ahead < self.window_bytes:
            s = self._staged[i]
            if s.device_copy is None and not s.handed:
                self._bring(s)
            ahead += s.nbytes
            i -= 1


def new_stager(source: Any, device: torch.device | None, window_bytes: int | None = None) -> ActivationStager:
    """A stager for a session's pools (``source``: their :class:`~um_lab.cuda.allocator.SegmentSource`): CUDA
    copies of tensors in the intermediate-results pool on ``device``,
    with at most half the host's available memory pinned and ``window_bytes`` in flight each way. Without a
    device (a fake driver on the CPU, in tests), where tensors are not in the pools, intermediates are told by
    autograd instead: tensors with a history that are not views of a leaf (a parameter or an input)."""
    snapshot: list[Any] = [None, None]  # (generation, index): rebuilt when a segment came or went

    def in_intermediate_pool(t: torch.Tensor) -> bool:
        generation = source.generation()
        if snapshot[0] != generation:
            snapshot[:] = [generation, source.index()]
        return bool(snapshot[1].data_type_of(t.data_ptr()) is DataType.ACT)

    def intermediate_by_history(t: torch.Tensor) -> bool:
        return not t.is_leaf and (t._base is None or not t._base.is_leaf)

    if device is not None and device.type == "cuda":
        return ActivationStager(CudaCopyOps(device), in_intermediate_pool, host_limit_bytes=available_host_bytes() // 2,
                                window_bytes=window_bytes)
    return ActivationStager(CpuCopyOps(), intermediate_by_history, host_limit_bytes=available_host_bytes() // 2,
                            window_bytes=window_bytes)
