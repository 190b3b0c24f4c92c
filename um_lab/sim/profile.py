"""Machine profiles: the constants of the simulator's roofline and Unified Memory driver model.

A profile is a JSON file. The packaged ``profiles/h200.json`` was built from measurements on an NVIDIA
H200 (PCIe Gen5 host link), recorded in ``calibration/h200-probe.json`` (2026-11-30), the primitives of
``bench/uvm_primitives.py``, the convolutions of ``bench/conv_in_step.py`` and the per-op training
steps of ``bench/step_detail.py``;
see :mod:`um_lab.sim.calibration` for how the constants are derived and fitted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import warnings
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from um_lab.errors import ProfileError
from um_lab.files import MIB, PROFILE_LIMIT, parse_json, read_json, read_text
from um_lab.types import MAX_CAPACITY_BYTES, MIN_CAPACITY_BYTES

FORMAT_VERSION = 2
#: Largest measurement file (a bench result or probe) calibration reads.
MEASUREMENT_LIMIT = 64 * MIB
#: The 16-bit tensor-core peaks (0: not measured, 16-bit kernels costed at the fp32 rates).
SIXTEEN_BIT_FIELDS = ("matmul_16bit_tflops", "attention_16bit_tflops", "conv_16bit_tflops")
#: Host costs that may be zero (a fit can find that a cost is not there), and rates not measured.
ZERO_ALLOWED = frozenset({"gemm_workspace_bytes", "cpu_op_us", "cpu_bwd_op_us", "cpu_cudnn_call_us",
                          "cpu_foreach_tensor_us", "cpu_view_op_us", "cpu_step_us", "kernel_us", "scheduler_h2d_GBps",
                          "scheduler_d2h_GBps", "conv_pool_slack", *SIXTEEN_BIT_FIELDS})
#: Fields a profile may leave out without a warning: an absent per-shape GEMM table is empty (``to_dict``
#: leaves an empty one out), an absent ``source`` is no description, an absent 16-bit rate is not measured.
OPTIONAL_FIELDS = frozenset({"gemm_shape_passes", "source", "gemm_workspace_bytes", *SIXTEEN_BIT_FIELDS})
#: Fields that hold whole numbers.
INT_FIELDS = frozenset({"gpu_memory_bytes", "fault_batch_size", "gemm_workspace_bytes"})
_TEXT_FIELDS = frozenset({"name", "source"})
#: PyTorch's cuBLAS workspace per (thread, stream) on compute capability 9.x: 8 buffers of 4 MiB
HOPPER_GEMM_WORKSPACE_BYTES = 8 * 4 * MIB


class ProfileDefaultsWarning(UserWarning):
    """A profile left out fields, which take :class:`Profile`'s starting values (not a calibrated card)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """Constants of one GPU + host link. Bandwidths in GB/s (1e9 B/s), times in microseconds.

    ``Profile()`` holds starting values (an H200-sized card with round numbers), not a calibrated
    machine: :func:`load_profile` (``"h200"``) gives the measured one.
    """

    name: str = "defaults"
    source: str = ""
    gpu_memory_bytes: int = 150_109_880_320  #: the card's memory (default simulated capacity)
    #: the cuBLAS workspace PyTorch's caching allocator holds for each thread that runs GEMMs on the card (a
    #: training step's forward and autograd's backward thread hold one each): part of a native step's peak.
    #: PyTorch's default on compute capability 9.x, and what ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` asks for
    gemm_workspace_bytes: int = HOPPER_GEMM_WORKSPACE_BYTES
    # compute roofline
    matmul_tflops: float = 55.0  #: fp32 GEMM / attention peak (no TF32: PyTorch's default for matmul)
    matmul_half_gflop: float = 0.05  #: GEMM size (GFLOP) at which a GEMM reaches half the peak
    attention_tflops: float = 30.0  #: fused (memory-efficient) fp32 attention kernels
    attention_half_gflop: float = 0.05  #: attention kernel size (GFLOP) at which it reaches half its peak
    conv_tflops: float = 250.0  #: convolution peak (cuDNN allows TF32 by default)
    conv_half_gflop: float = 1.0
    #: 16-bit (bf16 / fp16) tensor-core peaks of the same three kernel kinds; a 16-bit kernel keeps its
    #: fp32 kind's fixed cost (``half / peak``). 0: not measured on this card, and 16-bit kernels run at
    #: the fp32 rates (an upper bound on their time)
    matmul_16bit_tflops: float = 0.0
    attention_16bit_tflops: float = 0.0
    conv_16bit_tflops: float = 0.0
    hbm_GBps: float = 3000.0  #: effective HBM bandwidth of memory-bound kernels
    #: HBM passes of a batch norm's forward / backward kernels per byte of their operands (cuDNN's kernels
    #: read their input more than once: statistics, then normalise; in the backward also the reductions)
    norm_fwd_hbm_passes: float = 1.0
    norm_bwd_hbm_passes: float = 1.0
    kernel_us: float = 2.0  #: fixed GPU time per kernel
    #: host time to dispatch one forward/optimizer op from Python (the GPU starves when kernels are shorter)
    cpu_op_us: float = 20.0
    cpu_bwd_op_us: float = 12.0  #: host time of one backward op (autograd's C++ engine)
    cpu_cudnn_call_us: float = 30.0  #: extra host time per cuDNN call (descriptors, execution-plan lookup)
    cpu_foreach_tensor_us: float = 2.0  #: extra host time per tensor argument of a foreach op (Python lists)
    #: host time of one forward/optimizer op that launches no kernel (a view, a reshape, an allocation)
    cpu_view_op_us: float = 0.0
    cpu_step_us: float = 0.0  #: fixed host time per training step (the loop, zero_grad, the step's record)
    # host link
    pinned_h2d_GBps: float = 51.61
    remote_GBps: float = 51.2  #: GPU streaming reads of host-resident managed memory (zero-copy)
    remote_write_GBps: float = 52.6  #: GPU streaming writes to host-resident managed memory
    #: a kernel that both reads and writes host-resident data moves at most this many bytes per second in
    #: total (the link is not fully duplex for them: in-step elementwise kernels, bench/step_detail.py)
    remote_rw_GBps: float = 104.0
    #: the same for a kernel whose only remote accesses update data in place (an optimizer's foreach ops)
    remote_inplace_GBps: float = 104.0
    #: reads of a remote operand by a column reduction (a sum over leading dims: bias gradients), which
    #: keeps too few requests in flight to fill the link
    remote_colreduce_GBps: float = 51.2
    #: Tiles along which kernels re-read a remote operand (one link pass per tile of the other output
    #: dimension; bench/uvm_primitives.py): cuBLAS NT (forward x @ W.T) A operand; NT B operand, whose tile
    #: grows with the rows (reuse / 128, clipped to these bounds); NN; TN; 1x1 convolutions (input per
    #: output-channel tile, filter per pixel tile); the filter of a 1x1 convolution's backward.
    tile_gemm_a: float = 60.0
    tile_gemm_nt_b_min: float = 60.0
    tile_gemm_nt_b_max: float = 107.0
    tile_gemm_nn: float = 137.0
    tile_gemm_tn: float = 137.0
    tile_conv_1x1: float = 96.0
    tile_conv_1x1_bwd_filter: float = 245.0
    #: Tiles of a k x k / 1x1 convolution's implicit GEMM along which cuDNN re-reads a remote operand (in a
    #: training step with remote activations, its workspace remote too: bench/conv_in_step.py).
    tile_conv_igemm_kxk: float = 96.0
    tile_conv_igemm_1x1: float = 96.0
    norm_input_passes: float = 1.83  #: link passes of a training-mode batch norm's remote input (stats + normalise)
    #: Link passes over a 2-d GEMM's remote B operand (a weight) by layout and shape (um_lab.sim.gemm_passes,
    #: fitted on the H200 grid of bench/uvm_primitives.py --sections gemm_tiles): x @ W^T, passes at
    #: M = N = 4096, their exponents in M and 1/N, and the factor of a fused bias ...
    gemm_nt_passes: float = 50.0
    gemm_nt_m_exp: float = 0.8
    gemm_nt_inv_n_exp: float = 0.13
    gemm_nt_bias_factor: float = 1.14
    #: ... x @ W, the same, with its own exponent in M and a factor for K <= gemm_nn_small_k ...
    gemm_nn_passes: float = 22.0
    gemm_nn_m_exp: float = 0.98
    gemm_nn_m_exp_small_k: float = 0.74
    gemm_nn_inv_n_exp: float = 0.11
    gemm_nn_small_k_factor: float = 1.33
    gemm_nn_bias_factor: float = 1.29
    gemm_nn_small_k: float = 768.0
    #: ... and below gemm_fit_min_rows rows, x @ W^T's passes keep about this many 128-column thread blocks
    gemm_small_m_ctas: float = 264.0
    gemm_fit_min_rows: float = 512.0
    # Unified Memory driver
    prefetch_h2d_GBps: float = 47.4
    prefetch_d2h_GBps: float = 3.65
    evict_d2h_GBps: float = 3.65
    fault_xfer_GBps: float = 47.4  #: transfer rate inside fault servicing (overheads counted apart)
    fault_block_us: float = 157.0  #: servicing overhead per fully faulted 2 MiB block (migration)
    populate_block_us: float = 263.0  #: first GPU touch of a never-populated 2 MiB block
    fault_batch_us: float = 30.0  #: per fault batch (up to fault_batch_size faults)
    fault_batch_size: int = 256
    faults_per_block: float = 22.6  #: GPU page faults raised per fully faulted block
    density_threshold: float = 0.51  #: prefetcher pulls a whole block in above this resident share
    evict_chunk_us: float = 20.0  #: per evicted root chunk, on top of the transfer
    prefetch_block_us: float = 5.0  #: per block moved by cudaMemPrefetchAsync, on top of the transfer
    prefetch_call_us: float = 15.0  #: host time per cudaMemPrefetchAsync call (one per segment)
    prefetch_call_us_per_block: float = 1.0  #: host time per block of a prefetch call (resident too)
    #: 1: a cudaMemPrefetchAsync call returns only once the stream's earlier work is done; 0: at once
    prefetch_host_sync: float = 1.0
    #: the layer-ahead scheduler's side-stream rates measured in training (GPT-2-large, ResNet-50 under a
    #: budget: moves interleaved with compute, ~25 MB calls), where they differ from a lone prefetch's;
    #: 0: not measured, the prefetch rates above (um_lab.sim.budget)
    scheduler_h2d_GBps: float = 0.0
    scheduler_d2h_GBps: float = 0.0
    readmostly_write_fault_us: float = 58.0  #: per 4 KiB page a kernel writes in read_mostly data
    #: copies between GPU-resident managed memory and pinned host memory (staged activations), the slower way
    stage_copy_GBps: float = 51.0
    #: discarding GPU-resident pages, and discard-and-prefetch of discarded ones, as equivalent rates
    discard_GBps: float = 318.0
    discard_populate_GBps: float = 160.0
    #: the host link's time per GB of remote optimizer state that AdamW updates in place, and per GB copied in
    #: to the device and back for its step (both directions at once at the staging copies' rate)
    remote_update_ms_per_GB: float = 53.0
    remote_copy_ms_per_GB: float = 20.0
    #: under a budget the optimizer steps in chunks; its pool then keeps about this many chunks' temporaries cached
    #: beside the state (the planner's footprint of a run that fits B, :func:`um_lab.sim.budget.budget_footprint`)
    optimizer_cached_chunks: float = 1.0
    #: a model whose layers convolve: what its pools hold under a budget beyond that footprint, as a share of its
    #: intermediate-results bytes (cuDNN's workspaces, which the CPU trace does not see, and the segments the
    #: caching allocator keeps for them beside the live activations; :mod:`um_lab.sim.workspaces`)
    conv_pool_slack: float = 0.30
    #: host time of the scheduler's hooks per position they open (every module call, a continuation after a child
    #: returns, each backward; pre/post, saved-tensor and gradient hooks and the ledger's work together), while it
    #: follows a plan; an idle scheduler runs none
    scheduler_hook_us: float = 141.7
    #: host time of those hooks per tensor they record (module inputs and outputs, saved tensors, gradients) in
    #: forward and backward, where the trace counted them (``StepTrace.hook_tensors``): it follows the model better
    #: than a price per position
    scheduler_tensor_us: float = 54.2
    #: the rates at which the scheduler weighs a plan's moves (to the GPU; to the host)
    plan_prefetch_GBps: float = 47.0
    plan_evict_GBps: float = 13.0
    #: Measured link passes of weight GEMMs at exact shapes, ``(layout, bias, M, K, N, passes)`` with layout
    #: "nt" (x @ W^T) or "nn" (x @ W) and bias 0/1 (``bench/gemm_shapes.py``): they replace the power law of
    #: :mod:`um_lab.sim.gemm_passes` at those shapes (cuBLAS picks its kernel per shape). Empty: the law alone.
    gemm_shape_passes: tuple[tuple[str, int, int, int, int, float], ...] = ()
    #: Factor on the law's passes at shapes not in that table: nominally 1; its band is the spread, over the
    #: models timed by ``bench/gemm_shapes.py``, of their measured link bytes over the law's
    #: (:func:`um_lab.sim.gemm_passes.law_spread`), so a new model's zero-copy GEMMs carry the law's shape error.
    gemm_law_factor: float = 1.0

    def replace(self, **changes: Any) -> Profile:
        """A copy with ``changes`` (field name -> value) applied; an unknown field raises ``TypeError``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a format version (an empty per-shape GEMM table, unmeasured 16-bit rates and
        the default GEMM workspace are left out, so a profile without them keeps its digest)."""
        data = {"um_lab_profile": FORMAT_VERSION, **dataclasses.asdict(self)}
        for field in SIXTEEN_BIT_FIELDS:
            if not data[field]:
                del data[field]
        if data["gemm_workspace_bytes"] == HOPPER_GEMM_WORKSPACE_BYTES:
            del data["gemm_workspace_bytes"]
        if not self.gemm_shape_passes:
            del data["gemm_shape_passes"]
        else:
            data["gemm_shape_passes"] = [list(row) for row in self.gemm_shape_passes]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> Profile:
        """Build from a dict (a profile JSON's object), every field checked: numbers finite and positive
        (zero where :data:`ZERO_ALLOWED`; ``prefetch_host_sync`` 0 or 1), whole numbers where
        :data:`INT_FIELDS`, text for ``name`` / ``source``. A bad, unknown or wrongly typed field raises
        :class:`~um_lab.errors.ProfileError` naming it (and ``path``, the file it came from); missing
        fields take :class:`Profile`'s starting values with a :class:`ProfileDefaultsWarning` naming them
        (:data:`OPTIONAL_FIELDS` may be left out silently)."""
        def fail(message: str, field: str | None = None) -> ProfileError:
            return ProfileError(message, field, path)

        if not isinstance(data, Mapping):
            raise fail(f"must be a JSON object of profile fields, got {_kind(data)}")
        data = dict(data)
        version = data.pop("um_lab_profile", FORMAT_VERSION)
        if isinstance(version, bool) or version != FORMAT_VERSION:
            raise fail(f"unsupported profile format version {version!r} (this um_lab reads version "
                       f"{FORMAT_VERSION})", "um_lab_profile")
        measured = data.pop("measured", None)
        if measured is not None and not isinstance(measured, Mapping):
            raise fail(f"measured must be a JSON object, got {_kind(measured)}", "measured")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known, key=str)
        if extra:
            raise fail(f"unknown profile fields: {extra}; valid: {sorted(known)}", str(extra[0]))
        for key, value in data.items():
            data[key] = _checked_field(key, value, fail)
        missing = sorted(known - set(data) - OPTIONAL_FIELDS)
        if missing:
            where = f"profile file {str(path)!r}" if path is not None else "profile"
            warnings.warn(f"{where} leaves out {len(missing)} field(s), which take um_lab's starting values "
                          f"(round H200-sized numbers, not a calibrated card): {', '.join(missing)}",
                          ProfileDefaultsWarning, stacklevel=2)
        profile = cls(**data)
        if measured is not None:
            object.__setattr__(profile, "_measured", dict(measured))
        return profile

    def check(self) -> Profile:
        """This profile if every numeric field is a finite number >= 0 (a profile built in code is not checked
        when made); else :class:`~um_lab.errors.ProfileError` naming the field."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _TEXT_FIELDS or f.name == "gemm_shape_passes":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise ProfileError(f"field {f.name} must be a finite number >= 0, got {value!r}", f.name)
        return self

    @property
    def origin(self) -> dict[str, str]:
        """Where this profile came from: ``{"kind": "packaged", "name": ..., "file_sha256": ...}`` (a profile
        packaged with um_lab), ``{"kind": "file", "path": <absolute path>, "file_sha256": ...}`` (a user's
        profile file: its bytes' SHA-256), or ``{"kind": "code"}`` (built or changed in code, e.g. by
        :meth:`replace`). :func:`profile_sha256` digests the constants whatever the origin."""
        return dict(self.__dict__.get("_origin") or {"kind": "code"})

    @property
    def measured(self) -> Mapping[str, Any] | None:
        """The raw measurements recorded with the profile's file (its ``measured`` object), None when it
        recorded none or the profile was built or changed in code."""
        return self.__dict__.get("_measured")

    def save(self, path: str | Path, measured: dict[str, Any] | None = None) -> Path:
        """Write the profile as JSON (optionally with the raw measurements it came from)."""
        path = Path(path)
        d = self.to_dict()
        if measured is not None:
            d["measured"] = measured
        path.write_text(json.dumps(d, indent=1) + "\n")
        _packaged_profile.cache_clear()  # it may have replaced a packaged profile
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile JSON file: a regular file of at most :data:`~um_lab.files.PROFILE_LIMIT` bytes,
        checked as :meth:`from_dict` does; every error names the file. The profile's :attr:`origin` is the
        file's absolute path and the SHA-256 of its bytes."""
        text = read_text(path, "profile", PROFILE_LIMIT)
        profile = cls.from_dict(parse_json(text, "profile", source=path), path=path)
        object.__setattr__(profile, "_origin", {
            "kind": "file", "path": str(Path(path).absolute()),
            "file_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
        return profile


def read_measurements(path: str | os.PathLike[str]) -> Any:
    """A measurement JSON file that calibration reads (a probe, a bench result): a regular file of at most
    :data:`MEASUREMENT_LIMIT` bytes (:class:`~um_lab.errors.FileReadError` naming it otherwise)."""
    return read_json(path, "calibration measurement", MEASUREMENT_LIMIT)


def _kind(value: Any) -> str:
    """A JSON value's kind for messages: ``a list``, ``a string``, ..."""
    names = {list: "a list", tuple: "a list", str: "a string", bool: "true/false", int: "a number",
             float: "a number", type(None): "null", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


def _checked_field(key: str, value: Any, fail: Any) -> Any:
    """``value`` for field ``key`` as the profile holds it, or ``fail(message, key)`` raised."""
    if key in _TEXT_FIELDS:
        if not isinstance(value, str) or (key == "name" and not value.strip()):
            raise fail(f"field {key} must be {'a non-empty' if key == 'name' else 'a'} string, got {value!r}", key)
        return value
    if key == "gemm_shape_passes":
        try:
            return gemm_shape_table(value)
        except ValueError as e:
            raise fail(str(e), key) from None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and not math.isfinite(value):
        raise fail(f"field {key} must be a positive finite number, got {value!r}", key)
    if key == "prefetch_host_sync":
        if not number or value not in (0, 1):
            raise fail(f"field {key} must be 0 or 1, got {value!r}", key)
        return value
    zero = " (or 0)" if key in ZERO_ALLOWED else ""
    if not number or value < 0 or (value == 0 and key not in ZERO_ALLOWED):
        raise fail(f"field {key} must be a positive finite number{zero}, got {value!r}", key)
    if key in INT_FIELDS:
        if not float(value).is_integer():
            raise fail(f"field {key} must be a whole number, got {value!r}", key)
        value = int(value)
    if key == "gpu_memory_bytes" and not MIN_CAPACITY_BYTES <= value <= MAX_CAPACITY_BYTES:
        raise fail(f"field {key} must be between {MIN_CAPACITY_BYTES} B (one 2 MiB chunk) and {MAX_CAPACITY_BYTES} B "
                   f"(1 PiB), the GPUs the simulator models, got {value!r}", key)
    return value


def gemm_shape_table(rows: Any) -> tuple[tuple[str, int, int, int, int, float], ...]:
    """Rows ``[layout, bias, M, K, N, passes]`` checked into :attr:`Profile.gemm_shape_passes`'s form
    (``ValueError`` naming the first bad row)."""
    if isinstance(rows, str | bytes | Mapping) or not isinstance(rows, list | tuple):
        raise ValueError(f"gemm_shape_passes must be a list of rows [layout nt|nn, bias 0|1, M, K, N, passes >= 1]; "
                         f"got {rows!r}"[:300])
    out = []
    for row in rows:
        try:
            layout, bias, m, k, n, passes = row
            whole = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                        and float(v).is_integer() and v > 0 for v in (m, k, n))
            ok = layout in ("nt", "nn") and bias in (0, 1, True, False) and whole \
                and isinstance(passes, int | float) and math.isfinite(passes) and float(passes) >= 1.0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"gemm_shape_passes rows are [layout nt|nn, bias 0|1, M, K, N, passes >= 1]; "
                             f"got {row!r}"[:300])
        out.append((str(layout), int(bool(bias)), int(m), int(k), int(n), float(passes)))
    return tuple(sorted(out))


def packaged_profile_names() -> list[str]:
    """Names of the profiles packaged with um_lab (``"h200"``)."""
    folder = resources.files("um_lab.sim").joinpath("profiles")
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".json"))


def load_profile(name_or_path: str | os.PathLike[str] | Profile = "h200") -> Profile:
    """A packaged profile by name (``"h200"``), a profile JSON path, or a :class:`Profile` itself.

    A packaged name means the packaged profile even where a file of that name is in the working directory
    (a warning says it is not read: pass ``./h200`` to read it); a path (a ``Path``, text ending in
    ``.json`` or naming a folder, or an existing file) is read with :meth:`Profile.load`. Bad input raises
    :class:`~um_lab.errors.ProfileError` or :class:`~um_lab.errors.FileReadError` naming it; the profile's
    :attr:`Profile.origin` says which it was.
    """
    if isinstance(name_or_path, Profile):
        return name_or_path
    if isinstance(name_or_path, os.PathLike):
        return Profile.load(name_or_path)
    if not isinstance(name_or_path, str):
        raise ProfileError(f"must be a packaged profile name, a profile JSON path or a Profile, got "
                           f"{type(name_or_path).__name__} {name_or_path!r}"[:300])
    text = name_or_path
    if "\0" in text:
        raise ProfileError(f"a profile name or path cannot hold a NUL character, got {text!r}"[:300], "profile")
    names = packaged_profile_names()
    if text in names:
        if os.path.lexists(text):
            warnings.warn(f"profile {text!r} is the packaged profile; the file {text!r} in the working directory "
                          f"is not read (pass {os.path.join('.', text)!r} or its full path to use it)",
                          stacklevel=2)
        return _packaged_profile(text)
    if text.endswith(".json") or os.sep in text or (os.altsep and os.altsep in text) or os.path.lexists(text):
        return Profile.load(text)
    raise ProfileError(f"unknown profile {text!r}: not a packaged profile name ({', '.join(names)}) nor a "
                       "profile JSON file"[:300], "profile")


@functools.lru_cache(maxsize=8)
def _packaged_profile(name: str) -> Profile:
    """A packaged profile, parsed once (profiles are frozen; the file carries its raw measurements too)."""
    if name not in packaged_profile_names():
        raise ProfileError(f"unknown profile {name!r}: not a packaged profile name "
                           f"({', '.join(packaged_profile_names())})", "profile")
    raw = resources.files("um_lab.sim").joinpath(f"profiles/{name}.json").read_bytes()
    profile = Profile.from_dict(json.loads(raw), path=f"<packaged {name}>")
    object.__setattr__(profile, "_origin", {"kind": "packaged", "name": name,
                                            "file_sha256": hashlib.sha256(raw).hexdigest()})
    return profile


def profile_sha256(profile: str | Profile = "h200") -> str:
    """SHA-256 of a profile's constants (canonical JSON of :meth:`Profile.to_dict`; raw measurements and
    file formatting do not count): a recalibration changes it."""
    data = load_profile(profile).to_dict()
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
