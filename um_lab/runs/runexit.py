"""What happens to runs when their process ends: SIGTERM and interpreter exit.

A run's ``status.json`` says ``running`` while steps run. So that it does not stay so when the process
ends early (split from :mod:`um_lab.runs.runner`, which registers its runs here):

- **SIGTERM and SIGHUP are handled like SIGINT** while a :class:`~um_lab.runs.runner.Run` steps in the
  foreground on the main thread: :class:`RunInterrupted` (a ``KeyboardInterrupt``) is raised there, and
  the run ends ``interrupted`` with its completed steps, as on Ctrl-C. With only background runs, the
  signal marks them ``interrupted``, then terminates the process as the default action would.
  um_lab installs its handler only from the main thread, only where the signal has its default action
  (never over a handler of yours, nor over ``SIG_IGN``, e.g. under ``nohup``), and puts the default back
  when its runs end.
- **Repeated signals** (Ctrl-C pressed three times) cannot cut a run's final status short: while it is
  written on the main thread (:func:`held_signals`), SIGINT, SIGTERM and SIGHUP wait, and are delivered
  after it (one that only repeats the interrupt already ending the run is dropped). Once an interrupt has
  ended a foreground run, further SIGINTs within :data:`REPEAT_WINDOW_S` are taken as repeats of it and
  dropped (:func:`absorb_repeats`), so that they do not land in Python's own exit.
- **At interpreter exit** (``atexit``) a run still running (a background run, a foreground iteration
  left unfinished) is marked ``interrupted`` with its real step count; a run whose final status could
  not be written is retried. Signals wait meanwhile. A background run's thread is then asked to stop and
  waited for (at most :data:`EXIT_WAIT_S`): a thread still inside torch when the interpreter finalises
  would abort the process (``terminate called without an active exception``).

A process killed outright (SIGKILL, power loss) writes nothing: :func:`um_lab.runs.runread.load` reads such a
run (``running`` on disk, its process gone) as ``interrupted`` too, with its real step count (counted from
``records.jsonl``), ``interrupted_by`` saying that the process running it ended without closing it, and a
``note`` saying how that was found.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol


class _Run(Protocol):  # what this module needs of um_lab.runs.runner.Run
    path: Path

    def current_status(self) -> dict[str, Any]: ...

    def end_abruptly(self, state: str, reason: str) -> bool: ...

    def stop(self) -> None: ...


#: Signals handled like SIGINT while a run steps in the foreground (where the platform has them).
HANDLED_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
#: Signals held while a final status is written (:func:`held_signals`).
HELD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, *HANDLED_SIGNALS)
#: How long interpreter exit waits for background runs' threads to end their step in progress.
EXIT_WAIT_S = 60.0
#: After an interrupt ends a foreground run, SIGINTs for this long only repeat it (:func:`absorb_repeats`).
REPEAT_WINDOW_S = 1.0


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
_threads: dict[int, tuple[_Run, threading.Thread]] = {}  # background runs' threads, waited for at exit
_quiet_until = 0.0  # SIGINTs before this (time.monotonic) repeat the interrupt that ended a run


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def opened(run: _Run, *, foreground: bool) -> None:
    """Register ``run`` as running (``foreground``: stepping on the main thread)."""
    with _lock:
        _open[id(run)] = run
        if foreground:
            _foreground.add(id(run))


def started(run: _Run, thread: threading.Thread) -> None:
    """Register the thread running ``run`` in the background (stopped and waited for at exit)."""
    with _lock:
        for key in [k for k, (_, t) in _threads.items() if not t.is_alive() and t.ident is not None]:
            del _threads[key]
        _threads[id(run)] = (run, thread)


def closed(run: _Run, *, written: bool) -> None:
    """``run`` stopped stepping; ``written``: its final status is on disk (else retried at exit)."""
    with _lock:
        _foreground.discard(id(run))
        _signalled.pop(id(run), None)
        if written:
            _open.pop(id(run), None)


def stop_open_runs(under: Path) -> int:
    """Ask every run of this process whose folder lies under ``under`` to stop after its step in progress
    (a comparison's Stop); returns how many were asked."""
    target = Path(under).resolve()
    with _lock:
        runs = [run for run in _open.values() if target in Path(run.path).resolve().parents]
    for run in runs:
        run.stop()
    return len(runs)


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
    """Install the run handler of SIGTERM and SIGHUP (:data:`HANDLED_SIGNALS`; main thread only, and only
    over a signal's default action).

    Returns True when the caller holds it and must call :func:`release_sigterm` once its run ends.
    """
    global _holders
    if not _on_main_thread():
        return False
    _restore_sigint()
    with _lock:
        held = False
        for signum in HANDLED_SIGNALS:
            current = signal.getsignal(signum)
            if current is _on_sigterm:
                held = True
            elif current == signal.SIG_DFL:
                signal.signal(signum, _on_sigterm)
                held = True
            # else: a handler of the user's (or SIG_IGN, e.g. nohup): left alone
        if held:
            _holders += 1
        return held


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
        if _holders == 0:
            for signum in HANDLED_SIGNALS:
                if signal.getsignal(signum) is _on_sigterm:
                    signal.signal(signum, signal.SIG_DFL)


@contextlib.contextmanager
def held_signals(in_flight: BaseException | None = None) -> Iterator[list[int]]:
    """Hold SIGINT, SIGTERM and SIGHUP while a final status is written (main thread only; elsewhere
    nothing is held). Yields the list of signals that came meanwhile; on leaving, the handlers are put back
    and those signals delivered, but for one that repeats ``in_flight`` (an interrupt already ending the
    run: SIGINT, or a signal um_lab handles like it). Signals that come while they are put back are the
    caller's as usual."""
    pending: list[int] = []
    if not _on_main_thread():
        yield pending
        return
    previous: dict[signal.Signals, Any] = {}

    def hold(signum: int, frame: object) -> None:
        pending.append(signum)

    try:
        for held in HELD_SIGNALS:
            current = signal.getsignal(held)
            if current is None:  # a handler not installed from Python: left alone
                continue
            previous[held] = current
            signal.signal(held, hold)
        yield pending
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for came in dict.fromkeys(pending):
            handler = previous.get(signal.Signals(came))
            if isinstance(in_flight, KeyboardInterrupt) and (
                    handler in (signal.default_int_handler, _on_repeated_sigint, _on_sigterm)):
                continue  # the run is already ending on an interrupt: a second one only repeats it
            if handler not in (signal.SIG_IGN, None):
                signal.raise_signal(came)


def absorb_repeats() -> None:
    """An interrupt just ended a foreground run: for :data:`REPEAT_WINDOW_S`, a SIGINT is a repeat of it and
    dropped (main thread, and only over Python's default SIGINT handler). After the window SIGINT raises
    ``KeyboardInterrupt`` as before, and the default handler is put back by the next run, a SIGINT, or
    interpreter exit."""
    global _quiet_until
    if not _on_main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if current is not signal.default_int_handler and current is not _on_repeated_sigint:
        return  # a handler of the user's (a notebook kernel's): left alone
    _quiet_until = time.monotonic() + REPEAT_WINDOW_S
    signal.signal(signal.SIGINT, _on_repeated_sigint)


def _on_repeated_sigint(signum: int, frame: object) -> None:
    if time.monotonic() < _quiet_until:
        return  # a repeat of the Ctrl-C that ended the run
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise KeyboardInterrupt


def _restore_sigint() -> None:
    if _on_main_thread() and signal.getsignal(signal.SIGINT) is _on_repeated_sigint \
            and time.monotonic() >= _quiet_until:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _stop_threads(deadline: float, pending: list[int]) -> None:
    """Ask background runs' threads to stop and wait for them until ``deadline`` (or a signal comes)."""
    with _lock:
        running = [(run, thread) for run, thread in _threads.values() if thread.is_alive()]
        _threads.clear()
    for run, _ in running:
        run.stop()
    told = False
    for run, thread in running:
        while thread.is_alive() and not pending and time.monotonic() < deadline:
            thread.join(0.1)
            if thread.is_alive() and not told and time.monotonic() > deadline - EXIT_WAIT_S + 2.0:
                told = True
                print(f"um_lab: waiting for run {run.path} to end its step in progress before Python exits "
                      f"(marked interrupted; at most {deadline - time.monotonic():.0f} s more, Ctrl-C to stop "
                      "waiting)", file=sys.stderr)


@atexit.register
def _at_exit() -> None:
    with held_signals() as pending:  # a Ctrl-C now must not cut the statuses short (dropped: Python is exiting)
        try:
            end_open_runs("interrupted", "interpreter exit")
            _stop_threads(time.monotonic() + EXIT_WAIT_S, pending)
        finally:
            pending.clear()  # nothing is delivered at exit
