"""Runs given bad input or hit by faults: each case is refused with a typed error naming the input before
anything is written, or ends with an honest status and nothing left half-written.

Covered: iterating a started run, a custom policy under a preset's name, run folders whose status cannot be
checked (another host, no start time), records lost after a run, a full disk, ratios and capacities no GPU
has, a model knob its library refuses, repeated signals, SIGHUP, Python exiting mid-trace, reads of files
that are not regular or too large or nested too deep, run names that do not read as what they are, and a
too-small budget quoted as given.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from run_helpers import TINY, InstantBackend, spec, start_script, status_of, wait_for_steps

import um_lab.runs.runlog
import um_lab.runs.runner
from um_lab import models
from um_lab.app.cli import main
from um_lab.errors import BudgetTooSmall, FileReadError, ModelConfigError, SpecError, UmLabError
from um_lab.files import POLICY_LIMIT, RECORD_LINE_LIMIT
from um_lab.models import ModelCase
from um_lab.policy import Advice, Policy, PolicyError, PolicyFileError, check_preset_name, presets
from um_lab.runs import runexit
from um_lab.runs.runlog import RunDirError, RunNameError, list_runs
from um_lab.runs.runner import Run, RunStateError, run
from um_lab.runs.runread import NOT_CHECKABLE, RunLogError, RunLogWarning, load
from um_lab.runs.sweep import compare
from um_lab.schedule.live.stage import StaleSavedTensor
from um_lab.sizing import size_for_ratio
from um_lab.types import RunSpec

REPO = Path(__file__).resolve().parent.parent
SIM_MLP = {"width": 256, "depth": 2, "batch_size": 64}


def lines_of(path: Path) -> int:
    return (path / "records.jsonl").read_text().count("\n")


def finished_run(tmp_path: Path, **kw) -> Path:
    return run(spec(**kw), out_dir=tmp_path, backend=InstantBackend()).path


def rewrite_status(path: Path, **changes) -> None:
    status = status_of(path)
    status.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del status[key]
    (path / "status.json").write_text(json.dumps(status))


SIM_FOREGROUND = ("import sys\n"
                  "from um_lab.runs.runner import Run\n"
                  "from um_lab.types import RunSpec\n"
                  f"r = Run(RunSpec(model='mlp', model_kwargs={SIM_MLP!r}, backend='sim', steps=10**8,"
                  " oversubscription_ratio=1.5), out_dir=sys.argv[1])\n"
                  "for _ in r: pass\n")


# ------------------------------------------------------------------- a started run runs once


def test_iterating_a_started_run_is_refused_and_it_runs_once(tmp_path):
    backend = InstantBackend(delay_s=0.002)
    active = Run(spec(steps=200), out_dir=tmp_path, backend=backend).start()
    with pytest.raises(RunStateError, match="runs once.*started in the background"):
        for _ in active:
            pass
    assert active.join(timeout=30)
    assert backend.calls == 1 and lines_of(active.path) == 202 == status_of(active.path)["steps_completed"]
    assert status_of(active.path)["status"] == "complete" and isinstance(RunStateError("x"), UmLabError)


def test_a_run_being_iterated_cannot_be_started_or_iterated_again(tmp_path):
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    steps = iter(active)
    with pytest.raises(RunStateError, match="iterated already"):
        active.start()
    with pytest.raises(RunStateError):
        iter(active)
    assert len(list(steps)) == 7 and lines_of(active.path) == 7


# ------------------------------------------------------------ a custom policy under a preset's name


def test_run_refuses_a_custom_policy_under_a_presets_name_before_any_folder(tmp_path):
    posing = Policy("gpu-first", {"param": Advice(preferred_location="cpu")})
    with pytest.raises(PolicyError, match="'gpu-first' reuses the name of a preset") as caught:
        run(spec(), policy=posing, out_dir=tmp_path, backend=InstantBackend())
    assert caught.value.field == "name" and list(tmp_path.iterdir()) == []
    with pytest.raises(PolicyError, match="reuses the name of a preset"):  # the same rule as compare()
        compare(["mlp"], [posing], model_kwargs=TINY, backend="sim", backend_instance=InstantBackend(),
                steps=1, out_dir=tmp_path)
    # the preset itself, or a copy with its advice, is the preset
    same = Policy("gpu-first", dict(presets["gpu-first"].advice), "my words")
    assert check_preset_name(same) is same
    assert run(spec(), policy=same, out_dir=tmp_path, backend=InstantBackend()).spec.policy == "gpu-first"
    renamed = posing.replace(name="my-gpu-first")
    assert run(spec(), policy=renamed, out_dir=tmp_path, backend=InstantBackend()).policy == renamed


# ------------------------------------------------------ a running status that cannot be checked


def test_a_run_copied_from_another_host_reads_as_interrupted_with_its_real_count(tmp_path, capsys):
    path = finished_run(tmp_path)
    rewrite_status(path, status="running", complete=False, steps_completed=0,
                   host=socket.gethostname() + "-elsewhere", updated_at=um_lab.runs.runlog.now_iso())
    loaded = load(path)
    assert loaded.state == "interrupted" and not loaded.complete and loaded.steps_text == "7/7"
    assert loaded.status["interrupted_by"] == NOT_CHECKABLE
    assert "-elsewhere" in loaded.status["note"] and "cannot be checked" in loaded.status["note"]
    assert main(["show", str(path)]) == 0
    assert "state interrupted, 7/7 steps" in capsys.readouterr().out


def test_a_live_pid_without_its_start_time_is_not_read_as_running(tmp_path):
    path = finished_run(tmp_path)
    if um_lab.runs.runlog.process_start_ticks(os.getpid()) is None:
        pytest.skip("this platform does not tell when a process started")
    rewrite_status(path, status="running", complete=False, steps_completed=0, pid=os.getppid(), pid_started=None)
    loaded = load(path)
    assert loaded.state == "interrupted" and loaded.status["steps_completed"] == 7
    assert loaded.status["interrupted_by"] == NOT_CHECKABLE and "start" in loaded.status["note"]


def test_a_live_run_of_another_process_counts_the_steps_in_its_records(tmp_path):
    path = finished_run(tmp_path)
    parent = os.getppid()
    rewrite_status(path, status="running", complete=False, steps_completed=0, pid=parent,
                   pid_started=um_lab.runs.runlog.process_start_ticks(parent))
    loaded = load(path)
    assert loaded.state == "running" and loaded.steps_text == "7/7"  # not 0/7: the heartbeat lags


# ------------------------------------------------------------------ records lost after the run


def test_a_finished_run_that_lost_its_last_record_says_so(tmp_path, capsys):
    path = finished_run(tmp_path)
    lines = (path / "records.jsonl").read_bytes().splitlines(keepends=True)
    (path / "records.jsonl").write_bytes(b"".join(lines[:-1]))
    with pytest.warns(RunLogWarning, match=r"records\.jsonl holds 6 of the 7 steps .*missing: step 6\)"):
        loaded = load(path)
    assert loaded.steps_text == "6/7" and not loaded.complete and loaded.status["steps_in_status"] == 7
    assert loaded.summary()["steps"] == 4 and "missing: step 6" in loaded.status["note"]
    with pytest.warns(RunLogWarning):
        assert main(["show", str(path)]) == 0
    assert "6/7 steps" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["emptied", "removed"])
def test_a_finished_run_that_lost_all_its_records_says_so(tmp_path, damage):
    path = finished_run(tmp_path)
    if damage == "emptied":
        (path / "records.jsonl").write_bytes(b"")
    else:
        (path / "records.jsonl").unlink()
    with pytest.warns(RunLogWarning, match=r"records\.jsonl holds none of the 7 steps.*missing: steps 0-6"):
        loaded = load(path)
    assert loaded.steps_text == "0/7" and not loaded.complete and loaded.summary()["steps"] == 0


# --------------------------------------------------------------------------------- a full disk


class _FullDisk:
    """Writes that need new room fail with ENOSPC once ``full`` is set (in-place rewrites still work,
    unless ``in_place`` is False)."""

    def __init__(self, monkeypatch, in_place: bool = True) -> None:
        self.full = False
        real_write_file, real_rewrite = um_lab.runs.runlog._write_file, um_lab.runs.runlog._rewrite_in_place
        disk = self

        def write_file(path, data):
            if disk.full:
                with open(path, "wb") as f:  # the temporary file is created, then the write fails
                    f.write(data[:10])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_write_file(path, data)

        def rewrite(path, data):
            if disk.full and not in_place:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_rewrite(path, data)

        class Log:
            def __init__(self, f):
                self.f = f

            def write(self, text):
                if disk.full:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return self.f.write(text)

            def flush(self):
                self.f.flush()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        real_open_log = Run._open_log
        monkeypatch.setattr(um_lab.runs.runlog, "_write_file", write_file)
        monkeypatch.setattr(um_lab.runs.runlog, "_rewrite_in_place", rewrite)
        monkeypatch.setattr(Run, "_open_log", lambda run: Log(real_open_log(run)))


def test_a_full_disk_ends_the_run_failed_in_its_status_and_leaves_no_temp_file(tmp_path, monkeypatch):
    disk = _FullDisk(monkeypatch)
    active = Run(spec(steps=20), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: r.step == 3 and setattr(disk, "full", True))
    with pytest.raises(RunDirError, match=r"records\.jsonl \(No space left on device\); the 4 steps before this "
                                          r"one are in it"):
        list(active)
    status = status_of(active.path)
    assert status["status"] == "failed" and status["steps_completed"] == 4 == lines_of(active.path)
    assert "No space left on device" in status["error"] and "records.jsonl" in status["error"]
    assert [p.name for p in active.path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_status_that_cannot_be_written_at_all_leaves_no_temp_file(tmp_path, monkeypatch):
    disk = _FullDisk(monkeypatch, in_place=False)
    active = Run(spec(steps=20), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: r.step == 3 and setattr(disk, "full", True))
    with pytest.warns(RunLogWarning, match=r"cannot write .*status\.json.*ended failed after 4 steps, all in "
                                           r"records\.jsonl"):
        with pytest.raises(RunDirError, match="No space left"):
            list(active)
    assert [p.name for p in active.path.iterdir() if p.name.endswith(".tmp")] == []
    assert load(active.path).state == "failed"  # this process knows the run meanwhile
    monkeypatch.undo()  # room again: the retry at exit writes the real end
    runexit._at_exit()
    assert status_of(active.path)["status"] == "failed" and status_of(active.path)["steps_completed"] == 4


# ---------------------------------------------------------------- ratios and capacities refused


@pytest.mark.parametrize("ratio", [1e-320, 1e-300, 1e-4])
def test_a_ratio_no_gpu_has_is_refused_before_any_folder(tmp_path, ratio):
    with pytest.raises(SpecError, match=f"oversubscription_ratio={ratio!r} is below 0.001") as caught:
        Run(RunSpec(model="mlp", model_kwargs=TINY, backend="sim", oversubscription_ratio=ratio), out_dir=tmp_path)
    assert caught.value.field == "oversubscription_ratio" and list(tmp_path.iterdir()) == []
    with pytest.raises(SpecError, match="ratio"):
        size_for_ratio("mlp", 2**30, ratio, width=64, depth=1)


def test_a_capacity_below_one_chunk_names_the_capacity_not_a_ratio():
    with pytest.raises(SpecError) as caught:
        RunSpec(capacity_bytes=1)
    assert caught.value.field == "capacity_bytes" and "capacity_bytes=1 B is below one 2 MiB chunk" in str(caught.value)
    assert "ratio" not in str(caught.value)
    with pytest.raises(SpecError, match=r"above 1125899906842624 B \(1 PiB\)"):
        RunSpec(capacity_bytes=1e30)
    assert RunSpec(capacity_bytes=2 << 20).capacity_bytes == 2 << 20


def test_a_capacity_with_a_ratio_is_refused_up_front_and_an_old_folder_still_reads(tmp_path):
    with pytest.raises(SpecError, match=r"capacity_bytes or oversubscription_ratio, not both: "
                                        r"capacity_bytes=8589934592 \(8.00 GiB\).*oversubscription_ratio=1.5"):
        RunSpec(model="mlp", backend="sim", capacity_bytes=8 * 2**30, oversubscription_ratio=1.5)
    path = finished_run(tmp_path)  # a folder written before the rule reads back as written
    recorded = json.loads((path / "spec.json").read_text()) | {"capacity_bytes": 1000, "oversubscription_ratio": 1.5}
    (path / "spec.json").write_text(json.dumps(recorded))
    assert load(path).spec.capacity_bytes == 1000 and load(path).spec.oversubscription_ratio == 1.5


# --------------------------------------------------------- a knob the model library refuses


def test_a_knob_the_library_refuses_fails_before_any_folder(tmp_path, monkeypatch):
    def broken(width: int = 8) -> ModelCase:
        def build():
            raise KeyError("bogus")  # as a library's table lookup of a knob's value fails

        return ModelCase("broken", build, lambda g: (), lambda m: m)

    monkeypatch.setitem(models.ZOO, "broken", broken)
    with pytest.raises(ModelConfigError, match=r"model 'broken'.*width=3.*KeyError: 'bogus'"):
        Run(RunSpec(model="broken", model_kwargs={"width": 3}, backend="sim"), out_dir=tmp_path,
            backend=InstantBackend())
    assert list(tmp_path.iterdir()) == []


def test_gpt2_with_a_bogus_activation_fails_before_any_folder(tmp_path):
    pytest.importorskip("transformers")
    knobs = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "activation_function": "bogus"}
    with pytest.raises(ModelConfigError, match="bogus"):
        Run(RunSpec(model="gpt2-small", model_kwargs=knobs, batch_size=1, backend="sim"), out_dir=tmp_path,
            backend=InstantBackend())
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_that_cannot_be_written_whole_is_removed(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(um_lab.runs.runner, "environment_info", fail)
    with pytest.raises(RunDirError, match="No space left on device.*the folder was removed"):
        Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- signals


@pytest.fixture
def default_signals():
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in runexit.HANDLED_SIGNALS}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_signals_wait_while_a_final_status_is_written():
    reached = False
    with pytest.raises(KeyboardInterrupt):  # delivered afterwards...
        with runexit.held_signals() as pending:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert pending == [signal.SIGINT]
            reached = True  # ...not here
    assert reached
    with runexit.held_signals(KeyboardInterrupt()):  # a repeat of the interrupt in flight is dropped
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_three_sigints_end_the_run_interrupted_without_a_traceback_at_exit(tmp_path):
    for attempt in range(2):
        out = tmp_path / str(attempt)
        proc = start_script(SIM_FOREGROUND, str(out))
        try:
            path = wait_for_steps(out, proc, 20)
            for _ in range(3):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.02)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert "atexit" not in err and "Exception ignored" not in err, err
        status = status_of(path)
        assert status["status"] == "interrupted", (status, err)
        assert status["steps_completed"] == lines_of(path) >= 20
        assert not list(path.glob(".*.tmp"))


def test_sighup_is_handled_like_sigterm_in_the_foreground(tmp_path, default_signals):
    seen = []
    active = Run(spec(), out_dir=tmp_path, backend=InstantBackend())
    active.add_listener(lambda r: seen.append(signal.getsignal(signal.SIGHUP)))
    list(active)
    assert seen and all(h is runexit._on_sigterm for h in seen)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL

    proc = start_script(SIM_FOREGROUND, str(tmp_path / "hup"))
    try:
        path = wait_for_steps(tmp_path / "hup", proc, 20)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "RunInterrupted: run interrupted by SIGHUP" in err, err
    status = status_of(path)
    assert status["status"] == "interrupted" and status["interrupted_by"] == "SIGHUP"
    assert status["steps_completed"] == lines_of(path) >= 20


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed exception: the point
def test_a_signal_whose_exception_a_finalizer_swallowed_still_interrupts_the_run(tmp_path, default_signals):
    """A SIGTERM or SIGHUP that lands while Python runs a finalizer (a tensor's weak-reference callback) raises
    RunInterrupted there, and Python ignores it; the run must still stop at the next step, interrupted by it."""

    class Finalizer:
        def __del__(self):
            runexit._on_sigterm(signal.SIGHUP, None)  # the handler, run where the signal happened to land

    active = Run(spec(steps=50), out_dir=tmp_path, backend=InstantBackend())
    steps = []
    with pytest.raises(runexit.RunInterrupted, match="SIGHUP"):
        for record in active:
            steps.append(record.step)
            if record.step == 3:
                Finalizer()  # dies at once: its exception is printed as ignored, not raised here
    assert steps == [0, 1, 2, 3]
    status = status_of(active.path)
    assert status["status"] == "interrupted" and status["interrupted_by"] == "SIGHUP"
    assert status["steps_completed"] == lines_of(active.path) == 5  # the step in flight was recorded


def test_python_exiting_while_a_started_run_traces_exits_cleanly(tmp_path):
    script = ("import sys\n"
              "from um_lab.runs.runner import Run\n"
              "from um_lab.types import RunSpec\n"
              f"Run(RunSpec(model='mlp', model_kwargs={SIM_MLP!r}, backend='sim', steps=10**6,"
              " oversubscription_ratio=1.5), out_dir=sys.argv[1]).start()\n")
    for attempt in range(4):
        out = tmp_path / str(attempt)
        proc = start_script(script, str(out))
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "terminate called" not in err, (proc.returncode, err)
        (path,) = list_runs(out)
        status = status_of(path)
        assert status["status"] == "interrupted" and status["interrupted_by"] == "interpreter exit"
        assert status["steps_completed"] == lines_of(path)


# ------------------------------------------------------------------------------ reading files


def no_special_file_opened(monkeypatch):
    """Fail (instead of reading /dev/zero until memory runs out, or waiting on a FIFO) when anything opens a
    file that is neither a regular file nor a directory."""
    import builtins
    import io
    import stat

    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if isinstance(file, str | bytes | os.PathLike):
            try:
                mode = os.stat(file).st_mode
            except OSError:
                mode = None
            if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                raise AssertionError(f"opened {file!r}, which is not a regular file")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)


def test_a_policy_path_that_is_not_a_regular_file_says_what_it_is(tmp_path, monkeypatch):
    no_special_file_opened(monkeypatch)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, words in [("/dev/zero", "is a device"), ("/dev/null", "is a device"), (tmp_path, "is a directory"),
                        (fifo, "is a FIFO"), (tmp_path / "none.json", "not found")]:
        with pytest.raises(PolicyFileError, match=words) as caught:
            Policy.load(path)
        assert isinstance(caught.value, PolicyError) and isinstance(caught.value, FileReadError)
        assert str(path) in str(caught.value) and caught.value.field == "policy"


def test_a_policy_file_too_large_or_not_utf8_is_refused(tmp_path):
    big = tmp_path / "big.json"
    policy = presets["gpu-first"].to_dict() | {"name": "big", "description": "x" * (POLICY_LIMIT + 1)}
    big.write_text(json.dumps(policy))
    with pytest.raises(PolicyFileError, match=r"big\.json' is [\d,]+ bytes, more than the 262,144 a policy may be"):
        Policy.load(big)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(PolicyFileError, match="is not UTF-8"):
        Policy.load(latin)
    with pytest.raises(PolicyError, match="description: is 300,000 characters"):  # nor built in memory
        Policy("big", {}, "x" * 300_000)


def test_deeply_nested_json_is_a_typed_error_everywhere(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    nested = tmp_path / "deep.json"
    nested.write_text(deep)
    with pytest.raises(PolicyFileError, match="nested deeper"):
        Policy.load(nested)
    with pytest.raises(PolicyError, match="nested deeper"):
        Policy.from_json(deep)

    path = finished_run(tmp_path / "runs")
    spec_json = (path / "spec.json").read_text()
    (path / "spec.json").write_text(deep)
    with pytest.raises(RunLogError, match=r"spec\.json.*nested deeper"):
        load(path)
    (path / "spec.json").write_text(spec_json)
    status_json = (path / "status.json").read_text()
    (path / "status.json").write_text(deep)
    with pytest.warns(RunLogWarning, match=r"status\.json cannot be read.*nested deeper"):
        assert load(path).state == "unknown"
    (path / "status.json").write_text(status_json)
    with open(path / "records.jsonl", "a") as f:
        f.write(deep + "\n")
    with pytest.warns(RunLogWarning, match="line 8 is not a step record.*nested too deep"):
        assert len(list(load(path).records())) == 7


@pytest.mark.timeout(60)
def test_records_that_are_not_a_regular_file_are_refused_without_reading(tmp_path, capsys, monkeypatch):
    path = finished_run(tmp_path)
    no_special_file_opened(monkeypatch)
    (path / "records.jsonl").unlink()
    (path / "records.jsonl").symlink_to("/dev/zero")
    with pytest.raises(RunLogError, match=r"records\.jsonl' is a device"):
        list(load(path).records())

    (path / "records.jsonl").unlink()
    os.mkfifo(path / "records.jsonl")
    # were the FIFO opened for reading, this writer would unblock it (the assertions below fail, not hang)
    fifo = path / "records.jsonl"

    def unblock():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nothing to unblock
            pass

    timer = threading.Timer(10, unblock)
    timer.start()
    try:
        started = time.monotonic()
        assert main(["show", str(path)]) == 2
        assert time.monotonic() - started < 8
    finally:
        timer.cancel()
    err = capsys.readouterr().err
    assert "records.jsonl' is a FIFO (named pipe), not a regular file" in err and "Traceback" not in err


def test_an_overlong_record_line_is_skipped_and_the_rest_kept(tmp_path):
    path = finished_run(tmp_path)
    lines = (path / "records.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(2, b'{"step": 99, "pad": "' + b"x" * (RECORD_LINE_LIMIT * 2) + b'"}\n')
    (path / "records.jsonl").write_bytes(b"".join(lines))
    with pytest.warns(RunLogWarning, match=r"line 3 is not a step record .*longer than 1,048,576 bytes"):
        assert [r.step for r in load(path).records()] == list(range(7))


# --------------------------------------------------------------------------------- run names


@pytest.mark.parametrize("name, words", [
    ("a\nb", r"a control character at position 1 \(U\+000A\)"),
    ("report\u202egpj.exe", r"a format \(bidi or invisible\) character at position 6 \(U\+202E RIGHT-TO-LEFT OVERRIDE"),
    ("x\ud800y", r"a lone surrogate at position 1 \(U\+D800\)"),
    ("zero\u200bwidth", r"U\+200B ZERO WIDTH SPACE"),
])
def test_a_run_name_with_control_bidi_or_surrogate_characters_is_refused(tmp_path, name, words):
    with pytest.raises(RunNameError, match=words) as caught:
        Run(spec(), out_dir=tmp_path, backend=InstantBackend(), name=name)
    assert str(caught.value).isascii() and list(tmp_path.iterdir()) == []


def test_a_too_long_run_name_names_the_run_name_not_out_dir(tmp_path):
    with pytest.raises(RunNameError, match=r"run name 'xxxx.*is 300 characters \(300 bytes\), more than the 255") \
            as caught:
        Run(spec(), out_dir=tmp_path, backend=InstantBackend(), name="x" * 300)
    assert "out_dir" not in str(caught.value) and list(tmp_path.iterdir()) == []
    assert Run(spec(), out_dir=tmp_path, backend=InstantBackend(), name="é" * 127).path.name == "é" * 127


# -------------------------------------------------------------------------------- budgets


def test_a_budget_too_small_is_quoted_as_given(tmp_path):
    usable = 130_793_984  # what the scheduler plans with, once its resident pools are set aside
    backend = InstantBackend(budget_error=BudgetTooSmall(usable, 274_726_912, "optimizer of layer 0"))
    with pytest.raises(BudgetTooSmall) as caught:
        Run(spec(policy="layer-ahead-staged", budget=700_000_000), out_dir=tmp_path, backend=backend)
    assert caught.value.budget == 700_000_000 and caught.value.needed == 274_726_912 + 700_000_000 - usable
    text = str(caught.value)
    assert text.startswith("the GPU budget of 700000000 B (0.65 GiB) cannot hold optimizer of layer 0 next to")
    assert "leaving 130793984 B" in text and list(tmp_path.iterdir()) == []


def test_a_budget_too_small_on_the_simulator_is_quoted_as_given(tmp_path):
    with pytest.raises(BudgetTooSmall, match=r"^the GPU budget of 200000000 B \(0.19 GiB\) cannot hold"):
        Run(RunSpec(model="mlp", policy="layer-ahead", backend="sim", budget=200_000_000, steps=2),
            out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ typed errors


def test_stale_saved_tensor_is_a_um_lab_error():
    assert issubclass(StaleSavedTensor, UmLabError) and issubclass(StaleSavedTensor, RuntimeError)


def test_policy_file_errors_survive_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PolicyFileError("/x.json", "is a directory, not a regular file")))
    assert isinstance(error, PolicyError) and str(error) == "policy file '/x.json' is a directory, not a regular file"


def test_run_refuses_a_batch_size_that_disagrees_with_the_model_knob_before_any_folder(tmp_path):
    from um_lab import run as run_api
    from um_lab.errors import ModelConfigError

    spec = RunSpec(model="mlp", model_kwargs={"width": 16, "depth": 1, "batch_size": 8}, batch_size=4,
                   backend="sim", steps=1, warmup_steps=0)
    with pytest.raises(ModelConfigError, match="batch_size=4 and model_kwargs batch_size=8"):
        run_api(spec, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
