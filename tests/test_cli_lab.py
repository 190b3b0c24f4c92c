"""``um-lab lab``: arguments passed through to Jupyter, where notebook runs go, and stopping the server.

The stop tests run ``um-lab lab`` in a subprocess with a fake Jupyter (a script that sleeps, with a child
of its own in its process group), signal um-lab, and check that both processes are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from um_lab.app import commands, labserver
from um_lab.app.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def served(monkeypatch):
    """Capture what ``um-lab lab`` would start instead of starting it."""
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(commands, "_has_jupyterlab", lambda: True)
    monkeypatch.setattr(labserver, "serve_lab", lambda cmd, env: calls.append((list(cmd), dict(env))) or 0)
    return calls


def test_unknown_arguments_and_everything_after_dashdash_go_to_jupyter(served, tmp_path):
    assert main(["lab", "--notebooks", str(tmp_path), "--allow-root", "--port", "8899", "--ServerApp.x", "1",
                 "--", "--no-browser", "--port=1"]) == 0
    ((cmd, _),) = served
    assert "--ServerApp.port=8899" not in cmd  # a port after -- wins: Jupyter refuses two values of one setting
    assert cmd[-5:] == ["--allow-root", "--ServerApp.x", "1", "--no-browser", "--port=1"]  # theirs, in order
    assert cmd.count("--no-browser") == 1  # after --: passed through, not read as um-lab's option
    assert main(["lab", "--notebooks", str(tmp_path), "--", "--ServerApp.port=9999"]) == 0
    assert served[1][0][-1] == "--ServerApp.port=9999" and "--" not in served[1][0]


def test_other_commands_still_reject_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["models", "--allow-root"])
    assert info.value.code == 2 and "unrecognized arguments: --allow-root" in capsys.readouterr().err


def test_lab_help_documents_pass_through_and_runs_dir(capsys):
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    out = capsys.readouterr().out
    assert "um-lab lab --allow-root" in out and "-- --ServerApp.port=9999" in out and "UM_LAB_RUNS_DIR" in out


def test_lab_sets_runs_dir_to_start_folder_unless_set(served, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("UM_LAB_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nb").mkdir()
    assert main(["lab", "--notebooks", "nb"]) == 0
    expected = str((tmp_path / "runs").resolve())
    assert served[0][1]["UM_LAB_RUNS_DIR"] == expected
    assert f"runs from the notebooks go to {expected}" in capsys.readouterr().out
    monkeypatch.setenv("UM_LAB_RUNS_DIR", str(tmp_path / "mine"))
    assert main(["lab", "--notebooks", "nb"]) == 0
    assert served[1][1]["UM_LAB_RUNS_DIR"] == str((tmp_path / "mine").resolve())
    assert f"go to {(tmp_path / 'mine').resolve()}" in capsys.readouterr().out
    monkeypatch.setenv("UM_LAB_RUNS_DIR", "rel")  # relative to where um-lab lab started, not to notebooks/
    assert main(["lab", "--notebooks", "nb"]) == 0
    assert served[2][1]["UM_LAB_RUNS_DIR"] == str((tmp_path / "rel").resolve())


def test_serve_lab_returns_the_servers_own_exit_status():
    assert labserver.serve_lab([sys.executable, "-c", "import sys; sys.exit(3)"], os.environ) == 3


# ------------------------------------------------------------------------------- stopping the server

FAKE_JUPYTER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a child in the server's process group that ignores SIGTERM: only a kill of the group ends it
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    with open(out + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.environ.get('UM_LAB_RUNS_DIR', '')}")
    os.replace(out + ".tmp", out)
    time.sleep(120)
""")

DRIVER = textwrap.dedent("""
    import sys
    from um_lab.app import cli, commands
    fake, out, mode, grace, notebooks = sys.argv[1:6]
    from um_lab.app import labserver
    labserver.LAB_STOP_GRACE_S = float(grace)
    commands._has_jupyterlab = lambda: True
    labserver.lab_command = lambda nb, port=None, no_browser=False, extra=(): [sys.executable, fake, out, mode, *extra]
    sys.exit(cli.main(["lab", "--notebooks", notebooks]))
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaped yet has stopped running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("signum, mode, expected_rc", [
    (signal.SIGTERM, "plain", 128 + signal.SIGTERM),
    (signal.SIGINT, "ignore-term", 130),  # the server ignores SIGTERM: killed after the grace period
])
def test_stopping_um_lab_lab_stops_the_jupyter_server_and_its_group(tmp_path, signum, mode, expected_rc):
    fake = tmp_path / "fake_jupyter.py"
    fake.write_text(FAKE_JUPYTER)
    out = tmp_path / "pids"
    (tmp_path / "nb").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "UM_LAB_RUNS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = tmp_path / "lab.log"  # a file, not a pipe: a surviving child would hold a pipe open
    with open(log, "w") as sink:
        lab = subprocess.Popen([sys.executable, "-c", DRIVER, str(fake), str(out), mode, "1.0", "nb"],
                               cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and lab.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), f"the fake server never started:\n{log.read_text()}"
        server, child, runs_dir = out.read_text().split(" ", 2)
        pids = [int(server), int(child)]
        assert runs_dir == str((tmp_path / "runs").resolve())  # what the kernels would inherit
        assert all(_alive(p) for p in pids)
        lab.send_signal(signum)
        lab.wait(timeout=60)
        output = log.read_text()
        assert lab.returncode == expected_rc, output
        assert _gone_within(pids, 10), f"left running: {[p for p in pids if _alive(p)]}\n{output}"
        assert "JupyterLab stopped" in output
        if mode == "ignore-term":
            assert "did not stop within 1 s: killing it" in output
    finally:
        for pid in pids:  # only the processes this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if lab.poll() is None:
            lab.kill()
            lab.wait()


# ------------------------------------------------------------------------------- working copies

def test_um_lab_lab_serves_working_copies_of_the_repository_notebooks(served, monkeypatch, tmp_path, capsys):
    """The repository's notebooks are copied into runs/notebooks and that folder is served: running and saving
    there keeps outputs (and so live widgets across a page reload) and leaves the repository as committed."""
    monkeypatch.delenv("UM_LAB_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    committed = labserver.default_notebooks_dir()
    assert committed == REPO / "notebooks" and labserver.is_checkout_notebooks(committed)
    before = {p.name: p.read_bytes() for p in committed.glob("*.ipynb")}
    assert main(["lab"]) == 0
    ((cmd, env),) = served
    work = tmp_path / "runs" / labserver.WORKING_COPIES
    assert f"--ServerApp.root_dir={work}" in cmd and env["UM_LAB_RUNS_DIR"] == str(tmp_path / "runs")
    assert not any("pre_save_hook" in a for a in cmd)
    assert {p.name: p.read_bytes() for p in work.glob("*.ipynb")} == before
    assert "working copies of" in capsys.readouterr().out
    mine = work / "01_quickstart.ipynb"
    mine.write_text(mine.read_text().replace("um_lab", "um_lab ", 1))  # the user's edit (and outputs) stay
    edited = mine.read_bytes()
    assert main(["lab", "--notebooks", str(committed)]) == 0  # named explicitly: the same copies
    assert mine.read_bytes() == edited and served[1][0] == cmd
    assert {p.name: p.read_bytes() for p in committed.glob("*.ipynb")} == before
    assert main(["lab", "--notebooks", str(tmp_path)]) == 0  # a folder of the user's own: served as it is
    assert f"--ServerApp.root_dir={tmp_path}" in served[2][0]


def test_working_copies_never_overwrite_and_name_newer_committed_notebooks(tmp_path):
    committed, work = tmp_path / "committed", tmp_path / "work"
    (committed / "data").mkdir(parents=True)
    (committed / ".ipynb_checkpoints").mkdir()
    (committed / "a.ipynb").write_text("A1")
    (committed / "data" / "x.json").write_text("{}")
    (committed / ".ipynb_checkpoints" / "a-checkpoint.ipynb").write_text("old")
    assert labserver.working_copies(committed, work) == []
    assert (work / "a.ipynb").read_text() == "A1" and (work / "data" / "x.json").read_text() == "{}"
    assert not (work / ".ipynb_checkpoints").exists()
    (work / "a.ipynb").write_text("A1 with the user's outputs")
    os.utime(work / "a.ipynb", (1, 1))  # an old copy
    (committed / "a.ipynb").write_text("A2")
    assert labserver.working_copies(committed, work) == ["a.ipynb"]
    assert (work / "a.ipynb").read_text() == "A1 with the user's outputs"


def test_the_banner_warns_when_the_repository_notebooks_themselves_are_served(tmp_path):
    assert "writes into the repository" in " ".join(labserver.lab_banner(REPO, 8899))
    assert "writes into the repository" not in " ".join(labserver.lab_banner(tmp_path, 8899))
