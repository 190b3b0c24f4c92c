"""Turn a trace's storage accesses into per-op VA-block accesses (vectorised, NumPy only).

For each op: the 2 MiB blocks it touches, which 64 KiB big pages of each block it touches (a uint32
bitmask) and writes, the bytes it moves in each block, and the bytes it would move over the host link
if the block were accessed remotely (tiled kernels re-read remote operands once per output tile: see
:func:`link_passes`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from um_lab.sim.gemm_passes import passes_nn, passes_nt
from um_lab.sim.ops import (
    COL_REDUCE,
    CONV_1X1,
    CONV_1X1_BWD_FILTER,
    CONV_IGEMM,
    CONV_IGEMM_1X1,
    GEMM_A,
    GEMM_NN,
    GEMM_NT_B,
    GEMM_TN,
    GEMM_XW,
    GEMM_XW_BIAS,
    GEMM_XWT,
    GEMM_XWT_BIAS,
    NORM_STATS,
)
from um_lab.sim.placement import BIG_PAGE, BLOCK, Layout
from um_lab.sim.profile import Profile
from um_lab.sim.trace import ACC_READ, ACC_READ_WRITE, ACC_WRITE_ONLY, StepTrace

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
    inplace_bytes: np.ndarray  #: float64 bytes of the block the op updates in place (read and written)


def page_mask(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint32 masks of the big pages covering byte offsets [lo, hi) inside one block (hi > lo)."""
    first = (lo // BIG_PAGE).astype(np.uint64)
    last = ((hi - 1) // BIG_PAGE).astype(np.uint64)
    upper = (np.uint64(1) << (last + np.uint64(1))) - np.uint64(1)
    upper = np.where(last >= 31, _FULL, upper)
    lower = (np.uint64(1) << first) - np.uint64(1)
    return (upper & ~lower & _FULL).astype(np.uint32)


def link_passes(reuse: np.ndarray, reread: np.ndarray, profile: Profile,
                volume: np.ndarray | None = None, gemm_k: np.ndarray | None = None,
                gemm_n: np.ndarray | None = None) -> np.ndarray:
    """How many times each remote operand's bytes cross the host link (classes: :data:`um_lab.sim.ops.REREAD_CLASSES`).

    A tiled kernel re-reads its operand once per tile of the other output dimension
    (``ceil(reuse / tile)``, at least 1), with the profile's tiles; a convolution's implicit GEMM reads
    ``volume`` times the operand's bytes per pass, ``max(1, reuse / tile)`` passes with the k x k or the 1x1
    tile (cuDNN picks smaller tiles for narrow outputs); a training-mode batch norm (and a layer norm's
    backward) reads its input ``norm_input_passes`` times; a column reduction reads at
    ``remote_colreduce_GBps`` (``remote_GBps / remote_colreduce_GBps`` passes); a 2-d GEMM's weight
    (classes gemm_xwt*, gemm_xw*; ``reuse`` = M, with its K and N in ``gemm_k`` / ``gemm_n``) by the shape
    model of :mod:`um_lab.sim.gemm_passes`; everything else once.
    """
    p = profile
    nt_b = np.clip(reuse / 128.0, p.tile_gemm_nt_b_min, p.tile_gemm_nt_b_max)
    tiles = {GEMM_A: p.tile_gemm_a, GEMM_NT_B: nt_b, GEMM_NN: p.tile_gemm_nn, GEMM_TN: p.tile_gemm_tn,
             CONV_1X1: p.tile_conv_1x1, CONV_1X1_BWD_FILTER: p.tile_conv_1x1_bwd_filter}
    passes = np.ones(len(reuse))
    for cls, tile in tiles.items():
        sel = reread == cls
        if sel.any():
            t = tile[sel] if isinstance(tile, np.ndarray) else tile
            passes[sel] = np.maximum(1.0, np.ceil(reuse[sel] / t))
    for cls, tile in ((CONV_IGEMM, p.tile_conv_igemm_kxk), (CONV_IGEMM_1X1, p.tile_conv_igemm_1x1)):
        conv = reread == cls
        if conv.any():
            passes[conv] = np.maximum(1.0, reuse[conv] / tile)
    table = {row[:5]: row[5] for row in p.gemm_shape_passes}  # measured at exact shapes: they win over the law
    for classes, biased in (((GEMM_XWT, GEMM_XWT_BIAS), GEMM_XWT_BIAS), ((GEMM_XW, GEMM_XW_BIAS), GEMM_XW_BIAS)):
        sel = np.isin(reread, classes)
        if sel.any():
            if gemm_k is None or gemm_n is None:
                raise ValueError("GEMM weight reads need their K and N (gemm_k, gemm_n)")
            bias = reread[sel] == biased
            if biased == GEMM_XWT_BIAS:
                passes[sel] = passes_nt(reuse[sel], gemm_n[sel], bias, p)
            else:
                passes[sel] = passes_nn(reuse[sel], gemm_k[sel], gemm_n[sel], bias, p)
            if table:
                layout = "nt" if biased == GEMM_XWT_BIAS else "nn"
                for i in np.flatnonzero(sel):
                    key = (layout, int(reread[i] == biased), int(reuse[i]), int(gemm_k[i]), int(gemm_n[i]))
                    if key in table:
                        passes[i] = table[key]
    passes[reread == NORM_STATS] = p.norm_input_passes
    passes[reread == COL_REDUCE] = p.remote_GBps / p.remote_colreduce_GBps
    return passes if volume is None else passes * volume


def expand(trace: StepTrace, layout: Layout, profile: Profile) -> OpBlocks:
    """Expand ``trace``'s accesses under ``layout`` into per-op block accesses.

    Remote reads count :func:`link_passes` per operand; remote reads and remote writes are counted apart
    (``remote_bytes`` / ``write_bytes``): the host link is full duplex, so an in-place kernel's read and
    write streams overlap (see ``UvmModel.access``).
    """
    n_ops = trace.n_ops
    acc_op = np.repeat(np.arange(n_ops, dtype=np.int64), np.diff(trace.acc_ptr))
    base = layout.st_va[trace.acc_storage]
    keep = (base >= 0) & (trace.acc_hi > trace.acc_lo)
    acc_op, base = acc_op[keep], base[keep]
    lo = base + trace.acc_lo[keep]
    hi = base + trace.acc_hi[keep]
    write = trace.acc_write[keep] != ACC_READ
    inplace = trace.acc_write[keep] == ACC_READ_WRITE
    reads = trace.acc_write[keep] != ACC_WRITE_ONLY  # fresh outputs are not read
    reread = link_passes(trace.acc_reuse[keep], trace.acc_reread[keep], profile, trace.acc_volume[keep],
                         trace.acc_gemm_k[keep], trace.acc_gemm_n[keep]) * reads
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
    e_inplace = inplace[rep]
    # group by (op, block)
    key = e_op * (int(blk.max()) + 1 if len(blk) else 1) + blk
    order = np.argsort(key, kind="stable")
    key, e_op, blk, mask, nbytes = key[order], e_op[order], blk[order], mask[order], nbytes[order]
    e_write, e_reread, e_inplace = e_write[order], reread[rep][order], e_inplace[order]
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
        inplace_bytes=group_sum(np.where(e_inplace, nbytes, 0.0)),
    )
