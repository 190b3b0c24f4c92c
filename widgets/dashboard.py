"""The live dashboard: a plotly ``FigureWidget`` fed by a run's record stream, redrawn at most 4 times a second.

::

    from um_lab.runner import Run
    from um_lab.widgets import LiveDashboard
    board = LiveDashboard()
    display(board.widget)
    active = Run(spec)
    board.attach(active)       # before start(): every record reaches the board
    active.start()

``feed(record)`` is all the training thread does (an append under a lock); a drawer thread redraws the
figure in one ``batch_update`` when records arrived, never more often than ``max_redraws_per_s``, and
``finish()`` always draws the last state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from um_lab.types import StepRecord
from um_lab.widgets.figures import DASHBOARD_TRACES, dashboard_figure, dashboard_series, residency_title


class LiveDashboard:
    """A live, throttled view of step records (residency, step time, oversubscription, faults, traffic)."""

    def __init__(self, max_redraws_per_s: float = 4.0, title: str = "") -> None:
        if not max_redraws_per_s > 0:
            raise ValueError(f"max_redraws_per_s must be > 0, got {max_redraws_per_s}")
        import plotly.graph_objects as go

        self.min_interval_s = 1.0 / max_redraws_per_s
        self.widget: Any = go.FigureWidget(dashboard_figure((), title))
        self.records: list[StepRecord] = []
        self.redraws = 0  #: how many times the figure was redrawn (for tests and the overhead benchmark)
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._drawn = 0  # records drawn so far
        self._drawer: threading.Thread | None = None
        #: called as ``on_draw(records)`` after each redraw (the panel updates its progress bar from it)
        self.on_draw: Callable[[list[StepRecord]], None] | None = None

    # -- feeding -----------------------------------------------------------------------------------

    def attach(self, run: Any) -> LiveDashboard:
        """Receive ``run``'s records as they are written (call before ``run.start()``); starts drawing."""
        run.add_listener(self.feed)
        self.start()
        return self

    def feed(self, record: StepRecord) -> None:
        """Take one record (called from the thread that runs the steps: cheap, never draws)."""
        with self._lock:
            self.records.append(record)
        self._dirty.set()

    def reset(self) -> None:
        """Forget every record and clear the figure (for the next run)."""
        self.finish()
        with self._lock:
            self.records = []
            self._drawn = -1  # force a redraw of the empty state
        self.draw()

    # -- drawing -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the drawer thread (idempotent)."""
        if self._drawer is not None and self._drawer.is_alive():
            return
        self._closing.clear()
        self._drawer = threading.Thread(target=self._draw_loop, name="um_lab-dashboard", daemon=True)
        self._drawer.start()

    def finish(self, timeout: float = 5.0) -> None:
        """Stop the drawer thread and draw the last state."""
        self._closing.set()
        self._dirty.set()
        if self._drawer is not None and self._drawer is not threading.current_thread():
            self._drawer.join(timeout)
        self._drawer = None
        self.draw()

    def _draw_loop(self) -> None:
        last = 0.0
        while not self._closing.is_set():
            self._dirty.wait()
            wait = last + self.min_interval_s - time.monotonic()
            if wait > 0 and self._closing.wait(wait):
                break
            self._dirty.clear()
            self.draw()
            last = time.monotonic()

    def draw(self) -> None:
        """Redraw the figure from the records so far (skipped when nothing new arrived)."""
        with self._lock:
            records = list(self.records)
            if len(records) == self._drawn:
                return
            self._drawn = len(records)
        series = dashboard_series(records)
        fig = self.widget
        with fig.batch_update():
            for trace, name in zip(fig.data, DASHBOARD_TRACES, strict=True):
                x, y = series[name]
                trace.x, trace.y = x, y
            fig.layout.annotations[0].text = residency_title(records)
        self.redraws += 1
        if self.on_draw is not None:
            self.on_draw(records)

    def static_figure(self, title: str = "") -> Any:
        """The records so far as a plain ``go.Figure`` (kept by an exported notebook, unlike the widget)."""
        with self._lock:
            records = list(self.records)
        return dashboard_figure(records, title)
