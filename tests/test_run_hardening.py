"""Hardening of runs: SIGTERM and interpreter exit, runs left running, damaged run folders,
run names that would escape ``out_dir``.

The process-level tests start real subprocesses running a tiny model on the simulator and end them
(SIGTERM, a normal exit with a background run), then read ``status.json`` back. The rest use an
instant fake backend.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from run_helpers import InstantBackend, spec, start_script, status_of, wait_for_steps

import um_lab.runs.runlog
from um_lab.app.cli import main
from um_lab.errors import UmLabError
from um_lab.runs import runexit
from um_lab.runs.runlog import RunDirError, RunNameError, list_runs
from um_lab.runs.runner import Run, run
from um_lab.runs.runread import NotARunFolderError, RunLogError, RunLogWarning, load

REPO = Path(__file__).resolve().parent.parent
SIM_MLP = {"width": 256, "depth": 2, "batch_size": 64}


def lines_of(path: Path) -> int:
    return (path / "records.jsonl").read_text().count("\n")


# ------------------------------------------------------------------------ real processes ending


SIM_RUN = ("import sys, time\n"
           "from um_lab.runs.runner import Run\n"
           "from um_lab.types import RunSpec\n"
           f"r = Run(RunSpec(model='mlp', model_kwargs={SIM_MLP!r}, backend='sim', steps=10**8,"
           " oversubscription_ratio=1.5), out_dir=sys.argv[1])\n")


def _sigterm_after_steps(out: Path, proc: subprocess.Popen, n: int) -> tuple[Path, str, str]:
    """Wait for ``n`` recorded steps, send SIGTERM, collect the output (the process killed in any case)."""
    try:
        path = wait_for_steps(out, proc, n)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return path, stdout or "", stderr or ""


def _assert_interrupted_with_its_steps(path: Path, by: str, min_steps: int) -> None:
    status = status_of(path)
    assert status["status"] == "interrupted" and status["complete"] is False, status
    assert status["interrupted_by"] == by
    assert status["steps_completed"] == lines_of(path) >= min_steps  # the real count, not 0
    loaded = load(path)
    assert loaded.state == "interrupted" and [r.step for r in loaded.records()] == list(range(lines_of(path)))


def test_sigterm_ends_a_foreground_run_as_interrupted_with_its_steps(tmp_path):
    proc = start_script(SIM_RUN + "for _ in r: pass\n", str(tmp_path))
    path, _, err = _sigterm_after_steps(tmp_path, proc, 20)
    assert proc.returncode != 0 and "RunInterrupted: run interrupted by SIGTERM" in err, err
    _assert_interrupted_with_its_steps(path, "SIGTERM", 20)


def test_sigterm_to_um_lab_run_exits_130_and_keeps_the_steps(tmp_path):
    kw = [a for k, v in SIM_MLP.items() if k != "batch_size" for a in ("--model-kw", f"{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "um_lab.app.cli", "run", "--backend", "sim", "--steps",
                             str(10**8), "--ratio", "1.5", "--batch-size", "64", "--no-progress", "--out",
                             str(tmp_path), *kw], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    path, out, err = _sigterm_after_steps(tmp_path, proc, 20)
    assert proc.returncode == 130, err
    assert "completed steps kept" in out
    _assert_interrupted_with_its_steps(path, "SIGTERM", 20)


def test_sigterm_with_a_background_run_marks_it_and_still_terminates(tmp_path):
    proc = start_script(SIM_RUN + "r.start()\ntime.sleep(600)\n", str(tmp_path))
    path, _, _ = _sigterm_after_steps(tmp_path, proc, 20)
    assert proc.returncode == -signal.SIGTERM  # terminated by the signal, as without um_lab's handler
    _assert_interrupted_with_its_steps(path, "SIGTERM", 20)


def test_a_background_run_is_marked_interrupted_when_python_exits(tmp_path):
    script = SIM_RUN + ("r.start()\n"
                        "while r.steps_completed < 20: time.sleep(0.01)\n"
                        "sys.exit(0)\n")
    proc = start_script(script, str(tmp_path))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    (path,) = list_runs(tmp_path)
    _assert_interrupted_with_its_steps(path, "interpreter exit", 20)


# ------------------------------------------------------------------------- the SIGTERM handler


@pytest.fixture
def default_sigterm():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_um_lab_handles_sigterm_only_during_a_foreground_run_and_restores_the_default(tmp_path, default_sigterm):
    seen = []
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: seen.append(signal.getsignal(signal.SIGTERM)))
    list(active)
    assert seen and all(h is runexit._on_sigterm for h in seen)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    background = Run(spec(), out_dir=tmp_path, backend=InstantBackend(delay_s=0.001)).start()
    assert background.join(timeout=10)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back by join()


def test_a_users_sigterm_handler_is_never_replaced(tmp_path, default_sigterm):
    def mine(signum, frame):
        pass

    def theirs(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    seen = []
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: seen.append(signal.getsignal(signal.SIGTERM)))
    list(active)
    assert seen and all(h is mine for h in seen) and signal.getsignal(signal.SIGTERM) is mine

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # installed by the user during a run: kept after it
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: r.step == 1 and signal.signal(signal.SIGTERM, theirs))
    list(active)
    assert signal.getsignal(signal.SIGTERM) is theirs


def test_a_run_on_another_thread_installs_no_handler(tmp_path, default_sigterm):
    seen, errors = [], []

    def consume():
        try:
            active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
            active.add_listener(lambda r: seen.append(signal.getsignal(signal.SIGTERM)))
            list(active)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join(10)
    assert not errors and len(seen) == 7 and all(h is signal.SIG_DFL for h in seen)


# --------------------------------------------------------- runs left running, heartbeat, exit hook


def _finished_run(tmp_path, **kw) -> Path:
    return run(spec(**kw), out_dir=tmp_path, backend=InstantBackend()).path


def _rewrite_status(path: Path, **changes) -> None:
    status = status_of(path)
    status.update(changes)
    (path / "status.json").write_text(json.dumps(status))


def test_a_run_left_running_by_a_gone_process_is_interrupted_with_its_steps_from_the_records(tmp_path, capsys):
    path = _finished_run(tmp_path)
    _rewrite_status(path, status="running", complete=False, steps_completed=0, pid=2**22 + 12345)
    loaded = load(path)
    assert loaded.state == "interrupted" and not loaded.complete
    assert loaded.status["steps_completed"] == 7 and loaded.steps_text == "7/7"
    assert loaded.status["interrupted_by"] == "the process running it ended without closing it"
    assert "is gone" in loaded.status["note"] and "ended without closing it" in loaded.status["note"]
    assert json.loads((path / "status.json").read_text())["status"] == "running"  # read so; never rewritten
    assert "state='interrupted', steps=7/7" in repr(loaded) and "interrupted, 7/7 steps" in loaded._repr_html_()
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state interrupted, 7/7 steps" in out
    assert "interrupted by: the process running it ended without closing it" in out
    assert "note: " in out and "is gone" in out and "crashed" not in out


def test_a_running_status_of_this_process_without_its_run_is_left_running(tmp_path):
    path = _finished_run(tmp_path)
    _rewrite_status(path, status="running", complete=False, steps_completed=0, pid=os.getpid())
    loaded = load(path)
    assert loaded.state == "interrupted" and loaded.status["steps_completed"] == 7
    assert "no run of this process writes it" in loaded.status["note"]


def test_a_live_process_counts_as_running_unless_its_pid_was_reused_or_its_status_is_stale(tmp_path):
    path = _finished_run(tmp_path)
    parent = os.getppid()  # alive while this test runs
    started = um_lab.runs.runlog.process_start_ticks(parent)
    _rewrite_status(path, status="running", complete=False, pid=parent, pid_started=started)
    assert load(path).state == "running"
    if started is not None:  # Linux: a pid now naming another process
        _rewrite_status(path, pid_started=started + 1)
        loaded = load(path)
        assert loaded.state == "interrupted" and "another process" in loaded.status["note"]
    # another host (the pid cannot be checked): stale once the heartbeat is long overdue
    _rewrite_status(path, host=socket.gethostname() + "-elsewhere", pid_started=started,
                    updated_at="2000-01-01T00:00:00+00:00")
    loaded = load(path)
    assert loaded.state == "interrupted" and "stale" in loaded.status["note"]
    assert loaded.status["steps_completed"] == 7


def test_status_json_is_a_heartbeat_of_the_step_count(tmp_path, monkeypatch):
    monkeypatch.setattr(um_lab.runs.runlog, "HEARTBEAT_S", 0.0)
    on_disk = []
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: on_disk.append(status_of(active.path)["steps_completed"]))
    list(active)
    assert on_disk == [0, 1, 2, 3, 4, 5, 6]  # written after each step (the callback runs before it)
    assert status_of(active.path)["steps_completed"] == 7


def test_exit_hook_marks_a_left_foreground_iteration_interrupted(tmp_path):
    active = Run(spec(steps=50), out_dir=tmp_path, backend=InstantBackend())
    steps = iter(active)
    for _ in range(3):
        next(steps)
    runexit._at_exit()  # what atexit calls
    status = status_of(active.path)
    assert status["status"] == "interrupted" and status["steps_completed"] == 3 == lines_of(active.path)
    assert status["interrupted_by"] == "interpreter exit"
    steps.close()  # later, nothing more is written: the count still matches the records
    assert status_of(active.path)["status"] == "interrupted" and lines_of(active.path) == 3


def test_a_folder_that_becomes_unwritable_is_reported_and_retried_at_exit(tmp_path, monkeypatch):
    monkeypatch.setattr(um_lab.runs.runlog, "HEARTBEAT_S", 0.0)
    block = []

    def break_status_file(record):
        if record.step == 2:  # status.json cannot be replaced any more (works as root too)
            block.append(active.path / ".status.json.tmp")
            block[0].mkdir()

    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(break_status_file)
    with pytest.warns(RunLogWarning, match="cannot update .*status.json"):
        with pytest.raises(RunDirError, match=r"status\.json.*ended complete after 7 steps"):
            list(active)
    assert isinstance(RunDirError("x"), UmLabError)
    assert status_of(active.path)["status"] == "running"  # the disk lags...
    loaded = load(active.path)  # ...but this process knows the run
    assert loaded.state == "complete" and loaded.status["steps_completed"] == 7 and loaded.complete
    block[0].rmdir()
    runexit._at_exit()  # the retry at exit writes the real end
    assert status_of(active.path)["status"] == "complete" and status_of(active.path)["steps_completed"] == 7


# ------------------------------------------------------------------------------ damaged folders


def test_one_bad_line_in_records_is_skipped_with_one_warning_naming_file_and_line(tmp_path, capsys):
    path = _finished_run(tmp_path)
    lines = (path / "records.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(3, b'{"step": 3, "wall_ms": 1 GARBAGE\n')  # becomes line 4
    lines.insert(6, b"[1, 2]\n")
    lines.insert(7, b"\xff\xfe not utf-8\n")
    (path / "records.jsonl").write_bytes(b"".join(lines))
    loaded = load(path)
    with pytest.warns(RunLogWarning) as caught:
        steps = [r.step for r in loaded.records()]
    assert steps == list(range(7))
    assert len(caught) == 1 and "records.jsonl: line 4 " in str(caught[0].message)
    assert str(path) in str(caught[0].message)
    with pytest.warns(RunLogWarning, match="line 4"):
        assert loaded.summary()["steps"] == 5
    with pytest.warns(RunLogWarning, match="line 4"):
        assert len(loaded.to_frame()) == 7
    with pytest.warns(RunLogWarning, match="line 4"):
        assert main(["show", str(path)]) == 0
    assert "median_ms" in capsys.readouterr().out


def test_a_corrupt_status_json_is_named_and_the_run_stays_readable(tmp_path, capsys):
    path = _finished_run(tmp_path)
    (path / "status.json").write_text('{"status": "comp')
    with pytest.warns(RunLogWarning, match=r"status\.json cannot be read"):
        loaded = load(path)
    assert loaded.state == "unknown" and not loaded.complete and loaded.steps_text == "7/7"
    assert loaded.summary()["steps"] == 5
    with pytest.warns(RunLogWarning, match=str(path / "status.json")):
        assert main(["show", str(path)]) == 0
    assert "state unknown, 7/7 steps" in capsys.readouterr().out


def test_a_corrupt_spec_json_raises_an_error_naming_it(tmp_path):
    path = _finished_run(tmp_path)
    (path / "spec.json").write_text("{not json")
    with pytest.raises(RunLogError, match=r"spec\.json is not a readable run spec") as caught:
        load(path)
    assert isinstance(caught.value, UmLabError) and str(path / "spec.json") in str(caught.value)
    with pytest.raises(NotARunFolderError, match="not a um_lab run folder") as caught:
        load(tmp_path)
    assert isinstance(caught.value, UmLabError) and isinstance(caught.value, FileNotFoundError)


# --------------------------------------------------------------------------------- run names


@pytest.mark.parametrize("name", ["../x", "a/../../x", "sub/x", "..", ".", "", "  ", "x\0y", "ABS", Path("../p")])
def test_a_name_that_would_leave_out_dir_is_refused_before_anything_is_created(tmp_path, name):
    out = tmp_path / "runs"
    if name == "ABS":
        name = str(tmp_path / "elsewhere")
    backend = InstantBackend()
    with pytest.raises(RunNameError, match="plain folder name|must be a string") as caught:
        Run(spec(), out_dir=out, backend=backend, name=name)
    assert isinstance(caught.value, UmLabError) and isinstance(caught.value, ValueError)
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and backend.calls == 0


def test_a_plain_name_is_the_run_folder(tmp_path):
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend(), name="my-run.1")
    assert active.path == tmp_path / "my-run.1" and list(active)


def test_sigterm_landing_in_the_callers_loop_still_ends_the_run_interrupted(tmp_path, default_sigterm):
    """The signal's exception may surface in the caller's loop body, outside the run's generator."""
    active = Run(spec(steps=50), out_dir=tmp_path, backend=InstantBackend())
    with pytest.raises(runexit.RunInterrupted):
        for record in active:
            if record.step == 3:
                runexit._on_sigterm(signal.SIGTERM, None)  # as the handler runs: here, in the loop body
    status = status_of(active.path)
    assert status["status"] == "interrupted" and status["interrupted_by"] == "SIGTERM"
    assert status["steps_completed"] == lines_of(active.path) == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not runexit._signalled
