"""Caching-allocator placement: segment rounding, block reuse, per-type pools."""

from __future__ import annotations

import numpy as np
import pytest

from um_lab.models import get_model
from um_lab.sim.placement import BLOCK, CachingPool, place, round_request, segment_size
from um_lab.sim.trace import trace_step

MiB = 1 << 20


@pytest.mark.parametrize(("request_bytes", "segment"), [
    (1, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (13 * MiB + 5, 14 * MiB),
])
def test_segment_rounding(request_bytes: int, segment: int) -> None:
    assert segment_size(round_request(request_bytes)) == segment


def test_small_requests_share_a_segment_and_blocks_are_reused() -> None:
    va = [0]
    pool = CachingPool(va)
    a = pool.allocate(100_000)
    b = pool.allocate(100_000)
    assert len(pool.segments) == 1 and pool.segment_bytes == 2 * MiB
    assert b == a + round_request(100_000)
    pool.release(a)
    c = pool.allocate(50_000)  # best fit reuses the freed block
    assert c == a
    big = pool.allocate(3 * MiB)  # large pool: its own 20 MiB segment
    assert pool.segment_bytes == 22 * MiB
    pool.release(big)
    again = pool.allocate(5 * MiB)  # fits the cached 20 MiB segment
    assert again == big and pool.segment_bytes == 22 * MiB


def test_merge_of_free_neighbours() -> None:
    pool = CachingPool([0])
    x = pool.allocate(4 * MiB)
    y = pool.allocate(4 * MiB)
    pool.release(x)
    pool.release(y)
    z = pool.allocate(15 * MiB)  # needs the merged 20 MiB block
    assert z == x and len(pool.segments) == 1


def test_every_block_holds_one_type_and_footprint_matches_segments() -> None:
    trace = trace_step(get_model("mlp", width=512, depth=3, batch_size=64))
    placement = place(trace)
    layout = placement.final
    assert sum(layout.segment_bytes.values()) == layout.n_blocks * BLOCK
    # storages lie inside blocks of their own type
    sel = layout.st_va >= 0
    first = layout.st_va[sel] // BLOCK
    last = (layout.st_va[sel] + trace.st_nbytes[sel] - 1) // BLOCK
    assert np.all(layout.block_type[first] == trace.st_type[sel])
    assert np.all(layout.block_type[last] == trace.st_type[sel])
    # steady state: replaying the step reuses the cached blocks
    assert len(placement.layouts) <= 4
    assert placement.layout(100) is placement.final
