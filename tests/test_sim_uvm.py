"""The UM driver model: advice semantics, faults, prefetch, eviction order (unit level)."""

from __future__ import annotations

import numpy as np
import pytest

from um_lab.policy import Advice, Policy
from um_lab.sim.placement import BIG_PAGE, BLOCK
from um_lab.sim.profile import Profile
from um_lab.sim.uvm import AdviceTable, UvmModel
from um_lab.types import DataType

FULL = np.uint32(0xFFFFFFFF)
ACT = 3  # index of DataType.ACT in DATA_TYPES


def make_model(policy: Policy, capacity_chunks: int, n_blocks: int, block_type: int = ACT) -> UvmModel:
    model = UvmModel(Profile(), AdviceTable.from_policy(policy), capacity_chunks * BLOCK, n_blocks)
    model.block_type[:] = block_type
    return model


def touch(model: UvmModel, blocks: list[int], write: bool = False, remote_bytes: float = 0.0):
    b = np.array(blocks, np.int64)
    m = np.full(len(b), FULL, np.uint32)
    w = m if write else np.zeros(len(b), np.uint32)
    protect = np.zeros(len(model.gpu), bool)
    protect[b] = True
    return model.access(b, m, w, np.full(len(b), remote_bytes), protect)


def test_first_touch_populates_on_gpu_and_costs_faults() -> None:
    model = make_model(Policy("none"), 8, 4)
    fault_us, remote_us = touch(model, [0, 1], write=True)
    assert fault_us > 0 and remote_us == 0
    assert model.faults > 0 and model.used == 2
    assert np.all(model.gpu[:2] == FULL) and np.all(model.cpu[:2] == 0)
    assert model.htod.sum() == 0  # populated, nothing migrated
    fault_again, _ = touch(model, [0, 1])
    assert fault_again == 0.0


def test_zero_copy_maps_remotely_without_migration() -> None:
    zero_copy = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))
    model = make_model(Policy("zc", {DataType.ACT: zero_copy}), 8, 2)
    fault_us, remote_us = touch(model, [0, 1], remote_bytes=4e6)
    assert remote_us > 0 and model.remote_bytes == 8e6
    assert model.used == 0 and np.all(model.gpu == 0)
    assert np.all(model.cpu == FULL)
    assert model.htod.sum() == 0 and fault_us == 0


def test_read_mostly_duplicates_on_read_and_invalidates_on_write() -> None:
    model = make_model(Policy("rm", {DataType.ACT: Advice(read_mostly=True)}), 8, 1)
    model.cpu[0] = FULL  # data lives on the host
    touch(model, [0])  # GPU read
    assert model.gpu[0] == FULL and model.cpu[0] == FULL  # two copies
    assert model.htod[ACT] == BLOCK
    model.invalidate_host_copies(np.array([0]), np.array([FULL], np.uint32))  # a GPU write
    assert model.gpu[0] == FULL and model.cpu[0] == 0


def test_default_migrates_host_data_on_fault() -> None:
    model = make_model(Policy("none"), 8, 1)
    model.cpu[0] = FULL
    fault_us, _ = touch(model, [0])
    assert model.gpu[0] == FULL and model.cpu[0] == 0
    assert model.htod[ACT] == BLOCK and fault_us > 0


def test_density_prefetcher_pulls_whole_block() -> None:
    model = make_model(Policy("none"), 8, 2)
    model.cpu[:] = FULL
    b = np.array([0, 1], np.int64)
    protect = np.zeros(2, bool)
    few = np.array([0x1, 0x0000FFFF | 0x00FF0000], np.uint32)  # 1/32 and 24/32 of the pages
    model.access(b, few, np.zeros(2, np.uint32), np.zeros(2), protect)
    assert model.gpu[0] == 0x1  # sparse access: only that page
    assert model.gpu[1] == FULL  # > 51% touched: the prefetcher brings the rest


def test_eviction_is_least_recently_migrated_in_not_lru() -> None:
    model = make_model(Policy("none"), 3, 4)
    model.cpu[:] = FULL
    for b in (0, 1, 2):
        touch(model, [b])
    touch(model, [0])  # a later *access* does not refresh block 0 (no migration)
    touch(model, [3])  # needs a chunk: block 0 migrated in first, so it goes
    assert model.gpu[0] == 0 and model.gpu[3] == FULL
    assert model.evictions == 1 and model.dtoh[ACT] == BLOCK
    assert np.all(model.gpu[1:3] == FULL)


def test_prefetch_moves_bytes_and_may_evict() -> None:
    model = make_model(Policy("none"), 2, 4)
    model.cpu[:] = FULL
    touch(model, [0])
    touch(model, [1])
    moved, per_block, t_evict = model.prefetch_to_gpu(np.array([2, 3], np.int64))
    assert list(moved) == [2, 3]
    assert model.evictions == 2 and t_evict > 0
    assert model.htod[ACT] == 4 * BLOCK  # 2 faulted in, 2 prefetched
    assert np.all(per_block > 0)
    t = model.prefetch_to_cpu(np.array([2], np.int64))
    assert t > 0 and model.gpu[2] == 0 and model.dtoh[ACT] == 3 * BLOCK


def test_accessed_by_keeps_evicted_data_mapped_remotely() -> None:
    pinned = Advice(preferred_location="gpu", accessed_by=frozenset({"gpu"}))
    model = make_model(Policy("gf", {DataType.ACT: pinned}), 1, 2)
    touch(model, [0], write=True)
    touch(model, [1], write=True)  # evicts block 0 to the host
    assert model.gpu[0] == 0 and model.cpu[0] == FULL
    _, remote_us = touch(model, [0], remote_bytes=1e6)
    assert remote_us > 0 and model.gpu[0] == 0  # read over the link, not migrated back


def test_big_page_granularity() -> None:
    assert BLOCK // BIG_PAGE == 32


def test_remote_link_is_full_duplex() -> None:
    """An in-place update of host-resident data streams its read and write concurrently."""
    zero_copy = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))
    model = make_model(Policy("zc", {DataType.ACT: zero_copy}), 8, 1)
    b = np.array([0], np.int64)
    m = np.array([FULL], np.uint32)
    protect = np.ones(1, bool)
    p = model.p
    _, read_only = model.access(b, m, np.zeros(1, np.uint32), np.array([1e6]), protect)
    _, in_place = model.access(b, m, m, np.array([1e6]), protect, np.array([1e6]))
    assert read_only == pytest.approx(1e6 / (p.remote_GBps * 1e3))
    assert in_place == pytest.approx(max(1e6 / (p.remote_GBps * 1e3), 1e6 / (p.remote_write_GBps * 1e3)))
    assert in_place < 1.5 * read_only  # not read + write back to back
    assert model.remote_bytes == pytest.approx(3e6)  # bytes still count both directions


def test_session_and_simulator_share_one_prefetch_phase_table():
    from um_lab.policy import PREFETCH_BEFORE, STEP_PHASES
    from um_lab.sim.trace import PHASES
    from um_lab.sim.uvm import PREFETCH_PHASE
    from um_lab.types import DATA_TYPES, DataType

    assert len(PHASES) == len(STEP_PHASES) == len(PREFETCH_BEFORE)
    listed = [t for types in PREFETCH_BEFORE.values() for t in types]
    assert sorted(listed) == sorted(DATA_TYPES)  # every type prefetched before exactly one phase
    assert PREFETCH_PHASE == {DataType.PARAM: 0, DataType.INPUT: 0, DataType.ACT: 0, DataType.GRAD: 1,
                              DataType.OPTIM: 2}  # forward, backward, optimizer step
    assert [PHASES[i] for i in range(len(STEP_PHASES))] == ["fwd", "bwd", "opt"]
    assert STEP_PHASES == ("forward", "backward", "optimizer")
