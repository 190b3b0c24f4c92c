"""``CompareView()``: pick policies x ratios (x models), run them in the background with progress, then see
median step time with speed-up against ``um-default`` (log scale optional), step-time overlays and a table.

::

    from um_lab.widgets import CompareView
    view = CompareView(models={"mlp": {"width": 1024}}, policies=["gpu-first", "prefetch-all"], ratios=[0.8, 1.5])
    view                    # the panel; press Compare
    view.run(wait=True)     # or from code
    view.figure()           # static figures and the table for exported notebooks
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from um_lab.backend import backend_class, resolve_backend_name, valid_backend_names
from um_lab.errors import ModelConfigError, PolicyError, SpecError, UmLabError
from um_lab.models import ZOO
from um_lab.policy import named_policies
from um_lab.runs import runexit
from um_lab.runs.runlog import default_out_dir
from um_lab.runs.runner import RunStateError
from um_lab.runs.runread import load
from um_lab.runs.sweep import BASELINE_POLICY, compare
from um_lab.summary import readable_table
from um_lab.widgets._checks import (
    model_kwargs_value,
    model_name,
    no_duplicates,
    optional_positive,
    out_dir_value,
    sequence_value,
    whole_number,
)
from um_lab.widgets._html import error_text, html_text, wrapping
from um_lab.widgets._waiting import wait_for
from um_lab.widgets.figures import display_bundle, speedup_figure, step_time_panels
from um_lab.widgets.workload import backend_choices, model_choices

#: the readable table's columns: remote bytes (read over the link, never migrated) next to the migrated ones,
#: so a policy that migrates nothing and faults nothing is not read as moving nothing
_TABLE_COLUMNS = {"model": "model", "policy": "policy", "ratio": "ratio", "median_ms": "median ms",
                  "p90_ms": "p90 ms", f"speedup_vs_{BASELINE_POLICY}": "speed-up", "migrated_bytes": "migrated",
                  "remote_bytes": "remote (read over the link)", "gpu_page_faults": "faults",
                  "evictions": "evictions", "status": "status"}
MODEL_ROWS = 6  #: rows of the models list (the models picked are listed first, so they are in view)


def parse_ratios(text: str) -> list[float | None]:
    """``"0.8, 1.5, none"`` -> ``[0.8, 1.5, None]``; a :class:`SpecError` (a ``ValueError``) names the bad
    entry: not a number, not finite and > 0, or a ratio given twice (``1.5, 1.5x``; ``none, card``)."""
    if not isinstance(text, str):
        raise SpecError(f"ratios must be text such as '0.8, 1.5, none', got {text!r}", "ratios")
    out: list[float | None] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if part.lower() in ("none", "card"):
            out.append(None)
            continue
        try:
            value = float(part.rstrip("xX"))
        except ValueError:
            raise SpecError(f"not a ratio: {part!r} (numbers > 0, or 'none' for the whole card)", "ratios") from None
        if not (math.isfinite(value) and value > 0):
            raise SpecError(f"ratio must be a finite number > 0, got {part!r}", "ratios")
        out.append(value)
    if not out:
        raise SpecError("give at least one ratio, e.g. 0.8, 1.5", "ratios")
    no_duplicates("ratios", out, text)
    return out


def ratio_text(ratio: float | None) -> str:
    """A ratio as the ratios field shows it: ``none`` for the whole card, else the number exactly (``1.5``;
    never rounded, so the field reads back as the ratio given)."""
    if ratio is None:
        return "none"
    short = f"{ratio:g}"
    return short if float(short) == ratio else repr(float(ratio))


def model_list(picked: Sequence[str] = ()) -> list[str]:
    """The models list's options: the models picked first (in view without scrolling), then the others this
    install can build, in zoo order (no ResNet or ViT without torchvision)."""
    picked = [name for name in picked if name in ZOO]
    return [*picked, *(name for name in model_choices() if name not in picked)]


def reports_band(backend: str) -> bool:
    """True when backend ``backend`` (``auto`` resolved) can bracket its runs' step times with an
    uncertainty band (its ``reports_uncertainty_band``); False for one that cannot be resolved here."""
    try:
        return bool(getattr(backend_class(resolve_backend_name(backend)), "reports_uncertainty_band", False))
    except Exception:  # unknown now, or its module cannot be imported: no band to offer
        return False


def readable(table: pd.DataFrame, baseline: str = BASELINE_POLICY) -> pd.DataFrame:
    """The comparison's main columns, renamed and formatted by :func:`um_lab.summary.readable_table`
    (ms to 2 decimals, speed-ups as ``1.23x``, bytes in KiB/MiB/GiB, ``—`` where not measured)."""
    columns = {k: v for k, v in _TABLE_COLUMNS.items() if not k.startswith("speedup")}
    columns = {**dict(list(columns.items())[:5]), f"speedup_vs_{baseline}": f"speed-up vs {baseline}",
               **dict(list(columns.items())[5:])}
    present = [c for c in columns if c in table.columns]
    out = readable_table(table[present]).rename(columns=columns)
    if {"speedup_band_lo", "speedup_band_hi"} <= set(table.columns):  # the uncertainty band
        band = [("—" if pd.isna(lo) or pd.isna(hi) else f"{lo:.2f}–{hi:.2f}x")
                for lo, hi in zip(table["speedup_band_lo"], table["speedup_band_hi"], strict=True)]
        speedup = f"speed-up vs {baseline}"
        at = list(out.columns).index(speedup) + 1 if speedup in out else len(out.columns)
        out.insert(at, "speed-up band", band)
        flips = table["ranking_flips"] if "ranking_flips" in table else pd.Series([pd.NA] * len(table))
        out.insert(at + 1, "ranking flips in band", ["yes" if f is True else "" for f in flips.tolist()])
    return out


class _Progress:
    """The tqdm-like object ``compare`` drives: moves the panel's progress bar and status."""

    def __init__(self, view: CompareView) -> None:
        self.view = view

    def update(self, n: int = 1) -> None:
        self.view.progress.value += n

    def set_postfix_str(self, text: str) -> None:
        if self.view._stop.is_set():  # compare() asks before each run: stop between runs
            raise ComparisonStopped(f"stopped after {self.view.progress.value} of {self.view.progress.max} runs")
        self.view._say(f"running {self.view.progress.value + 1}/{self.view.progress.max}: {text}")


class ComparisonStopped(UmLabError):
    """Stop was pressed: the comparison ended after the run in progress (finished runs stay on disk)."""


class CompareView:
    """The comparison panel: policies x ratios x models on one backend (any registered one), results as
    figures and a table. The uncertainty band is offered on a backend that reports one (the simulator)."""

    def __init__(self, models: Sequence[str] | Mapping[str, Mapping[str, Any]] = ("mlp",),
                 policies: Sequence[str] = ("gpu-first", "prefetch-all", "zero-copy-params"),
                 ratios: Sequence[float | None] = (0.8, 1.5), backend: str = "sim", steps: int = 5,
                 warmup_steps: int = 1, out_dir: str | os.PathLike[str] | None = None) -> None:
        import ipywidgets as w

        # every argument checked up front: a typed UmLabError naming it and quoting the value
        choices = backend_choices()
        if not isinstance(backend, str) or backend not in choices:
            raise SpecError(f"unknown backend {backend!r}; valid: {valid_backend_names()}", "backend")
        if isinstance(models, Mapping):
            names = [model_name(m, "model") for m in models]
            self.model_kwargs = {m: model_kwargs_value(m, kw, "models", integers=False)
                                 for m, kw in models.items()}
        else:
            names = [model_name(m, "model") for m in sequence_value("models", models, ModelConfigError)]
            self.model_kwargs = {}
        no_duplicates("models", names, error=ModelConfigError)
        policies = sequence_value("policies", policies, PolicyError)
        for p in policies:
            if not isinstance(p, str) or p not in named_policies():
                raise PolicyError("policies", f"unknown policy {p!r}; valid: {', '.join(named_policies())}")
        no_duplicates("policies", policies, error=PolicyError)
        ratios = [optional_positive("ratios", r) for r in sequence_value("ratios", ratios)]
        no_duplicates("ratios", ratios)
        for name, given in (("models", names), ("policies", policies), ("ratios", ratios)):
            if not given:
                raise SpecError(f"{name}: give at least one", name)
        steps = whole_number("steps", steps, 1)
        warmup_steps = whole_number("warmup_steps", warmup_steps, 0)
        out_dir_value(out_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
        self.models = w.SelectMultiple(options=model_list(names), value=names, description="models",
                                       rows=MODEL_ROWS)
        self.policies = w.SelectMultiple(options=list(named_policies()), value=list(policies), description="policies",
                                         rows=7)
        self.ratios = w.Text(value=", ".join(ratio_text(r) for r in ratios),
                             description="ratios", placeholder="0.8, 1.5, none")
        self.backend = w.Dropdown(options=choices, value=backend, description="backend")
        self.backend.add_class("um-lab-compare-backend")
        self.steps = w.IntText(value=steps, description="steps")  # a value < 1 is refused at Compare
        self.warmup = warmup_steps
        self.log_scale = w.Checkbox(value=False, description="log scale", indent=False)
        #: on a backend that reports one (the simulator: each run also at both ends of the profile constants'
        #: ranges, um_lab.sim.band); disabled on the others
        self.band = w.Checkbox(value=True, description="uncertainty band", indent=False)
        self.backend.observe(lambda _c: self._backend_changed(), names="value")
        self._backend_changed()
        self.run_button = w.Button(description="Compare", icon="play", button_style="success")
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.stop_button.on_click(lambda _b: self.stop())
        self.progress = w.IntProgress(value=0, min=0, max=1, description="runs")
        self.status = w.HTML("pick policies and ratios, then press Compare")
        self.output = w.Output()
        for name, control in (("models", self.models), ("policies", self.policies), ("ratios", self.ratios),
                              ("steps", self.steps), ("output", self.output), ("run", self.run_button),
                              ("stop", self.stop_button), ("status", self.status), ("progress", self.progress)):
            control.add_class(f"um-lab-compare-{name}")
        self.run_button.on_click(lambda _b: self.run())
        self.log_scale.observe(lambda _c: self._show(), names="value")
        self.widget = w.VBox([w.HTML("<h3 style='margin:4px 0'>Compare policies</h3>"),
                              w.HBox([self.models, self.policies], layout=wrapping()),
                              w.HBox([self.ratios, self.backend, self.steps, self.log_scale, self.band],
                                     layout=wrapping()),
                              w.HBox([self.run_button, self.stop_button, self.progress], layout=wrapping()),
                              self.status, self.output])
        self.widget.add_class("um-lab-compare")
        self.table: pd.DataFrame | None = None
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._before: set[Path] = set()  # the comparison folders there before the last Compare
        self._ended = threading.Event()  # set when no comparison is running
        self._ended.set()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _backend_changed(self) -> None:
        supported = reports_band(self.backend.value)
        self.band.disabled = not supported
        self.band.description = "uncertainty band" if supported else "uncertainty band (not on this backend)"

    def _say(self, text: str, colour: str = "#000") -> None:
        """Show plain ``text`` in the status line (escaped: names, paths and errors may hold ``<``)."""
        self.status.value = f"<span style='color:{colour}'>{html_text(text)}</span>"

    def run(self, wait: bool = False, timeout: float | None = None) -> None:
        """Run the comparison in the background (what Compare does); bad input is explained in the panel."""
        if not self._ended.is_set():
            self._say("a comparison is already running", "#a60")
            return
        self.last_error = None
        self._stop.clear()
        try:  # every cell checked before the first run: nothing runs twice, no table is lost late
            ratios = parse_ratios(self.ratios.value)
            models = list(self.models.value)
            if not models or not self.policies.value:
                raise SpecError("pick at least one model and one policy", "models")
            no_duplicates("models", models, error=ModelConfigError)
            no_duplicates("policies", list(self.policies.value), error=PolicyError)
            whole_number("steps", self.steps.value, 1)
        except ValueError as e:
            self.last_error = e
            self._say(f"error: {e}", "#c00")
            return
        policies = list(self.policies.value)
        n_policies = len(policies) + (BASELINE_POLICY not in policies)
        self.progress.max, self.progress.value, self.progress.bar_style = len(models) * len(ratios) * n_policies, 0, ""
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._before = self._comparison_folders()
        self._ended.clear()
        models_arg = {m: self.model_kwargs.get(m, {}) for m in models}
        threading.Thread(target=self._compare, args=(models_arg, policies, ratios), daemon=True,
                         name="um_lab-compare").start()
        if wait:
            self.wait(timeout)

    def _comparison_folders(self) -> set[Path]:
        """The comparison folders under ``out_dir`` now."""
        return set(self.out_dir.glob("compare-*")) if self.out_dir.is_dir() else set()

    def stop(self) -> None:
        """End the comparison after the step in progress (what Stop does): the run going stops there (its
        completed steps stay on disk and in the table, status ``stopped``) and no further run starts."""
        if not self._ended.is_set():
            self._stop.set()
            for folder in self._comparison_folders() - self._before:  # this comparison's: made after Compare
                runexit.stop_open_runs(folder)
            self._say("stopping after the current step…", "#a60")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the comparison ended; True when it has. An interrupt while waiting stops it too."""
        return wait_for(self._ended, timeout, self.stop)

    def _compare(self, models: dict[str, dict[str, Any]], policies: list[str], ratios: list[float | None]) -> None:
        self.table = None  # never the previous comparison's figures
        self.output.outputs = ()
        try:
            band = bool(self.band.value) and reports_band(self.backend.value)
            self.table = compare(models, policies, ratios, backend=self.backend.value, steps=int(self.steps.value),
                                 warmup_steps=self.warmup, out_dir=self.out_dir, progress=_Progress(self),
                                 keep_going=True, band=band)
            failed = int((self.table["status"] != "complete").sum())
            note = f"; {failed} run(s) failed or were refused (see the table)" if failed else ""
            self._say(f"done: {len(self.table)} runs{note}. Folder: {self.table.attrs.get('sweep_dir')}",
                      "#a60" if failed else "#080")
            self.progress.bar_style = "warning" if failed else "success"
            self._show()
        except ComparisonStopped as e:
            folders = sorted(self._comparison_folders() - self._before)
            self._say(f"{e}; their folders are in {folders[-1] if folders else self.out_dir}", "#a60")
            self.progress.bar_style = "warning"
            self._show_partial(e)
        except Exception as e:  # shown in the panel, never a traceback
            self.last_error = e
            self._say(f"error: {error_text(e)}", "#c00")
            self.progress.bar_style = "danger"
            self._show_partial(e)
        finally:
            self.run_button.disabled, self.stop_button.disabled = False, True
            self._ended.set()

    def _show_partial(self, error: BaseException) -> None:
        """The table of the runs made before a comparison stopped or failed (``compare`` hands it over), shown
        as a finished one is; nothing when no run finished."""
        table = getattr(error, "compare_table", None)
        if table is not None and len(table):
            self.table = table
            try:
                self._show()
            except Exception:  # a partial table that cannot be drawn: the status line says what happened
                self.output.outputs = ()

    def _show(self) -> None:
        if self.table is None:
            return
        bars, overlay = self.figures()
        table = readable(self.table)
        self.output.outputs = (display_bundle(bars), display_bundle(overlay),
                               {"output_type": "display_data", "metadata": {},
                                "data": {"text/html": table.to_html(index=False), "text/plain": table.to_string()}})

    def figures(self) -> tuple[Any, Any]:
        """(speed-up bars, step-time overlay) of the last comparison, as plain plotly figures."""
        if self.table is None:
            raise RunStateError("no comparison yet: press Compare or call view.run(wait=True)")
        bars = speedup_figure(self.table, BASELINE_POLICY, self.log_scale.value)
        runs = []
        for row in self.table.itertuples():
            if not isinstance(row.run_dir, str):  # refused before it started: nothing to draw
                continue
            ratio = "card" if pd.isna(row.ratio) else f"{row.ratio:g}x"
            runs.append((f"{row.model} @ {ratio}", str(row.policy), load(row.run_dir).records()))
        # one small panel per (model, ratio), one line per policy in the same colour in every panel
        overlay = step_time_panels(runs)
        if self.log_scale.value:
            overlay.update_yaxes(type="log")
        return bars, overlay

    def readable_table(self) -> pd.DataFrame:
        """The last comparison's table, rounded and readable."""
        if self.table is None:
            raise RunStateError("no comparison yet: press Compare or call view.run(wait=True)")
        return readable(self.table)
