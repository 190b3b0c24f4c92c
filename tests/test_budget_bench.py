"""bench/budget.py's row logic on the CPU with the fake driver (the numbers mean nothing here; the
schema, the ratios and the error rows do)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from fakes import FakePoolAPI, FakeRuntime, drain, install_fake_driver

from um_lab.types import DataType

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
GiB = 1 << 30
SCHEMA = {"model", "footprint_bytes", "budget_bytes", "ratio", "step_ms", "fit_step_ms", "crossing_bytes",
          "bound_ms", "over_bound", "max_resident_ledger", "max_resident_cupti", "fsdp2_step_ms",
          "fsdp2_peak_bytes", "sim_step_ms"}


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_budget", ROOT / "bench" / "budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_budget"] = module
    spec.loader.exec_module(module)
    source, driver = install_fake_driver(cap=1 << 40)
    module.SESSION_KWARGS.update(_pool_api=FakePoolAPI(), _runtime=FakeRuntime(), _source=source)
    module.memory_reads = []

    def device_memory():  # free GPU memory drops by 1 GiB at every read (another user of the card)
        free = (64 << 30) - len(module.memory_reads) * (1 << 30)
        module.memory_reads.append(free)
        return free, 80 << 30

    monkeypatch.setattr(module, "device_memory", device_memory)
    module.fake_source = source
    real_run = module.run_session

    def run(case, steps, limit, **kw):
        out = real_run(case, steps, limit, **kw)
        if kw.get("budget") is None:
            out["peak_bytes"] = 96 * MiB  # the fake driver holds no tensors: a footprint for the CPU. The ok
            # rows' B = 96 MiB / ratio must lie in [44, 64) MiB whatever the CPU heap layout: below the 64.2 MiB of
            # parameters, gradients and AdamW state every step reads (or nothing crosses), and at least the largest
            # position, a hidden layer's optimizer chunk, counted in whole 2 MiB blocks: 4 x 4 MiB tensors (<= 3
            # blocks each), 4 x 4 KiB (<= 2 each), 2 step scalars (1 each) = at most 22 blocks, 44 MiB (seen: 26-34
            # MiB, so ratio 3, B = 32 MiB, failed with BudgetTooSmall when the heap put them across more blocks)
        return out

    monkeypatch.setattr(module, "run_session", run)
    monkeypatch.setattr(module, "build_case", lambda name: module.get_model("mlp", width=1024, depth=4,
                                                                            batch_size=64))
    yield module
    drain(source)
    sys.modules.pop("bench_budget", None)


def test_bench_rows_carry_the_issue_schema_and_the_ledger_numbers(bench):
    torch.manual_seed(0)
    lines = []
    rows = bench.bench_model("mlp", [1.75, 2.0, 40.0], 4, 1 << 40, False, lines.append)  # B 54.9, 48, 2.4 MiB
    assert all("error" not in r for r in rows[:2]), [r.get("error") for r in rows]
    assert [r["ratio"] for r in rows] == [1.75, 2.0, 40.0]
    ok, refused = rows[:2], rows[2]
    for row in ok:
        assert SCHEMA <= set(row) and row["budget_bytes"] == int(96 * MiB / row["ratio"])
        assert row["max_resident_ledger"] > 0 and row["crossing_bytes"] > 0 and row["followed_plan"]
        assert row["bound_ms"] >= row["fit_step_ms"] and row["over_bound"] == row["step_ms"] / row["bound_ms"]
        # the primitives: 50.6 GB/s in, 18.0 GB/s out, not overlapped; a steady step moves out about what it
        # brings in, so that bound lies above the one at 47 GB/s both ways
        assert row["evicted_bytes"] >= row["prefetched_bytes"] / 2 > 0
        assert row["primitive_bound_ms"] >= row["bound_ms"]
        assert row["over_primitive_bound"] == row["step_ms"] / row["primitive_bound_ms"]
        assert row["max_resident_cupti"] is None and row["fsdp2_step_ms"] is None and row["sim_step_ms"] is None
    assert refused["step_ms"] is None and refused["error"].startswith("BudgetTooSmall")  # 2.4 MiB: not one layer
    assert any("ratio 2.0" in line for line in lines)


def test_timed_moves_give_each_row_its_side_stream_rates(bench):
    """--time-moves: the row's move_timing has, per direction, the median bytes, ms, calls and rate of the
    measured steps (on the CPU the recording fake's 1 ms a call), and the bytes match the ledger's."""
    torch.manual_seed(0)
    lines = []
    row = bench.bench_model("mlp", [2.0], 5, 1 << 40, False, lines.append, time_moves=True)[0]
    timing = row["move_timing"]
    assert set(timing) == {"to_gpu", "to_host"}
    assert timing["to_gpu"]["GB"] == pytest.approx(row["prefetched_bytes"] / 1e9, rel=0.35)
    assert timing["to_host"]["GB"] == pytest.approx(row["evicted_bytes"] / 1e9, rel=0.35)
    for t in timing.values():
        assert t["calls"] > 0 and t["ms"] == t["calls"] and t["host_ms"] >= 0
        assert t["GBps"] == pytest.approx(t["GB"] / t["ms"] * 1e3, rel=0.01)
    assert any("side stream per step" in line for line in lines)
    plain = bench.bench_model("mlp", [2.0], 4, 1 << 40, False, lines.append)[0]
    assert "move_timing" not in plain


def test_each_session_caps_at_the_smaller_of_the_limit_and_the_default_cap_read_just_before_it(bench):
    from um_lab.cuda.allocator import default_cap

    torch.manual_seed(0)
    case = bench.build_case("mlp")
    small = bench.run_session(case, 1, 1 << 30)  # the limit is the smaller one
    assert small["cap_bytes"] == 1 << 30
    big = bench.run_session(case, 1, 1 << 40)  # the default cap, from free memory read again now
    assert len(bench.memory_reads) == 2
    assert big["cap_bytes"] == default_cap(bench.memory_reads[-1], 80 << 30) < default_cap(64 << 30, 80 << 30)


def test_the_bench_aborts_at_0_8_of_the_cap_on_the_absolute_live_total_after_a_step(bench, monkeypatch):
    torch.manual_seed(0)
    case = bench.build_case("mlp")
    monkeypatch.setattr(bench, "device_memory", lambda: ((3 << 30) + (100 << 20), 40 << 30))  # cap 1.1 GiB
    other = bench.fake_source.allocate(DataType.ACT, 900 << 20)  # managed bytes held outside the session
    try:
        with pytest.raises(bench.ManagedLimitExceeded, match="after step 0"):
            bench.run_session(case, 3, 1 << 40)  # 0.9 GiB > 0.8 x 1.1 GiB, below the shim's own cap
        with pytest.raises(bench.ManagedLimitExceeded):  # and it stops the model, not only the row
            bench.bench_model("mlp", [2.0], 2, 1 << 40, False, lambda line: None)
    finally:
        bench.fake_source.free(other)


def test_a_session_that_leaves_managed_bytes_behind_aborts_the_model(bench, monkeypatch):
    torch.manual_seed(0)
    kept = []

    class Leaky(bench.Session):
        def step(self, *args, **kw):
            if not kept:  # a segment nothing frees: close() reports it still held
                kept.append(self._pools.source.allocate(DataType.ACT, 4 << 20))
            return super().step(*args, **kw)

    monkeypatch.setattr(bench, "Session", Leaky)
    try:
        with pytest.raises(bench.ManagedBytesLeft, match="still held"):
            bench.run_session(bench.build_case("mlp"), 1, 1 << 40)
    finally:
        for ptr in kept:
            bench.fake_source.free(ptr)


def _peers_module():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers


def test_the_fsdp2_peer_shards_every_layer_deepest_first():
    peers = _peers_module()
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2))
    layers = peers.layer_modules(model)
    assert layers[0] is model[0][0] and set(map(id, layers)) == {id(model[0]), id(model[0][0]), id(model[1])}


def test_every_peer_trains_the_same_model_to_the_same_loss_on_the_cpu():
    """Without CUDA each peer runs its code path (nothing offloaded): the same seed, batch and optimizer,
    so every peer's loss after its steps is the same; checkpointing wraps every layer."""
    peers = _peers_module()
    rows = {p: peers.run("mlp-small", p, steps=1) for p in peers.PEERS}
    cuda = torch.cuda.is_available()
    assert rows["fsdp2-offload"]["units"] == 18 and rows["fsdp2-offload"]["offload"] == \
        ("CPUOffloadPolicy" if cuda else "none")
    assert "per layer" in rows["checkpoint"]["checkpointing"]
    for p, row in rows.items():
        assert row["peer"] == p and row["step_ms"] > 0 and (row["peak_reserved_bytes"] is None) != cuda
        assert row["loss"] == pytest.approx(rows["fits"]["loss"], rel=1e-4), p
    with pytest.raises(ValueError, match="unknown peer"):
        peers.run("mlp-small", "zero-offload", steps=1)


def test_a_peer_in_bf16_trains_under_autocast_on_the_cpu():
    peers = _peers_module()
    row = peers.run("mlp-small", "checkpoint", steps=1, precision="bf16")
    assert row["precision"] == "bf16" and math.isfinite(row["loss"])


def test_the_committed_budget_results_follow_the_issue_schema():
    """bench/results/budget.json: the row schema, measured values consistent with each other."""
    import json
    from pathlib import Path

    report = json.loads((Path(__file__).parents[1] / "bench" / "results" / "budget.json").read_text())
    assert {"date", "device", "rows"} <= set(report)
    keys = {"model", "footprint_bytes", "budget_bytes", "ratio", "step_ms", "fit_step_ms", "crossing_bytes", "bound_ms",
            "over_bound", "max_resident_ledger", "max_resident_cupti", "fsdp2_step_ms", "fsdp2_peak_bytes",
            "sim_step_ms"}
    assert report["rows"]
    for row in report["rows"]:
        assert keys <= set(row), keys - set(row)
        assert row["budget_bytes"] < row["footprint_bytes"]
        # a row whose ledger passed B must say so (the fixed pool grew under a plan at ratio 3)
        assert row["max_resident_ledger"] <= row["budget_bytes"] or row["over_budget_steps"] > 0, row
        assert abs(row["over_bound"] - row["step_ms"] / row["bound_ms"]) < 1e-6
        assert row["bound_ms"] >= row["fit_step_ms"]


def test_a_budget_row_measures_from_the_second_step_after_its_last_replan_and_at_least_three_steps(bench):
    from types import SimpleNamespace

    def records(replanned_at, n):
        return [SimpleNamespace(extra={"budget": {"replanned": i in replanned_at}}) for i in range(n)]

    assert bench.settled_from(records({0}, 10)) == 2  # the first plan: past the usual two
    assert bench.settled_from(records({0, 1, 2, 3}, 10)) == 5  # partial staging sized in rounds after steps 1-3
    assert bench.settled_from(records({0, 6}, 10)) == 7  # a late re-plan: still three steps measured
    assert bench.settled_from(records({0, 8}, 10)) == 7
    assert bench.settled_from(records(set(), 2)) == 0
    assert bench.settled_from([SimpleNamespace(extra={})] * 6) == 2  # no budget: the usual two skipped
    idle = [SimpleNamespace(extra={"budget": {"replanned": i == 0, "idle": i >= 3}}) for i in range(8)]
    assert bench.settled_from(idle) == 4  # the first idle step brings the pools to the GPU: not measured
    assert bench.settled_from(idle[:6]) == 3  # still three steps measured


def test_predicted_rows_simulate_the_staging_settings_they_name(bench, monkeypatch):
    monkeypatch.setattr(bench, "build_case", lambda name: bench.small_cnn())  # the quick run's CNN: saves to stage
    settings = ((False, True, False), (True, True, False), (True, True, True))
    rows = bench.predict(["cnn-small"], [2.0], lambda line: None, settings)
    assert [(r["stage_activations"], r["partial_staging"]) for r in rows] == \
        [(False, False), (True, False), (True, True)]
    plain, staged, partial = rows
    assert "sim_staged_bytes" not in plain and staged["sim_staged_bytes"] > 0
    assert staged["sim_fixed_bytes"] > 0 and staged["sim_stage"] and not plain["sim_stage"]
    # partial staging keeps some saves on the GPU: fewer copies, a larger fixed pool, no slower a step
    assert partial["sim_staged_bytes"] < staged["sim_staged_bytes"] <= staged["sim_crossing_bytes"] // 2 + 1
    assert partial["sim_fixed_bytes"] > staged["sim_fixed_bytes"] and partial["sim_step_ms"] <= staged["sim_step_ms"]
    assert all(r["sim_budget_bytes"] == plain["sim_budget_bytes"] for r in rows)


def test_predicted_peers_recompute_into_less_memory_and_say_where_they_fit(bench, monkeypatch):
    from um_lab.models import get_model

    monkeypatch.setattr(bench, "build_case", lambda name: get_model("mlp", width=512, depth=6, batch_size=2048))
    rows = bench.predict_peers(["mlp"], [1.2, 50.0], lambda line: None)
    assert [(r["precision"], r["recompute"]) for r in rows] == \
        [("fp32", "none"), ("fp32", "every-layer"), ("bf16", "none"), ("bf16", "every-layer")]
    fits, checkpointed = rows[0], rows[1]
    assert checkpointed["sim_footprint_bytes"] < fits["sim_footprint_bytes"]
    assert checkpointed["sim_step_ms"] > fits["sim_step_ms"]  # the forward runs again
    assert fits["fits_at_ratio"] == {"1.2": False, "50.0": False}  # everything-fits never fits below itself
    assert checkpointed["fits_at_ratio"]["50.0"] is False
    assert checkpointed["fits_at_ratio"]["1.2"] == (checkpointed["sim_footprint_bytes"]
                                                    <= fits["sim_footprint_bytes"] / 1.2)


def test_planned_rows_train_as_the_planner_chooses_and_carry_its_prediction(bench):
    lines: list[str] = []
    row = bench.bench_model("mlp", [2.0], 4, 1 << 40, False, lines.append, planned=True)[0]
    plan = row["plan"]
    assert row["precision"] == "fp32" and row["step_ms"] is not None, row.get("error")
    assert row["sim_step_ms"] == plan["predicted_step_ms"] > 0
    assert plan["recompute"] in ("none", "every-layer") or 0 < plan["recompute"] < plan["layers"]
    assert row["stage_activations"] == plan["stage_activations"]
    assert any("planner:" in line for line in lines)


def test_a_planned_row_is_priced_again_on_the_machines_fitted_profile_before_it_runs(bench):
    """With a simulator on a profile fitted to the machine (here: the scheduler's hooks 1.4x slower), each planned
    row carries its plan's step on that profile too, and --machine-calibrate is refused where there is nothing to
    price."""
    import warnings

    from um_lab.sim.backend import SimBackend
    from um_lab.sim.machine_calibration import with_scale

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        machine = SimBackend(with_scale(bench.sim_backend().profile, "scheduler", 1.4))
    lines: list[str] = []
    row = bench.bench_model("mlp", [2.0], 4, 1 << 40, False, lines.append, planned=True, machine_sim=machine)[0]
    assert row["sim_step_ms"] < row["machine_calibrated_ms"] <= 1.4 * row["sim_step_ms"] + 1e-6
    assert any("fitted profile" in line for line in lines)
    for argv in (["--machine-calibrate"], ["--machine-calibrate", "--recompute", "auto", "--predict"]):
        with pytest.raises(SystemExit):
            bench.main(argv)


def test_the_best_peer_is_the_fastest_whose_reserved_peak_fits_the_budget(bench):
    peers = {"fits": {"step_ms": 100.0, "peak_reserved_bytes": 40 * GiB},
             "checkpoint": {"step_ms": 130.0, "peak_reserved_bytes": 18 * GiB},
             "save-on-cpu": {"step_ms": 300.0, "peak_reserved_bytes": 15 * GiB},
             "fsdp2-offload": {"error": "no result within 300 s"}}
    assert bench.best_peer(peers, 20 * GiB) == ("checkpoint", 130.0)
    assert bench.best_peer(peers, 16 * GiB) == ("save-on-cpu", 300.0)
    assert bench.best_peer(peers, 10 * GiB) == (None, None)


def test_a_budget_session_trains_a_model_that_recomputes_every_layer(bench):
    """Recompute runs each layer's forward again inside backward: the scheduler learns that order of use too and
    keeps its ledger under B on every step."""
    from um_lab.training import with_training

    case = with_training(bench.build_case("mlp"), "fp32", "every-layer")
    out = bench.run_session(case, 6, 1 << 40, budget=48 * MiB)
    budgets = [r.extra["budget"] for r in out["records"]]
    # the first step learns the order (no plan: its fresh writes are seen after the fact); every planned step
    # leaves room for what a position writes at new addresses, the recompute's included
    assert not budgets[0]["planned"] and all(b["followed_plan"] for b in budgets[1:])
    assert all(b["max_resident_ledger"] <= 48 * MiB and not b["over_budget"] for b in budgets[1:]), \
        [b["max_resident_ledger"] for b in budgets]
    assert budgets[-1]["followed_plan"] and budgets[-1]["prefetched_bytes"] > 0
    assert all(math.isfinite(r.loss) for r in out["records"])
