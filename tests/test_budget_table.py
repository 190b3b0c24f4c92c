"""bench/budget_table.py: runs merged with their sources, the FSDP2 peer's columns filled by model, the
pre-registered predictions attached, a table line per row (errors included)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def table_module():
    spec = importlib.util.spec_from_file_location("budget_table", ROOT / "bench" / "budget_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(model, ratio, step_ms, stage=False, **kw):
    return {"model": model, "ratio": ratio, "stage_activations": stage, "step_ms": step_ms, "fit_step_ms": 500.0,
            "crossing_bytes": 40 * GiB, "over_bound": (step_ms or 0) / 1000, "max_resident_ledger": 19 * GiB,
            "budget_bytes": 20 * GiB, "fsdp2_step_ms": None, "fsdp2_peak_bytes": None, **kw}


def test_runs_merge_with_peer_and_predictions_and_print_a_line_each(tmp_path, capsys):
    table = table_module()
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps({"device": "H200", "rows": [row("gpt2-large", 2.0, 4000.0),
                                                       row("gpt2-large", 2.0, 1500.0, stage=True)]}))
    b.write_text(json.dumps({"device": "H200", "rows": [row("gpt2-xl", 2.0, None, error="BudgetTooSmall: x"),
                                                       row("resnet50", 2.0, 800.0, fsdp2_step_ms=1.0,
                                                           fsdp2_peak_bytes=GiB)]}))
    peer = tmp_path / "peer.jsonl"
    peer.write_text("\n".join(json.dumps({"model": m, "fsdp2_step_ms": ms, "fsdp2_peak_bytes": 25 * GiB})
                              for m, ms in [("gpt2-large", 1910.0), ("resnet50", 240.0)]) + "\n")
    predicted = tmp_path / "pred.json"
    predicted.write_text(json.dumps({"rows": [{"model": "gpt2-xl", "ratio": 2, "sim_step_ms": 4300.0},
                                              {"model": "gpt2-large", "ratio": 2.0, "sim_step_ms": 4139.0}]}))
    out = tmp_path / "budget.json"
    assert table.main([str(a), str(b), "--fsdp2", str(peer), "--predicted", str(predicted), "--note", "n",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["device"] == "H200" and result["note"] == "n" and len(rows) == 4
    assert [r["source"] for r in rows] == [str(a)] * 2 + [str(b)] * 2
    assert rows[0]["fsdp2_step_ms"] == 1910.0 and rows[0]["fsdp2_source"] == str(peer)
    assert rows[3]["fsdp2_step_ms"] == 1.0 and "fsdp2_source" not in rows[3]  # measured in the run: kept
    assert rows[2]["predicted_step_ms"] == 4300.0 and rows[1]["predicted_step_ms"] == 4139.0
    # the sim_step_ms: the prediction where the run did not simulate the row itself
    assert rows[1]["sim_step_ms"] == 4139.0 and rows[1]["sim_step_source"] == "prediction"
    assert rows[3].get("sim_step_ms") is None  # no prediction for it
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 + 4
    assert "| gpt2-large | 2 | host | on, managed pool | off | 1,500 |" in printed[3] and "1,910 (25.0)" in printed[3]
    assert "error: BudgetTooSmall: x" in printed[4]


def test_a_missing_file_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "budget.json"
    assert table_module().main([str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    assert not out.exists() and "no such file" in capsys.readouterr().err


def test_predictions_come_from_a_files_simulator_section_too():
    """A predictions file whose rows are by hand keeps the simulator's under "sim" (budget_predicted_staging_pinned):
    those rows' sim_step_ms are attached; rows without one are not."""
    table = table_module()
    rows = [row("gpt2-large", 2.0, 1700.0, stage=True), row("resnet50", 2.0, 300.0, stage=True)]
    table.add_predictions(rows, {"rows": [{"model": "gpt2-large", "ratio": 2.0, "predicted_step_ms": 982},
                                          {"model": "resnet50", "ratio": 2.0, "predicted_step_ms": 237}],
                                 "sim": {"rows": [{"model": "gpt2-large", "ratio": 2.0, "sim_step_ms": 961}]}})
    assert rows[0]["predicted_step_ms"] == 961
    assert "predicted_step_ms" not in rows[1]


def test_the_staging_column_names_the_intermediate_pool_and_a_string_sim_field_is_not_rows():
    budget_table = table_module()

    assert budget_table.staging_cell({"stage_activations": False}) == "off"
    assert budget_table.staging_cell({"stage_activations": True}) == "on, managed pool"
    assert budget_table.staging_cell({"stage_activations": True, "device_activations": True}) == "on, device pool"
    rows = [{"model": "gpt2-large", "ratio": 2.0}]
    budget_table.add_predictions(rows, {"sim": "how the rows were simulated",
                                        "rows": [{"model": "gpt2-large", "ratio": 2, "sim_step_ms": 961.0}]})
    assert rows[0]["predicted_step_ms"] == 961.0


def test_a_run_may_give_some_of_its_rows_only(tmp_path, capsys):
    table = table_module()
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"device": "H200", "rows": [row("gpt2-large", 1.5, 1000.0), row("gpt2-large", 3.0, 2000.0),
                                                       row("gpt2-xl", 1.5, 900.0)]}))
    out = tmp_path / "budget.json"
    assert table.main([f"{a}@gpt2-large:1.5,gpt2-xl:1.5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["ratio"]) for r in rows] == [("gpt2-large", 1.5), ("gpt2-xl", 1.5)]
    assert all(r["source"] == str(a) for r in rows)
    assert table.main([f"{tmp_path / 'nope.json'}@gpt2-xl:2", "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_predictions_follow_the_remote_and_telemetry_settings_and_the_runs_they_were_made_for():
    table = table_module()
    rows = [row("gpt2-xl", 2.0, 1500.0, remote_optimizer=True, source="raw/s18_call1/x.json"),
            row("gpt2-xl", 2.0, 2200.0, remote_optimizer=False, prefetched_bytes=GiB, source="raw/s18_call1/x.json"),
            row("gpt2-xl", 2.0, 1400.0, remote_optimizer=True, source="raw/s18_call2/x.json"),
            row("gpt2-xl", 2.0, 1900.0, remote_optimizer=True, max_resident_cupti=GiB, source="raw/s18_call3/x.json")]
    first = {"rows": [{"model": "gpt2-xl", "ratio": 2.0, "remote_optimizer": True, "sim_step_ms": 956.0,
                       "predicted_step_ms": [950, 1350]},
                      {"model": "gpt2-xl", "ratio": 2.0, "remote_optimizer": False, "sim_step_ms": 1163.0,
                       "predicted_step_ms": [1550, 1950]}]}
    later = {"rows": [{"model": "gpt2-xl", "ratio": 2.0, "remote_optimizer": True, "predicted_step_ms": [1300, 1900]},
                      {"model": "gpt2-xl", "peer": "fsdp2", "predicted_step_ms": [2500, 3200]}]}
    table.add_predictions(rows, first, "raw/s18_call1")
    table.add_predictions(rows, later, "raw/s18_call2")
    assert (rows[0]["predicted_step_ms"], rows[0]["predicted_range_ms"]) == (956.0, [950, 1350])
    assert (rows[1]["predicted_step_ms"], rows[1]["predicted_range_ms"]) == (1163.0, [1550, 1950])
    assert rows[2]["predicted_range_ms"] == [1300, 1900] and "predicted_step_ms" not in rows[2]
    assert "predicted_range_ms" not in rows[3]  # a CUPTI-on row: no prediction was made for it here
    lines = table.markdown(rows).splitlines()
    assert "956 (sim) / 950–1,350" in lines[2] and "; optimizer state moved" in lines[3]
    assert table.staging_cell({"stage_activations": True, "device_activations": True, "remote_bytes": 2 * GiB}) \
        == "on, device pool; optimizer state remote 2.0 GiB in place"
    assert table.staging_cell({"stage_activations": True, "device_activations": True, "remote_bytes": 2 * GiB,
                               "remote_copied_bytes": 2 * GiB}) \
        == "on, device pool; optimizer state remote 2.0 GiB copied"
    ab = [{**row("gpt2-xl", 2.0, 2267.0, remote_optimizer=True, source="raw/s18_call1/x.json"), "remote_copies": False,
           "remote_bytes": 8 * GiB}]
    table.add_predictions(ab, first, "raw/s18_call1")
    assert "predicted_step_ms" not in ab[0]  # copies turned off for an A/B row: no prediction simulated it
    in_place = {"rows": [{"model": "gpt2-xl", "ratio": 2.0, "sim_step_ms": 1202.5, "remote_copies": False}]}
    table.add_predictions(ab, in_place, "raw/s18_call1")
    assert ab[0]["predicted_step_ms"] == 1202.5  # one that says it simulated the state in place
    copying = [{**ab[0], "remote_copies": True, "remote_copied_bytes": 8 * GiB}]
    copying[0].pop("predicted_step_ms")
    both = {"rows": [{"model": "gpt2-xl", "ratio": 2.0, "sim_step_ms": 1000.0},
                     {"model": "gpt2-xl", "ratio": 2.0, "sim_step_ms": 1202.5, "remote_copies": False}]}
    table.add_predictions(copying, both, "raw/s18_call1")
    assert copying[0]["predicted_step_ms"] == 1000.0  # never the prediction of the state in place
    failed = [{"model": "m", "sim_step_ms": None, "sim_error": "BudgetTooSmall: x", "predicted_step_ms": 9.0}]
    table.fill_sim_from_predictions(failed)
    assert failed[0]["sim_step_ms"] is None and "sim_step_source" not in failed[0]  # its failure stays visible
    assert table.staging_cell({"stage_activations": True, "device_activations": True, "tail_kept_bytes": GiB}) \
        == "on, device pool, last 1.00 GiB kept"


def test_a_rows_simulated_step_and_hand_range_each_come_from_their_most_specific_prediction():
    table = table_module()
    rows = [{**row("gpt2-large", 1.5, 840.0, stage=True), "remote_optimizer": True, "partial_staging": True}]
    predicted = {"rows": [{"model": "gpt2-large", "ratio": 1.5, "partial_staging": True,
                           "predicted_step_ms": [750, 1000]},
                          {"model": "gpt2-large", "ratio": 1.5, "partial_staging": False,
                           "predicted_step_ms": [950, 1150]}],
                 "sim": {"rows": [{"model": "gpt2-large", "ratio": 1.5, "remote_optimizer": True,
                                   "partial_staging": True, "sim_step_ms": 708.0},
                                  {"model": "gpt2-large", "ratio": 1.5, "remote_optimizer": True,
                                   "partial_staging": False, "sim_step_ms": 961.0}]}}
    table.add_predictions(rows, predicted)
    # the simulator's row names more settings than the hand range's: each still gives its own column
    assert (rows[0]["predicted_step_ms"], rows[0]["predicted_range_ms"]) == (708.0, [750, 1000])


def test_planner_runs_merge_into_the_planner_key_beside_their_committed_predictions(tmp_path):
    table = table_module()
    row = {"model": "gpt2-large", "precision": "fp32", "ratio": 2.0, "fit_step_ms": 500.0, "step_ms": 600.0,
           "sim_step_ms": 550.0, "machine_calibrated_ms": 625.0, "plan": {"recompute": 30}, "best_peer": "checkpoint",
           "best_peer_ms": 700.0,
           "peers": {"checkpoint": {"step_ms": 700.0}}, "idle_steps": 3, "internal_diagnostic": [1, 2]}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "2026-12-06T03:00:00+00:00", "device": "GPU A",
                               "rows": [row, {"model": "gpt2-large", "ratio": 2.0, "step_ms": None}]}))
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({"planned": {"rows": [{"model": "gpt2-large", "precision": "fp32", "ratio": 2.0,
                                                           "step_ms": 480.0}]}}))
    out = tmp_path / "budget.json"
    old = {"model": "gpt2-large", "precision": "fp32", "ratio": 2.0, "device": "GPU A", "step_ms": 900.0}
    other = {"model": "gpt2-large", "precision": "bf16", "ratio": 2.0, "device": "GPU B", "step_ms": 200.0}
    out.write_text(json.dumps({"rows": [{"kept": True}], "planner": {"rows": [old, other]}}))
    assert table.main([str(run), "--planner", "--predicted", str(predicted), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["rows"] == [{"kept": True}]  # the scheduler's table is untouched
    rows = merged["planner"]["rows"]
    assert other in rows and old not in rows and len(rows) == 2  # the same model, precision, ratio and device: replaced
    new = rows[-1]
    assert new["step_ms"] == 600.0 and new["device"] == "GPU A" and new["date"] == "2026-12-06"
    assert new["over_fit_step"] == 1.2 and new["committed_prediction"] == 480.0
    assert abs(new["committed_error"] - 0.25) < 1e-12 and abs(new["sim_error"] - (600 / 550 - 1)) < 1e-12
    assert "internal_diagnostic" not in new and new["idle_steps"] == 3
    assert new["machine_calibrated_ms"] == 625.0 and abs(new["machine_calibrated_error"] - (600 / 625 - 1)) < 1e-12


def test_a_plan_refused_on_the_gpu_is_kept_with_its_reason(tmp_path):
    table = table_module()
    refused = {"model": "resnet50", "precision": "fp32", "ratio": 3.0, "fit_step_ms": 40.0, "step_ms": None,
               "plan": {"recompute": "every-layer"}, "error": "BudgetTooSmall: the GPU budget cannot hold it",
               "best_peer": "save-on-cpu", "best_peer_ms": 360.0}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "2026-12-07T01:00:00+00:00", "device": "GPU A", "rows": [refused]}))
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({"planned": {"rows": [{"model": "resnet50", "precision": "fp32", "ratio": 3.0,
                                                           "step_ms": 79.0}]}}))
    out = tmp_path / "budget.json"
    assert table.main([str(run), "--planner", "--predicted", str(predicted), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["planner"]["rows"]
    assert row["step_ms"] is None and row["error"].startswith("BudgetTooSmall") and row["committed_prediction"] == 79.0
    assert row["over_fit_step"] is None and row["committed_error"] is None and row["best_peer"] == "save-on-cpu"
