"""Run and comparison folders on careless and hostile input: a closed stdout, an ``out_dir`` that is not a
folder, copied record lines, a bad ``summary.csv``, a disk full at start, a path not found, a custom model.

Runs are instant (a fake backend) unless a real process is what is tested.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import TINY, InstantBackend, spec, start_script, status_of
from torch import nn

import um_lab
import um_lab.runs.runlog
from um_lab.app import cli
from um_lab.app.cli import main
from um_lab.errors import FileReadError, UmLabError
from um_lab.models import custom
from um_lab.runs.runlog import RunDirError, list_runs
from um_lab.runs.runner import Run, run
from um_lab.runs.runread import ENDED_WITHOUT_CLOSING, NOT_CHECKABLE, NotARunFolderError, RunLogWarning, load
from um_lab.runs.sweep import compare

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
CLI = [sys.executable, "-c", "import sys; from um_lab.app.cli import main; sys.exit(main())"]
TINY_ARGS = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]


def finished_run(tmp_path: Path, **kw) -> Path:
    """A complete run of 2 warm-up and 5 measured steps (steps 0-6)."""
    return run(spec(**kw), out_dir=tmp_path, backend=InstantBackend()).path


def rewrite_status(path: Path, **changes) -> None:
    (path / "status.json").write_text(json.dumps({**status_of(path), **changes}))


def summary_steps(out: str) -> int:
    (line,) = [line for line in out.splitlines() if line.split()[:1] == ["steps"]]
    return int(line.split()[1].replace(",", ""))


# ------------------------------------------------------------- a closed stdout, a run left pending


@pytest.mark.parametrize("closed", ["stdout", "stdout and stderr"])
def test_um_lab_run_into_a_closed_pipe_runs_to_the_end(tmp_path, closed):
    both = closed == "stdout and stderr"
    proc = subprocess.Popen([*CLI, "run", "--backend", "sim", "--steps", "3", "--warmup", "1", "--out",
                             str(tmp_path), *TINY_ARGS, *([] if both else ["--no-progress"])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if both else subprocess.PIPE, env=ENV)
    proc.stdout.close()  # as `| head -1` that has read its line: every later write finds no reader
    err = "" if both else proc.stderr.read().decode()
    assert proc.wait(timeout=300) == cli.EXIT_OK, err
    assert "Broken pipe" not in err and "Traceback" not in err
    (path,) = list_runs(tmp_path)
    status = status_of(path)
    assert status["status"] == "complete" and status["steps_completed"] == 4


def test_um_lab_compare_into_a_closed_pipe_runs_every_cell_and_writes_its_table(tmp_path):
    proc = subprocess.Popen([*CLI, "compare", "--backend", "sim", "--steps", "1", "--warmup", "0", "--out",
                             str(tmp_path), "--models", "mlp", "--policies", "um-default", "gpu-first",
                             "--ratios", "none", *TINY_ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    proc.stdout.close()  # `2>&1 | head -1`: the progress bar and the table find no reader
    assert proc.wait(timeout=300) == cli.EXIT_OK
    (sweep,) = tmp_path.glob("compare-*")
    table = (sweep / "summary.csv").read_text()
    assert "um-default" in table and "gpu-first" in table


def test_show_into_a_closed_pipe_still_exits_quietly(tmp_path):
    path = finished_run(tmp_path)
    show = subprocess.Popen([*CLI, "show", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    show.stdout.close()
    err = show.stderr.read().decode()
    assert show.wait(timeout=120) == cli.EXIT_BROKEN_PIPE and err == ""


def test_a_run_left_pending_by_a_process_that_is_gone_reads_as_interrupted(tmp_path, capsys):
    script = ("import sys\n"
              "from um_lab.runs.runner import Run\n"
              "from um_lab.types import RunSpec\n"
              f"Run(RunSpec(model='mlp', model_kwargs={TINY!r}, backend='sim', steps=1, warmup_steps=2),"
              " out_dir=sys.argv[1])\n")  # created, never started: the process ends with it pending
    proc = start_script(script, str(tmp_path))
    assert proc.wait(timeout=120) == 0, proc.communicate()[1]
    (path,) = list_runs(tmp_path)
    assert status_of(path)["status"] == "pending"
    loaded = load(path)
    assert loaded.state == "interrupted" and not loaded.complete and loaded.steps_text == "0/3"
    assert loaded.status["interrupted_by"] == ENDED_WITHOUT_CLOSING
    assert f"status.json says pending, but its process (pid {proc.pid})" in loaded.status["note"]
    assert main(["show", str(path)]) == 0
    assert "state interrupted, 0/3 steps" in capsys.readouterr().out


def test_a_pending_status_from_elsewhere_reads_as_interrupted_with_its_real_count(tmp_path):
    path = finished_run(tmp_path)
    rewrite_status(path, status="pending", complete=False, steps_completed=0,
                   host=socket.gethostname() + "-elsewhere")
    loaded = load(path)
    assert loaded.state == "interrupted" and loaded.steps_text == "7/7"
    assert loaded.status["interrupted_by"] == NOT_CHECKABLE


def test_a_pending_run_of_a_live_process_stays_pending(tmp_path):
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())  # this process, not started yet
    assert load(active.path).state == "pending"
    path = finished_run(tmp_path)
    parent = os.getppid()
    rewrite_status(path, status="pending", complete=False, steps_completed=0, pid=parent,
                   pid_started=um_lab.runs.runlog.process_start_ticks(parent))
    assert load(path).state == "pending"


# ------------------------------------------------------------------------ an out_dir not a folder


def test_an_out_dir_that_is_a_device_or_a_file_is_refused_before_anything(tmp_path):
    backend = InstantBackend()
    with pytest.raises(RunDirError, match=r"out_dir /dev/null is a device, not a folder") as caught:
        um_lab.run(spec(), out_dir="/dev/null", backend=backend)
    assert "already exists" not in str(caught.value) and isinstance(caught.value, UmLabError)
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(RunDirError, match=r"out_dir .*notes\.txt is a regular file, not a folder"):
        um_lab.run(spec(), out_dir=file, backend=backend)
    with pytest.raises(RunDirError, match=r"cannot write runs under /dev/null: out_dir /dev/null is a device"):
        compare(["mlp"], ["um-default"], backend_instance=backend, out_dir="/dev/null", model_kwargs=TINY)
    assert backend.calls == 0 and list(tmp_path.iterdir()) == [file] and file.read_text() == "mine"


def test_the_lab_panel_says_its_out_dir_is_not_a_folder():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from um_lab.widgets import Lab

    with pytest.raises(RunDirError, match="is a device, not a folder"):
        Lab(model="mlp", model_kwargs=TINY, backend="sim", steps=1, out_dir="/dev/null")


# ------------------------------------------------------------------------------ copied record lines


def test_a_duplicated_last_record_is_warned_about_and_summarised_once(tmp_path, capsys):
    path = finished_run(tmp_path)
    records = path / "records.jsonl"
    lines = records.read_bytes().splitlines(keepends=True)
    records.write_bytes(b"".join(lines) + lines[-1])
    with pytest.warns(RunLogWarning, match=r"records\.jsonl: step 6 is recorded more than once \(1 extra line\)"):
        assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "7/7 steps" in out and summary_steps(out) == 5
    assert "step 6 is recorded more than once" in load(path).status["note"]


def test_200000_copies_of_one_record_count_once(tmp_path, capsys):
    path = finished_run(tmp_path)
    records = path / "records.jsonl"
    lines = records.read_bytes().splitlines(keepends=True)
    records.write_bytes(b"".join(lines[:-1]) + lines[-1] * 200_000)
    with pytest.warns(RunLogWarning, match=r"step 6 is recorded more than once \(199,999 extra lines\)"):
        assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "7/7 steps" in out and summary_steps(out) == 5


def test_a_missing_step_replaced_by_a_copy_of_another_is_found(tmp_path, capsys):
    path = finished_run(tmp_path)
    records = path / "records.jsonl"
    lines = records.read_bytes().splitlines(keepends=True)
    lines[3] = lines[2]  # step 3 lost, step 2 twice: as many lines as status.json counts
    records.write_bytes(b"".join(lines))
    with pytest.warns(RunLogWarning) as caught:
        assert main(["show", str(path)]) == 0
    texts = [str(w.message) for w in caught]
    assert any("holds 6 of the 7 steps" in t and "missing: step 3" in t and "step 2 is recorded more than once" in t
               for t in texts), texts
    assert any(t.startswith(f"{records}: step 2 is recorded more than once") and "missing: step 3" in t
               for t in texts), texts
    out = capsys.readouterr().out
    assert "6/7 steps" in out and summary_steps(out) == 4
    with pytest.warns(RunLogWarning):
        assert [r.step for r in load(path).records()] == [0, 1, 2, 4, 5, 6]


# ------------------------------------------------------------------- a comparison's bad summary.csv


def _comparison(tmp_path: Path) -> Path:
    table = compare(["mlp"], ["um-default"], backend_instance=InstantBackend(), out_dir=tmp_path, steps=1,
                    model_kwargs=TINY)
    return Path(table.attrs["sweep_dir"])


def test_a_corrupt_summary_csv_is_named_with_what_is_wrong(tmp_path, capsys):
    sweep = _comparison(tmp_path)
    (sweep / "summary.csv").write_text('model,policy\n"mlp,um-default\n')
    assert main(["show", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"'{sweep / 'summary.csv'}' cannot be parsed as CSV" in err and "EOF inside string" in err, err
    with pytest.raises(FileReadError, match="cannot be parsed as CSV"):
        um_lab.files.read_csv(sweep / "summary.csv", "comparison's summary", um_lab.files.TABLE_LIMIT)


def test_a_summary_csv_linked_to_a_device_is_not_read(tmp_path, capsys):
    sweep = _comparison(tmp_path)
    (sweep / "summary.csv").unlink()
    (sweep / "summary.csv").symlink_to("/dev/zero")
    assert main(["show", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"'{sweep / 'summary.csv'}' is a device, not a regular file" in err and "without summary" not in err


# ------------------------------------------------------------------------------- a disk full at start


@pytest.fixture
def full_disk(monkeypatch):
    def write_file(path, data):
        with open(path, "wb"):  # the file is created, then the write fails
            pass
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(um_lab.runs.runlog, "_write_file", write_file)


def test_a_disk_full_at_start_leaves_nothing_behind(tmp_path, full_disk):
    with pytest.raises(RunDirError, match="No space left on device"):
        Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RunDirError, match="No space left on device"):
        Run(spec(), out_dir=tmp_path / "new" / "runs", backend=InstantBackend())
    assert list(tmp_path.iterdir()) == []  # the folders it made for out_dir are gone too
    with pytest.raises(RunDirError, match="cannot write runs under.*No space left on device"):
        compare(["mlp"], ["um-default"], backend_instance=InstantBackend(), out_dir=tmp_path / "c", model_kwargs=TINY)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------- a path not found, custom


def test_show_of_a_path_not_found_says_not_found(tmp_path, capsys):
    missing = tmp_path / "nosuch"
    assert main(["show", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"run folder {missing} not found" in err and "spec.json" not in err
    with pytest.raises(NotARunFolderError, match="not found"):
        load(missing)


def test_show_names_a_custom_model_as_custom(tmp_path, capsys):
    case = custom("mlp", nn.Linear(4, 2), lambda g: (torch.randn(3, 4, generator=g),
                                                      torch.randint(0, 2, (3,), generator=g)))
    mine = run(spec(), case=case, out_dir=tmp_path, backend=InstantBackend())
    assert json.loads((mine.path / "model.json").read_text())["info"]["custom"] is True
    assert main(["show", str(mine.path)]) == 0
    assert f"{mine.path}: mlp (custom) under um-default" in capsys.readouterr().out
    zoo = finished_run(tmp_path / "zoo")
    assert main(["show", str(zoo)]) == 0
    assert f"{zoo}: mlp under um-default" in capsys.readouterr().out
