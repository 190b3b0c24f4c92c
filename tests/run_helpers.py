"""Helpers shared by the runner tests on the sim and cuda backends, and by those that end real processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

from um_lab.runs.runner import Run
from um_lab.runs.runread import LoadedRun, load
from um_lab.types import RunSpec


def stop_in_background(spec: RunSpec, out_dir, *, min_steps: int, timeout_s: float, poll_s: float) -> LoadedRun:
    """Start ``spec`` in the background, stop it once ``min_steps`` steps are done, return it loaded.

    Asserts that the run stopped, is marked stopped and incomplete, and kept every completed step.
    """
    active = Run(spec, out_dir=out_dir).start()
    deadline = time.time() + timeout_s
    while active.steps_completed < min_steps and time.time() < deadline:
        time.sleep(poll_s)
    active.stop()
    assert active.join(timeout=timeout_s)
    loaded = load(active.path)
    assert loaded.state == "stopped" and not loaded.complete
    assert len(list(loaded.records())) == loaded.status["steps_completed"] >= min_steps
    return loaded


REPO = Path(__file__).resolve().parents[1]


def start_script(script: str, *args: str) -> subprocess.Popen:
    """A Python process running ``script`` from the repository, its output piped."""
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int, timeout_s: float = 120) -> Path:
    """The run folder under ``out`` once its records hold ``n`` steps (AssertionError if ``proc`` ends first)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        logs = list(out.glob("*/records.jsonl"))
        if logs and logs[0].read_text().count("\n") >= n:
            return logs[0].parent
        if proc.poll() is not None:
            raise AssertionError(f"the process ended early ({proc.returncode}): {proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"fewer than {n} steps within {timeout_s} s")
