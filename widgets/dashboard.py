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


def _thin(values: list[Any], max_points: int) -> list[Any]:
    """Every k-th value, so that at most about ``max_points`` remain; the last value is always kept."""
    if len(values) <= max_points:
        return values
    stride = -(-len(values) // max_points)
    thinned = values[::stride]
    return thinned if (len(values) - 1) % stride == 0 else [*thinned, values[-1]]


class LiveDashboard:
    """A live, throttled view of step records (residency, step time, oversubscription, faults, traffic)."""

    def __init__(self, max_redraws_per_s: float = 4.0, title: str = "", max_points: int = 2000) -> None:
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
        self.max_points = max_points
        self._series: dict[str, tuple[list[Any], list[Any]]] = {name: ([], []) for name in DASHBOARD_TRACES}
        self._drawer: threading.Thread | None = None
        #: called as ``on_draw(number of records drawn)`` after each redraw (the panel's progress bar)
        self.on_draw: Callable[[int], None] | None = None

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
        """Redraw the figure with the records that arrived since the last draw (skipped when none did).

        Series grow incrementally; a trace longer than ``max_points`` is drawn thinned to every k-th step
        (its last step always kept), so a redraw costs the same at step 100 and at step 100,000.
        """
        with self._lock:
            if len(self.records) == self._drawn:
                return
            if self._drawn < 0 or len(self.records) < self._drawn:  # reset: start the series again
                self._series = {name: ([], []) for name in DASHBOARD_TRACES}
                self._drawn = 0
            new = self.records[self._drawn:]
            self._drawn = len(self.records)
            last_records = self.records[-1:]
        for name, (x, y) in dashboard_series(new).items():
            self._series[name][0].extend(x)
            self._series[name][1].extend(y)
        fig = self.widget
        with fig.batch_update():
            for trace, name in zip(fig.data, DASHBOARD_TRACES, strict=True):
                x, y = self._series[name]
                trace.x, trace.y = _thin(x, self.max_points), _thin(y, self.max_points)
            title = residency_title(last_records) if last_records else residency_title(())
            if fig.layout.annotations[0].text != title:
                fig.layout.annotations[0].text = title
        self.redraws += 1
        if self.on_draw is not None:
            self.on_draw(self._drawn)

    def static_figure(self, title: str = "") -> Any:
        """The records so far as a plain ``go.Figure`` (kept by an exported notebook, unlike the widget)."""
        with self._lock:
            records = list(self.records)
        return dashboard_figure(records, title)
