"""bench/budget.py's row logic on the CPU with the fake driver (the numbers mean nothing here; the
schema, the ratios and the error rows do)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from fakes import FakePoolAPI, FakeRuntime, drain, install_fake_driver

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
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
    real_run = module.run_session

    def run(case, steps, limit, **kw):
        out = real_run(case, steps, limit, **kw)
        if kw.get("budget") is None:
            out["peak_bytes"] = 192 * MiB  # the fake driver holds no tensors: a footprint for the CPU
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
    rows = bench.bench_model("mlp", [2.0, 3.0, 40.0], 4, 1 << 40, False, lines.append)
    assert all("error" not in r for r in rows[:2]), rows
    assert [r["ratio"] for r in rows] == [2.0, 3.0, 40.0]
    ok, refused = rows[:2], rows[2]
    for row in ok:
        assert SCHEMA <= set(row) and row["budget_bytes"] == int(192 * MiB / row["ratio"])
        assert row["max_resident_ledger"] > 0 and row["crossing_bytes"] > 0 and row["followed_plan"]
        assert row["bound_ms"] >= row["fit_step_ms"] and row["over_bound"] == row["step_ms"] / row["bound_ms"]
        assert row["max_resident_cupti"] is None and row["fsdp2_step_ms"] is None and row["sim_step_ms"] is None
    assert refused["step_ms"] is None and refused["error"].startswith("BudgetTooSmall")  # 4.8 MiB: not one layer
    assert any("ratio 2.0" in line for line in lines)
