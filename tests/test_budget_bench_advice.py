"""bench/budget.py --advice: host-preferred pools under a budget (the default) against no advice."""

import inspect

import pytest
import torch
from test_budget_bench import bench  # noqa: F401 - the fixture

from um_lab.schedule.live import control, stage


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


def test_staging_gets_its_own_row_and_its_bytes_count_as_crossing(bench, monkeypatch):  # noqa: F811
    monkeypatch.setattr(stage, "MIN_STAGE_BYTES", 64 << 10)  # the CPU test's models are small
    torch.manual_seed(0)
    rows = bench.bench_model("mlp-small", [2.0], 4, 1 << 40, False, lambda line: None, stages=(False, True))
    assert [r["stage_activations"] for r in rows] == [False, True]
    plain, staged = rows
    assert "error" not in staged and staged["step_ms"] > 0
    assert plain["staged_bytes"] == 0 and staged["staged_bytes"] > 0 and staged["restored_bytes"] > 0
    assert staged["crossing_bytes"] >= staged["staged_bytes"] + staged["restored_bytes"]
    assert all(st["staged_tensors"] > 0 for st in staged["staging_all"])


def test_device_activations_get_a_row_each_only_where_staging_is_on(bench, monkeypatch):  # noqa: F811
    monkeypatch.setattr(stage, "MIN_STAGE_BYTES", 64 << 10)
    torch.manual_seed(0)
    rows = bench.bench_model("mlp-small", [2.0], 3, 1 << 40, False, lambda line: None, stages=(False, True),
                             device_acts=(False, True))
    assert [(r["stage_activations"], r["device_activations"]) for r in rows] == [(False, False), (True, False),
                                                                                   (True, True)]
    assert all("error" not in r and r["step_ms"] > 0 for r in rows)
    assert [r["staging_all"][0]["staged_tensors"] > 0 for r in rows[1:]] == [True, True]


def test_partial_staging_and_remote_optimizer_state_get_a_row_each_with_their_fields(bench, monkeypatch):  # noqa: F811
    monkeypatch.setattr(stage, "MIN_STAGE_BYTES", 64 << 10)
    torch.manual_seed(0)
    rows = bench.bench_model("mlp-small", [2.0], 3, 1 << 40, False, lambda line: None, stages=(False, True),
                             partials=(False, True), remotes=(True, False))
    assert [(r["stage_activations"], r["partial_staging"], r["remote_optimizer"]) for r in rows] == [
        (False, False, True), (False, False, False), (True, False, True), (True, True, True),
        (True, False, False), (True, True, False)]
    assert all("error" not in r and r["step_ms"] > 0 for r in rows)
    assert all(r["tail_kept_bytes"] >= 0 for r in rows[2:]) and all("tail_kept_bytes" not in r for r in rows[:2])
    assert all(r["remote_bytes"] == 0 for r in rows if not r["remote_optimizer"])


def test_each_row_is_handed_on_as_it_completes_so_a_stopped_run_keeps_it(bench, monkeypatch):  # noqa: F811
    """bench/budget.py writes its file after every row: a run its caller's time limit stops keeps the rows done."""
    torch.manual_seed(0)
    heard = []
    real_run = bench.run_session
    budget_runs = []

    def run(case, steps, limit, **kw):
        if kw.get("budget") is not None:
            budget_runs.append(kw["budget"])
            if len(budget_runs) == 2:
                raise KeyboardInterrupt  # the caller's time limit, in the second budget run
        return real_run(case, steps, limit, **kw)

    monkeypatch.setattr(bench, "run_session", run)
    with pytest.raises(KeyboardInterrupt):
        bench.bench_model("mlp", [1.75, 2.0], 4, 1 << 40, False, lambda line: None,
                          row_done=lambda rows: heard.append([dict(r) for r in rows]))
    assert len(heard) == 1 and [r["ratio"] for r in heard[0]] == [1.75] and heard[0][0]["step_ms"] > 0


def test_remote_copies_get_a_row_each_where_state_is_remote_and_only_the_copying_row_copies(bench, monkeypatch):  # noqa: F811
    monkeypatch.setattr(stage, "MIN_STAGE_BYTES", 64 << 10)
    monkeypatch.setattr(control, "worth_copying", lambda in_place, copying, costs: True)  # the fake's plans always move
    torch.manual_seed(0)
    # at 1.5 (B 64 MiB) the slots found no room at the first plan once in five runs after other tests (the CPU
    # heap's addresses decide how many 2 MiB blocks each tensor spans): 1.4 leaves them room
    rows = bench.bench_model("mlp", [1.4], 6, 1 << 40, False, lambda line: None, stages=(True,),
                             copies_opts=(True, False), repeat=1)
    assert [(r["remote_copies"], r["repeat"]) for r in rows] == [(True, 1), (False, 1)]
    assert inspect.signature(bench.bench_model).parameters["copies_opts"].default == (False,)  # in place: default
    copying, in_place = rows
    assert "error" not in copying, copying["error"]
    # which step announces the slots depends on the CPU heap's addresses: some step copies, not every one measured
    assert copying["remote_bytes"] > 0 and any(copying["remote_copied_bytes_all"]), copying["replan_reasons_all"]
    assert in_place["remote_bytes"] > 0 and not any(in_place["remote_copied_bytes_all"])


def test_settling_the_tails_growth_gets_a_row_each_only_with_partial_staging(bench):  # noqa: F811
    grid = bench.option_grid(stages=(False, True), partials=(False, True), settles=(True, False))
    assert [(o.stage, o.partial, o.settle) for o in grid] == [
        (False, False, False), (True, False, False), (True, True, True), (True, True, False)]
    assert grid[2].row_fields()["settle_tail_growth"] is True
