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

from um_lab.app import cli, labserver
from um_lab.app.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def served(monkeypatch):
    """Capture what ``um-lab lab`` would start instead of starting it."""
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(cli, "_has_jupyterlab", lambda: True)
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
    from um_lab.app import cli
    fake, out, mode, grace, notebooks = sys.argv[1:6]
    from um_lab.app import labserver
    labserver.LAB_STOP_GRACE_S = float(grace)
    cli._has_jupyterlab = lambda: True
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


# ------------------------------------------------------------------------------- saving notebooks

HOOK_ARG = f"--ContentsManager.pre_save_hook={labserver.SAVE_HOOK}"
COMMITTED = REPO / "notebooks" / "01_quickstart.ipynb"


def test_the_checkout_notebooks_are_saved_through_the_hook(tmp_path):
    notebooks = labserver.default_notebooks_dir()
    assert notebooks == REPO / "notebooks" and labserver.checkout_notebooks() == notebooks
    assert HOOK_ARG in labserver.lab_command(notebooks)
    assert HOOK_ARG in labserver.lab_command(REPO), "a root above notebooks/ serves them too"
    assert not any("pre_save_hook" in a for a in labserver.lab_command(tmp_path)), "a folder of your own: as Jupyter"
    mine = ["--FileContentsManager.pre_save_hook=my.hook"]
    assert labserver.lab_command(notebooks, extra=mine)[-1:] == mine and HOOK_ARG not in labserver.lab_command(
        notebooks, extra=mine), "a hook of the user's replaces it (Jupyter takes one)"
    assert "without new outputs" in " ".join(labserver.lab_banner(notebooks, 8899))
    assert "without new outputs" not in " ".join(labserver.lab_banner(tmp_path, 8899))


def _ran(cell: dict, n: int) -> None:
    """What running a code cell in JupyterLab does to it."""
    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"run {n}\n"},
                       {"output_type": "display_data", "metadata": {},
                        "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "m", "version_major": 2,
                                                                              "version_minor": 0},
                                 "text/plain": "Lab(...)"}}]
    cell["execution_count"] = n
    cell["metadata"] = {**cell.get("metadata", {}), "execution": {"iopub.status.busy": "2030-01-01T00:00:00Z"}}


def test_the_hook_saves_a_new_notebook_without_outputs_or_widget_state():
    model = {"type": "notebook", "format": "json", "content": {
        "nbformat": 4, "nbformat_minor": 5, "metadata": {"widgets": {"state": {}}, "kernelspec": {"name": "python3"}},
        "cells": [{"cell_type": "code", "id": "a", "source": "print(1)", "metadata": {"tags": ["x"]},
                   "outputs": [], "execution_count": None},
                  {"cell_type": "markdown", "id": "b", "source": "# text", "metadata": {}}]}}
    _ran(model["content"]["cells"][0], 3)
    labserver.keep_committed_outputs(model=model, path="new.ipynb", contents_manager=None)
    code, text = model["content"]["cells"]
    assert code["outputs"] == [] and code["execution_count"] is None and code["metadata"] == {"tags": ["x"]}
    assert code["source"] == "print(1)" and text["source"] == "# text"
    assert model["content"]["metadata"] == {"kernelspec": {"name": "python3"}}
    other = {"type": "file", "format": "text", "content": "x"}
    labserver.keep_committed_outputs(model=other, path="a.txt", contents_manager=None)
    assert other == {"type": "file", "format": "text", "content": "x"}


@pytest.mark.parametrize("manager", ["FileContentsManager", "AsyncLargeFileManager"])
def test_a_committed_notebook_run_and_saved_in_jupyter_stays_as_committed(tmp_path, manager, monkeypatch):
    """Through Jupyter's own contents manager (the async one is JupyterLab's), configured as ``um-lab lab``
    configures it: a run changes nothing on disk; an edit is saved, without outputs."""
    import asyncio
    import inspect
    import json

    managers = pytest.importorskip("jupyter_server.services.contents.largefilemanager")
    from jupyter_server.services.contents.filemanager import FileContentsManager

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))  # the notary's signatures: not the user's
    cls = FileContentsManager if manager == "FileContentsManager" else managers.AsyncLargeFileManager
    (tmp_path / "root").mkdir()
    cm = cls(root_dir=str(tmp_path / "root"), pre_save_hook=labserver.SAVE_HOOK)  # a string, as um-lab lab gives it

    def call(result):
        return asyncio.run(result) if inspect.isawaitable(result) else result

    committed = COMMITTED.read_bytes()
    (tmp_path / "root" / COMMITTED.name).write_bytes(committed)
    model = call(cm.get(COMMITTED.name, content=True))
    assert any(c.get("outputs") for c in model["content"]["cells"]), "the committed notebook has outputs"
    content = json.loads(json.dumps(model["content"]))  # as the browser sends it back
    code = [c for c in content["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code, 1):
        _ran(cell, n)
    content["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    content["metadata"]["language_info"] = {"name": "python", "version": "3.99.0"}
    call(cm.save({"type": "notebook", "format": "json", "content": content}, COMMITTED.name))
    assert (tmp_path / "root" / COMMITTED.name).read_bytes() == committed, "running it changed nothing on disk"

    code[-1]["source"] += "\n# an edit"
    content["cells"].append({"cell_type": "code", "id": "new-cell", "source": "1 + 1", "metadata": {},
                             "outputs": [], "execution_count": None})
    _ran(content["cells"][-1], 99)
    call(cm.save({"type": "notebook", "format": "json", "content": content}, COMMITTED.name))
    saved = json.loads((tmp_path / "root" / COMMITTED.name).read_text())
    before = json.loads(committed)
    edited, new = saved["cells"][-2], saved["cells"][-1]
    assert "".join(edited["source"]).endswith("# an edit") and edited["outputs"] == [] and new["outputs"] == []
    assert edited["execution_count"] is None and "execution" not in new["metadata"]
    assert saved["cells"][:-2] == before["cells"][:-1], "the other cells keep their committed outputs"
    assert saved["metadata"] == before["metadata"]
