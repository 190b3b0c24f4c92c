"""bench/budget.py --advice: host-preferred pools under a budget (the default) against no advice."""

import pytest
import torch
from test_budget_bench import bench  # noqa: F401 - the fixture


def test_the_advice_choices_map_to_the_sessions_flag(bench):  # noqa: F811
    assert bench.host_advice("host") is True and bench.host_advice("none") is False
    with pytest.raises(ValueError, match="advice must be one of"):
        bench.host_advice("gpu")


def test_each_advice_gets_its_own_row_under_the_budget(bench):  # noqa: F811
    torch.manual_seed(0)
    rows = bench.bench_model("mlp", [2.0], 4, 1 << 40, False, lambda line: None, advices=("host", "none"))
    assert [r["advice"] for r in rows] == ["host", "none"]
    for row in rows:  # the ledger may pass B only through writes it learns of after the fact (touched_bytes)
        assert "error" not in row and row["followed_plan"] and row["step_ms"] > 0
        assert row["max_resident_ledger"] <= row["budget_bytes"] + row["touched_bytes"]
