"""bench/diagnostics/dead_moves.py on a small traced MLP: the liveness of storages follows their accesses,
the dead share of the plan's moves is a share, and the dead-aware plan moves only the live bytes."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dead_moves():
    spec = importlib.util.spec_from_file_location("dead_moves", ROOT / "bench" / "diagnostics" / "dead_moves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def analysed(dead_moves):
    from um_lab.sim.backend import SimBackend
    from um_lab.sim.budget import simulate_budget

    sim = SimBackend()
    prepared = sim.prepare(dead_moves.build_case("mlp-small"))
    layout = prepared.placement.final
    result = simulate_budget(prepared.trace, layout, sim.profile, int(prepared.footprint_bytes / 2),
                             remote_optimizer=False)  # what the plan that moves optimizer state moves
    return prepared.trace, layout, result


def test_a_temporary_is_dead_before_its_first_write_and_after_its_last_access(dead_moves, analysed):
    trace, layout, _ = analysed
    live = dead_moves.Liveness(trace, layout.st_va)
    temporaries = [s for s in range(len(trace.st_nbytes)) if not trace.st_persistent[s] and live.ops[s]
                   and not live.reads[s][0] and len(live.ops[s]) > 1]
    assert temporaries
    for s in temporaries[:20]:
        first, last = live.ops[s][0], live.ops[s][-1]
        assert not live.storage_live(s, first)  # its first access only writes it
        assert live.storage_live(s, first + 1) == live.reads[s][1]  # then as its next access does
        assert not live.storage_live(s, last + 1)  # freed after its last access
    persistent = [s for s in range(len(trace.st_nbytes)) if trace.st_persistent[s] and live.ops[s] and live.reads[s][0]]
    assert persistent and all(live.storage_live(s, trace.n_ops) for s in persistent)  # read again next step


def test_the_dead_aware_plan_moves_the_live_bytes_and_drops_or_populates_the_rest(dead_moves, analysed):
    from um_lab.sim.budget import replay_plan
    from um_lab.sim.profile import load_profile

    trace, layout, result = analysed
    live = dead_moves.Liveness(trace, layout.st_va)
    shares = dead_moves.dead_share(result.plan, result.derived.op_start, live)
    assert shares["prefetched_bytes"] == pytest.approx(result.plan.prefetched_bytes)
    assert shares["evicted_bytes"] == pytest.approx(result.plan.evicted_bytes)
    assert 0 < shares["evicted_dead_bytes"] < shares["evicted_bytes"]
    aware = dead_moves.dead_aware(result.plan, result.derived.op_start, live)
    assert aware.evicted_bytes == pytest.approx(shares["evicted_bytes"] - shares["evicted_dead_bytes"], rel=1e-6)
    assert aware.discarded_bytes == pytest.approx(shares["evicted_dead_bytes"], rel=1e-6)
    assert aware.prefetched_bytes + aware.populated_bytes == pytest.approx(result.plan.prefetched_bytes, rel=1e-6)
    blocks = [b for ms in aware.moves for m in ms for b in m.blocks]
    assert sorted(blocks) == sorted(b for ms in result.plan.moves for m in ms for b in m.blocks)
    profile = load_profile("h200")
    faster = replay_plan(result.derived, aware, profile).wall_us
    assert np.isfinite(faster) and faster < replay_plan(result.derived, result.plan, profile).wall_us
