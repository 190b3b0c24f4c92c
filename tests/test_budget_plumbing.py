"""A GPU budget from the user's side: --budget, RunSpec fields, the layer-ahead policy name,
typed errors for bad input before anything is allocated, and what the run folder records."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from um_lab import compare, get_model
from um_lab.app.cli import main
from um_lab.app.cli_args import parse_budget
from um_lab.cuda.backend import CudaBackend
from um_lab.errors import BudgetError, SpecError
from um_lab.policy import LAYER_AHEAD, get_policy, named_policies, presets
from um_lab.runs.runlog import list_runs
from um_lab.runs.runner import Run
from um_lab.runs.runread import iter_records, load
from um_lab.schedule.config import Budget
from um_lab.sim.backend import SimBackend
from um_lab.types import RunSpec

TINY = {"width": 1024, "depth": 3}
GiB = 1 << 30


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", (8 * GiB, None)), ("1.5e9", (1_500_000_000, None)), ("0.5x", (None, 0.5)), ("1X", (None, 1.0)),
])
def test_a_budget_is_a_size_or_a_fraction_of_the_footprint(text, expected):
    budget = parse_budget(text)
    assert (budget.bytes, budget.fraction) == expected and budget.lookahead == 2 and not budget.stage_activations


@pytest.mark.parametrize("text", ["-1", "-2GiB", "0", "nan", "inf", "nanx", "infx", "0x", "-0.5x", "1.5x",
                                  "eight", "8 parsecs", "x", ""])
def test_a_bad_budget_on_the_command_line_is_refused_before_anything_runs(text, tmp_path, capsys):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_budget(text)
    with pytest.raises(SystemExit) as stop:
        main(["run", "--backend", "sim", "--budget", text, "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--budget" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing was written"


@pytest.mark.parametrize("budget", [-1, 0, 1.5, True, math.nan, -0.5, math.inf, "lots", "2x", [1]])
def test_a_bad_budget_in_a_run_spec_is_a_spec_error_naming_the_field(budget):
    with pytest.raises(SpecError) as error:
        RunSpec(budget=budget)
    assert error.value.field == "budget" and repr(budget)[:4] in str(error.value)


def test_a_budget_above_the_safety_cap_is_refused_before_the_run_folder_is_written(tmp_path):
    case = get_model("mlp", **TINY)
    backend = CudaBackend(cap_bytes=256 << 20)  # a cap given: no GPU is asked
    spec = RunSpec(model="mlp", model_kwargs=TINY, backend="cuda", budget=512 << 20)
    with pytest.raises(BudgetError, match="above the safety cap"):
        Run(spec, case, out_dir=tmp_path, backend=backend)
    assert not list(tmp_path.iterdir())
    assert backend.budget_for(dataclass_replace(spec, budget=32 << 20), case, get_policy("um-default")) \
        == 32 << 20


def test_layer_ahead_on_a_gpu_needs_a_budget_and_a_fraction_takes_the_estimated_footprint():
    case = get_model("mlp", **TINY)
    backend = CudaBackend(cap_bytes=8 * GiB)
    with pytest.raises(BudgetError, match="needs a GPU budget"):
        backend.preflight(RunSpec(model="mlp", policy=LAYER_AHEAD, backend="cuda"), case, get_policy(LAYER_AHEAD))
    checked = backend.preflight(RunSpec(model="mlp", backend="cuda", budget=0.5), case,
                                get_policy("um-default"))
    assert checked is not None and checked["budget_bytes"] == int(0.5 * checked["estimate"]["total_bytes"])
    no_budget = backend.preflight(RunSpec(model="mlp", backend="cuda"), case, get_policy("um-default"))
    assert no_budget is not None and "budget_bytes" not in no_budget


def test_a_budget_above_the_simulated_capacity_or_below_one_block_is_refused(tmp_path):
    case = get_model("mlp", **TINY)
    sim = SimBackend()
    with pytest.raises(BudgetError, match="simulated GPU capacity"):
        Run(RunSpec(model="mlp", backend="sim", capacity_bytes=256 << 20, budget=512 << 20), case,
            out_dir=tmp_path, backend=sim)
    with pytest.raises(BudgetError, match="below one 2 MiB block"):
        Run(RunSpec(model="mlp", backend="sim", budget=1 << 20), case, out_dir=tmp_path, backend=sim)
    assert not list(tmp_path.iterdir())


def test_layer_ahead_is_a_named_policy_but_not_an_advice_preset():
    assert LAYER_AHEAD in named_policies() and LAYER_AHEAD not in presets
    policy = get_policy(LAYER_AHEAD)
    assert policy.name == LAYER_AHEAD and all(a.is_default for a in policy.advice.values())


def test_cli_run_on_the_simulator_records_the_budget_in_the_run_folder(tmp_path, capsys):
    status = main(["run", "--backend", "sim", "--model", "mlp", "--model-kw", "width=1024", "--model-kw", "depth=3",
                   "--policy", LAYER_AHEAD, "--budget", "0.5x", "--steps", "2", "--warmup", "0", "--no-progress",
                   "--out", str(tmp_path)])
    assert status == 0, capsys.readouterr().err
    [run_dir] = list_runs(tmp_path)
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["policy"] == LAYER_AHEAD and Budget.from_dict(spec["budget"]).fraction == 0.5
    model = json.loads((run_dir / "model.json").read_text())
    budget = model["preflight"]["budget_bytes"]
    assert budget == int(0.5 * model["preflight"]["footprint_bytes"])
    records = list(iter_records(run_dir / "records.jsonl"))
    assert len(records) == 2
    for record in records:
        numbers = record.extra["budget"]
        assert numbers["budget_bytes"] == budget and numbers["max_resident_ledger"] <= budget
        # the MLP's moving data at half its footprint is optimizer state: left in host memory by default
        assert numbers["prefetched_bytes"] + numbers["remote_bytes"] > 0 and record.wall_ms > 0


def test_compare_shows_layer_ahead_as_one_more_policy_and_gives_only_it_the_budget(tmp_path):
    table = compare(["mlp"], ["um-default", LAYER_AHEAD], ratios=[2.0], backend="sim", steps=2, warmup_steps=0,
                    model_kwargs=TINY, out_dir=tmp_path, budget=0.4)
    assert list(table["policy"]) == ["um-default", LAYER_AHEAD]
    assert (table["status"] == "complete").all() and table["median_ms"].notna().all()
    specs = {load(d).spec.policy: load(d).spec for d in table["run_dir"]}
    assert specs[LAYER_AHEAD].budget.fraction == 0.4 and not specs["um-default"].has_budget
    with pytest.raises(SpecError):
        compare(["mlp"], [LAYER_AHEAD], backend="sim", model_kwargs=TINY, out_dir=tmp_path, budget=2.0)


def test_layer_ahead_on_the_simulator_keeps_resident_bytes_under_the_simulated_capacity(tmp_path):
    table = compare(["mlp"], [LAYER_AHEAD], ratios=[2.0], backend="sim", steps=1, warmup_steps=0,
                    model_kwargs=TINY, out_dir=tmp_path)
    run_dir = table.loc[table["policy"] == LAYER_AHEAD, "run_dir"].item()
    [record] = list(iter_records(f"{run_dir}/records.jsonl"))
    assert record.extra["budget"]["budget_bytes"] <= record.gpu_capacity_bytes + (2 << 20)
    assert sum(record.resident_bytes.values()) <= record.extra["budget"]["budget_bytes"]


def dataclass_replace(spec: RunSpec, **changes: object) -> RunSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


def test_a_budget_too_small_for_one_layer_is_refused_on_the_simulator_before_the_run_folder(tmp_path):
    case = get_model("mlp", **TINY)
    with pytest.raises(BudgetError, match="cannot hold"):
        Run(RunSpec(model="mlp", backend="sim", budget=4 << 20), case, out_dir=tmp_path, backend=SimBackend())
    assert not list(tmp_path.iterdir())


def test_a_budget_with_advice_is_refused_on_the_simulator_which_models_the_scheduler_alone(tmp_path):
    case = get_model("mlp", **TINY)
    with pytest.raises(BudgetError, match="without memory advice.*gpu-first"):
        Run(RunSpec(model="mlp", backend="sim", policy="gpu-first", budget=0.9), case,
            out_dir=tmp_path, backend=SimBackend())
    assert list(tmp_path.iterdir()) == []
    Run(RunSpec(model="mlp", backend="sim", policy="um-default", budget=0.9), case,
        out_dir=tmp_path / "ok", backend=SimBackend())  # no advice: the budget is simulated


def test_the_lab_panel_lists_layer_ahead_and_passes_its_budget_field(tmp_path):
    pytest.importorskip("ipywidgets")
    from um_lab.widgets import Lab

    lab = Lab(model="mlp", model_kwargs=TINY, backend="sim", policy=LAYER_AHEAD, budget="0.5x", out_dir=tmp_path,
              steps=1, warmup_steps=0)
    assert LAYER_AHEAD in lab.advice.preset.options and lab.advice.preset.value == LAYER_AHEAD
    spec = lab.spec()
    assert spec.policy == LAYER_AHEAD and spec.budget.fraction == 0.5
    lab.budget.value = "lots"
    assert lab.run() is None and lab.state == "error" and "GPU budget" in lab.status.value
    assert isinstance(lab.last_error, SpecError) and not list(tmp_path.iterdir())
    lab.budget.value = "0.5x"
    active = lab.run(wait=True, timeout=120)
    assert active is not None and lab.state == "complete"
    [record] = lab.records
    assert record.extra["budget"]["max_resident_ledger"] <= record.extra["budget"]["budget_bytes"]


def test_order_and_scheduler_arguments_raise_typed_budget_errors():
    from um_lab.schedule.ledger import Ledger
    from um_lab.schedule.order import Access, Order
    from um_lab.schedule.plan import Scheduler
    from um_lab.types import DataType

    with pytest.raises(BudgetError, match="phase must be one of"):
        Access("sideways", "layer", DataType.PARAM, ((0, 4),))
    with pytest.raises(BudgetError, match="lookahead must be >= 0"):
        Scheduler(Ledger(1 << 21), Order.from_accesses([]), lookahead=-1)


def test_the_library_parses_sizes_and_budgets_with_typed_errors_the_cli_and_lab_share():
    from um_lab.schedule.config import budget_from_text
    from um_lab.units import size_bytes

    assert size_bytes("8GiB") == 8 << 30 and budget_from_text("6GiB") == (6 << 30, None)
    assert budget_from_text(" 0.5x ") == (None, 0.5)
    for text, field in (("lots", "gpu_budget_bytes"), ("2x", "gpu_budget_fraction"), ("halfx", "gpu_budget_fraction"),
                        ("0", "gpu_budget_bytes")):
        with pytest.raises(SpecError) as info:
            budget_from_text(text)
        assert info.value.field == field
    with pytest.raises(argparse.ArgumentTypeError, match="budget / footprint"):
        parse_budget("2x")  # the CLI's argparse type says the same
