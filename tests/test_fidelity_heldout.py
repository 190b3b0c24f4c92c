"""The held-out fidelity sets keep the fit and the check apart (bench/sim_fidelity.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sim_fidelity  # noqa: E402

REMOTE_HEAVY = {"act-remote", "offload-optimizer", "zero-copy-params"}


def _key(model: str, kwargs: dict, policy: str) -> str:
    return json.dumps([model, kwargs, policy], sort_keys=True)


def test_the_new_set_uses_no_fit_model_and_repeats_no_earlier_configuration() -> None:
    new = sim_fidelity.NEW_HELDOUT
    assert len(new) >= 6
    assert sum(policy in REMOTE_HEAVY for _, _, policy in new) >= 3
    fit = set(sim_fidelity.FIT_MODELS) | set(sim_fidelity.STEP_FIT_MODELS)
    assert not {model for model, _, _ in new} & fit
    earlier = {_key(*c) for rows in sim_fidelity.HELDOUT_SETS.values() for c in rows}
    earlier |= {_key(*c) for c in sim_fidelity.configurations()}
    assert not {_key(*c) for c in new} & earlier
    assert len({_key(*c) for c in new}) == len(new)


def _committed(folder: str) -> dict:
    path = ROOT / "bench" / "results" / "sim_fidelity_heldout" / folder
    if (path / "predicted.json").is_file():
        return json.loads((path / "predicted.json").read_text())
    return json.loads((path / "measured.json").read_text())["predictions"]


def test_the_committed_predictions_are_the_new_set() -> None:
    predicted = _committed("2026-12-02T0134")
    rows = {_key(r["model"], r["model_kwargs"], r["policy"]): r for r in predicted["rows"]}
    assert set(rows) == {_key(*c) for c in sim_fidelity.NEW_HELDOUT}
    assert all(r["simulated_ms"] > 0 and r["measured_ms"] is None for r in rows.values())


def test_the_corpus_set_brings_models_outside_the_zoo_remote_heavy_and_under_budgets() -> None:
    """At least 10 rows on corpus models (none a zoo model), at least 4 remote-heavy and 3 under layer-ahead
    budgets, each predicted in the newest folder before it is measured."""
    from um_lab.models import ZOO

    corpus = sim_fidelity.CORPUS_HELDOUT
    assert len(corpus) >= 10 and len({_key(*c) for c in corpus}) == len(corpus)
    assert all("/" in model and model.split("/", 1)[1] not in ZOO for model, _, _ in corpus)
    assert sum(policy in REMOTE_HEAVY for _, _, policy in corpus) >= 4
    assert sum(policy == "layer-ahead" and "budget" in kw for _, kw, policy in corpus) >= 3
    newest = max((ROOT / "bench" / "results" / "sim_fidelity_heldout").iterdir()).name
    rows = {_key(r["model"], r["model_kwargs"], r["policy"]): r for r in _committed(newest)["rows"]}
    assert set(rows) == {_key(*c) for c in corpus}
    assert all(r["simulated_ms"] > 0 and r["measured_ms"] is None for r in rows.values())


def test_the_newest_corpus_set_runs_no_model_an_earlier_set_ran() -> None:
    earlier = {model for rows in sim_fidelity.HELDOUT_SETS.values() for model, _, _ in rows}
    earlier |= {model for model, _, _ in sim_fidelity.NEW_HELDOUT}
    assert not {model for model, _, _ in sim_fidelity.CORPUS_HELDOUT} & earlier


def test_a_budget_rows_scheduler_numbers_are_kept_beside_its_step() -> None:
    """A measured row under a budget keeps its timed steps' scheduler numbers (medians, idle steps, re-plan reasons),
    what tells its error apart; a row without a budget keeps none."""
    from types import SimpleNamespace

    steps = [SimpleNamespace(extra={"budget": {"hooks_ms": h, "positions": 600, "evicted_bytes": e, "idle": idle,
                                               "replan_reason": why}})
             for h, e, idle, why in ((90.0, 0, False, "unforeseen"), (110.0, 4 << 20, False, ""),
                                     (100.0, 2 << 20, True, ""))]
    numbers = sim_fidelity.scheduler_numbers(steps)
    assert numbers["hooks_ms"] == 100.0 and numbers["positions"] == 600 and numbers["evicted_bytes"] == 2 << 20
    assert numbers["idle_steps"] == 1 and numbers["replan_reasons"] == ["unforeseen", "", ""]
    assert numbers["remote_bytes"] == 0  # a number the steps did not report counts as none
    assert set(sim_fidelity.BUDGET_NUMBERS) <= set(numbers)
    assert sim_fidelity.scheduler_numbers([SimpleNamespace(extra={})]) == {}


def test_a_simulated_budget_row_carries_the_schedulers_numbers_too() -> None:
    """The simulator's side of a budget row keeps the same numbers (positions, moves), so the two can be set side by
    side; a row without a budget has none."""
    import warnings

    from um_lab.sim.backend import SimBackend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = SimBackend()
        kw = {"batch_size": 64, "width": 1024, "depth": 4}
        _, _, budgeted = sim_fidelity.simulate(sim, "mlp", {**kw, "budget": "0.6x"}, "layer-ahead", None, 2, 1)
        _, _, plain = sim_fidelity.simulate(sim, "mlp", kw, "um-default", None, 2, 1)
    kept = sim_fidelity._rounded(budgeted)
    assert kept["budget"]["positions"] > 0 and kept["budget"]["idle_steps"] == 0
    assert set(sim_fidelity.BUDGET_NUMBERS) <= set(kept["budget"]) and isinstance(kept["live_GiB"], float)
    assert "budget" not in plain
