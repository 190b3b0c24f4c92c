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


def test_remote_rereads_follow_the_measured_tiles_and_outputs_are_not_read() -> None:
    """Remote re-reads: 1x1 convolution filters once per output-pixel tile (``tile_conv_1x1``), k x k
    convolutions once, GEMMs by their own tiles; write-only outputs are never read over the link."""
    import dataclasses

    import numpy as np

    from um_lab.sim.access import expand
    from um_lab.sim.ops import CONV_1X1, READ_ONCE
    from um_lab.sim.placement import place
    from um_lab.sim.profile import Profile
    from um_lab.sim.replicas import resnet_replica
    from um_lab.sim.trace import cached_trace

    tr = cached_trace(resnet_replica(50, batch_size=4, image_size=64, classes=10))
    layout = place(tr).final
    small = expand(tr, layout, dataclasses.replace(Profile(), tile_conv_1x1=32.0))
    big = expand(tr, layout, dataclasses.replace(Profile(), tile_conv_1x1=128.0))
    assert (tr.acc_reread == CONV_1X1).any() and (tr.acc_reread == READ_ONCE).any()
    op_of = np.repeat(np.arange(tr.n_ops), np.diff(small.ptr))
    param = layout.block_type[small.block] == 0
    conv = (tr.op_kind[op_of] == 2) & param
    gemm = (tr.op_kind[op_of] == 1) & param
    ratio = small.remote_bytes[conv].sum() / big.remote_bytes[conv].sum()
    assert 1.2 < ratio <= 4.0  # up to 4x fewer tiles re-read the 1x1 filters (each read at least once)
    assert np.array_equal(small.remote_bytes[gemm], big.remote_bytes[gemm])
    # the batch copy only writes its input storages
    first = slice(small.ptr[0], small.ptr[1])
    assert small.remote_bytes[first].sum() == 0 and small.write_bytes[first].sum() > 0
