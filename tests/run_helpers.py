"""Helpers shared by the runner tests on the sim and cuda backends."""

import time

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
