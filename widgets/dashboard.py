"""The live dashboard: a plotly ``FigureWidget`` fed by a run's record stream, redrawn at most 4 times a second.

::

    from um_lab.runs.runner import Run
    from um_lab.widgets import LiveDashboard
    board = LiveDashboard()
    display(board.widget)
    active = Run(spec)
    board.attach(active)       # follows the run's records from the drawer thread
    active.start()

``attach(run)`` costs the training thread nothing: a drawer thread reads the run's newest records
(``run.tail``) and redraws the figure in one ``plotly_restyle`` message when records arrived, never more often
than ``max_redraws_per_s`` and never taking more than ``max_share`` of the time (a redraw that took
4 ms waits at least 0.8 s at the default 0.5%: the drawer shares the GIL with the training thread).
``finish()`` always draws the last state. The board keeps only the steps it draws (every k-th of a
long run, and the newest), never the whole run: that is on disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from um_lab.types import StepRecord
from um_lab.widgets.figures import (
    DASHBOARD_TRACES,
    dashboard_figure,
    dashboard_figure_from_rows,
    dashboard_row,
    dashboard_series,
)


def _on_grid(items: list[tuple[int, Any]], stride: int) -> list[tuple[int, Any]]:
    """The ``(index, item)`` pairs whose index is a multiple of ``stride``."""
    return [(i, item) for i, item in items if i % stride == 0]


class LiveDashboard:
    """A live, throttled view of step records (residency, step time, oversubscription, faults, traffic).

    ``max_points``: longer runs are drawn thinned to every k-th step (the newest always kept).
    """

    def __init__(self, max_redraws_per_s: float = 4.0, title: str = "", max_points: int = 1000,
                 max_share: float = 0.005) -> None:
        if not max_redraws_per_s > 0:
            raise ValueError(f"max_redraws_per_s must be > 0, got {max_redraws_per_s}")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, got {max_points}")
        import plotly.graph_objects as go

        self.min_interval_s = 1.0 / max_redraws_per_s
        self.max_share = max_share
        self.max_points = max_points
        self.widget: Any = go.FigureWidget(dashboard_figure((), title))
        #: the layout the figure shows now (units, titles, empty-panel notes and ranges; see dashboard_series)
        self._layout: dict[str, Any] = dashboard_series(np.empty((0, len(DASHBOARD_TRACES) + 1)))[1]
        self.count = 0  #: records fed since the last reset
        self.last: StepRecord | None = None  #: the newest record drawn
        self.redraws = 0  #: how many times the figure was redrawn (for tests and the overhead benchmark)
        self.draw_seconds = 0.0  #: time spent redrawing, on the drawer thread
        #: called as ``on_draw(number of records drawn)`` after each redraw (the panel's progress bar)
        self.on_draw: Callable[[int], None] | None = None
        self._pending: list[tuple[int, StepRecord]] = []  # (index, record) fed, not yet looked at by draw()
        self._newest: tuple[int, StepRecord | None] = (-1, None)  # (index, record) of the newest fed
        self._feed_lock = threading.Lock()
        self._draw_lock = threading.Lock()  # one draw (or reset) at a time, whoever calls it
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._drawer: threading.Thread | None = None
        self._source: Any = None  # the Run being followed (attach)
        self._clear_state()

    def _clear_state(self) -> None:
        self._rows: list[tuple[int, tuple[float, ...]]] = []  # (record index, row) of every stride-th step
        self._stride = 1
        self._last_index = -1
        self._drawn_count = -1  # count at the last redraw (-1: the figure must be redrawn)

    # -- feeding -----------------------------------------------------------------------------------

    def attach(self, run: Any) -> LiveDashboard:
        """Follow ``run`` (a :class:`um_lab.runs.runner.Run`) and start drawing.

        The drawer thread reads the run's newest records (``run.tail``) before each redraw, so the
        training thread does no work for the dashboard at all; a fast run is sampled at the redraws
        (every step when fewer than ``len(run.tail)`` arrive between two), and the whole run is on disk.
        """
        self._source = run
        self.start()
        return self

    def _poll(self) -> None:
        source = self._source
        if source is None:
            return
        for record in list(source.tail):  # one C-level copy: atomic under the GIL
            if record.step >= self.count:
                self._feed_at(record.step, record)

    def feed(self, record: StepRecord) -> None:
        """Take one record (for a stream of your own; :meth:`attach` follows a Run by itself).

        Only every stride-th record is kept until the next draw (and the newest): holding thousands of
        records between redraws would make every garbage collection on the feeding thread slower.
        """
        self._feed_at(self.count, record)

    def _feed_at(self, index: int, record: StepRecord) -> None:
        self._newest = (index, record)
        self.count = index + 1
        if index % self._stride == 0:  # stride may double meanwhile: _take() filters again
            with self._feed_lock:
                self._pending.append((index, record))
                if len(self._pending) > self.max_points:  # a fast run between two redraws: thin here too
                    self._stride *= 2
                    self._pending = _on_grid(self._pending, self._stride)
        if not self._dirty.is_set():
            self._dirty.set()

    def reset(self) -> None:
        """Forget every record and clear the figure (for the next run)."""
        self.finish()
        with self._draw_lock:
            with self._feed_lock:
                self._pending, self.count, self.last, self._newest = [], 0, None, (-1, None)
            self._clear_state()
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
        self._poll()
        self._source = None
        self.draw()

    def _draw_loop(self) -> None:
        next_at = 0.0
        while not self._closing.is_set():
            if self._source is None:  # fed by hand: sleep until something arrives
                self._dirty.wait()
            wait = max(next_at - time.monotonic(), 0.0 if self._source is None else 1e-3)
            if self._closing.wait(wait):
                break
            self._dirty.clear()
            self._poll()
            started = time.monotonic()
            self.draw()
            took = time.monotonic() - started
            # at most max_redraws_per_s, and redrawing takes at most max_share of the time (the training
            # thread shares the GIL with this one)
            next_at = started + max(self.min_interval_s, took / self.max_share)

    def _take(self) -> int:
        """Move fed records into the kept rows (every stride-th step; the stride doubles past max_points)."""
        with self._feed_lock:
            pending, self._pending = self._pending, []
            stride = self._stride
        newest_index, newest = self._newest  # one tuple, set by feed() in one assignment
        rows = _on_grid(self._rows, stride)  # feed() may have doubled the stride
        rows.extend((i, dashboard_row(r)) for i, r in _on_grid(pending, stride))
        while len(rows) > self.max_points:
            stride *= 2
            rows = _on_grid(rows, stride)
        self._rows = rows
        with self._feed_lock:
            self._stride = max(self._stride, stride)
        self.last, self._last_index = newest, newest_index
        return newest_index + 1

    def _rows_to_draw(self) -> np.ndarray:
        rows = [row for _, row in self._rows]
        if self.last is not None and not (self._rows and self._rows[-1][0] == self._last_index):
            rows.append(dashboard_row(self.last))
        return np.asarray(rows, dtype=float)

    def draw(self) -> None:
        """Redraw the figure with the records that arrived since the last draw (skipped when none did).

        Only the steps that will be drawn are converted: every ``stride``-th step (``stride`` doubles
        whenever more than ``max_points`` steps would be kept) plus always the newest one, so a redraw
        costs about the same at step 100 and at step 100,000.
        """
        started = time.perf_counter()
        with self._draw_lock:
            count = self._take()
            if count == self._drawn_count:
                return
            self._drawn_count = count
            series, layout = dashboard_series(self._rows_to_draw(), [self.last] if self.last is not None else [])
            fig = self.widget
            # one restyle message for every trace; plotly_restyle skips the per-property validators, which
            # cost most of a batch_update's time (the arrays are float64 built here)
            fig.plotly_restyle({"x": [series[name][0] for name in DASHBOARD_TRACES],
                                "y": [series[name][1] for name in DASHBOARD_TRACES]},
                               list(range(len(DASHBOARD_TRACES))))
            # the layout changes rarely (the first step, a unit, a reset): one relayout message then
            changed = {key: value for key, value in layout.items() if self._layout.get(key) != value}
            if changed:
                # an axis that autoranged in the browser holds the range plotly.js computed there, while this
                # side still holds the explicit range it last sent: clear it first, or the same explicit range
                # (an empty panel's 0-1) is not sent again and the browser keeps the old run's range
                cleared = {key: None for key in changed if key.endswith(".range")}
                if cleared:
                    fig.plotly_relayout(cleared)
                fig.plotly_relayout(changed)
                self._layout = layout
            self.redraws += 1
            self.draw_seconds += time.perf_counter() - started
        if self.on_draw is not None:
            self.on_draw(count)

    def static_figure(self, title: str = "") -> Any:
        """What the board shows, as a plain ``go.Figure`` (kept by an exported notebook, unlike the widget)."""
        with self._draw_lock:
            self._take()
            rows = self._rows_to_draw()
            last = [self.last] if self.last is not None else []
        return dashboard_figure_from_rows(rows, last, title)
