"""Plots and tables that read at a glance: axes from zero, empty states, capped overlays, units, remote bytes,
and only the models this install can build."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest
from test_runner import TINY_MLP, FakeBackend

import um_lab.runs.runner
import um_lab.runs.sweep
from um_lab import models
from um_lab.app.cli import main, summary_line
from um_lab.app.cli_args import SUMMARY_COLUMNS, format_table
from um_lab.summary import summarize
from um_lab.types import DATA_TYPES, RunSpec, StepRecord
from um_lab.units import format_bytes

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from um_lab.widgets.figures import (  # noqa: E402
    DASHBOARD_PANELS,
    MAX_LINES,
    NO_DATA_YET,
    NOT_MEASURED_HERE,
    REMOTE_TRACE,
    byte_unit,
    comparison_figure,
    dashboard_figure,
    residency_figure,
    speedup_figure,
    step_time_overlay,
    step_time_panels,
)

GIB, TIB = 2**30, 2**40
LONG_NUMBER = re.compile(r"\d{10,}")  #: a raw byte count such as 671174623232


def steady(n: int = 12, faults: int | None = 11_827, remote: int | None = 0) -> list[StepRecord]:
    """Records of a steady run: 320-325 ms steps, 11,827-11,831 faults, as the noise the axes must not zoom into."""
    return [StepRecord(step=i, wall_ms=320.0 + i % 6, live_bytes={"param": 2 * GIB, "act": GIB}, cap_bytes=None,
                       gpu_capacity_bytes=4 * GIB, resident_bytes={"param": GIB}, telemetry="simulated",
                       gpu_page_faults=None if faults is None else faults + i % 5,
                       htod_bytes={"param": 300 * 2**20}, dtoh_bytes={"param": 100 * 2**20}, remote_bytes=remote)
            for i in range(n)]


def _notes(fig) -> list:
    return list(fig.layout.annotations[len(DASHBOARD_PANELS):])


def _axis(fig, name):
    return fig.layout[name]


# ------------------------------------------------------------------------------------------- dashboard


def test_an_empty_dashboard_says_no_data_yet_and_has_no_negative_range():
    fig = dashboard_figure(())
    for k, (xaxis, yaxis, _) in enumerate(DASHBOARD_PANELS):
        for axis in (xaxis, yaxis):
            assert _axis(fig, axis).range == (0, 1) and _axis(fig, axis).autorange is False, axis
        note = _notes(fig)[k]
        assert note.visible and note.text == NO_DATA_YET


def test_step_time_and_fault_axes_start_at_zero_not_at_the_noise():
    fig = dashboard_figure(steady())
    for _, yaxis, _ in DASHBOARD_PANELS:
        assert _axis(fig, yaxis).rangemode == "tozero" and _axis(fig, yaxis).autorange is True, yaxis
    assert fig.layout.xaxis2.rangemode == "nonnegative"
    assert not any(note.visible for note in _notes(fig)), "every panel has data: no empty-state note"
    step_time = next(t for t in fig.data if t.name == "step time")
    assert min(step_time.y) >= 320  # the data is the noise band; the axis still starts at 0 (rangemode)


def test_a_panel_whose_quantity_no_step_measured_says_so():
    fig = dashboard_figure(steady(faults=None, remote=None))
    faults = DASHBOARD_PANELS.index(next(p for p in DASHBOARD_PANELS if "page faults" in p[2]))
    note = _notes(fig)[faults]
    assert note.visible and note.text == NOT_MEASURED_HERE
    assert fig.layout.yaxis4.range == (0, 1) and fig.layout.yaxis4.autorange is False
    assert not _notes(fig)[1].visible  # step time was measured


def test_the_residency_and_traffic_panels_have_their_own_legends_and_single_lines_none():
    fig = dashboard_figure(steady())
    by_name = {t.name: t for t in fig.data}
    for name in (*[t.value for t in DATA_TYPES], "GPU capacity"):
        assert by_name[name].legend == "legend" and by_name[name].showlegend is not False
    for name in ("migrated to GPU", "migrated to host", REMOTE_TRACE):
        assert by_name[name].legend == "legend2" and by_name[name].showlegend is not False
    for name in ("step time", "oversubscription", "page faults"):  # named by the panel's title
        assert by_name[name].showlegend is False
    assert fig.layout.legend2.y == pytest.approx(fig.layout.yaxis5.domain[1])  # beside its panel
    assert fig.layout.legend.y == pytest.approx(fig.layout.yaxis.domain[1])
    assert dashboard_figure(steady(), title="my run").layout.title.text == "my run"


def test_byte_panels_pick_a_readable_unit():
    assert byte_unit(0) == ("MiB", 2**20) and byte_unit(900 * 2**20) == ("MiB", 2**20)
    assert byte_unit(3 * GIB) == ("GiB", GIB) and byte_unit(3.7e12) == ("TiB", TIB)
    assert byte_unit(512, smallest="KiB") == ("KiB", 1024)
    big = dashboard_figure(steady(remote=2 * TIB))  # 2 TiB read over the link each step
    assert big.layout.yaxis5.title.text == "TiB" and "(TiB)" in big.layout.annotations[4].text
    remote = next(t for t in big.data if t.name == REMOTE_TRACE)
    assert list(remote.y) == pytest.approx([2.0] * 12)
    small = dashboard_figure(steady(remote=0))
    assert small.layout.yaxis5.title.text == "MiB"
    assert small.layout.yaxis.title.text == "GiB"  # 3 GiB live of a 4 GiB GPU


def test_the_live_dashboard_leaves_and_reenters_the_empty_state():
    from um_lab.widgets import LiveDashboard

    board = LiveDashboard()
    fig = board.widget
    assert all(note.visible and note.text == NO_DATA_YET for note in _notes(fig))
    assert fig.layout.yaxis2.range == (0, 1)
    for record in steady(faults=None):
        board.feed(record)
    board.draw()
    visible = [note.visible for note in _notes(fig)]
    assert visible == [False, False, False, True, False]  # only page faults: not measured
    assert _notes(fig)[3].text == NOT_MEASURED_HERE
    assert fig.layout.yaxis2.autorange is True and fig.layout.yaxis2.rangemode == "tozero"
    assert "simulated" in fig.layout.annotations[0].text
    board.reset()
    assert all(note.visible and note.text == NO_DATA_YET for note in _notes(fig))
    assert fig.layout.yaxis2.range == (0, 1) and fig.layout.yaxis2.autorange is False


def test_residency_and_comparison_figures_start_at_zero_and_say_when_empty():
    assert residency_figure(steady()).layout.yaxis.rangemode == "tozero"
    empty = residency_figure([])
    assert empty.layout.yaxis.range == (0, 1) and [a.text for a in empty.layout.annotations] == [NO_DATA_YET]
    table = pd.DataFrame({"model": ["mlp"] * 2, "policy": ["um-default", "gpu-first"], "ratio": [1.5, 1.5],
                          "median_ms": [320.0, 325.0], "speedup_vs_um-default": [1.0, 0.98]})
    assert comparison_figure(table).layout.yaxis.rangemode == "tozero"
    assert speedup_figure(table).layout.yaxis.rangemode == "tozero"
    assert speedup_figure(table, log_scale=True).layout.yaxis.type == "log"
    none = speedup_figure(table.iloc[:0])
    assert none.layout.yaxis.range == (0, 1) and "no runs" in none.layout.annotations[0].text


# ---------------------------------------------------------------------------------- step-time overlays


def _runs(n_models: int, n_ratios: int, n_policies: int) -> Iterator[tuple[str, str, list[StepRecord]]]:
    for m in range(n_models):
        for r in range(n_ratios):
            for p in range(n_policies):
                records = [StepRecord(step=i, wall_ms=10.0 * (p + 1) + m + r, live_bytes={}, cap_bytes=None,
                                      gpu_capacity_bytes=GIB) for i in range(4)]
                yield f"model{m} @ {r + 1}x", f"policy{p}", records


def test_an_overlay_of_48_runs_draws_at_most_max_lines_lines_the_rest_as_their_median():
    runs = [(f"{panel} {line}", records) for panel, line, records in _runs(2, 3, 8)]
    fig = step_time_overlay(runs)
    assert len(fig.data) == MAX_LINES <= 8
    grouped = fig.data[-1]
    assert grouped.name == f"median of {48 - MAX_LINES + 1} other runs" and grouped.line.dash == "dash"
    rest = [np.asarray([r.wall_ms for r in records]) for _, records in runs[MAX_LINES - 1:]]
    assert list(grouped.y) == pytest.approx(list(np.median(np.vstack(rest), axis=0)))
    assert fig.layout.yaxis.rangemode == "tozero"
    assert len(step_time_overlay(runs[:3]).data) == 3  # few runs: every one drawn


def test_step_time_panels_draw_one_panel_per_cell_and_one_legend_entry_per_policy():
    fig = step_time_panels(list(_runs(2, 3, 8)))
    titles = [a.text for a in fig.layout.annotations]
    assert titles == [f"model{m} @ {r}x" for m in range(2) for r in (1, 2, 3)]
    assert len(fig.data) == 48
    shown = [t.name for t in fig.data if t.showlegend is not False]
    assert shown == [f"policy{p}" for p in range(8)], "each policy once in the legend"
    colours = {}
    for trace in fig.data:
        colours.setdefault(trace.name, set()).add(trace.line.color)
    assert all(len(c) == 1 for c in colours.values()), "a policy has one colour in every panel"
    assert all(fig.layout[f"yaxis{k if k > 1 else ''}"].rangemode == "tozero" for k in range(1, 7))


def test_step_time_panels_cap_lines_per_panel_and_panels():
    fig = step_time_panels(list(_runs(1, 2, 11)))
    per_panel: dict[str, int] = {}
    for trace in fig.data:
        per_panel[trace.xaxis] = per_panel.get(trace.xaxis, 0) + 1
    assert set(per_panel.values()) == {MAX_LINES}
    assert sum(t.name.startswith("median of") for t in fig.data) == 2
    many = step_time_panels(list(_runs(5, 3, 1)), max_panels=12)  # 15 cells
    assert len(many.data) == 12 and "the first 12 of 15 panels" in many.layout.title.text
    empty = step_time_panels([])
    assert len(empty.data) == 0 and empty.layout.yaxis.range == (0, 1)


# ------------------------------------------------------------------------------- units and remote bytes


def test_byte_counts_are_never_printed_raw():
    assert format_bytes(671174623232) == "625.08 GiB"
    assert format_bytes(3.7e12) == "3.37 TiB"
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**20) == "3.00 MiB"


def test_summaries_put_remote_bytes_next_to_migrated_bytes():
    keys = list(summarize([]))
    assert keys[keys.index("migrated_bytes") + 1] == "remote_bytes"
    assert SUMMARY_COLUMNS[SUMMARY_COLUMNS.index("migrated_bytes") + 1] == "remote_bytes"


def test_the_cli_table_shows_remote_bytes_in_units_and_no_raw_counts():
    table = pd.DataFrame({"model": ["gpt2-xl"] * 2, "policy": ["um-default", "gpu-first"], "ratio": [1.5, 1.5],
                          "steps": [20, 20], "median_ms": [1234.5678, 320.25], "mean_ms": [1240.0, 321.0],
                          "p90_ms": [1300.0, 322.0], "speedup_vs_um-default": [1.0, 3.855],
                          "migrated_bytes": [671174623232, 0], "remote_bytes": [None, 4_068_193_022_771],
                          "gpu_page_faults": [11_827_000, 0], "evictions": [42, 0], "status": ["complete"] * 2})
    text = format_table(table)
    assert "remote_bytes" in text and "625.08 GiB" in text and "3.70 TiB" in text
    assert "1,234.568 ms" in text and "3.855x" in text and "11,827,000" in text and "—" in text
    assert not LONG_NUMBER.search(text.replace(",", "")), text


def test_summary_lines_carry_units():
    assert summary_line("migrated_bytes", 671174623232).split() == ["migrated_bytes", "625.08", "GiB"]
    assert summary_line("median_ms", 320.25).split() == ["median_ms", "320.250", "ms"]
    assert summary_line("remote_bytes", None).split() == ["remote_bytes", "—"]
    assert summary_line("oversubscription", 1.5).split() == ["oversubscription", "1.500"]
    assert summary_line("gpu_page_faults", 11827).split() == ["gpu_page_faults", "11,827"]


class BigTraffic(FakeBackend):
    """The fake, moving what a large model moves: 625 GiB migrated and 3.7 TB read over the link a step."""

    def run(self, spec, case, policy):
        for record in super().run(spec, case, policy):
            record.htod_bytes = {"param": 671174623232}
            record.dtoh_bytes = None
            record.remote_bytes = 3_700_000_000_000
            yield record


@pytest.fixture
def big_traffic(monkeypatch):
    def make(name="auto", **options):
        return BigTraffic()

    monkeypatch.setattr(um_lab.runs.runner, "get_backend", make)
    monkeypatch.setattr(um_lab.runs.sweep, "get_backend", make)


def _without_paths(out: str, root) -> str:
    return "\n".join(line for line in out.splitlines() if str(root) not in line)


def test_cli_run_show_and_compare_print_units_and_remote_bytes(big_traffic, tmp_path, capsys):
    tiny = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]
    assert main(["run", "--backend", "sim", "--policy", "gpu-first", "--steps", "2", "--warmup", "0",
                 "--out", str(tmp_path / "runs"), "--no-progress", *tiny]) == 0
    out = _without_paths(capsys.readouterr().out, tmp_path)
    assert re.search(r"migrated_bytes\s+1\.22 TiB", out), out  # 2 steps x 625 GiB
    assert re.search(r"remote_bytes\s+6\.73 TiB", out), out
    assert re.search(r"median_ms\s+[\d.]+ ms", out) and re.search(r"peak_live_bytes\s+4.88 KiB", out)
    assert not LONG_NUMBER.search(out), out
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert main(["show", str(run_dir)]) == 0
    shown = _without_paths(capsys.readouterr().out, tmp_path)
    assert re.search(r"remote_bytes\s+6\.73 TiB", shown) and re.search(r"htod_bytes\s+1\.22 TiB", shown)
    assert not LONG_NUMBER.search(shown), shown
    assert main(["compare", "--backend", "sim", "--policies", "gpu-first", "--ratios", "none", "--steps", "1",
                 "--warmup", "0", "--out", str(tmp_path / "cmp"), "--no-progress", *tiny]) == 0
    table = _without_paths(capsys.readouterr().out, tmp_path)
    assert "remote_bytes" in table and "3.37 TiB" in table and "625.08 GiB" in table
    assert not LONG_NUMBER.search(table.replace(",", "")), table


def test_the_compare_views_table_has_remote_bytes_next_to_migrated(tmp_path):
    from um_lab.runs.sweep import compare
    from um_lab.widgets.compare_view import readable

    table = compare({"mlp": TINY_MLP}, ["gpu-first"], steps=2, warmup_steps=0, out_dir=tmp_path,
                    backend_instance=BigTraffic())
    shown = readable(table)
    columns = list(shown.columns)
    assert columns[columns.index("migrated") + 1] == "remote (read over the link)"
    assert set(shown["remote (read over the link)"]) == {"6.73 TiB"}
    assert not LONG_NUMBER.search(shown.to_string())


# ------------------------------------------------------------------------------- only what can run


@pytest.fixture
def no_torchvision(monkeypatch):
    """This install as one without torchvision (whatever is installed here)."""
    real = models.module_importable
    monkeypatch.setattr(models, "module_importable", lambda module: module != "torchvision" and real(module))


def test_without_torchvision_the_model_lists_leave_out_resnet_and_vit(no_torchvision, tmp_path):
    from um_lab.widgets import CompareView, WorkloadPicker

    buildable = models.buildable_models()
    assert "mlp" in buildable and not any(n.startswith(("resnet", "vit")) for n in buildable)
    picker = WorkloadPicker("mlp", {"width": 16, "depth": 1, "batch_size": 4}, backend="sim")
    assert not any(n.startswith(("resnet", "vit")) for n in picker.model.options)
    assert "resnet50" in picker.model_note.value and "vit-b16" in picker.model_note.value
    view = CompareView(models={"mlp": TINY_MLP}, out_dir=tmp_path)
    assert not any(n.startswith(("resnet", "vit")) for n in view.models.options)
    asked = WorkloadPicker("resnet50", backend="sim")  # named on purpose: offered, its estimate says what it lacks
    assert "resnet50" in asked.model.options and "vit-b16" not in asked.model.options
    picker.wait_estimate()
    asked.wait_estimate()


def test_the_install_hint_keeps_a_cpu_torch_cpu(no_torchvision, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    need = models.model_needs("resnet50")
    assert need == "needs torchvision: pip install torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert "um_lab[models]" not in need
    assert models.install_hint("transformers") == "pip install transformers"
    from um_lab.widgets.workload import missing_models_html

    assert "download.pytorch.org/whl/cpu" in missing_models_html() and "um_lab[models]" not in missing_models_html()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert models.install_hint("torchvision") == "pip install 'um_lab[models]'"
    assert models.model_needs("mlp") is None and models.model_needs("not-a-model") is None


def test_a_library_that_is_installed_but_does_not_import_counts_as_missing(tmp_path, monkeypatch):
    (tmp_path / "broken_vision_lib.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(models._IMPORTABLE, "broken_vision_lib", raising=False)
    assert models.module_importable("broken_vision_lib") is False
    assert models.module_importable("no_such_module_here") is False
    assert models.module_importable("json") is True
    models._IMPORTABLE.pop("broken_vision_lib", None)
    models._IMPORTABLE.pop("no_such_module_here", None)


def test_the_cli_model_listing_names_what_is_missing_and_how_to_add_it(no_torchvision, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "not here: needs torchvision" in lines["resnet50"] and "whl/cpu" in lines["vit-b16"]
    assert "not here" not in lines["mlp"]


def test_run_spec_still_names_any_zoo_model():
    assert RunSpec(model="resnet50").model == "resnet50"  # the list filters what is offered, not what exists
