"""Simulated step time against the oversubscription ratio: more oversubscription must not run
faster, except where the UM driver itself would, and then the reason is checked.

Step times are steady-state means: under least-recently-migrated-in eviction the driver state can cycle
over several steps (periods of 2 to over 100 steps were seen), so one step's time depends on where in the
cycle it falls; the mean of 24 steps after 8 warm-up steps is within 0.25% of the exact cycle mean on
these models.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import numpy as np
import pytest

from um_lab.models import ModelCase
from um_lab.policy import Advice, Policy, presets
from um_lab.sim.backend import SimBackend
from um_lab.sim.placement import BLOCK
from um_lab.sim.profile import Profile
from um_lab.sim.replicas import model_case
from um_lab.sim.uvm import AdviceTable, UvmModel
from um_lab.types import DataType, RunSpec

FULL = np.uint32(0xFFFFFFFF)
ACT = 3  # index of DataType.ACT in DATA_TYPES
WARMUP, STEPS = 8, 24
RATIOS = (0.8, 1.05, 1.25, 1.5, 2.0, 3.0)
#: Small configurations of four model families (a few seconds each for every preset and ratio).
MODELS: dict[str, tuple[str, dict]] = {
    "mlp": ("mlp", {"width": 1024, "depth": 4, "batch_size": 64}),
    "gpt2-small-2l": ("gpt2-small", {"n_layer": 2, "batch_size": 2, "seq_len": 256}),
    "bert-base-2l": ("bert-base", {"num_hidden_layers": 2, "batch_size": 2, "seq_len": 256}),
    "resnet18": ("resnet18", {"batch_size": 8, "image_size": 64}),
    "resnet50-bs128": ("resnet50", {"batch_size": 128}),
}
FIFO = ("least-recently-migrated-in eviction is first-in-first-out, not a stack algorithm: a smaller GPU can "
        "hold a better set when it matters and evict fewer chunks (Belady's anomaly; UvmModel.evict)")
ACCESSED_BY = ("accessed_by=gpu keeps an evicted page on the host, read remotely for good: which data end up "
               "remote depends on what the first steps evicted, and a smaller GPU can end with less of it "
               "(UvmModel.access)")
REMOTE_FOR_MIGRATION = ("accessed_by=gpu activations left on the host are read over the link instead of being "
                        "evicted and faulted back: less capacity, fewer evictions, cheaper (UvmModel.access)")
#: Decreases the driver model produces on purpose: (model, preset, lower ratio, higher ratio) -> reason.
#: None is on RATIOS for the four small models; these are the issue's ResNet-50 case and finer ratios.
EXCEPTIONS: dict[tuple[str, str, float, float], str] = {
    ("resnet50-bs128", "offload-optimizer", 1.5, 2.0): FIFO,
    ("mlp", "um-default", 2.05, 2.1): FIFO,
    ("mlp", "prefetch-all", 1.3, 1.35): FIFO,
    ("gpt2-small-2l", "gpu-first", 1.85, 1.9): ACCESSED_BY,
    ("gpt2-small-2l", "paper-3type", 2.5, 3.0): REMOTE_FOR_MIGRATION,
}


@dataclasses.dataclass(frozen=True)
class Steady:
    """Means over the steady steps of one run."""

    ms: float
    evictions: float
    remote_bytes: float
    fault_ms: float


@functools.cache
def backend() -> SimBackend:
    return SimBackend()


@functools.cache
def case(label: str) -> ModelCase:
    name, kwargs = MODELS[label]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unknown-op notes of the tracer
        return model_case(name, **kwargs)


@functools.cache
def steady(label: str, policy: str, ratio: float) -> Steady:
    spec = RunSpec(oversubscription_ratio=ratio, warmup_steps=WARMUP, steps=STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = [r for r in backend().run(spec, case(label), policy) if not r.warmup]
    return Steady(float(np.mean([r.wall_ms for r in recs])), float(np.mean([r.evictions for r in recs])),
                  float(np.mean([r.remote_bytes for r in recs])), float(np.mean([r.extra["fault_ms"] for r in recs])))


@pytest.mark.parametrize("label", ["mlp", "gpt2-small-2l", "bert-base-2l", "resnet18"])
def test_step_time_never_decreases_as_the_ratio_grows(label: str) -> None:
    decreases = []
    for policy in presets:
        for lo, hi in itertools.pairwise(RATIOS):
            t_lo, t_hi = steady(label, policy, lo).ms, steady(label, policy, hi).ms
            if t_hi < t_lo * (1 - 1e-9) and (label, policy, lo, hi) not in EXCEPTIONS:
                decreases.append(f"{policy} {lo}->{hi}: {t_lo:.3f} -> {t_hi:.3f} ms")
    assert not decreases, "more oversubscription ran faster:\n" + "\n".join(decreases)


@pytest.mark.parametrize("key", list(EXCEPTIONS), ids=lambda k: f"{k[0]}-{k[1]}-{k[2]}-{k[3]}")
def test_documented_decreases_come_from_their_stated_cause(key: tuple[str, str, float, float]) -> None:
    """An allowed decrease must still look like its reason: fewer evictions for eviction order, and for
    accessed-by residency no evictions and fewer remote bytes."""
    label, policy, lo, hi = key
    a, b = steady(label, policy, lo), steady(label, policy, hi)
    if b.ms >= a.ms:
        return  # no longer decreases: allowed, nothing to explain
    reason = EXCEPTIONS[key]
    if reason == ACCESSED_BY:
        assert a.evictions == b.evictions == 0 and b.remote_bytes < a.remote_bytes
    else:
        assert b.evictions < a.evictions
    if reason == REMOTE_FOR_MIGRATION:
        assert b.remote_bytes > a.remote_bytes


def test_every_decrease_on_a_fine_grid_comes_with_less_driver_work() -> None:
    """Between neighbouring ratios 0.05 apart a step may run faster at the larger ratio only if the driver
    did less: fewer evictions, fewer remote bytes or less fault servicing (one 30 us fault batch fewer,
    when faults group differently into ops). A faster step with as much work would be a clock bug."""
    ratios = [round(1.0 + 0.05 * i, 2) for i in range(41)]  # 1.0 .. 3.0
    unexplained = []
    for policy in presets:
        for lo, hi in itertools.pairwise(ratios):
            a, b = steady("mlp", policy, lo), steady("mlp", policy, hi)
            less_work = (b.evictions < a.evictions or b.remote_bytes < a.remote_bytes
                         or b.fault_ms < a.fault_ms - 1e-9)
            if b.ms < a.ms * (1 - 1e-9) and not less_work:
                unexplained.append(f"{policy} {lo}->{hi}: {a} -> {b}")
    assert not unexplained, "\n".join(unexplained)


# -- the driver model's eviction order, in isolation ------------------------------------------------------------


def migrated_blocks(capacity_chunks: int, order: list[int], rounds: int = 1) -> list[int]:
    """Blocks migrated to the GPU in each round of whole-block GPU reads of host data, in ``order``."""
    n = max(order) + 1
    model = UvmModel(Profile(), AdviceTable.from_policy(presets["um-default"]), capacity_chunks * BLOCK, n)
    model.block_type[:] = ACT
    model.cpu[:] = FULL
    per_round = []
    for _ in range(rounds):
        before = int(model.htod.sum())
        for b in order:
            protect = np.zeros(n, bool)
            protect[b] = True
            model.access(np.array([b]), np.array([FULL]), np.zeros(1, np.uint32), np.zeros(1), protect)
        per_round.append((int(model.htod.sum()) - before) // BLOCK)
    return per_round


def test_fifo_eviction_has_beladys_anomaly() -> None:
    """The textbook reference string: 3 chunks migrate 9 blocks, 4 chunks migrate 10."""
    belady = [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4]
    assert migrated_blocks(3, belady) == [9]
    assert migrated_blocks(4, belady) == [10]


def test_repeated_access_order_moves_everything_whatever_the_deficit() -> None:
    """Why um-default is flat in the ratio (GPT-2-medium bs 8 x 1024: 6.10 s per step from 1.05x to 1.5x,
    every step migrating its whole 34.4 GiB footprint): when each step touches its blocks in the order of the
    step before, each miss evicts the oldest chunk, which is the next block the step needs. A forward pass and
    a backward pass in reverse (no refresh on a hit) fare no better once the deficit reaches half the blocks,
    and one block short of fitting still moves all of them."""
    n = 8
    cyclic = list(range(n))
    assert [migrated_blocks(c, cyclic, rounds=3)[-1] for c in range(1, n + 1)] == [8, 8, 8, 8, 8, 8, 8, 0]
    fwd_bwd = cyclic + cyclic[::-1]
    assert [migrated_blocks(c, fwd_bwd, rounds=3)[-1] for c in range(1, n + 1)] == [14, 12, 10, 8, 8, 8, 8, 0]


# -- prefetch ordering --------------------------------------------------------------------------------------------


def test_forward_prefetch_host_time_is_on_the_step_clock() -> None:
    """The forward phase's prefetches are issued after the (untimed) batch copy: on a host-bound step with
    nothing to move, each call's host time lengthens the step by exactly that time. (They used to be issued
    before the batch copy, whose clock reset then dropped their host time.)"""
    profile = dataclasses.replace(Profile(), prefetch_host_sync=0.0, prefetch_call_us=500.0,
                                  prefetch_call_us_per_block=0.0)
    sim = SimBackend(profile)
    tiny = model_case("mlp", width=256, depth=2, batch_size=8)
    prefetch_params = Policy("prefetch-params", {DataType.PARAM: Advice(prefetch="to-gpu-before-use")})
    spec = RunSpec(steps=1, warmup_steps=1)
    plain = list(sim.run(spec, tiny, "um-default"))[-1].wall_ms
    prefetched = list(sim.run(spec, tiny, prefetch_params))[-1].wall_ms
    calls = sim.prepare(tiny).placement.final.segment_count["param"]
    assert prefetched - plain == pytest.approx(calls * 0.5, abs=1e-6)
