"""Waiting for a background job in a way Ctrl-C (or the notebook's stop button) can interrupt."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_for(ended: threading.Event, timeout: float | None, on_interrupt: Callable[[], None],
             settle_s: float = 0.0) -> bool:
    """Block until ``ended`` is set or ``timeout`` passes; True once it is set.

    Waits on an Event in short slices, not on ``Thread.join``: an interrupted join can leave the thread
    reported as ended. An interrupt calls ``on_interrupt()`` (stop the job), waits up to ``settle_s``
    for the end, and is raised again.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not ended.wait(0.1) and (deadline is None or time.monotonic() < deadline):
            pass
    except KeyboardInterrupt:
        on_interrupt()
        ended.wait(settle_s)
        raise
    return ended.is_set()
