"""The advice grid: a row per data type (or per paper group) x preferred location, accessed by, read-mostly,
prefetch; a preset dropdown that fills it; save / load as JSON; warnings shown inline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from um_lab.advice_notes import policy_notes
from um_lab.errors import FileReadError, PolicyError, UmLabError
from um_lab.policy import PREFERRED_LOCATIONS, PREFETCHES, Advice, Policy, get_policy, named_policies
from um_lab.types import DATA_TYPES, PAPER_GROUPS, DataType
from um_lab.widgets._html import html_text

CUSTOM = "custom"


class _Row:
    """One row of controls editing the advice of one or more data types."""

    def __init__(self, label: str, dtypes: tuple[DataType, ...], on_change: Callable[[_Row], None]) -> None:
        import ipywidgets as w

        self.dtypes = dtypes
        self.label = w.HTML(f"<b>{html_text(label)}</b>", layout=w.Layout(width="150px"))
        self.preferred = w.Dropdown(options=PREFERRED_LOCATIONS, layout=w.Layout(width="90px"))
        self.by_gpu = w.Checkbox(description="gpu", indent=False, layout=w.Layout(width="55px"))
        self.by_cpu = w.Checkbox(description="cpu", indent=False, layout=w.Layout(width="55px"))
        self.read_mostly = w.Checkbox(indent=False, layout=w.Layout(width="90px"))
        self.prefetch = w.Dropdown(options=PREFETCHES, layout=w.Layout(width="170px"))
        self.note = w.HTML(layout=w.Layout(width="260px"))
        self.box = w.HBox([self.label, self.preferred, self.by_gpu, self.by_cpu, self.read_mostly, self.prefetch,
                           self.note])
        self.box.add_class(f"um-lab-advice-{label.replace(' ', '-')}")
        for control in self.controls:
            control.observe(lambda _change: on_change(self), names="value")

    @property
    def controls(self) -> tuple[Any, ...]:
        return (self.preferred, self.by_gpu, self.by_cpu, self.read_mostly, self.prefetch)

    def advice(self) -> Advice:
        accessed = {p for p, box in (("gpu", self.by_gpu), ("cpu", self.by_cpu)) if box.value}
        return Advice(self.preferred.value, frozenset(accessed), bool(self.read_mostly.value), self.prefetch.value)

    def show(self, advice: Advice, mixed: bool = False) -> None:
        self.preferred.value = advice.preferred_location
        self.by_gpu.value = "gpu" in advice.accessed_by
        self.by_cpu.value = "cpu" in advice.accessed_by
        self.read_mostly.value = advice.read_mostly
        self.prefetch.value = advice.prefetch
        self.note.value = ("<span style='color:#a60'>these types differ; editing sets all of them</span>"
                           if mixed else "")


class AdviceGrid:
    """Edits a :class:`Policy`: ``grid.policy`` is what the controls say; ``grid.set_policy(p)`` shows ``p``."""

    def __init__(self, policy: Policy | str = "um-default", on_change: Callable[[Policy], None] | None = None,
                 policy_dir: str | Path = ".") -> None:
        import ipywidgets as w

        self._on_change = on_change
        self._quiet = False
        self._policy = get_policy(policy)
        self.preset = w.Dropdown(options=[*named_policies(), CUSTOM], description="preset",
                                 layout=w.Layout(width="280px"))
        self.preset.add_class("um-lab-preset")
        self.description = w.HTML(layout=w.Layout(width="100%"))
        self.description.add_class("um-lab-policy-description")
        self.three_types = w.ToggleButton(value=False, description="paper's three types",
                                          tooltip="group param+grad+optim as the paper's 'model parameters'")
        self.three_types.add_class("um-lab-three-types")
        header = w.HBox([w.HTML(f"<i>{text}</i>", layout=w.Layout(width=width)) for text, width in (
            ("data type", "150px"), ("preferred", "90px"), ("accessed by", "110px"), ("read-mostly", "90px"),
            ("prefetch", "170px"), ("", "260px"))])
        self._rows5 = [_Row(t.value, (t,), self._edited) for t in DATA_TYPES]
        self._rows3 = [_Row(name, types, self._edited) for name, types in PAPER_GROUPS.items()]
        self.rows = w.VBox()
        self.notes = w.HTML()
        self.notes.add_class("um-lab-advice-notes")
        self.path = w.Text(value=str(Path(policy_dir) / "policy.json"), description="JSON file",
                           layout=w.Layout(width="360px"))
        self.save_button = w.Button(description="Save", icon="save", layout=w.Layout(width="80px"))
        self.load_button = w.Button(description="Load", icon="folder-open", layout=w.Layout(width="80px"))
        self.file_status = w.HTML()
        self.file_status.add_class("um-lab-file-status")
        self.save_button.on_click(lambda _b: self.save())
        self.load_button.on_click(lambda _b: self.load())
        self.preset.observe(self._preset_chosen, names="value")
        self.three_types.observe(lambda _c: self._layout_rows(), names="value")
        self.widget = w.VBox([w.HBox([self.preset, self.three_types]), self.description, header, self.rows,
                              self.notes, w.HBox([self.path, self.save_button, self.load_button]),
                              self.file_status])
        self.widget.add_class("um-lab-advice")
        self._layout_rows()
        self.set_policy(self._policy)

    # -- the policy --------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The policy the grid shows (named after its preset, or ``custom`` once edited)."""
        return self._policy

    def set_policy(self, policy: Policy | str) -> None:
        """Show ``policy`` (a preset name or a :class:`Policy`) in the grid. A policy that carries a preset's
        name but other advice is shown as custom and renamed, so runs never record it as that preset."""
        policy = get_policy(policy)
        if policy.name in named_policies() and policy != named_policies()[policy.name]:
            policy = Policy(f"{policy.name} (edited)", policy.advice, policy.description)
        self._policy = policy
        self._quiet = True
        try:
            self.preset.value = self._policy.name if self._policy.name in named_policies() else CUSTOM
            self._show()
        finally:
            self._quiet = False
        self._changed()

    def _show(self) -> None:
        for row in self._rows5 + self._rows3:
            values = {self._policy[t] for t in row.dtypes}
            row.show(self._policy[row.dtypes[0]], mixed=len(values) > 1)
        # a policy's description (and name) may come from a shared file: shown as text, never as HTML
        self.description.value = (f"<small>{html_text(self._policy.description)}</small>"
                                  if self._policy.description else "")

    def _layout_rows(self) -> None:
        self.rows.children = [r.box for r in (self._rows3 if self.three_types.value else self._rows5)]

    def _preset_chosen(self, change: dict[str, Any]) -> None:
        if self._quiet or change["new"] == CUSTOM:
            return
        self.set_policy(change["new"])

    def _edited(self, row: _Row) -> None:
        """One row was edited: only that row's data types change (a paper group sets all of its types)."""
        if self._quiet:
            return
        advice = dict(self._policy.advice)
        try:
            for dtype in row.dtypes:
                advice[dtype] = row.advice()
        except PolicyError as e:  # the dropdowns only offer valid values; kept for safety
            self.notes.value = f"<span style='color:#c00'>{html_text(e)}</span>"
            return
        if advice == dict(self._policy.advice):
            return
        name = CUSTOM if self._policy.name in named_policies() else self._policy.name  # a loaded policy keeps its name
        self._policy = Policy(name, advice, "edited: not a preset")
        self._quiet = True
        try:
            self.preset.value = CUSTOM
            self._show()
        finally:
            self._quiet = False
        self._changed()

    def _changed(self) -> None:
        notes = policy_notes(self._policy)
        self.notes.value = "".join(
            f"<div style='color:#a60'>&#9888; <b>{html_text(dtype)}</b>: {html_text(text)}</div>"
            for dtype, texts in notes.items() for text in texts)
        if self._on_change is not None:
            self._on_change(self._policy)

    # -- files -------------------------------------------------------------------------------------

    def save(self, path: str | Path | None = None) -> Path | None:
        """Write the policy as JSON (to the path field by default); errors show in the panel."""
        target = Path(path or self.path.value)
        try:
            saved = self._policy.save(target)
        except OSError as e:
            self._file_says(f"cannot save {target}: {e.strerror or e}", "#c00")
            return None
        self._file_says(f"saved policy {self._policy.name!r} to {saved}")
        return saved

    def load(self, path: str | Path | None = None) -> Policy | None:
        """Read a policy JSON file into the grid; a bad file is explained in the panel, the grid unchanged."""
        source = Path(path or self.path.value)
        try:
            policy = Policy.load(source)
        except OSError as e:
            self._file_says(f"cannot read {source}: {e.strerror or e}", "#c00")
            return None
        except FileReadError as e:  # missing, not a regular file, too large, not UTF-8: the message names it
            self._file_says(f"{'not a valid policy' if source.is_file() else 'cannot read'}: {e}", "#c00")
            return None
        except (UmLabError, ValueError, RecursionError) as e:  # ValueError: not text (UnicodeDecodeError)
            self._file_says(f"{source} is not a valid policy: {e}", "#c00")
            return None
        self.set_policy(policy)
        self._file_says(f"loaded policy {policy.name!r} from {source}")
        return policy

    def _file_says(self, text: str, colour: str = "#000") -> None:
        """Show plain ``text`` as the file status (escaped: paths, names and errors may hold ``<``)."""
        self.file_status.value = f"<span style='color:{colour}'>{html_text(text)}</span>"
