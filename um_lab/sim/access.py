"""Turn a trace's storage accesses into per-op VA-block accesses (vectorised, NumPy only).

For each op: the 2 MiB blocks it touches, which 64 KiB big pages of each block it touches (a uint32
bitmask) and writes, the bytes it moves in each block, and the bytes it would move over the host link
if the block were accessed remotely (GEMM operands are re-read once per output tile of the other
dimension, which is what makes zero-copy parameters so slow).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from um_lab.sim.placement import BIG_PAGE, BLOCK, Layout
from um_lab.sim.trace import StepTrace

_FULL = np.uint64(0xFFFFFFFF)


@dataclasses.dataclass
class OpBlocks:
    """Per-op block accesses in CSR form: entries ``ptr[i]:ptr[i+1]`` belong to op ``i``."""

    ptr: np.ndarray  #: int64, n_ops + 1
    block: np.ndarray  #: int64 block index
    mask: np.ndarray  #: uint32 big pages touched
    write_mask: np.ndarray  #: uint32 big pages written
    nbytes: np.ndarray  #: float64 bytes accessed in the block
    remote_bytes: np.ndarray  #: float64 bytes read over the host link if remote (with re-reads)
    write_bytes: np.ndarray  #: float64 bytes written in the block (written over the link if remote)


def page_mask(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint32 masks of the big pages covering byte offsets [lo, hi) inside one block (hi > lo)."""
    first = (lo // BIG_PAGE).astype(np.uint64)
    last = ((hi - 1) // BIG_PAGE).astype(np.uint64)
    upper = (np.uint64(1) << (last + np.uint64(1))) - np.uint64(1)
    upper = np.where(last >= 31, _FULL, upper)
    lower = (np.uint64(1) << first) - np.uint64(1)
    return (upper & ~lower & _FULL).astype(np.uint32)


def reread_factor(reuse: np.ndarray, tile_min: float, tile_max: float) -> np.ndarray:
    """How often a GEMM operand is read when it is not in GPU memory (no L2 reuse across tiles).

    ``reuse`` is the extent of the other output dimension; the GEMM library's tile along it grows with
    the problem (``reuse / 4`` clipped to [tile_min, tile_max]); each tile re-reads the operand.
    Non-GEMM accesses (reuse 1) are read once.
    """
    tile = np.clip(reuse / 4.0, tile_min, tile_max)
    return np.maximum(1.0, np.ceil(reuse / tile))


def expand(trace: StepTrace, layout: Layout, tile_min: float, tile_max: float,
           conv_tile: float | None = None) -> OpBlocks:
    """Expand ``trace``'s accesses under ``layout`` into per-op block accesses.

    ``tile_min`` / ``tile_max``: GEMM output tile bounds (see :func:`reread_factor`); ``conv_tile``:
    the output-pixel (N*P*Q) tile of implicit-GEMM convolutions, which re-read their filter once per
    tile (cuDNN's convolution kernels use larger pixel tiles than cuBLAS's GEMM tiles along M; None:
    as GEMMs). Remote reads
    and remote writes are counted apart (``remote_bytes`` / ``write_bytes``): the host link is full
    duplex, so an in-place kernel's read and write streams overlap (see ``UvmModel.access``).
    """
    n_ops = trace.n_ops
    acc_op = np.repeat(np.arange(n_ops, dtype=np.int64), np.diff(trace.acc_ptr))
    base = layout.st_va[trace.acc_storage]
    keep = (base >= 0) & (trace.acc_hi > trace.acc_lo)
    acc_op, base = acc_op[keep], base[keep]
    lo = base + trace.acc_lo[keep]
    hi = base + trace.acc_hi[keep]
    write = trace.acc_write[keep] > 0
    reads = trace.acc_write[keep] != 1  # write-only outputs are not read
    reuse = trace.acc_reuse[keep]
    reread = reread_factor(reuse, tile_min, tile_max)
    if conv_tile is not None:
        conv = trace.op_kind[acc_op] == 2
        reread = np.where(conv, np.maximum(1.0, np.ceil(reuse / conv_tile)), reread)
    reread = reread * reads
    first_block = lo // BLOCK
    n_blk = (hi - 1) // BLOCK - first_block + 1
    # one entry per (access, block)
    rep = np.repeat(np.arange(len(lo)), n_blk)
    offset = np.arange(len(rep)) - np.repeat(np.cumsum(n_blk) - n_blk, n_blk)
    blk = first_block[rep] + offset
    blk_lo = np.maximum(lo[rep], blk * BLOCK) - blk * BLOCK
    blk_hi = np.minimum(hi[rep], (blk + 1) * BLOCK) - blk * BLOCK
    mask = page_mask(blk_lo, blk_hi)
    nbytes = (blk_hi - blk_lo).astype(np.float64)
    e_op = acc_op[rep]
    e_write = write[rep]
    # group by (op, block)
    key = e_op * (int(blk.max()) + 1 if len(blk) else 1) + blk
    order = np.argsort(key, kind="stable")
    key, e_op, blk, mask, nbytes = key[order], e_op[order], blk[order], mask[order], nbytes[order]
    e_write, e_reread = e_write[order], reread[rep][order]
    if len(key):
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    else:
        starts = np.zeros(0, np.int64)
    wmask = np.where(e_write, mask, np.uint32(0)).astype(np.uint32)

    def group_or(x: np.ndarray) -> np.ndarray:
        return np.bitwise_or.reduceat(x, starts) if len(starts) else x[:0]

    def group_sum(x: np.ndarray) -> np.ndarray:
        return np.add.reduceat(x, starts) if len(starts) else x[:0]

    g_op = e_op[starts] if len(starts) else e_op[:0]
    ptr = np.zeros(n_ops + 1, np.int64)
    np.add.at(ptr, g_op + 1, 1)
    return OpBlocks(
        ptr=np.cumsum(ptr),
        block=blk[starts] if len(starts) else blk[:0],
        mask=group_or(mask).astype(np.uint32),
        write_mask=group_or(wmask).astype(np.uint32),
        nbytes=group_sum(nbytes),
        remote_bytes=group_sum(nbytes * e_reread),
        write_bytes=group_sum(np.where(e_write, nbytes, 0.0)),
    )
