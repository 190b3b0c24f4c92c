"""The CLI, ``compare`` and ``um-lab lab`` on careless and hostile input: nothing silently wrong, no table lost.

A batch size given twice, duplicated comparison cells, cells that cannot run (checked before the first run;
a late failure still writes the table of the runs made), an existing ``--csv``, absurd ratios, budgets and
capacities, um_lab's own errors as one line, a closed pipe, the policy names, and the lab server's
address, port and authentication. Runs are instant (a fake backend) unless a real simulator check is what
is tested.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_runner import FakeBackend

import um_lab.runs.runner
import um_lab.runs.sweep
from um_lab.app import cli, commands, labserver
from um_lab.app.cli import main
from um_lab.errors import BudgetTooSmall, InputError, ModelConfigError, OutputExistsError, SpecError, UmLabError
from um_lab.policy import named_policies
from um_lab.runs.runlog import list_runs
from um_lab.runs.runread import load
from um_lab.runs.sweep import compare, write_export
from um_lab.summary import speedup_over, with_speedup

REPO = Path(__file__).resolve().parent.parent
KNOBS = ["--model-kw", "width=16", "--model-kw", "depth=1"]
TINY = [*KNOBS, "--batch-size", "4"]
TINY_MLP = {"width": 16, "depth": 1, "batch_size": 4}


@pytest.fixture
def fake_backend(monkeypatch):
    """Instant runs (the CLI and compare logic only); ``created`` lists the backends made. Set
    ``fail`` to ``{(policy, ratio): exception}`` to make those runs raise at their first step."""
    created: list[FakeBackend] = []
    fail: dict[tuple[str, float | None], BaseException] = {}

    class Failing(FakeBackend):
        def run(self, spec, case, policy):
            error = fail.get((policy.name, spec.oversubscription_ratio))
            if error is not None:
                raise error
            yield from super().run(spec, case, policy)

    def make(name="auto", **options):
        created.append(Failing())
        return created[-1]

    monkeypatch.setattr(um_lab.runs.runner, "get_backend", make)
    monkeypatch.setattr(um_lab.runs.sweep, "get_backend", make)
    make.created, make.fail = created, fail  # type: ignore[attr-defined]
    return make


def cli_error(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def usage_error(capsys, argv) -> str:
    """argparse's refusal of ``argv``: exit status 2 and its message."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def sweeps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("compare-")) if folder.exists() else []


# --------------------------------------------------------------------------- a batch size given twice


@pytest.mark.parametrize("command", ["run", "compare"])
def test_batch_size_and_a_model_kw_batch_size_that_disagree_are_refused(fake_backend, tmp_path, capsys, command):
    rc, err = cli_error(capsys, [command, "--batch-size", "4", "--model-kw", "batch_size=8", *KNOBS,
                                 "--backend", "sim", "--steps", "1", "--out", str(tmp_path / "runs")])
    assert rc == 2 and "--batch-size 4 and --model-kw batch_size=8 disagree" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists() and fake_backend.created == []


def test_batch_size_given_twice_alike_is_one_batch_size(fake_backend, tmp_path, capsys):
    assert main(["run", "--batch-size", "4", "--model-kw", "batch_size=4", *KNOBS, "--backend", "sim",
                 "--steps", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    (run_dir,) = list_runs(tmp_path)
    assert load(run_dir).spec.batch_size == 4


def test_compare_refuses_a_batch_size_against_a_models_batch_size_knob(fake_backend, tmp_path):
    with pytest.raises(SpecError, match="batch_size=4 and mlp's knob batch_size=8 disagree") as info:
        compare({"mlp": {**TINY_MLP, "batch_size": 8}}, ["gpu-first"], batch_size=4, backend="sim", steps=1,
                out_dir=tmp_path)
    assert info.value.field == "batch_size" and list(tmp_path.iterdir()) == [] and fake_backend.created == []


# --------------------------------------------------------------------------- duplicated cells


@pytest.mark.parametrize("flags, words", [
    (["--ratios", "1.5", "1.5"], "ratio 1.5 is given more than once"),
    (["--ratios", "none", "none"], "ratio None (the profile's card) is given more than once"),
    (["--models", "mlp", "mlp"], "model 'mlp' is given more than once"),
])
def test_compare_refuses_a_duplicated_ratio_or_model_before_the_first_run(fake_backend, tmp_path, capsys,
                                                                           flags, words):
    rc, err = cli_error(capsys, ["compare", *flags, "--backend", "sim", "--steps", "1", "--out",
                                 str(tmp_path / "runs"), "--csv", str(tmp_path / "t.csv"), "--no-progress", *TINY])
    assert rc == 2 and words in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "t.csv").exists() and fake_backend.created == []


def test_compare_api_refuses_duplicates_so_the_compare_view_does_too(fake_backend, tmp_path):
    with pytest.raises(SpecError, match="ratio 1.5 is given more than once") as info:
        compare(["mlp"], ["gpu-first"], ratios=[1.5, 2, 1.5], model_kwargs=TINY_MLP, backend="sim", out_dir=tmp_path)
    assert info.value.field == "ratios"
    with pytest.raises(ModelConfigError, match="model 'mlp' is given more than once") as info:
        compare(["mlp", "mlp"], ["gpu-first"], model_kwargs=TINY_MLP, backend="sim", out_dir=tmp_path)
    assert info.value.field == "models"
    assert list(tmp_path.iterdir()) == [] and fake_backend.created == []


def test_a_duplicated_policy_runs_once(fake_backend, tmp_path, capsys):
    assert main(["compare", "--policies", "gpu-first", "gpu-first", "um-default", "--backend", "sim", "--steps",
                 "1", "--out", str(tmp_path), "--no-progress", *TINY]) == 0
    (sweep,) = sweeps(tmp_path)
    table = pd.read_csv(sweep / "summary.csv")
    assert sorted(table["policy"]) == ["gpu-first", "um-default"]


def test_speedups_of_a_table_with_duplicated_cells_do_not_fail():
    table = pd.DataFrame({"model": ["mlp"] * 5, "policy": ["um-default", "um-default", "gpu-first", "gpu-first",
                                                           "um-default"],
                          "ratio": [1.5, 1.5, 1.5, 1.5, None], "median_ms": [10.0, 20.0, 5.0, 30.0, 8.0],
                          "p90_ms": [1.0] * 5}, index=[0, 0, 1, 1, 2])  # two tables put together
    speedups = speedup_over(table, "um-default")
    assert list(speedups) == [1.5, 0.75, 3.0, 0.5, 1.0]  # the baseline: the mean of its two medians
    assert list(with_speedup(table.copy(), "um-default")["speedup_vs_um-default"]) == list(speedups)


# --------------------------------------------------------------------------- every cell before the first run


def test_compare_checks_every_ratios_capacity_before_the_first_run(tmp_path):
    """On the simulator (real): ratio 1e9 leaves the tiny model less than one 2 MiB chunk of GPU."""
    with pytest.raises(SpecError, match="below one 2 MiB chunk") as info:
        compare({"mlp": TINY_MLP}, ["gpu-first"], ratios=[1.5, 1e9], backend="sim", steps=1, out_dir=tmp_path)
    assert "mlp under um-default at ratio 1e+09. Nothing was run." in info.value.__notes__[0]
    assert sweeps(tmp_path) == []


def test_the_cli_refuses_a_tiny_ratio_before_anything_is_created(tmp_path, capsys):
    for command, flag in (("run", "--ratio"), ("compare", "--ratios")):
        err = usage_error(capsys, [command, flag, "1.5", "1e-300"] if command == "compare" else
                          [command, flag, "1e-300", "--backend", "sim", "--out", str(tmp_path), *TINY])
        assert "ratio '1e-300' is below 0.001" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_compare_checks_a_layer_ahead_budget_before_the_first_run(tmp_path, capsys):
    """On the simulator (real): a 2 MiB budget cannot hold the staged policy's fixed pools."""
    rc, err = cli_error(capsys, ["compare", "--policies", "um-default", "layer-ahead-staged", "--budget", "2MiB",
                                 "--backend", "sim", "--steps", "1", "--out", str(tmp_path), "--no-progress",
                                 "--csv", str(tmp_path / "t.csv"), *TINY])
    assert rc == 2 and "cannot hold" in err and "mlp under layer-ahead-staged" in err and "Nothing was run" in err
    assert sweeps(tmp_path) == [] and not (tmp_path / "t.csv").exists()
    with pytest.raises(BudgetTooSmall):
        compare({"mlp": TINY_MLP}, ["layer-ahead-staged"], budget=2 << 20, backend="sim", steps=1,
                out_dir=tmp_path)
    assert sweeps(tmp_path) == []


def test_a_compare_that_fails_late_writes_the_table_of_the_runs_made(fake_backend, tmp_path, capsys):
    fake_backend.fail[("gpu-first", 2.0)] = RuntimeError("the card fell off")
    csv = tmp_path / "t.csv"
    rc = main(["compare", "--ratios", "1.5", "2", "3", "--backend", "sim", "--steps", "1", "--out",
               str(tmp_path / "runs"), "--csv", str(csv), "--no-progress", *TINY])
    out, err = capsys.readouterr()
    assert rc == 1 and "um-lab: error: the card fell off" in err and "Traceback" not in err
    assert "stopped after 4 of 6 runs (3 complete)" in err
    (sweep,) = sweeps(tmp_path / "runs")
    for table in (pd.read_csv(csv), pd.read_csv(sweep / "summary.csv")):
        assert list(table["status"]) == ["complete", "complete", "complete", "failed"]
        assert list(table["ratio"]) == [1.5, 1.5, 2.0, 2.0] and "the card fell off" in table["error"].iloc[3]
    assert "stopped early" in out and out.count("complete") == 3


def test_a_compare_api_failure_carries_the_table_it_wrote(fake_backend, tmp_path):
    fake_backend.fail[("gpu-first", 2.0)] = RuntimeError("the card fell off")
    with pytest.raises(RuntimeError, match="the card fell off") as info:
        compare({"mlp": TINY_MLP}, ["gpu-first"], ratios=[1.5, 2.0], backend="sim", steps=1, out_dir=tmp_path)
    table = info.value.compare_table
    assert list(table["status"]) == ["complete", "complete", "complete", "failed"]
    assert "speedup_vs_um-default" in table and table["speedup_vs_um-default"].iloc[1] == pytest.approx(2.0, 0.2)
    assert (Path(table.attrs["sweep_dir"]) / "summary.csv").is_file()


def test_a_compare_interrupted_keeps_the_table_of_the_runs_made(fake_backend, tmp_path, capsys):
    fake_backend.fail[("um-default", 2.0)] = KeyboardInterrupt()
    csv = tmp_path / "t.csv"
    rc, err = cli_error(capsys, ["compare", "--ratios", "1.5", "2", "--backend", "sim", "--steps", "1", "--out",
                                 str(tmp_path / "runs"), "--csv", str(csv), "--no-progress", *TINY])
    assert rc == 130 and "um-lab: interrupted" in err and "stopped after 3 of 4 runs (2 complete)" in err
    assert list(pd.read_csv(csv)["status"]) == ["complete", "complete", "interrupted"]


# --------------------------------------------------------------------------- an existing --csv


def test_compare_refuses_an_existing_csv_unless_force(fake_backend, tmp_path, capsys):
    csv = tmp_path / "table.csv"
    csv.write_text("another comparison's table\n")
    argv = ["compare", "--backend", "sim", "--steps", "1", "--out", str(tmp_path / "runs"), "--csv", str(csv),
            "--no-progress", *TINY]
    rc, err = cli_error(capsys, argv)
    assert rc == 2 and f"{csv} already exists" in err and "--force" in err
    assert csv.read_text() == "another comparison's table\n" and fake_backend.created == []
    assert main([*argv, "--force"]) == 0
    assert len(pd.read_csv(csv)) == 2 and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_csv_made_while_the_comparison_ran_is_not_replaced(fake_backend, tmp_path, capsys, monkeypatch):
    csv = tmp_path / "table.csv"

    class Racing(FakeBackend):  # another comparison writes the same --csv first
        def run(self, spec, case, policy):
            csv.write_text("the other comparison's table\n")
            yield from super().run(spec, case, policy)

    monkeypatch.setattr(um_lab.runs.sweep, "get_backend", lambda name="auto", **options: Racing())
    rc, err = cli_error(capsys, ["compare", "--backend", "sim", "--steps", "1", "--out", str(tmp_path / "runs"),
                                 "--csv", str(csv), "--no-progress", *TINY])
    assert rc == 1 and "was created by something else while this comparison ran" in err
    assert csv.read_text() == "the other comparison's table\n"
    (sweep,) = sweeps(tmp_path / "runs")
    assert f"the table is in {sweep}/summary.csv" in err and len(pd.read_csv(sweep / "summary.csv")) == 2


def test_write_export_creates_or_with_force_replaces(tmp_path):
    table = pd.DataFrame({"a": [1, 2]})
    path = tmp_path / "sub" / "t.csv"
    write_export(table, path)
    with pytest.raises(OutputExistsError) as info:
        write_export(table.assign(a=[3, 4]), path)
    assert info.value.path == path and list(pd.read_csv(path)["a"]) == [1, 2]
    write_export(table.assign(a=[3, 4]), path, force=True)
    assert list(pd.read_csv(path)["a"]) == [3, 4] and sorted(p.name for p in path.parent.iterdir()) == ["t.csv"]


# --------------------------------------------------------------------------- budgets, capacities, ratios


@pytest.mark.parametrize("flag, value, words", [
    ("--budget", "-1GiB", "a GPU budget must be > 0, got '-1GiB'"),
    ("--budget", "-0.5x", "a GPU budget must be > 0, got '-0.5x'"),
    ("--capacity", "-1GiB", "a simulated GPU capacity must be > 0, got '-1GiB'"),
    ("--ratio", "-1.5", "ratio must be > 0: '-1.5'"),
])
def test_a_negative_looking_value_is_read_and_refused(tmp_path, capsys, flag, value, words):
    err = usage_error(capsys, ["run", flag, value, "--backend", "sim", "--out", str(tmp_path), *TINY])
    assert words in err and "expected one argument" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_capacity_below_one_chunk_is_refused_up_front(tmp_path, capsys):
    err = usage_error(capsys, ["run", "--capacity", "1", "--backend", "sim", "--out", str(tmp_path), *TINY])
    assert "at least one 2 MiB chunk" in err and "smaller ratio" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, ratio_flag", [("run", "--ratio"), ("compare", "--ratios")])
def test_a_capacity_with_a_ratio_is_refused_up_front(fake_backend, tmp_path, capsys, command, ratio_flag):
    rc, err = cli_error(capsys, [command, "--capacity", "8GiB", ratio_flag, "1.5", "--backend", "sim", "--out",
                                 str(tmp_path / "runs"), *TINY])
    assert rc == 2 and "--capacity 8589934592 B (8 GiB) and" in err and "give one of them" in err
    assert not (tmp_path / "runs").exists() and fake_backend.created == []
    with pytest.raises(SpecError, match="capacity_bytes and ratios both set"):
        compare({"mlp": TINY_MLP}, ["gpu-first"], ratios=[None, 1.5], capacity_bytes=8 << 30, backend="sim",
                out_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- um_lab's errors, one line each


class _Refused(UmLabError):
    """An error of um_lab's that is neither bad input nor a runtime error (exit status 1)."""


@pytest.mark.parametrize("error, code", [
    (_Refused("profile 'x.json' is not a calibration profile"), 1),
    (InputError("profile 'x.json' is not a calibration profile", "profile"), 2),
])
def test_any_um_lab_error_is_one_line_without_a_traceback(fake_backend, tmp_path, capsys, monkeypatch, error,
                                                          code):
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(commands, "_backend_instance", refuse)
    rc, err = cli_error(capsys, ["run", "--profile", "x.json", "--backend", "sim", "--out", str(tmp_path), *TINY])
    assert rc == code and err == "um-lab: error: profile 'x.json' is not a calibration profile\n"


@pytest.mark.parametrize("content", ["[1, 2]", '{"um_lab_profile": 2, "name": "trunc', "\x00garbage\xff"])
def test_a_profile_that_is_not_one_is_a_one_line_error_naming_the_file(tmp_path, capsys, content):
    profile = tmp_path / "p.json"
    profile.write_text(content, errors="surrogateescape")
    rc, err = cli_error(capsys, ["run", "--profile", str(profile), "--backend", "sim", "--out",
                                 str(tmp_path / "runs"), "--no-progress", *TINY])
    assert rc in (1, 2) and err.startswith("um-lab: error:") and "p.json" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- a closed pipe, the policy names


def test_show_into_a_closed_pipe_exits_quietly(fake_backend, tmp_path):
    assert main(["run", "--backend", "sim", "--steps", "1", "--out", str(tmp_path), "--no-progress", *TINY]) == 0
    (run_dir,) = list_runs(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    show = subprocess.Popen([sys.executable, "-c", "import sys; from um_lab.app.cli import main; sys.exit(main())",
                             "show", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    show.stdout.close()  # as `| head` that has read what it wanted: the next write finds no reader
    err = show.stderr.read().decode()
    show.wait(timeout=120)
    assert show.returncode == cli.EXIT_BROKEN_PIPE == 141 and err == ""


def test_policies_lists_every_name_the_cli_accepts(capsys):
    assert main(["policies"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert listed == list(named_policies()) and {"layer-ahead", "layer-ahead-staged"} <= set(listed)


# --------------------------------------------------------------------------- the lab server


@pytest.fixture
def served(monkeypatch):
    """What ``um-lab lab`` would start, instead of starting it."""
    calls: list[list[str]] = []
    monkeypatch.setattr(commands, "_has_jupyterlab", lambda: True)
    monkeypatch.setattr(labserver, "serve_lab", lambda cmd, env: calls.append(list(cmd)) or 0)
    return calls


def _settings(cmd: list[str], names: tuple[str, ...]) -> list[str]:
    return [arg for arg in cmd if arg.lstrip("-").partition("=")[0] in names]


def _jupyter_accepts(cmd: list[str]) -> None:
    """Jupyter's own parser reads the command's arguments (two values of one setting are refused there)."""
    serverapp = pytest.importorskip("jupyter_server.serverapp")
    app = serverapp.ServerApp()
    try:
        app.parse_command_line(cmd[3:])  # after python -m jupyterlab
    except SystemExit as e:
        pytest.fail(f"Jupyter refused {cmd[3:]}: exit {e.code}")


@pytest.mark.parametrize("ip_args", [["--ServerApp.ip=0.0.0.0"], ["--ip", "0.0.0.0"], ["--ip=192.168.1.5"]])
def test_the_users_ip_is_passed_through_alone_and_warned_about(served, tmp_path, capsys, ip_args):
    assert main(["lab", "--notebooks", str(tmp_path), "--", *ip_args]) == 0
    (cmd,) = served
    assert _settings(cmd, labserver.IP_NAMES) == [ip_args[0]] and cmd[-len(ip_args):] == ip_args
    out, err = capsys.readouterr()
    assert "reachable from the network" in out and "127.0.0.1 only" not in out
    assert "um-lab: WARNING: JupyterLab listens on" in err and "reachable from the network" in err
    _jupyter_accepts(cmd)


def test_a_local_ip_of_the_users_is_not_warned_about(served, tmp_path, capsys):
    assert main(["lab", "--notebooks", str(tmp_path), "--", "--ServerApp.ip=::1"]) == 0
    out, err = capsys.readouterr()
    assert "::1 only" in out and err == ""
    assert _settings(served[0], labserver.IP_NAMES) == ["--ServerApp.ip=::1"]


@pytest.mark.parametrize("token_args", [["--IdentityProvider.token="], ["--ServerApp.token", ""],
                                        ["--IdentityProvider.token=''"]])
def test_an_empty_token_is_said_to_turn_authentication_off(served, tmp_path, capsys, token_args):
    assert main(["lab", "--notebooks", str(tmp_path), "--", *token_args]) == 0
    out, err = capsys.readouterr()
    assert "AUTHENTICATION OFF" in out and "token it prints" not in out
    assert "um-lab: WARNING: TOKEN AUTHENTICATION IS OFF" in err and "FROM THE NETWORK" not in err
    assert main(["lab", "--notebooks", str(tmp_path), "--", *token_args, "--ip=0.0.0.0"]) == 0
    assert "FROM THE NETWORK" in capsys.readouterr().err


def test_with_the_token_on_the_banner_says_to_use_it(served, tmp_path, capsys):
    assert main(["lab", "--notebooks", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "127.0.0.1 only" in out and "open the URL with the token it prints" in out and err == ""
    assert _settings(served[0], labserver.IP_NAMES) == ["--ServerApp.ip=127.0.0.1"]
    _jupyter_accepts(served[0])


def test_a_busy_port_is_refused_before_jupyter_starts(served, tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv in (["--port", str(port)], ["--", f"--ServerApp.port={port}"]):
            rc, err = cli_error(capsys, ["lab", "--notebooks", str(tmp_path), *argv])
            assert rc == 2 and f"port {port} is in use on 127.0.0.1" in err and "--port" in err
        assert served == []
        assert labserver.port_in_use(port) and not labserver.port_in_use(port, "192.0.2.1")  # not ours: cannot tell


def test_a_named_port_is_kept_not_moved(served, tmp_path, capsys):
    with socket.socket() as probe:  # a port that is free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["lab", "--notebooks", str(tmp_path), "--port", str(port)]) == 0
    assert "--ServerApp.port_retries=0" in served[0] and f"port {port} (a busy port stops it" in capsys.readouterr().out
    _jupyter_accepts(served[0])
    assert main(["lab", "--notebooks", str(tmp_path), "--port", str(port), "--", "--port-retries=5"]) == 0
    assert _settings(served[1], labserver.PORT_RETRY_NAMES) == ["--port-retries=5"]
    assert main(["lab", "--notebooks", str(tmp_path)]) == 0  # Jupyter's port: it may move, and the banner says so
    assert _settings(served[2], labserver.PORT_RETRY_NAMES) == []
    assert "the next free one" in capsys.readouterr().out


def test_a_root_dir_of_the_users_replaces_ours(served, tmp_path):
    assert main(["lab", "--notebooks", str(tmp_path), "--", "--notebook-dir", "/elsewhere"]) == 0
    assert _settings(served[0], labserver.ROOT_DIR_NAMES) == ["--notebook-dir"]


def test_jupyter_settings_are_read_in_both_spellings():
    extra = ["--ip", "0.0.0.0", "--ServerApp.port=9", "--IdentityProvider.token", "", "-x", "--port", "10"]
    assert labserver.user_ip(extra) == "0.0.0.0" and labserver.named_port(None, extra) == 10
    assert labserver.named_port(5, []) == 5 and labserver.named_port(5, ["--port=x"]) is None
    assert labserver.auth_off(extra) and not labserver.auth_off(["--IdentityProvider.token=abc"])
    assert not labserver.auth_off(["--IdentityProvider.token=", "--ServerApp.password=sha1:x"])
    assert [labserver.is_local(ip) for ip in (None, "127.0.0.1", "localhost", "::1", "0.0.0.0", "", "*",
                                              "example.org")] == [True] * 4 + [False] * 4
