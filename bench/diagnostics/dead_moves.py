"""How much of what the layer-ahead scheduler moves is dead data (issue 13; the simulator, CPU only).

The ledger does not know which 2 MiB blocks hold only freed or not-yet-written tensors, so its plan copies
them like live ones. On the simulator the traced step knows every access, so for each move of the steady
plan this asks whether the block's contents are still needed: a block is *dead* at an op when every
storage lying in it is next accessed by a write that reads nothing (a fresh output), or never again
(freed). An eviction at position ``i`` moves dead data when the block is dead where ``i`` starts; a
prefetch for position ``j``, when it is dead where ``j`` starts. Dead evictions could be discards and dead
prefetches populates (no copy: ``cudaMemDiscardBatchAsync`` / ``cudaMemDiscardAndPrefetchBatchAsync``).

    python bench/diagnostics/dead_moves.py --models gpt2-large --ratios 2 --out bench/results/dead_moves.json
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from um_lab.budget.ledger import BLOCK  # noqa: E402
from um_lab.sim.trace import ACC_WRITE_ONLY, StepTrace  # noqa: E402

GiB = 1 << 30


class Liveness:
    """Whether a VA block's contents are still needed at an op of the traced step (see the module doc)."""

    def __init__(self, trace: StepTrace, st_va: np.ndarray) -> None:
        n = len(trace.st_nbytes)
        ops: list[list[int]] = [[] for _ in range(n)]
        reads: list[list[bool]] = [[] for _ in range(n)]
        for op in range(trace.n_ops):
            for k in range(int(trace.acc_ptr[op]), int(trace.acc_ptr[op + 1])):
                s = int(trace.acc_storage[k])
                read = int(trace.acc_write[k]) != ACC_WRITE_ONLY
                if ops[s] and ops[s][-1] == op:
                    reads[s][-1] = reads[s][-1] or read  # one op reading and writing: it reads
                else:
                    ops[s].append(op)
                    reads[s].append(read)
        self.ops, self.reads = ops, reads
        self.persistent = trace.st_persistent
        self.by_block: dict[int, list[int]] = {}
        for s in range(n):
            va, nbytes = int(st_va[s]), int(trace.st_nbytes[s])
            if va < 0 or nbytes <= 0:
                continue
            for b in range(va // BLOCK, (va + nbytes - 1) // BLOCK + 1):
                self.by_block.setdefault(b, []).append(s)

    def storage_live(self, s: int, op: int) -> bool:
        """True when storage ``s``'s next access at or after ``op`` reads it (persistent ones wrap around)."""
        ops = self.ops[s]
        if not ops:
            return False
        k = bisect.bisect_left(ops, op)
        if k < len(ops):
            return self.reads[s][k]
        return bool(self.persistent[s]) and self.reads[s][0]

    def block_live(self, block: int, op: int) -> bool:
        """True when any storage in ``block`` is live at ``op``."""
        return any(self.storage_live(s, op) for s in self.by_block.get(block, ()))


def split_dead(move: Any, position: int, op_start: tuple[int, ...], live: Liveness) -> tuple[list[int], list[int]]:
    """The blocks of a prefetch or eviction issued at ``position``: (live, dead). An eviction's blocks are judged
    where its position starts, a prefetch's where the position it serves starts."""
    at = op_start[move.target if move.kind == "prefetch" else position]
    live_blocks: list[int] = []
    dead_blocks: list[int] = []
    for b in move.blocks:
        (live_blocks if live.block_live(b, at) else dead_blocks).append(b)
    return live_blocks, dead_blocks


def dead_share(plan: Any, op_start: tuple[int, ...], live: Liveness) -> dict[str, float]:
    """Bytes the plan's steady step moves each way, and how many of them are dead."""
    out = {"prefetched_bytes": 0.0, "prefetched_dead_bytes": 0.0, "evicted_bytes": 0.0, "evicted_dead_bytes": 0.0}
    for i, moves in enumerate(plan.moves):
        for m in moves:
            if m.kind not in ("prefetch", "evict") or not m.blocks:
                continue
            per_block = m.nbytes / len(m.blocks)
            key = "prefetched" if m.kind == "prefetch" else "evicted"
            out[f"{key}_bytes"] += per_block * len(m.blocks)
            out[f"{key}_dead_bytes"] += per_block * len(split_dead(m, i, op_start, live)[1])
    return out


def _runs(blocks: list[int], per_block: float) -> tuple[tuple[int, int], ...]:
    """Spans of consecutive blocks (one call each), ``per_block`` bytes per block."""
    spans: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if spans and spans[-1][0] + spans[-1][1] == b * BLOCK:
            spans[-1] = (spans[-1][0], spans[-1][1] + BLOCK)
        else:
            spans.append((b * BLOCK, BLOCK))
    scale = per_block / BLOCK
    return tuple((p, int(n * scale)) for p, n in spans)


def dead_aware(plan: Any, op_start: tuple[int, ...], live: Liveness) -> Any:
    """``plan`` with each dead block's eviction made a discard and each dead block's prefetch a populate (no
    copy), the live ones left as they are: what a ledger that knew the free blocks would issue."""
    import dataclasses

    from um_lab.budget.ledger import Move

    moves: list[list[Any]] = []
    for i, position in enumerate(plan.moves):
        out = []
        for m in position:
            if m.kind not in ("prefetch", "evict") or not m.blocks:
                out.append(m)
                continue
            per_block = m.nbytes / len(m.blocks)
            kept, dead = split_dead(m, i, op_start, live)
            for kind, blocks in ((m.kind, kept), ("populate" if m.kind == "prefetch" else "discard", dead)):
                if blocks:
                    out.append(Move(kind, _runs(blocks, per_block), int(per_block * len(blocks)), m.resident_after,
                                    m.target, tuple(blocks)))
        moves.append(out)
    flat = [m for ms in moves for m in ms]
    return dataclasses.replace(
        plan, moves=moves, prefetched_bytes=sum(m.nbytes for m in flat if m.kind == "prefetch"),
        evicted_bytes=sum(m.nbytes for m in flat if m.kind == "evict"),
        discarded_bytes=sum(m.nbytes for m in flat if m.kind == "discard"),
        populated_bytes=sum(m.nbytes for m in flat if m.kind == "populate"))


def build_case(name: str) -> Any:
    """bench/budget.py's model at its size (the sizes the budget rows were measured at)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import budget

    return budget.build_case(name)


def analyse(name: str, ratio: float) -> dict[str, Any]:
    """The simulated plan of ``name`` at footprint / ``ratio`` and the dead share of its moves."""
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.budget import replay_plan, simulate_budget

    sim = SimBackend()
    prepared = sim.prepare(build_case(name))
    budget = int(prepared.footprint_bytes / ratio)
    layout = prepared.placement.final
    result = simulate_budget(prepared.trace, layout, sim.profile, budget, remote_optimizer=False)  # the moving plan
    live = Liveness(prepared.trace, layout.st_va)
    shares = dead_share(result.plan, result.derived.op_start, live)
    moved = shares["prefetched_bytes"] + shares["evicted_bytes"]
    dead = shares["prefetched_dead_bytes"] + shares["evicted_dead_bytes"]
    aware = replay_plan(result.derived, dead_aware(result.plan, result.derived.op_start, live), sim.profile)
    return {"model": name, "ratio": ratio, "sim_footprint_bytes": prepared.footprint_bytes, "sim_budget_bytes": budget,
            **{k: int(v) for k, v in shares.items()}, "dead_fraction": dead / moved if moved else 0.0,
            "live_crossing_bytes": int(moved - dead), "sim_step_ms": result.step.wall_us / 1e3,
            "sim_step_ms_dead_aware": aware.wall_us / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-large"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[2.0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", action="append", default=[], help="kept in the output file (repeatable)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        for ratio in args.ratios:
            row = analyse(name, ratio)
            rows.append(row)
            print(f"{name} at {ratio:g}: moves {(row['prefetched_bytes'] + row['evicted_bytes']) / GiB:.1f} GiB/step, "
                  f"dead {row['dead_fraction']:.1%} (in {row['prefetched_dead_bytes'] / GiB:.1f} of "
                  f"{row['prefetched_bytes'] / GiB:.1f} GiB, out {row['evicted_dead_bytes'] / GiB:.1f} of "
                  f"{row['evicted_bytes'] / GiB:.1f} GiB); step {row['sim_step_ms']:.0f} ms, with dead blocks "
                  f"discarded and populated {row['sim_step_ms_dead_aware']:.0f} ms", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                        "device": "simulated: the h200 profile (um_lab.sim.budget)",
                                        "notes": args.note, "rows": rows},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
