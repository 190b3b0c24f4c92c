"""CPU tests of the ``um-lab`` CLI, called in-process (``main([...])``) and once as a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_backend_registry import THIRD_MODULE
from test_runner import FakeBackend

import um_lab.runs.runner
import um_lab.runs.sweep
from um_lab.app import commands, labserver
from um_lab.app.cli import main
from um_lab.app.cli_args import format_table, parse_bytes, parse_model_kwargs, parse_ratio
from um_lab.backend import register_backend, unregister_backend
from um_lab.runs.runlog import list_runs
from um_lab.runs.runread import iter_records, load

TINY = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_backend(monkeypatch):
    """Route the runner's backend construction to the instant fake (runner/CLI logic only)."""
    created = []

    def make(name="auto", **options):
        backend = FakeBackend()
        created.append(backend)
        return backend

    monkeypatch.setattr(um_lab.runs.runner, "get_backend", make)  # Run
    monkeypatch.setattr(um_lab.runs.sweep, "get_backend", make)  # compare
    return created


def run_dirs(out: Path) -> list[Path]:
    return list_runs(out) if out.exists() else []


def test_run_on_sim_prints_backend_and_summary_and_logs_steps(tmp_path, capsys):
    rc = main(["run", "--backend", "sim", "--steps", "5", "--warmup", "2", "--ratio", "3",
               "--out", str(tmp_path), "--no-progress", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0] == "backend: sim"
    assert "median_ms" in out and "status: complete" in out
    (path,) = run_dirs(tmp_path)
    loaded = load(path)
    assert loaded.complete and len(list(loaded.records())) == 7
    assert loaded.spec.model_kwargs == {"width": 16, "depth": 1} and loaded.spec.batch_size == 4
    assert loaded.spec.oversubscription_ratio == 3.0
    assert loaded.environment["backend"] == "sim" and loaded.environment["calibration_profile"] == "h200"
    assert all(r.backend == "sim" and r.telemetry == "simulated" for r in loaded.records())
    assert f"oversubscription   {loaded.summary()['oversubscription']:.3f}" in out


def test_sim_profile_option(tmp_path, capsys):
    rc = main(["run", "--backend", "sim", "--profile", "h200", "--steps", "1", "--out", str(tmp_path),
               "--no-progress", *TINY])
    assert rc == 0 and load(run_dirs(tmp_path)[0]).environment["calibration_profile"] == "h200"
    assert main(["run", "--backend", "sim", "--profile", "no-such-card", "--out", str(tmp_path), *TINY]) == 2
    assert "unknown profile 'no-such-card'" in capsys.readouterr().err
    assert main(["run", "--profile", "h200", "--backend", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--profile is not an option of backend 'cuda'" in err and "backends that take one: sim" in err


def test_auto_backend_is_always_printed(fake_backend, tmp_path, capsys):
    rc = main(["run", "--steps", "1", "--out", str(tmp_path), "--no-progress", *TINY])
    first = capsys.readouterr().out.splitlines()[0]
    assert rc == 0
    expected = "cuda (auto: a CUDA GPU is available)" if torch.cuda.is_available() else \
        "sim (auto: no CUDA GPU here)"
    assert first == f"backend: {expected}"
    env = json.loads((run_dirs(tmp_path)[0] / "environment.json").read_text())
    assert env["backend_requested"] == "auto" and env["backend_note"] == expected


def test_compare_on_sim_prints_table_and_exports_csv(tmp_path, capsys):
    csv = tmp_path / "exports" / "table.csv"  # a folder the CLI creates
    rc = main(["compare", "--models", "mlp", "--policies", "gpu-first", "zero-copy-params",
               "--ratios", "0.5", "2", "--backend", "sim", "--steps", "3", "--warmup", "1",
               "--out", str(tmp_path / "runs"), "--csv", str(csv), "--no-progress", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert "speedup_vs_um-default" in out and "zero-copy-params" in out
    table = pd.read_csv(csv)
    assert len(table) == 6 and set(table["ratio"]) == {0.5, 2.0}
    assert (table["backend"] == "sim").all() and (table["status"] == "complete").all()
    by = table.set_index(["policy", "ratio"])
    assert by.loc[("um-default", 2.0), "median_ms"] > by.loc[("um-default", 0.5), "median_ms"]
    assert by.loc[("um-default", 2.0), "evictions"] > 0
    assert len(run_dirs(tmp_path / "runs")) == 6


def test_compare_progress_bar_goes_to_stderr(fake_backend, tmp_path, capsys):
    rc = main(["compare", "--backend", "sim", "--steps", "1", "--out", str(tmp_path), *TINY])
    err = capsys.readouterr().err
    assert rc == 0 and "compare" in err and "2/2" in err


def test_parquet_export_needs_pyarrow(fake_backend, tmp_path, capsys):
    target = tmp_path / "table.parquet"
    rc = main(["compare", "--backend", "sim", "--steps", "1", "--out", str(tmp_path / "runs"),
               "--parquet", str(target), "--no-progress", *TINY])
    captured = capsys.readouterr()
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert rc == 2 and "--parquet needs pyarrow" in captured.err
        assert not (tmp_path / "runs").exists()  # refused before the sweep
    else:
        assert rc == 0 and len(pd.read_parquet(target)) == 2


@pytest.mark.parametrize("argv, message", [
    (["run", "--model", "nope"], "unknown model 'nope'; valid: mlp, resnet18"),
    (["run", "--policy", "fastest"], "unknown preset 'fastest'; valid: um-default, gpu-first"),
    (["run", "--backend", "tpu"], "unknown backend 'tpu'; valid: cuda, sim, auto"),
    (["compare", "--models", "mlp", "nope"], "unknown model 'nope'; valid: mlp"),
    (["compare", "--policies", "nope"], "unknown preset 'nope'; valid:"),
    (["run", "--policy", "missing.json"], "policy file 'missing.json' not found"),
    (["run", "--model-kw", "width"], "--model-kw expects KEY=VALUE"),
    (["run", "--backend", "sim", "--model-kw", "colour=3"], "colour"),
    (["run", "--backend", "sim", "--steps", "0"], "steps must be >= 1"),
])
def test_bad_input_exits_2_with_a_message(fake_backend, tmp_path, capsys, argv, message):
    rc = main([*argv, "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("um-lab: error:") and message in err
    assert run_dirs(tmp_path / "runs") == []


def test_unwritable_out_is_reported_before_running(fake_backend, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["run", "--backend", "sim", "--out", str(blocker / "runs"), *TINY])
    assert rc == 2 and "cannot write the run directory" in capsys.readouterr().err
    assert fake_backend == [] or all(b.calls == [] for b in fake_backend)


def test_policy_from_json_file(fake_backend, tmp_path, capsys):
    from um_lab.policy import presets

    policy_file = tmp_path / "mine.json"
    presets["gpu-first"].replace(name="my-gpu-first").save(policy_file)
    rc = main(["run", "--backend", "sim", "--steps", "1", "--policy", str(policy_file),
               "--out", str(tmp_path / "runs"), "--no-progress", *TINY])
    assert rc == 0
    loaded = load(run_dirs(tmp_path / "runs")[0])
    assert loaded.spec.policy == "my-gpu-first" and loaded.policy == presets["gpu-first"].replace(
        name="my-gpu-first")


def test_interrupted_run_keeps_its_steps(monkeypatch, tmp_path, capsys):
    class Interrupting(FakeBackend):
        def run(self, spec, case, policy):
            for record in super().run(spec, case, policy):
                if record.step == 3:
                    raise KeyboardInterrupt
                yield record

    monkeypatch.setattr(um_lab.runs.runner, "get_backend", lambda name="auto", **kw: Interrupting())
    rc = main(["run", "--backend", "sim", "--steps", "10", "--out", str(tmp_path), "--no-progress", *TINY])
    assert rc == 130
    assert "3 completed steps kept" in capsys.readouterr().out
    loaded = load(run_dirs(tmp_path)[0])
    assert loaded.state == "interrupted" and not loaded.complete and len(list(loaded.records())) == 3


def test_without_out_runs_go_to_the_runs_dir_variable(fake_backend, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UM_LAB_RUNS_DIR", str(tmp_path / "lab-runs"))
    assert main(["run", "--steps", "1", "--no-progress", *TINY]) == 0
    assert main(["compare", "--steps", "1", "--no-progress", *TINY]) == 0
    assert len(run_dirs(tmp_path / "lab-runs")) == 3 and not (tmp_path / "runs").exists()
    monkeypatch.delenv("UM_LAB_RUNS_DIR")
    assert main(["run", "--steps", "1", "--no-progress", *TINY]) == 0
    assert len(run_dirs(tmp_path / "runs")) == 1  # the fallback: runs/ in the current folder


def test_show_prints_state_and_summary(fake_backend, tmp_path, capsys):
    main(["run", "--backend", "sim", "--steps", "4", "--out", str(tmp_path), "--no-progress", *TINY])
    capsys.readouterr()
    assert main(["show", str(run_dirs(tmp_path)[0])]) == 0
    out = capsys.readouterr().out
    assert "state complete" in out and "6/6 steps" in out and "median_ms" in out
    assert main(["show", str(tmp_path)]) == 2
    assert "not a um_lab run folder" in capsys.readouterr().err


def test_models_and_policies_listings(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("mlp", "resnet50", "vit-b16", "gpt2-xl", "bert-large"):
        assert name in out
    assert "width=4096" in out
    assert main(["policies"]) == 0
    assert "paper-3type" in capsys.readouterr().out


# ------------------------------------------------------------------------------ calibrate and lab


def test_cuda_backend_without_a_gpu_is_a_clear_error(monkeypatch, tmp_path, capsys):
    import um_lab.backend

    monkeypatch.setattr(um_lab.backend, "cuda_available", lambda: False)  # what the cuda backend asks
    for command in ("run", "compare"):
        assert main([command, "--backend", "cuda", "--out", str(tmp_path), "--no-progress"]) == 1
        assert "the cuda backend cannot run here" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_needs_cuda(monkeypatch, capsys):
    import um_lab.backend

    monkeypatch.setattr(um_lab.backend, "cuda_available", lambda: False)
    assert main(["calibrate", "--out", "x.json"]) == 2
    assert "calibrate needs CUDA" in capsys.readouterr().err
    assert main(["calibrate", "--machine", "h200", "--out", "x.json"]) == 2
    assert "calibrate needs CUDA" in capsys.readouterr().err


def test_calibrate_takes_one_of_host_only_and_machine(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["calibrate", "--host-only", "h200", "--machine", "h200"])
    assert stopped.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_lab_without_jupyterlab_is_a_clear_error(monkeypatch, capsys):
    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec",
                        lambda name, *a: None if name == "jupyterlab" else real(name, *a))
    assert main(["lab"]) == 2
    assert "jupyterlab is not installed" in capsys.readouterr().err


def test_lab_binds_localhost_and_keeps_token_auth(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(commands, "_has_jupyterlab", lambda: True)
    monkeypatch.setattr(labserver, "serve_lab", lambda cmd, env: calls.append((cmd, env)) or 0)
    assert main(["lab", "--notebooks", str(tmp_path), "--port", "8899", "--no-browser"]) == 0
    ((cmd, _),) = calls
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert "--ServerApp.ip=127.0.0.1" in cmd and f"--ServerApp.root_dir={tmp_path.resolve()}" in cmd
    assert "--ServerApp.port=8899" in cmd and "--no-browser" in cmd
    assert not any("token" in part.lower() or "password" in part.lower() for part in cmd)
    assert main(["lab", "--notebooks", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- parsing


def test_argparse_rejects_bad_values_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--backend", "sim", "--ratios", "0"])
    assert info.value.code == 2 and "ratio must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--capacity", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err


def test_parsers():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes("lots")
    assert parse_ratio("none") is None and parse_ratio("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError):
        parse_ratio("-1")
    assert parse_model_kwargs(["width=8", "act=gelu", "flag=true", "lr=1e-3"]) == {
        "width": 8, "act": "gelu", "flag": True, "lr": 1e-3}


def test_subprocess_smoke_on_sim(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "um_lab.app.cli", "run", "--backend", "sim", "--steps", "3",
                           "--out", str(tmp_path), *TINY], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("backend: sim\n") and "status: complete" in done.stdout
    assert load(run_dirs(tmp_path)[0]).complete
    done = subprocess.run([sys.executable, "-m", "um_lab.app.cli", "run", "--model", "nope"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 2 and "valid: mlp" in done.stderr


# ------------------------------------------------------------------ a third backend, no CLI edits


def test_a_registered_third_backend_runs_compares_and_shows_from_the_cli(third, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "third" in capsys.readouterr().out  # --backend's help lists the registry's names
    rc = main(["run", "--backend", "third", "--policy", "gpu-first", "--steps", "3", "--warmup", "1",
               "--out", str(tmp_path / "runs"), "--no-progress", *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[0] == "backend: third" and "status: complete" in out
    (path,) = run_dirs(tmp_path / "runs")
    loaded = load(path)
    assert loaded.complete and loaded.environment["backend"] == "third"
    assert [r.backend for r in loaded.records()] == ["third"] * 4
    assert main(["show", str(path)]) == 0
    assert "on third, state complete, 4/4 steps" in capsys.readouterr().out

    rc = main(["compare", "--backend", "third", "--policies", "gpu-first", "--steps", "2", "--warmup", "0",
               "--out", str(tmp_path / "cmp"), "--no-progress", *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gpu-first" in out and "2.333" in out and "none" in out  # 10.5 ms / 4.5 ms
    assert "NaN" not in out and "None" not in out and "—" in out  # its records measure no traffic


def test_options_go_to_the_backends_that_take_them(third, tmp_path, capsys):
    out = str(tmp_path / "runs")
    assert main(["run", "--backend", "third", "--profile", "h200", "--out", out, *TINY]) == 2
    err = capsys.readouterr().err
    assert "--profile is not an option of backend 'third'" in err and "backends that take one: sim" in err
    assert main(["run", "--backend", "third", "--ratio", "1.5", "--out", out, *TINY]) == 2
    assert "size the model instead" in capsys.readouterr().err
    assert run_dirs(tmp_path / "runs") == []

    class Profiled(third.ThirdBackend):  # a backend of its own that takes a calibration profile
        name = "profiled"

        def __init__(self, profile: str = "default") -> None:
            super().__init__()
            self.profile = profile

        def environment(self):
            return {"device": {"name": f"profiled by {self.profile}"}}

    register_backend("profiled", Profiled)
    try:
        assert main(["run", "--backend", "profiled", "--profile", "my-card", "--steps", "1", "--out", out,
                     "--no-progress", *TINY]) == 0
        assert load(run_dirs(tmp_path / "runs")[0]).environment["device"] == {"name": "profiled by my-card"}
        assert main(["run", "--backend", "cuda", "--profile", "x", "--out", out]) == 2
        assert "backends that take one: sim, profiled" in capsys.readouterr().err
    finally:
        unregister_backend("profiled")


def test_an_installed_backend_is_found_by_the_cli_through_its_entry_point(tmp_path):
    """A package declaring ``[project.entry-points."um_lab.backends"] third = ...``: no import by hand."""
    (tmp_path / "um_lab_third.py").write_text(THIRD_MODULE)
    dist = tmp_path / "um_lab_third-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: um_lab_third\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[um_lab.backends]\nthird = um_lab_third:ThirdBackend\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "um_lab.app.cli", "run", "--backend", "third", "--steps", "2",
                           "--out", str(tmp_path / "runs"), "--no-progress", *TINY],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("backend: third\n") and "status: complete" in done.stdout
    (path,) = run_dirs(tmp_path / "runs")
    assert [r.backend for r in iter_records(path / "records.jsonl")] == ["third"] * 4  # 2 warm-up + 2
    done = subprocess.run([sys.executable, "-m", "um_lab.app.cli", "run", "--backend", "tpu"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2 and "valid: cuda, sim, third, auto" in done.stderr


def test_tables_show_no_ratio_as_none_and_nothing_as_nan(tmp_path, capsys):
    table = pd.DataFrame({"model": ["mlp", "mlp"], "policy": ["um-default", "gpu-first"], "ratio": [None, None],
                          "steps": [3, 0], "median_ms": [2.0, float("nan")], "status": ["complete", "refused"]})
    text = format_table(table)
    assert "none" in text and "NaN" not in text and "nan" not in text.lower().replace("none", "")
    assert "—" in text  # the refused run's time: not measured
    # a comparison folder read back from its summary.csv (where no ratio is an empty cell, NaN when read)
    sweep = tmp_path / "compare-x"
    sweep.mkdir()
    table.assign(ratio=[None, 1.5]).to_csv(sweep / "summary.csv", index=False)
    assert main(["show", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "none" in out and "1.5" in out and "NaN" not in out


def test_python_dash_m_um_lab_is_the_command_line() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "um_lab", "policies"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "um-default" in done.stdout and "gpu-first" in done.stdout


def test_search_writes_a_policy_that_run_takes(tmp_path, capsys) -> None:
    best = tmp_path / "best.json"
    knobs = ["--model", "mlp", "--model-kw", "width=64", "--model-kw", "depth=1", "--model-kw", "batch_size=8"]
    assert main(["search", *knobs, "--ratio", "1.5", "--workers", "1", "--steps", "2", "--save", str(best)]) == 0
    out = capsys.readouterr().out
    assert "with um-default" in out and f"policy written to {best}" in out
    assert main(["search", *knobs, "--ratio", "1.5", "--workers", "1", "--save", str(best)]) == 2  # exists
    assert main(["run", *knobs, "--ratio", "1.5", "--backend", "sim", "--steps", "2", "--policy", str(best),
                 "--out", str(tmp_path / "runs")]) == 0
    with pytest.raises(SystemExit) as info:  # neither --ratio nor --capacity: argparse's usage error
        main(["search", *knobs])
    assert info.value.code == 2
