"""What to train and where: model and size knobs, backend (any registered one), simulated capacity or the
safety cap, and a live memory estimate per data type with its oversubscription ratio (before anything runs).

Nothing here tests a backend's name: the backend list is the registry's, the capacity controls show for a
backend that simulates capacity, and the limit shown otherwise is what the backend says a run must fit in.
"""

from __future__ import annotations

import atexit
import html
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

from um_lab import models
from um_lab.backend import AUTO, backend_class, backend_names, get_backend, resolve_backend_name, valid_backend_names
from um_lab.errors import ModelConfigError, SpecError
from um_lab.sizing import MemoryEstimate, estimate_memory, format_bytes
from um_lab.training import with_training
from um_lab.types import DATA_TYPES, PRECISIONS, RunSpec
from um_lab.widgets._checks import capacity_bytes_of, model_kwargs_value, model_name, optional_positive
from um_lab.widgets._html import html_text, wrapping

#: config fields worth a knob for the transformer families (the rest stay at the size's defaults)
_CONFIG_KNOBS = {"gpt2": ("n_layer", "n_embd", "n_head"),
                 "bert": ("num_hidden_layers", "hidden_size", "num_attention_heads")}
CAPACITY_MODES = ("ratio", "capacity GiB", "card")
_CHUNK = 2 << 20  # the simulated GPU's memory comes in 2 MiB chunks
_ESTIMATORS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_estimators() -> None:
    """Let estimates still tracing a model finish before the interpreter tears torch down under them."""
    for thread in list(_ESTIMATORS):
        thread.join(timeout=30)


def model_knobs(name: str) -> dict[str, int]:
    """The integer size knobs of zoo model ``name`` with their defaults, e.g. ``{"width": 4096, ...}``."""
    model_name(name)
    base = getattr(models, "_ZOO_BASE", {}).get(name, models.ZOO[name])
    fixed = getattr(models, "_FIXED_BY_NAME", {}).get(base, set())
    knobs = {p.name: p.default for p in inspect.signature(base).parameters.values()
             if p.name not in fixed and isinstance(p.default, int) and not isinstance(p.default, bool)}
    family, _, size = name.partition("-")
    sizes = {"gpt2": models.GPT2_SIZES, "bert": models.BERT_SIZES}.get(family, {})
    for field in _CONFIG_KNOBS.get(family, ()):
        if size in sizes:
            knobs[field] = sizes[size][field]
    return knobs


def estimate_html(estimate: MemoryEstimate, capacity_bytes: int | None, capacity_label: str,
                  footprint_bytes: int | None = None) -> str:
    """A small table: bytes per data type, total, native PyTorch's peak where the simulator's trace gives it,
    and the ratio to the capacity. With ``footprint_bytes``
    (the simulator's managed segments, what a simulated run oversubscribes) the ratio is of that."""
    def cell(label: str, value: str, title: str = "") -> str:
        hint = f" title='{html.escape(title, quote=True)}'" if title else ""
        return f"<div style='padding:0 8px'{hint}>{label}<br><b>{value}</b></div>"

    cells = "".join(cell(t.value, format_bytes(estimate.bytes_per_type.get(t.value, 0))) for t in DATA_TYPES)
    cells += cell("total", format_bytes(estimate.total_bytes))
    native = ""
    if estimate.native_peak_bytes is not None:  # what plain PyTorch would peak at: the user's comparison
        cells += cell("native peak", format_bytes(estimate.native_peak_bytes),
                      "native PyTorch's peak: everything live at once, plus cuBLAS's GEMM workspaces "
                      f"({format_bytes(estimate.workspace_bytes or 0)}), which um_lab's pools do not hold")
        if estimate.workspace_bytes:
            native = f"; native peak includes {format_bytes(estimate.workspace_bytes)} of cuBLAS workspaces"
    if footprint_bytes is not None:
        cells += cell("segments", format_bytes(footprint_bytes))
    if capacity_bytes:
        r = (footprint_bytes if footprint_bytes is not None else estimate.total_bytes) / capacity_bytes
        colour = "#c00" if r > 1 else "#080"
        cells += cell(html_text(capacity_label), format_bytes(capacity_bytes))  # a profile's name
        cells += cell("ratio", f"<span style='color:{colour}'>{r:.3g}x</span>")
    basis = ("the ratio is of the simulator's 2 MiB segments (what a run oversubscribes)" if footprint_bytes
             is not None else "a lower bound (2 MiB segment rounding and temporaries come on top)")
    # cells in a wrapping row, not a table: on a narrow screen they take a second line, not a scroll bar
    return (f"<div style='display:flex;flex-wrap:wrap'>{cells}</div><small>estimate per type: "
            f"{html_text(estimate.method)}; "
            f"{basis}{native}</small>")


def model_choices(*given: str) -> list[str]:
    """The models a dropdown offers: those this install can build (:func:`um_lab.models.buildable_models`;
    no ResNet or ViT without torchvision), plus any of ``given`` (the model asked for by name), in zoo order."""
    offered = set(models.buildable_models()) | set(given)
    return [name for name in models.ZOO if name in offered]


def missing_models_html() -> str:
    """A short note naming the zoo models this install cannot build and the command that adds each missing
    library (keeping a CPU torch CPU); empty when every model can be built."""
    missing: dict[str, list[str]] = {}
    for name in models.ZOO:
        needs = models.model_needs(name)
        if needs is not None:
            missing.setdefault(needs, []).append(name)
    notes = []
    for needs, names in missing.items():
        what, _, command = needs.partition(": ")
        notes.append(f"<div><small>not offered here: {html_text(', '.join(names))} ({html_text(what)}: "
                     f"<code>{html_text(command)}</code>)</small></div>")
    return "".join(notes)


def backend_choices() -> list[str]:
    """What a backend dropdown offers: ``auto``, then every registered backend (a third one included)."""
    return [AUTO, *backend_names()]


#: what the panel's recompute dropdown offers (selected layers: ``RunSpec(recompute=[...])`` from code)
RECOMPUTE_CHOICES = ("none", "every-layer")


class WorkloadPicker:
    """Model dropdown, size knobs, backend and capacity controls, and the live memory estimate."""

    def __init__(self, model: str = "mlp", model_kwargs: dict[str, Any] | None = None, backend: str = "auto",
                 ratio: float | None = 1.5, capacity_gib: float | None = None,
                 on_change: Callable[[], None] | None = None,
                 backend_for: Callable[[str], Any] | None = None) -> None:
        """``backend_for(name)`` returns the backend instance the runs will use for a registered name
        (default: one built here with no options). The limit shown is what it says a run must fit in; on a
        backend that simulates capacity and prepares a case (the simulator: ``prepare(case).footprint_bytes``)
        the panel's ratio is of that footprint, and the prepared trace is reused by the run."""
        import ipywidgets as w

        model_kwargs = model_kwargs_value(model_name(model), model_kwargs)
        choices = backend_choices()
        if not isinstance(backend, str) or backend not in choices:
            raise SpecError(f"unknown backend {backend!r}; valid: {valid_backend_names()}", "backend")
        ratio = optional_positive("ratio", ratio)
        capacity_gib = optional_positive("capacity_gib", capacity_gib)
        self._on_change = on_change
        self._backend_for = backend_for
        self._own_backends: dict[str, Any] = {}
        self._own_backends_lock = threading.Lock()  # the estimate thread asks too
        self.last_footprint: int | None = None
        #: (model, knobs) the last estimate and footprint were made for (None: none made yet)
        self.last_sized: tuple[str, dict[str, Any]] | None = None
        # only what this install can build (the model asked for by name too: its estimate says what it lacks)
        self.model = w.Dropdown(options=model_choices(model), value=model, description="model")
        self.model.add_class("um-lab-model")
        self.model_note = w.HTML(missing_models_html())
        self.model_note.add_class("um-lab-model-note")
        self.knob_box = w.HBox(layout=wrapping())
        self.knobs: dict[str, Any] = {}
        self.precision = w.Dropdown(options=PRECISIONS, value="fp32", description="precision",
                                    tooltip="fp32, or autocast to bf16 / fp16 with fp32 master weights",
                                    layout=w.Layout(width="200px"))
        self.precision.add_class("um-lab-precision")
        self.recompute = w.Dropdown(options=RECOMPUTE_CHOICES, value="none", description="recompute",
                                    tooltip="recompute every layer's activations in backward instead of keeping them",
                                    layout=w.Layout(width="230px"))
        self.recompute.add_class("um-lab-recompute")
        self.backend = w.Dropdown(options=choices, value=backend, description="backend",
                                  layout=w.Layout(width="200px"))
        self.backend.add_class("um-lab-backend")
        mode = "card" if ratio is None and capacity_gib is None else ("capacity GiB" if capacity_gib else "ratio")
        self.capacity_mode = w.ToggleButtons(options=CAPACITY_MODES, value=mode,
                                             tooltips=["oversubscription ratio: footprint / simulated capacity",
                                                       "simulated GPU capacity in GiB", "the profile's whole card"])
        # unbounded: a value out of range is refused (estimate line, status line), never clamped
        self.capacity_value = w.FloatText(value=capacity_gib or ratio or 1.0, step=0.25, layout=w.Layout(width="90px"))
        self.capacity_value.add_class("um-lab-capacity")
        self.capacity_box = w.HBox([w.HTML("simulated GPU:"), self.capacity_mode, self.capacity_value],
                                   layout=wrapping())
        self.cap_note = w.HTML()
        self.estimate = w.HTML("estimating…")
        self.estimate.add_class("um-lab-estimate")
        self.last_estimate: MemoryEstimate | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._cap_bytes: int | None = None
        self._knob_memory: dict[str, dict[str, Any]] = {}  # model -> its knobs as last set in this panel
        self.model.observe(lambda change: self._model_changed(change["old"]), names="value")
        for control in (self.precision, self.recompute):
            control.observe(lambda _c: self._refresh_estimate(), names="value")
        for control in (self.backend, self.capacity_mode, self.capacity_value):
            control.observe(lambda _c: self._settings_changed(), names="value")
        self.widget = w.VBox([w.HBox([self.model, self.backend], layout=wrapping()), self.model_note, self.knob_box,
                              w.HBox([self.precision, self.recompute], layout=wrapping()), self.capacity_box,
                              self.cap_note, self.estimate])
        self._build_knobs(dict(model_kwargs or {}))
        self._settings_changed()

    # -- what the controls say ---------------------------------------------------------------------

    @property
    def resolved_backend(self) -> str:
        """The registered backend the runs use (``auto`` resolved here: cuda with a GPU, else sim)."""
        return resolve_backend_name(str(self.backend.value))

    @property
    def simulates_capacity(self) -> bool:
        """True when the picked backend simulates the GPU's capacity (the capacity controls apply)."""
        return bool(backend_class(self.resolved_backend).simulates_capacity)

    def backend_instance(self, name: str | None = None) -> Any:
        """The backend the runs will use for ``name`` (default: the picked one), from ``backend_for``."""
        name = self.resolved_backend if name is None else resolve_backend_name(name)
        if self._backend_for is not None:
            return self._backend_for(name)
        with self._own_backends_lock:
            if name not in self._own_backends:
                self._own_backends[name] = get_backend(name)
            return self._own_backends[name]

    def model_kwargs(self) -> dict[str, Any]:
        """The knob values."""
        return {name: int(control.value) for name, control in self.knobs.items()}

    def training(self) -> dict[str, str]:
        """``{"precision", "recompute"}`` as picked, for the RunSpec."""
        return {"precision": str(self.precision.value), "recompute": str(self.recompute.value)}

    def sim_capacity(self) -> tuple[int | None, float | None]:
        """``(capacity_bytes, oversubscription_ratio)`` for the RunSpec (on a backend that simulates
        capacity; see :attr:`simulates_capacity`)."""
        mode, value = self.capacity_mode.value, self.capacity_value.value
        if mode == "ratio":  # SpecError quoting the value where it is not a finite number > 0
            return None, optional_positive("ratio", value)
        if mode == "capacity GiB":
            return capacity_bytes_of("capacity GiB", value), None
        return None, None

    def capacity_bytes(self, footprint: int | None) -> tuple[int | None, str]:
        """The capacity the footprint is compared with, and its label: on a backend that simulates capacity,
        the simulated GPU the controls describe (in whole 2 MiB chunks, as the simulator takes it); else the
        limit the backend puts on a run (the cuda backend's safety cap; None: no limit to show). A value the
        controls hold that the backend refuses raises its error (:class:`SpecError` for a bad ratio)."""
        if not self.simulates_capacity:
            return self._cap_bytes, "safety cap"
        capacity, ratio = self.sim_capacity()
        if ratio is not None and not footprint:
            return None, "simulated GPU"
        label = "simulated GPU"
        if capacity is None and ratio is None:  # the whole card of the backend's profile
            profile_name = getattr(getattr(self.backend_instance(), "profile", None), "name", None)
            label = f"simulated {profile_name}" if profile_name else "simulated card"
        spec = RunSpec(model=self.model.value, backend=self.resolved_backend, capacity_bytes=capacity,
                       oversubscription_ratio=ratio)
        # raises where the backend refuses it (e.g. a ratio leaving less than one 2 MiB chunk): the estimate
        # line says so, as the run would
        try:
            capacity = self.backend_instance().capacity_for(spec, int(footprint or 0))
        except SpecError as e:  # quote what the field holds, as given
            raise SpecError(f"{self.capacity_mode.value} {self.capacity_value.value!r}: {e}", e.field) from None
        return (None if capacity is None else int(capacity) // _CHUNK * _CHUNK), label

    # -- reacting ----------------------------------------------------------------------------------

    def _build_knobs(self, values: dict[str, Any]) -> None:
        import ipywidgets as w

        defaults = model_knobs(self.model.value)
        unknown = sorted(set(values) - set(defaults))
        if unknown:
            raise ModelConfigError(f"model {self.model.value!r} has no knob(s) {unknown} in the panel; its knobs: "
                                   f"{', '.join(defaults)}", unknown[0])
        self.knobs = {}
        for name, default in defaults.items():
            # unbounded: a value the model refuses is quoted in the estimate line, never clamped
            control = w.IntText(value=int(values.get(name, default)), description=name,
                                style={"description_width": "initial"}, layout=w.Layout(width="190px"))
            control.add_class(f"um-lab-knob-{name}")
            control.observe(lambda _c: self._refresh_estimate(), names="value")
            self.knobs[name] = control
        self.knob_box.children = list(self.knobs.values())

    def _model_changed(self, old: str) -> None:
        """Another model: its knobs as last set here (or as given), else its defaults; the old model's kept."""
        self._knob_memory[old] = self.model_kwargs()
        self._build_knobs(self._knob_memory.get(str(self.model.value), {}))
        self._refresh_estimate()

    def _settings_changed(self) -> None:
        name = self.resolved_backend
        simulated = self.simulates_capacity
        self.capacity_box.layout.display = None if simulated else "none"
        self.capacity_value.disabled = self.capacity_mode.value == "card"
        self._cap_bytes, self.cap_note.value = None, ""
        try:
            backend_class(name).check_available()
        except Exception as e:  # e.g. no GPU for cuda: said here, before Run is pressed
            self.cap_note.value = f"<span style='color:#c00'>{html.escape(f'{name}: {e}')}</span>"
        else:
            if not simulated:
                self._cap_bytes = self._run_limit(name)
                if self._cap_bytes:
                    self.cap_note.value = (f"{html_text(name)}: managed bytes are capped at "
                                           f"<b>{format_bytes(self._cap_bytes)}</b> (its safety cap); a run "
                                           "above it is refused before anything is allocated")
        self._refresh_estimate()

    def _run_limit(self, name: str) -> int | None:
        """What the backend says a run of the picked model must fit in (None: no limit)."""
        try:
            limit = self.backend_instance(name).capacity_for(RunSpec(model=self.model.value, backend=name), 0)
        except Exception:  # no limit it can tell here: none shown (the run's own pre-flight still checks)
            return None
        return None if limit is None else int(limit)

    def _refresh_estimate(self) -> None:
        """Recompute the estimate in the background; the newest request wins."""
        with self._lock:
            self._generation += 1
            generation = self._generation
        self.estimate.value = "estimating…"
        name, kwargs = self.model.value, self.model_kwargs()
        thread = threading.Thread(target=self._estimate, args=(generation, name, kwargs, self.training()), daemon=True,
                                  name="um_lab-estimate")
        _ESTIMATORS.add(thread)
        thread.start()
        if self._on_change is not None:
            self._on_change()

    def _estimate(self, generation: int, name: str, kwargs: dict[str, Any], training: dict[str, str]) -> None:
        footprint = None
        try:
            case = with_training(models.get_model(name, **kwargs), **training)
            backend = self.backend_instance() if self.simulates_capacity else None
            from um_lab.sim.profile import Profile

            profile = getattr(backend, "profile", None)  # the simulated card's, for its GEMM workspace
            estimate: MemoryEstimate | None = estimate_memory(
                case, profile=profile if isinstance(profile, Profile) else "h200")
            prepare = getattr(backend, "prepare", None) if self.simulates_capacity else None
            if callable(prepare):
                footprint = int(prepare(case).footprint_bytes)  # what the run will oversubscribe
            text = ""
        except Exception as e:  # shown in the panel; a bad size is the user's to fix
            estimate, text = None, f"<span style='color:#c00'>{html_text(f'cannot size {name}: {e}')}</span>"
        with self._lock:
            if generation != self._generation:
                return
            self.last_estimate, self.last_footprint = estimate, footprint
            self.last_sized = (name, dict(kwargs))
        if estimate is not None:
            try:
                capacity, label = self.capacity_bytes(footprint if footprint is not None else estimate.total_bytes)
                text = estimate_html(estimate, capacity, label, footprint)
            except Exception as e:  # e.g. a ratio typed as -1.5: said here (Run refuses it too), never a traceback
                text = (estimate_html(estimate, None, "", footprint)
                        + f"<div style='color:#c00'>{html_text(f'simulated GPU: {e}')}</div>")
        self.estimate.value = text

    def wait_estimate(self, timeout: float = 120.0) -> MemoryEstimate | None:
        """Block until the current estimate is shown (for scripts and tests)."""
        import time

        deadline = time.monotonic() + timeout
        while self.estimate.value == "estimating…" and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.last_estimate

