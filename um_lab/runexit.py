"""What happens to runs when their process ends: SIGTERM and interpreter exit.

A run's ``status.json`` says ``running`` while steps run. So that it does not stay so when the process
ends early (split from :mod:`um_lab.runner`, which registers its runs here):

- **SIGTERM is handled like SIGINT** while a :class:`~um_lab.runner.Run` steps in the foreground on the
  main thread: :class:`RunInterrupted` (a ``KeyboardInterrupt``) is raised there, and the run ends
  ``interrupted`` with its completed steps, as on Ctrl-C. With only background runs, SIGTERM marks them
  ``interrupted``, then terminates the process as the default action would.
  um_lab installs its handler only from the main thread, only where SIGTERM has its default action
  (never over a handler of yours, nor over ``SIG_IGN``), and puts the default back when its runs end.
- **At interpreter exit** (``atexit``) a run still running (a background run, a foreground iteration
  left unfinished) is marked ``interrupted`` with its real step count; a run whose final status could
  not be written is retried.

A process killed outright (SIGKILL, power loss) writes nothing: :func:`um_lab.runread.load` reads such a
run (``running`` on disk, its process gone) as ``interrupted`` too, with its real step count (counted from
``records.jsonl``), ``interrupted_by`` saying that the process running it ended without closing it, and a
``note`` saying how that was found.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Protocol


class _Run(Protocol):  # what this module needs of um_lab.runner.Run
    path: Path

    def current_status(self) -> dict[str, Any]: ...

    def end_abruptly(self, state: str, reason: str) -> bool: ...


class RunInterrupted(KeyboardInterrupt):
    """A signal other than SIGINT (SIGTERM) interrupted a run stepping on the main thread.

    A ``KeyboardInterrupt``, like SIGINT's, so code that stops on Ctrl-C stops on it too, and
    ``except Exception`` does not swallow it (hence not a ``UmLabError``). ``signum`` is the signal's
    number, ``signal_name`` its name (recorded as the status's ``interrupted_by``).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"run interrupted by {self.signal_name}")


_lock = threading.RLock()
_open: dict[int, _Run] = {}  # id(run) -> run whose final status is not on disk yet
_foreground: set[int] = set()  # ids of runs stepping in the foreground on the main thread
_signalled: dict[int, str] = {}  # run id -> the signal that ended its foreground stepping
_holders = 0  # runs that asked for the SIGTERM handler (it stays installed while > 0)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def opened(run: _Run, *, foreground: bool) -> None:
    """Register ``run`` as running (``foreground``: stepping on the main thread)."""
    with _lock:
        _open[id(run)] = run
        if foreground:
            _foreground.add(id(run))


def closed(run: _Run, *, written: bool) -> None:
    """``run`` stopped stepping; ``written``: its final status is on disk (else retried at exit)."""
    with _lock:
        _foreground.discard(id(run))
        _signalled.pop(id(run), None)
        if written:
            _open.pop(id(run), None)


def own_status(path: Path) -> dict[str, Any] | None:
    """The in-memory status of a run of this process writing ``path``, or None if none is open."""
    target = Path(path).resolve()
    with _lock:
        runs = list(_open.values())
    for run in runs:
        if Path(run.path).resolve() == target:
            return run.current_status()
    return None


def hold_sigterm() -> bool:
    """Install the run SIGTERM handler (main thread only, and only over the default action).

    Returns True when the caller holds it and must call :func:`release_sigterm` once its run ends.
    """
    global _holders
    if not _on_main_thread():
        return False
    with _lock:
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            if current != signal.SIG_DFL:
                return False  # a handler of the user's (or SIG_IGN): left alone
            signal.signal(signal.SIGTERM, _on_sigterm)
        _holders += 1
        return True


def release_sigterm() -> None:
    """Give back a hold from :func:`hold_sigterm`; the default action returns once none is left."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
    restore_if_idle()


def restore_if_idle() -> None:
    """Put SIGTERM's default action back if no run holds um_lab's handler (main thread only; a run
    ending on a background thread leaves that to the next main-thread call, e.g. ``Run.join``)."""
    if not _on_main_thread():
        return
    with _lock:
        if _holders == 0 and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def end_open_runs(state: str, reason: str) -> None:
    """Mark every run still running as ``state`` (with its real step count) and seal its status."""
    with _lock:
        runs = list(_open.values())
    for run in runs:
        try:
            written = run.end_abruptly(state, reason)
        except Exception as e:  # noqa: BLE001  (the process is ending: report, go on with the others)
            written = False
            print(f"um_lab: could not mark run {run.path} {state}: {e}", file=sys.stderr)
        if written:
            with _lock:
                _open.pop(id(run), None)


def signalled(run: _Run) -> str | None:
    """The signal's name if SIGTERM reached the process while ``run`` stepped in the foreground."""
    with _lock:
        return _signalled.get(id(run))


def _on_sigterm(signum: int, frame: object) -> None:
    with _lock:
        foreground = bool(_foreground)
        for rid in _foreground:  # the exception may surface in the caller's loop, closing the run's generator
            _signalled[rid] = signal.Signals(signum).name
    if foreground:
        raise RunInterrupted(signum)  # the foreground run unwinds and writes `interrupted` itself
    end_open_runs("interrupted", signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)  # then terminate, as the default action would have
    os.kill(os.getpid(), signum)


@atexit.register
def _at_exit() -> None:
    end_open_runs("interrupted", "interpreter exit")
