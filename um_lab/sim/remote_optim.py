"""Optimizer state left in host memory under a budget (the experimental ``remote_optimizer`` option, on by
default), on the simulator: what the optimizer's kernels cost when part of a layer's state is remote.

:func:`remote_costs` gives each traced optimizer-state storage the time its kernels spend on it over the
link if it is remote: per access, the longest of its read stream at ``remote_GBps``, its write stream at
``remote_write_GBps`` and both at ``remote_inplace_GBps`` (an in-place update: AdamW's foreach ops) or
``remote_rw_GBps``, as :meth:`um_lab.sim.uvm.UvmModel.access` prices a remote kernel. The foreach step reads
each state tensor in several kernels (``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``addcdiv_``), so the
link carries the state 2-3 times over, not once each way. :func:`remote_extra_us` turns a plan's remote
blocks into extra GPU time per position (a storage partly remote costs its share).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from um_lab.schedule.ledger import BLOCK
from um_lab.sim.placement import Layout
from um_lab.sim.profile import Profile
from um_lab.sim.trace import ACC_READ, ACC_READ_WRITE, ACC_WRITE_ONLY, StepTrace
from um_lab.types import DATA_TYPES, DataType

_OPTIM = DATA_TYPES.index(DataType.OPTIM)

#: one remote storage of a position: (first block, blocks, microseconds its kernels spend on it when remote,
#: bytes they then move over the link, both directions, its own bytes)
RemoteCost = tuple[int, int, float, float, int]


def remote_costs(trace: StepTrace, layout: Layout, profile: Profile, ops: Iterable[int]) -> dict[int, RemoteCost]:
    """Storage -> its :data:`RemoteCost` over the optimizer ``ops``, for every optimizer-state storage they touch."""
    p = profile
    us: dict[int, float] = {}
    link: dict[int, float] = {}
    for op in ops:
        for k in range(int(trace.acc_ptr[op]), int(trace.acc_ptr[op + 1])):
            s = int(trace.acc_storage[k])
            if int(trace.st_type[s]) != _OPTIM or int(layout.st_va[s]) < 0:
                continue
            nbytes = float(trace.acc_hi[k] - trace.acc_lo[k])
            code = int(trace.acc_write[k])
            read = nbytes if code in (ACC_READ, ACC_READ_WRITE) else 0.0
            write = nbytes if code in (ACC_WRITE_ONLY, ACC_READ_WRITE) else 0.0
            both = p.remote_inplace_GBps if code == ACC_READ_WRITE else p.remote_rw_GBps
            us[s] = us.get(s, 0.0) + max(read / (p.remote_GBps * 1e3), write / (p.remote_write_GBps * 1e3),
                                         (read + write) / (both * 1e3))
            link[s] = link.get(s, 0.0) + read + write
    out: dict[int, RemoteCost] = {}
    for s, t in us.items():
        va, nbytes = int(layout.st_va[s]), int(trace.st_nbytes[s])
        first = va // BLOCK
        out[s] = (first, (va + max(nbytes, 1) - 1) // BLOCK - first + 1, t, link[s], nbytes)
    return out


def _remote_blocks_in(costs: Sequence[Sequence[RemoteCost]], remote: Iterable[int],
                      n: int) -> Iterator[tuple[int, RemoteCost, int]]:
    """(position, storage cost, how many of its blocks are in ``remote``) for each of the first ``n`` positions'
    storages with any block there."""
    blocks = np.fromiter(remote, dtype=np.int64)
    if not len(blocks):
        return
    blocks.sort()
    for i, entries in enumerate(costs[:n]):
        for cost in entries:
            first, count = cost[0], cost[1]
            inside = int(np.searchsorted(blocks, first + count) - np.searchsorted(blocks, first))
            if inside:
                yield i, cost, inside


def remote_extra_us(costs: Sequence[Sequence[RemoteCost]], remote: Iterable[int], n: int) -> tuple[list[float], float]:
    """Extra GPU time of each of ``n`` positions when the blocks ``remote`` stay in host memory
    (``costs[i]``: position ``i``'s storages), and the bytes the step then moves over the link for them."""
    extra = [0.0] * n
    link = 0.0
    for i, (_, count, us, nbytes, _), inside in _remote_blocks_in(costs, remote, n):
        extra[i] += us * inside / count
        link += nbytes * inside / count
    return extra, link


def remote_state_bytes(costs: Sequence[Sequence[RemoteCost]], remote: Iterable[int], n: int) -> list[int]:
    """Bytes of each of ``n`` positions' optimizer state in the blocks ``remote`` (a storage partly remote: its
    share): what the session copies in for the position's step and back after it when it copies remote state."""
    out = [0] * n
    for i, (_, count, _, _, nbytes), inside in _remote_blocks_in(costs, remote, n):
        out[i] += nbytes * inside // count
    return out


def by_layer(costs: Mapping[int, RemoteCost], layer: Mapping[int, int]) -> dict[int, list[RemoteCost]]:
    """The storages' costs grouped by the layer that owns them."""
    out: dict[int, list[RemoteCost]] = {}
    for s, cost in costs.items():
        if s in layer:
            out.setdefault(layer[s], []).append(cost)
    return out
