"""Uncertainty bands: every simulated step time as a range over the profile constants' ranges.

A profile constant is either measured on the target GPU (its range is the spread of the measurements,
recorded with the profile under ``measured.primitives``) or not (fitted, set by hand, or taken from the
driver source; each carries a relative range in :data:`UNMEASURED` saying why). Step time is monotone in
every constant the band varies (a faster link or a cheaper fault never slows a step; the driver model's
decisions do not depend on timing), so the band's ends are two runs: every constant at its fast end, and
every constant at its slow end. The trace and placement are shared with the nominal run, and steps that
repeat the same state cost nothing (:class:`~um_lab.sim.backend.SimBackend`).

A comparison's ranking *flips inside the band* when two policies' order at either end differs from their
nominal order: the constants' uncertainty alone could reverse the conclusion.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from um_lab.errors import ProfileError
from um_lab.sim.placement import BLOCK
from um_lab.sim.profile import Profile, load_profile, packaged_profile_names

#: Constants whose larger value makes a step faster (bandwidths, peaks, tiles); the rest of the banded
#: constants make it slower (latencies, per-call costs, passes).
FASTER_WHEN_LARGER = frozenset({
    "matmul_tflops", "attention_tflops", "conv_tflops", "hbm_GBps", "pinned_h2d_GBps", "remote_GBps",
    "remote_write_GBps", "remote_rw_GBps", "remote_inplace_GBps",
    "remote_colreduce_GBps", "tile_gemm_a", "tile_gemm_nt_b_min", "tile_gemm_nt_b_max", "tile_gemm_nn",
    "tile_gemm_tn", "tile_conv_1x1", "tile_conv_1x1_bwd_filter", "tile_conv_igemm_kxk",
    "tile_conv_igemm_1x1", "prefetch_h2d_GBps", "prefetch_d2h_GBps", "evict_d2h_GBps", "fault_xfer_GBps",
})

#: Relative ranges (low factor, high factor) of constants not measured on the target GPU, and why.
UNMEASURED: dict[str, tuple[float, float, str]] = {
    # fallbacks: the packaged profile records measured ranges for these (measured.primitives), which win
    "matmul_tflops": (0.9, 1.1, "fitted (per-op GEMMs of training steps: um_lab.sim.step_fit)"),
    "attention_tflops": (0.9, 1.1, "fitted (per-op attention kernels of training steps)"),
    "conv_tflops": (0.8, 1.2, "fitted (per-op convolutions of ResNet-50 steps)"),
    "kernel_us": (0.5, 2.0, "set by hand"),
    "cpu_op_us": (0.75, 1.25, "fitted to tiny-batch (host-bound) steps"),
    "cpu_bwd_op_us": (0.75, 1.25, "fitted to tiny-batch (host-bound) steps"),
    "cpu_view_op_us": (0.75, 1.25, "fitted to tiny-batch (host-bound) steps"),
    "cpu_step_us": (0.5, 1.5, "fitted to tiny-batch (host-bound) steps"),
    "cpu_cudnn_call_us": (0.5, 1.5, "set by hand (the host fit finds no separate share: 0)"),
    "cpu_foreach_tensor_us": (0.5, 2.0, "set by hand (the host fit finds no separate share: 0)"),
    "fault_batch_us": (0.67, 1.5, "nvidia-uvm source: 20-45 us per batch on older GPUs"),
    "evict_chunk_us": (0.5, 2.0, "not measured: nothing is oversubscribed here"),
    "prefetch_block_us": (0.5, 2.0, "set by hand"),
    "prefetch_call_us": (0.75, 1.25, "fitted to prefetch-policy step times"),
    "prefetch_call_us_per_block": (0.5, 2.0, "fitted to prefetch-policy step times"),
    "readmostly_write_fault_us": (0.5, 2.0, "fitted to two read-mostly step times 100x apart in size"),
}

def profile_ranges(profile: str | Path | Profile = "h200") -> dict[str, tuple[float, float]]:
    """``{field: (low, high)}`` for every banded constant of ``profile``.

    Measured constants use the ranges recorded with the profile (``measured.primitives``); a
    :class:`Profile` built in code gets only the :data:`UNMEASURED` ranges around its values (unless it
    equals the packaged profile of its name). A recorded range that is not two finite numbers >= 0 raises
    :class:`~um_lab.errors.ProfileError` naming the field and the profile's file.
    """
    prof = load_profile(profile)
    ranges: dict[str, tuple[float, float]] = {}
    for name, (lo, hi, _why) in UNMEASURED.items():
        value = float(getattr(prof, name))
        if value > 0:
            ranges[name] = (value * lo, value * hi)
    block_us = lambda gbps: BLOCK / (float(gbps) * 1e3)  # noqa: E731
    for name, info in _measured_provenance(prof).items():
        if not hasattr(prof, name):
            continue
        value = float(getattr(prof, name))
        span = _recorded_range(prof, name, info, "range")
        gbps = _recorded_range(prof, name, info, "range_GBps", positive=True)
        if span is None and gbps is not None:  # a per-block cost measured as a rate: slow rate = high cost
            span = sorted(block_us(g) for g in gbps)
            if name == "fault_block_us":
                span = [max(1.0, v - block_us(prof.prefetch_h2d_GBps)) for v in span]
        if span:
            ranges[name] = (min(float(span[0]), value), max(float(span[1]), value))
    return ranges


def _profile_path(profile: Profile) -> str | None:
    origin = profile.origin
    return origin.get("path") or (f"<packaged {origin['name']}>" if "name" in origin else None)


def _recorded_range(profile: Profile, name: str, info: Any, key: str,
                    positive: bool = False) -> list[float] | None:
    """``measured.primitives[name][key]`` as two floats (low <= high), None when not recorded."""
    if not isinstance(info, Mapping):
        raise ProfileError(f"measured.primitives.{name} must be a JSON object, got {info!r}"[:300],
                           name, _profile_path(profile))
    span = info.get(key)
    if span is None:
        return None
    ok = isinstance(span, list | tuple) and len(span) == 2 and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive else v >= 0)
        for v in span)
    if not ok:
        raise ProfileError(f"measured.primitives.{name}.{key} must be [low, high], two finite numbers "
                           f"{'> 0' if positive else '>= 0'}, got {span!r}"[:300], name, _profile_path(profile))
    return sorted(float(v) for v in span)


def _measured_provenance(profile: Profile) -> Mapping[str, Any]:
    """The ``measured.primitives`` recorded with ``profile``'s file; for a profile built in code, those of
    the packaged profile of its name if it equals it, else none."""
    measured = profile.measured
    if measured is None and profile.origin["kind"] == "code" and profile.name in packaged_profile_names():
        packaged = load_profile(profile.name)
        measured = packaged.measured if packaged == profile else None
    primitives = (measured or {}).get("primitives", {})
    if not isinstance(primitives, Mapping):
        raise ProfileError(f"measured.primitives must be a JSON object, got {primitives!r}"[:300],
                           "measured", _profile_path(profile))
    return primitives


def corner_profiles(profile: str | Path | Profile = "h200",
                    ranges: Mapping[str, tuple[float, float]] | None = None) -> tuple[Profile, Profile]:
    """(fast, slow): every banded constant at the end that makes a step faster, and at the other end."""
    prof = load_profile(profile)
    ranges = profile_ranges(profile) if ranges is None else ranges
    fast, slow = {}, {}
    for name, (lo, hi) in ranges.items():
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi and hi > 0):
            raise ProfileError(f"range of {name} must be 0 <= low <= high, high > 0, got ({lo}, {hi})", name,
                               _profile_path(prof))
        fast[name], slow[name] = (hi, lo) if name in FASTER_WHEN_LARGER else (lo, hi)
    return (prof.replace(name=f"{prof.name}-fast", **fast), prof.replace(name=f"{prof.name}-slow", **slow))


_BACKENDS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def corner_backends(profile: str | Path | Profile = "h200", prefetch_stream: str = "compute") -> tuple[Any, Any]:
    """Simulated backends at the band's fast and slow ends (cached: their prepared cases are reused)."""
    from um_lab.sim.backend import SimBackend

    fast, slow = corner_profiles(profile)
    out = []
    for corner in (fast, slow):
        key = (json.dumps(dataclasses.asdict(corner), sort_keys=True), prefetch_stream)
        with _LOCK:
            backend = _BACKENDS.get(key)
            if backend is None:
                backend = _BACKENDS[key] = SimBackend(corner, prefetch_stream)
        out.append(backend)
    return out[0], out[1]


def band_ms(spec: Any, case: Any, policy: Any, profile: str | Path | Profile = "h200",
            prefetch_stream: str = "compute") -> tuple[float, float]:
    """(fast end, slow end) of the median step time of ``spec`` under ``policy`` (ms)."""
    import statistics

    ends = []
    for backend in corner_backends(profile, prefetch_stream):
        timed = [r.wall_ms for r in backend.run(spec, case, policy) if not r.warmup]
        ends.append(statistics.median(timed) if timed else float("nan"))
    return ends[0], ends[1]


def with_band(table: Any, baseline: str) -> Any:
    """Add the band's consequences to a ``compare`` table that has ``band_fast_ms`` / ``band_slow_ms``:
    ``speedup_band_lo`` / ``speedup_band_hi`` (the speed-up over ``baseline`` at the two ends, and the
    nominal, lowest and highest) and ``ranking_flips`` (True when the row's place among the policies of
    its (model, ratio) differs at either end of the band from its nominal place)."""
    import numpy as np
    import pandas as pd

    from um_lab.summary import speedup_over

    t = table.copy()
    columns = ("median_ms", "band_fast_ms", "band_slow_ms")
    stacked = np.vstack([speedup_over(t, baseline, col) for col in columns])
    t["speedup_band_lo"] = np.nanmin(stacked, axis=0)
    t["speedup_band_hi"] = np.nanmax(stacked, axis=0)
    key = t["model"].astype(str) + "|" + t["ratio"].astype(object).where(t["ratio"].notna(), "none").astype(str)
    ranks = {col: t.groupby(key)[col].rank(method="min") for col in columns}
    flips = (ranks["band_fast_ms"] != ranks["median_ms"]) | (ranks["band_slow_ms"] != ranks["median_ms"])
    t["ranking_flips"] = flips.where(t["band_fast_ms"].notna() & t["band_slow_ms"].notna(), pd.NA)
    return t
