"""bench/budget.py --advice: the budget sessions' policy (host-preferred pools: only the scheduler migrates)."""

import pytest
import torch
from test_budget_bench import bench  # noqa: F401 - the fixture

from um_lab.types import DataType


def test_host_advice_prefers_the_host_for_every_type_and_maps_it_for_the_gpu(bench):  # noqa: F811
    policy = bench.budget_policy("host")
    for t in DataType:
        assert policy[t].preferred_location == "cpu" and policy[t].accessed_by == {"gpu"}
    assert bench.budget_policy("none").name == "um-default"
    with pytest.raises(ValueError, match="advice must be one of"):
        bench.budget_policy("gpu")


def test_each_advice_gets_its_own_row_under_the_budget(bench):  # noqa: F811
    torch.manual_seed(0)
    rows = bench.bench_model("mlp", [2.0], 4, 1 << 40, False, lambda line: None, advices=("none", "host"))
    assert [r["advice"] for r in rows] == ["none", "host"]
    for row in rows:  # the ledger may pass B only through writes it learns of after the fact (touched_bytes)
        assert "error" not in row and row["followed_plan"] and row["step_ms"] > 0
        assert row["max_resident_ledger"] <= row["budget_bytes"] + row["touched_bytes"]
