"""Helpers shared by the runner tests on the sim and cuda backends, and by those that end real processes."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from um_lab.backend_base import BackendBase
from um_lab.errors import BudgetTooSmall
from um_lab.models import ModelCase
from um_lab.policy import Policy
from um_lab.runs.runner import Run
from um_lab.runs.runread import LoadedRun, load
from um_lab.types import DATA_TYPES, RunSpec, StepRecord

TINY = {"width": 16, "depth": 1, "batch_size": 4}  #: an MLP that builds and steps at once


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
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                os.environ.get("PYTHONPATH")]))})


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


class InstantBackend(BackendBase):
    """Yields valid records at once (``delay_s`` apart); counts how often it is asked to run."""

    name = "sim"
    simulates_capacity = True

    def __init__(self, delay_s: float = 0.0, budget_error: BudgetTooSmall | None = None) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.budget_error = budget_error

    def preflight(self, spec, case, policy):
        if self.budget_error is not None:
            raise self.budget_error
        return None

    def run(self, spec: RunSpec, case: ModelCase, policy: Policy) -> Iterator[StepRecord]:
        self.calls += 1
        for i in range(spec.warmup_steps + spec.steps):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield StepRecord(step=i, wall_ms=10.0 + i, live_bytes={t.value: 100 for t in DATA_TYPES},
                             cap_bytes=None, gpu_capacity_bytes=1000, backend="sim", policy=policy.name,
                             loss=1.0, warmup=i < spec.warmup_steps, telemetry="fake")


def spec(**kw) -> RunSpec:
    """A five-step simulated run of the tiny MLP, with ``kw`` changed."""
    return RunSpec(**{"model": "mlp", "model_kwargs": TINY, "backend": "sim", "steps": 5, "warmup_steps": 2, **kw})


def status_of(path: Path) -> dict:
    """The run folder's status.json."""
    return json.loads((path / "status.json").read_text())
