"""The Jupyter server behind ``um-lab lab``: its command line, its environment (where notebook runs go),
and running it so that stopping ``um-lab lab`` stops the server and its kernels."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

LAB_STOP_GRACE_S = 10.0  #: seconds Jupyter gets to shut down (kernels included) before it is killed


def default_notebooks_dir() -> Path:
    """``notebooks/`` beside the um_lab package (a source checkout), else under the current folder."""
    import um_lab

    beside = Path(um_lab.__file__).resolve().parent.parent / "notebooks"
    return beside if beside.is_dir() else Path.cwd() / "notebooks"


def lab_command(notebooks: Path, port: int | None = None, no_browser: bool = False,
                extra: Sequence[str] = ()) -> list[str]:
    """The JupyterLab command line: bound to 127.0.0.1, Jupyter's token authentication left on;
    ``extra`` arguments come last, as given (so they can override ours)."""
    cmd = [sys.executable, "-m", "jupyterlab", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.root_dir={notebooks}"]
    if port is not None:
        cmd.append(f"--ServerApp.port={port}")
    if no_browser:
        cmd.append("--no-browser")
    return [*cmd, *extra]


def lab_environment(start_dir: Path | None = None) -> tuple[dict[str, str], Path]:
    """The Jupyter server's environment and where its notebooks' runs go: ``UM_LAB_RUNS_DIR`` as set,
    else ``runs``; made absolute against ``start_dir`` (default: the current folder), since the kernels
    run in the notebook folder."""
    from um_lab.runlog import RUNS_DIR_ENV

    env = dict(os.environ)
    runs = ((start_dir or Path.cwd()) / Path(env.get(RUNS_DIR_ENV, "").strip() or "runs").expanduser()).resolve()
    env[RUNS_DIR_ENV] = str(runs)
    return env, runs


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the server leads its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def serve_lab(cmd: Sequence[str], env: Mapping[str, str], grace_s: float | None = None) -> int:
    """Run the Jupyter server in its own session and wait for it; returns its exit status.

    SIGINT, SIGTERM or SIGHUP to this process sends SIGTERM to the server's process group (Jupyter
    shuts its kernels down); after ``grace_s`` seconds (default :data:`LAB_STOP_GRACE_S`), or at a
    second signal, the group is killed. Then returns 128 + the signal's number (130 for Ctrl-C).
    """
    grace = LAB_STOP_GRACE_S if grace_s is None else grace_s
    received: list[int] = []
    deadline: list[float] = []
    proc: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        if proc is None:
            return  # Popen has not returned yet; handled right after it does
        if len(received) == 1:
            deadline.append(time.monotonic() + grace)
            signal_group(proc, signal.SIGTERM)
        else:
            signal_group(proc, signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
        if received:
            deadline.append(time.monotonic() + grace)
            signal_group(proc, signal.SIGTERM)
        while True:
            try:
                status = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    print(f"JupyterLab did not stop within {grace:g} s: killing it", flush=True)
                    deadline.clear()
                    signal_group(proc, signal.SIGKILL)
        if received:
            signal_group(proc, signal.SIGKILL)  # anything of the server's group still left
            return 128 + received[0]
        return status
    finally:
        if proc is not None and proc.poll() is None:  # an unexpected error while waiting
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
