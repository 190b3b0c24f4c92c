"""``Lab()``: the notebook panel. Pick a model and its size, see its memory against the GPU, set advice per
data type, press Run and watch the live dashboard; Stop ends the run after the current step.

::

    from um_lab.widgets import Lab
    lab = Lab(model="gpt2-small", policy="gpu-first", backend="sim", ratio=1.5)
    lab                      # the panel
    lab.run(wait=True)       # the same as pressing Run, from code
    lab.static_figure()      # the dashboard as a plain figure (kept by exported notebooks)
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

from um_lab.backend import backend_class, backend_options, get_backend
from um_lab.errors import BudgetError, SpecError, UmLabError
from um_lab.policy import Policy, presets
from um_lab.runs.runlog import default_out_dir
from um_lab.runs.runner import Run, RunStateError
from um_lab.runs.runread import LoadedRun, iter_records
from um_lab.schedule.config import Budget
from um_lab.types import RunSpec, StepRecord
from um_lab.widgets._checks import (
    capacity_bytes_of,
    model_kwargs_value,
    model_name,
    optional_positive,
    out_dir_value,
    real_number,
    text_value,
    whole_number,
)
from um_lab.widgets._html import error_text, html_text, wrapping
from um_lab.widgets._waiting import wait_for
from um_lab.widgets.advice_grid import AdviceGrid
from um_lab.widgets.dashboard import LiveDashboard
from um_lab.widgets.figures import dashboard_figure, display_bundle
from um_lab.widgets.timeline import TimelineView
from um_lab.widgets.workload import WorkloadPicker

_END_COLOURS = {"complete": "#080", "stopped": "#a60", "interrupted": "#a60", "failed": "#c00", "error": "#c00"}


class _Default:
    """The ratio a panel starts with when none is given (told apart from a ratio the user gave)."""

    def __repr__(self) -> str:
        return "1.5"


DEFAULT_RATIO = _Default()


class Lab:
    """The lab panel (ipywidgets). Display it as a cell's last expression; drive it by hand or from code.

    ``pace_s`` waits that long after each step (simulator runs are fast; a pace lets a class watch them).
    ``out_dir``: where runs are written (default: ``$UM_LAB_RUNS_DIR``, else ``runs/``). ``telemetry``
    is passed to a backend built with a ``telemetry`` option (the cuda backend; ``"auto"``: CUPTI
    residency where it can be measured). ``backend`` is ``auto`` or any registered backend.
    ``budget``: the GPU budget field (``8GiB``, or ``0.5x`` of the footprint; empty: none) for the
    layer-ahead scheduler (the advice grid's ``layer-ahead`` entry; on the simulator without a budget it
    keeps resident bytes under the simulated capacity).
    """

    def __init__(self, model: str = "mlp", policy: Policy | str = "um-default", backend: str = "auto",
                 steps: int = 20, warmup_steps: int = 2, ratio: float | None | _Default = DEFAULT_RATIO,
                 capacity_gib: float | None = None, model_kwargs: dict[str, Any] | None = None,
                 pace_s: float = 0.0, out_dir: str | os.PathLike[str] | None = None,
                 telemetry: bool | str = "auto", budget: str = "") -> None:
        import ipywidgets as w

        # every argument checked up front: a typed UmLabError naming it and quoting the value, never a
        # value silently changed to fit a control
        steps = whole_number("steps", steps, 1)
        warmup_steps = whole_number("warmup_steps", warmup_steps, 0)
        pace_s = real_number("pace_s", pace_s, 0.0)
        if capacity_gib is not None and not isinstance(ratio, _Default) and ratio is not None:
            raise SpecError(f"give ratio or capacity_gib, not both: ratio={ratio!r} and capacity_gib={capacity_gib!r} "
                            "both set the simulated GPU's size", "capacity_gib")
        ratio = optional_positive("ratio", 1.5 if isinstance(ratio, _Default) else ratio)
        capacity_gib = optional_positive("capacity_gib", capacity_gib)
        if capacity_gib is not None:
            capacity_bytes_of("capacity_gib", capacity_gib)
        budget = text_value("budget", budget)
        if budget.strip():
            try:
                Budget(budget)
            except (SpecError, BudgetError) as e:
                raise SpecError(f"budget: {e}", "budget") from None
        if not isinstance(telemetry, (bool, str)):
            raise SpecError(f"telemetry must be True, False or a mode name (str), got {telemetry!r}", "telemetry")
        out_dir_value(out_dir)
        model_kwargs = model_kwargs_value(model_name(model), model_kwargs)
        self.out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
        self.telemetry = telemetry
        self._backends: dict[str, Any] = {}
        self._backends_lock = threading.Lock()
        self.workload = WorkloadPicker(model, model_kwargs, backend, ratio, capacity_gib,
                                       on_change=self._workload_changed, backend_for=self._backend)
        self.advice = AdviceGrid(policy, on_change=lambda _policy: self._workload_changed())
        # unbounded fields: a value typed out of range is refused when Run is pressed, never clamped
        self.steps = w.IntText(value=steps, description="steps", layout=w.Layout(width="170px"))
        self.steps.add_class("um-lab-steps")
        self.warmup = w.IntText(value=warmup_steps, description="warm-up", layout=w.Layout(width="170px"))
        self.pace = w.FloatText(value=pace_s, step=0.05, description="pace (s/step)",
                                style={"description_width": "initial"}, layout=w.Layout(width="190px"))
        self.pace.add_class("um-lab-pace")
        self.budget = w.Text(value=budget, description="GPU budget", placeholder="8GiB or 0.5x (layer-ahead)",
                             style={"description_width": "initial"}, layout=w.Layout(width="260px"))
        self.budget.add_class("um-lab-budget")
        self.run_button = w.Button(description="Run", icon="play", button_style="success")
        self.run_button.add_class("um-lab-run")
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.stop_button.add_class("um-lab-stop")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="steps")
        self.progress.add_class("um-lab-progress")
        self.status = w.HTML("idle: press Run")
        self.status.add_class("um-lab-status")
        self.dashboard = LiveDashboard()
        self.dashboard.on_draw = self._drawn
        live = w.Box([self.dashboard.widget])
        live.add_class("um-lab-live")
        self._live = live  # hidden once a run's static figure is shown: one dashboard per run
        self.static_output = w.Output()
        self.static_output.add_class("um-lab-static")
        self.run_button.on_click(lambda _b: self.run())
        self.stop_button.on_click(lambda _b: self.stop())
        #: inside one step, on the simulator: resident bytes per type kernel by kernel, two policies side by side
        self.timeline = TimelineView(model=str(self.workload.model.value), model_kwargs=self._timeline_kwargs(),
                                     ratio=None, simulate_now=False)
        self.tabs = w.Tab([w.VBox([live, self.static_output]), self.timeline.widget])
        self.tabs.titles = ("per step", "inside a step")
        self.tabs.add_class("um-lab-tabs")
        self.tabs.observe(lambda change: self._tab_opened(change["new"]), names="selected_index")
        self.widget = w.VBox([
            w.HTML("<h3 style='margin:4px 0'>um_lab</h3>"), self.workload.widget,
            w.HTML("<b>Advice per data type</b>"), self.advice.widget,
            w.HBox([self.steps, self.warmup, self.pace, self.budget], layout=wrapping()),
            w.HBox([self.run_button, self.stop_button, self.progress], layout=wrapping()), self.status, self.tabs])
        self.widget.add_class("um-lab")
        self.active: Run | None = None
        self.state = "idle"  #: idle, running, complete, stopped, interrupted, failed or error (refused to start)
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._ended = threading.Event()  # set by the watcher once the panel shows the run's end
        self._ended.set()
        self.workload.model.observe(lambda _c: self._model_switched(), names="value")

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _timeline_kwargs(self) -> dict[str, Any]:
        try:
            return dict(self.workload.model_kwargs())
        except UmLabError:  # a knob typed out of range: the timeline waits for a valid one
            return {}

    def _tab_opened(self, index: int | None) -> None:
        """The step timeline tab simulates the panel's workload when it is opened (not before: it costs a trace)."""
        if index != 1:
            return
        try:
            capacity, ratio = self.workload.sim_capacity()
            policy = self.policy
        except UmLabError as e:  # no figure of other settings under the error
            self.timeline.clear(f"<span style='color:#b00'>{html_text(e)}</span>")
            return
        label = policy.name if presets.get(policy.name) == policy else f"{policy.name} (this panel)"
        self.timeline.set_workload(model=str(self.workload.model.value), model_kwargs=self._timeline_kwargs(),
                                   ratio=ratio, capacity_bytes=capacity, policy=(policy, label))

    def _workload_changed(self) -> None:
        """A setting changed: an open timeline follows it at once (a closed one when it is opened)."""
        tabs = getattr(self, "tabs", None)  # None while the panel is being built
        if tabs is not None and tabs.selected_index == 1:
            self._tab_opened(1)

    # -- what would run ----------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The policy the advice grid shows."""
        return self.advice.policy

    def spec(self) -> RunSpec:
        """The :class:`RunSpec` the panel's controls describe."""
        backend = self.workload.resolved_backend
        capacity, ratio = self.workload.sim_capacity() if self.workload.simulates_capacity else (None, None)
        return RunSpec(model=self.workload.model.value, policy=self.policy.name, backend=backend,
                       steps=int(self.steps.value), warmup_steps=int(self.warmup.value),
                       model_kwargs=self.workload.model_kwargs(), capacity_bytes=capacity,
                       oversubscription_ratio=ratio, budget=self._budget_field(), **self.workload.training())

    def _budget_field(self) -> Budget | None:
        """The budget field as a :class:`~um_lab.schedule.config.Budget`; empty: none (SpecError when bad)."""
        text = str(self.budget.value).strip()
        if not text:
            return None
        try:
            return Budget(text)
        except (SpecError, BudgetError) as e:
            raise SpecError(f"GPU budget: {e}", "budget") from None

    def _check_capacity(self, spec: RunSpec) -> None:
        """Refuse a simulated capacity the backend refuses for this model (a ratio leaving less than one
        2 MiB chunk, ...) before the run's folder exists, where the estimate already knows the footprint of
        exactly these model and knobs (else the run's own check says it)."""
        if spec.capacity_bytes is None and spec.oversubscription_ratio is None:
            return
        footprint = self.workload.last_footprint
        if footprint and self.workload.last_sized == (spec.model, dict(spec.model_kwargs)):
            try:
                self._backend(spec.backend).capacity_for(spec, footprint)
            except SpecError as e:  # quote what the field holds, as given
                given = f"{self.workload.capacity_mode.value} {self.workload.capacity_value.value!r}"
                raise SpecError(f"{given}: {e}", e.field) from None

    def _backend(self, name: str) -> Any:
        """The panel's one instance of backend ``name`` (refused, as the run would be, where it cannot run)."""
        backend_class(name).check_available()  # e.g. CudaUnavailableError without a GPU
        with self._backends_lock:  # the estimate thread and Run may ask at once: one simulator, one trace cache
            if name not in self._backends:
                options = {"telemetry": self.telemetry} if "telemetry" in backend_options(name) else {}
                self._backends[name] = get_backend(name, **options)
            return self._backends[name]

    # -- running -----------------------------------------------------------------------------------

    def run(self, wait: bool = False, timeout: float | None = None) -> Run | None:
        """Start a run with the panel's settings (what Run does); ``wait=True`` blocks until it ends.

        Anything that stops it from starting (a size refused under the safety cap, bad knobs, no GPU)
        is shown in the status line, never raised; ``lab.last_error`` keeps the exception.
        """
        if not self._ended.is_set():  # a run is going, or the panel is still showing its end
            self._say("a run is already going: press Stop first", "#a60")
            return None
        self.last_error = None
        try:
            real_number("pace (s/step)", self.pace.value, 0.0)
            spec = self.spec()
            self._check_capacity(spec)
            active = Run(spec, policy=self.policy, out_dir=self.out_dir, backend=self._backend(spec.backend))
        except Exception as e:  # refused before any step: explain in the panel, not as a traceback
            self.last_error = e
            self.state = "error"
            self._say(f"error: {error_text(e)}", _END_COLOURS["error"])
            return None  # the last run (if any) stays on show, and lab.result still is that run
        self._stop.clear()
        self._ended.clear()
        self.static_output.outputs = ()
        self._live.layout.display = None  # the live dashboard, in place of the last run's static figure
        self.dashboard.reset()
        self.active = active
        total = spec.warmup_steps + spec.steps
        self.progress.max, self.progress.value, self.progress.bar_style = total, 0, ""
        self.dashboard.attach(active)
        if self.pace.value > 0:
            active.add_listener(self._pace_step)
        self.state = "running"
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.workload.model.disabled = True  # the plots on show belong to the model picked
        self._say(f"running {spec.model} under {self.policy.name} on {active.backend_note}: 0/{total} steps")
        active.start()
        threading.Thread(target=self._watch, args=(active,), daemon=True, name="um_lab-lab-watch").start()
        if wait:
            self.wait(timeout)
        return active

    def _pace_step(self, _record: object) -> None:
        """Wait the pace field's seconds after a step (the stop button cuts the wait short; a value typed
        during the run that is not a finite number >= 0 waits not at all)."""
        pace = float(self.pace.value)
        if math.isfinite(pace) and pace > 0:
            self._stop.wait(pace)

    def stop(self) -> None:
        """End the run after the step in progress (its completed steps stay on disk)."""
        if self.active is None or self.active.done:
            return
        self.active.stop()
        self._stop.set()
        self._say("stopping after the current step…", "#a60")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current run has ended and the panel shows it; True when it has.

        An interrupt while waiting (Ctrl-C, the notebook's stop button) stops the run after its current
        step, waits for that, and is raised again."""
        return wait_for(self._ended, timeout, self.stop, settle_s=60)

    def _watch(self, active: Run) -> None:
        try:
            self._show_end(active)
        except Exception as e:  # never leave the panel stuck on "running"
            self.last_error = self.last_error or e
            self._say(f"{active.status}: the panel could not show the run's end ({error_text(e)}). "
                      f"Run folder: {active.path}", _END_COLOURS["error"])
        finally:
            self.state = active.status if active.done else "failed"
            self.run_button.disabled, self.stop_button.disabled = False, True
            self.workload.model.disabled = False
            self._ended.set()

    def _show_end(self, active: Run) -> None:
        try:
            active.join()
        except BaseException as e:  # the run's own error: shown in the status line
            self.last_error = e
        self.dashboard.finish()
        spec = active.spec
        done = f"{active.steps_completed}/{spec.warmup_steps + spec.steps} steps"
        text = f"{active.status}: {spec.model} under {spec.policy} on {active.backend_note}, {done}"
        if self.last_error is not None:
            text += f" — error: {error_text(self.last_error)}"
        summary = active.summary()
        if summary["steps"]:
            text += f"; median step {summary['median_ms']:.2f} ms"
        self.progress.bar_style = "success" if active.status == "complete" else "warning"
        if self.dashboard.count:
            self.static_output.outputs = (display_bundle(self.static_figure()),)
            self._live.layout.display = "none"  # the static figure shows this run now: one dashboard, not two
        self._say(f"{text}. Run folder: {active.path}", _END_COLOURS.get(active.status, "#000"))

    def _model_switched(self) -> None:
        """Another model was picked: the last model's plots go (its run stays on disk: ``lab.result``), so
        nothing on show belongs to a model other than the one picked. A run going keeps its dashboard."""
        if not self._ended.is_set():
            return
        self.static_output.outputs = ()
        self._live.layout.display = None
        self.dashboard.reset()
        self.progress.value, self.progress.bar_style = 0, ""
        model = self.workload.model.value
        if self.active is not None:
            spec = self.active.spec
            self._say(f"idle: press Run for {model} (the last run, {spec.model} under {spec.policy}, is in "
                      f"{self.active.path})")
        else:
            self._say(f"idle: press Run for {model}")

    def _drawn(self, steps: int) -> None:
        self.progress.value = steps
        if self.active is not None and self.state == "running" and not self._stop.is_set():
            spec = self.active.spec
            self._say(f"running {spec.model} under {spec.policy} on {self.active.backend_note}: "
                      f"{steps}/{spec.warmup_steps + spec.steps} steps")

    def _say(self, text: str, colour: str = "#000") -> None:
        """Show plain ``text`` in the status line (escaped: names, paths and errors may hold ``<``)."""
        self.status.value = f"<span style='color:{colour}'>{html_text(text)}</span>"

    # -- results -----------------------------------------------------------------------------------

    @property
    def records(self) -> list[StepRecord]:
        """The current (or last) run's records so far, read from its folder (the panel keeps only what it
        draws)."""
        if self.active is None:
            return []
        return list(iter_records(self.active.path / "records.jsonl"))

    @property
    def result(self) -> LoadedRun:
        """The last run as read from its folder (once it ended)."""
        if self.active is None:
            raise RunStateError("no run yet: press Run or call lab.run()")
        return self.active.result()

    def static_figure(self, max_points: int = 5000) -> Any:
        """The last run's dashboard as a plain plotly figure (an exported notebook keeps it), read from the
        run's folder; runs longer than ``max_points`` steps are drawn thinned to every k-th step."""
        if self.active is None:
            return self.dashboard.static_figure()
        spec = self.active.spec
        title = f"{spec.model} · {spec.policy} · {self.active.backend_note} · {self.active.status}"
        return dashboard_figure(iter_records(self.active.path / "records.jsonl"), title, max_points)
