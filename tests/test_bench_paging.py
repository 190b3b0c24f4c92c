"""bench/budget_vs_paging.py: the scheduler against demand paging on an oversubscribed simulated card."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paging():
    spec = importlib.util.spec_from_file_location("bench_budget_vs_paging", ROOT / "bench" / "budget_vs_paging.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_budget_vs_paging"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_budget_vs_paging", None)


def test_each_policy_gets_a_row_per_ratio_and_the_table_and_file_say_the_same(paging, tmp_path, capsys):
    out = tmp_path / "paging.json"
    assert paging.main(["--models", "mlp", "--ratios", "2", "--steps", "2", "--no-band", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert saved["band"] is False and [r["policy"] for r in rows] == list(paging.POLICIES)
    assert all(r["status"] == "complete" and r["ratio"] == 2.0 and r["median_ms"] > 0 for r in rows)
    paged, *scheduled = rows
    assert paged["speedup_vs_um-default"] == 1.0 and paged["gpu_page_faults"] > 0  # the driver pages on demand
    assert all(r["gpu_page_faults"] == 0 for r in scheduled)  # the scheduler moves data before it is touched
    printed = capsys.readouterr().out
    assert printed.count("| mlp | 2 |") == 3 and f"wrote {out}" in printed
    assert paging.main(["--table", str(out)]) == 0  # the table again from the file
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert capsys.readouterr().out.splitlines() == table and len(table) == 2 + 3


def test_a_ratio_that_does_not_oversubscribe_is_refused(paging, tmp_path):
    with pytest.raises(SystemExit):
        paging.main(["--ratios", "1", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
