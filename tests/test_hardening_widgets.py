"""The notebook panels under bad input: every constructor argument refused with a typed error that names it and
quotes it, nothing clamped or changed silently, values typed into the panel refused in its status line, and
text from files, names and errors shown as text in the page (escaped), never as HTML."""

import json
import threading

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import pandas as pd  # noqa: E402

from um_lab import models  # noqa: E402
from um_lab.errors import ModelConfigError, PolicyError, SpecError, UmLabError  # noqa: E402
from um_lab.policy import Advice, Policy  # noqa: E402
from um_lab.types import StepRecord  # noqa: E402
from um_lab.widgets import AdviceGrid, CompareView, Lab  # noqa: E402
from um_lab.widgets import compare_view as compare_view_module  # noqa: E402
from um_lab.widgets.compare_view import parse_ratios, ratio_text  # noqa: E402
from um_lab.widgets.figures import (  # noqa: E402
    dashboard_figure,
    display_bundle,
    speedup_figure,
    step_time_overlay,
)

TINY_MLP = {"width": 256, "depth": 2, "batch_size": 32}
PAYLOAD = '<img src=x onerror="window.__pwned=1">'
ESCAPED = "&lt;img src=x onerror=&quot;window.__pwned=1&quot;&gt;"


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped any thread (the estimate thread's traceback) while the test ran."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def _lab(tmp_path, **kwargs):
    options = {"model": "mlp", "model_kwargs": TINY_MLP, "backend": "sim", "steps": 2, "warmup_steps": 0,
               "out_dir": tmp_path / "runs", **kwargs}
    return Lab(**options)


def _no_runs(tmp_path) -> bool:
    return not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ----------------------------------------------------------------------------- numbers never changed


@pytest.mark.parametrize("ratio", [-1.5, 0, 0.0, float("nan"), float("inf"), -float("inf"), "1.5", True])
def test_lab_refuses_a_ratio_that_is_not_a_finite_number_above_zero_quoting_it(tmp_path, ratio):
    with pytest.raises(SpecError) as caught:
        _lab(tmp_path, ratio=ratio)
    assert caught.value.field == "ratio"
    assert f"got {ratio!r}" in str(caught.value)
    assert _no_runs(tmp_path)


def test_lab_keeps_a_huge_ratio_as_given_and_refuses_it_in_the_status_line_before_any_folder(tmp_path,
                                                                                                  thread_errors):
    lab = _lab(tmp_path, ratio=1e9)
    assert lab.workload.capacity_value.value == 1e9, "the panel must not clamp the ratio given"
    lab.workload.wait_estimate()
    assert "ratio 1000000000.0" in lab.workload.estimate.value
    assert "below one 2 MiB chunk" in lab.workload.estimate.value
    assert lab.run() is None and lab.state == "error"
    assert isinstance(lab.last_error, SpecError)
    assert "ratio 1000000000.0" in lab.status.value and "below one 2 MiB chunk" in lab.status.value
    assert _no_runs(tmp_path) and thread_errors == []


def test_lab_refuses_a_negative_knob_quoting_it_not_a_clamped_zero(tmp_path):
    with pytest.raises(ModelConfigError) as caught:
        Lab(model="mlp", model_kwargs={"width": -3}, backend="sim", out_dir=tmp_path / "runs")
    assert caught.value.field == "width"
    assert "got -3" in str(caught.value) and "got 0" not in str(caught.value)
    assert _no_runs(tmp_path)


@pytest.mark.parametrize(("kwargs", "field", "quoted"), [
    ({"width": "5"}, "width", "'5'"),
    ({"width": 2.5}, "width", "2.5"),
    ({"width": True}, "width", "True"),
    ({"nope": 1}, "nope", "nope"),
    ([("width", 8)], "model_kwargs", "[('width', 8)]"),
])
def test_lab_refuses_knobs_that_are_not_the_models_integers(tmp_path, kwargs, field, quoted):
    with pytest.raises(ModelConfigError) as caught:
        Lab(model="mlp", model_kwargs=kwargs, backend="sim", out_dir=tmp_path / "runs")
    assert caught.value.field == field and quoted in str(caught.value)


def test_lab_nan_ratio_is_refused_up_front_and_a_nan_typed_in_never_raises_in_the_estimate_thread(
        tmp_path, thread_errors):
    with pytest.raises(SpecError, match=r"ratio must be a finite number > 0, got nan"):
        _lab(tmp_path, ratio=float("nan"))
    lab = _lab(tmp_path)
    lab.workload.wait_estimate()
    lab.workload.capacity_value.value = float("nan")
    lab.workload.wait_estimate()
    assert "ratio must be a finite number &gt; 0, got nan" in lab.workload.estimate.value
    assert lab.run() is None and lab.state == "error" and "got nan" in lab.status.value
    assert _no_runs(tmp_path)
    assert thread_errors == [], f"an exception escaped a thread: {thread_errors!r}"


def test_values_typed_into_the_panel_are_kept_and_refused_in_the_status_line(tmp_path, thread_errors):
    lab = _lab(tmp_path)
    lab.workload.wait_estimate()
    lab.workload.capacity_value.value = -1.5
    assert lab.workload.capacity_value.value == -1.5, "the ratio field must not clamp what was typed"
    lab.workload.wait_estimate()
    assert "got -1.5" in lab.workload.estimate.value
    assert lab.run() is None and lab.state == "error" and "ratio must be a finite number &gt; 0, got -1.5" in \
        lab.status.value
    lab.workload.capacity_value.value = 1.5
    lab.workload.knobs["width"].value = -3
    assert lab.workload.knobs["width"].value == -3, "a knob field must not clamp what was typed"
    lab.workload.wait_estimate()
    assert "got -3" in lab.workload.estimate.value and "got 0" not in lab.workload.estimate.value
    assert lab.run() is None and "got -3" in lab.status.value
    lab.workload.knobs["width"].value = TINY_MLP["width"]
    lab.steps.value = 0
    assert lab.run() is None and "steps must be &gt;= 1, got 0" in lab.status.value
    lab.steps.value = 2
    lab.pace.value = -1.0
    assert lab.run() is None and "pace (s/step) must be a finite number &gt;= 0, got -1.0" in lab.status.value
    assert _no_runs(tmp_path) and thread_errors == []


# ----------------------------------------------------------------------------- typed constructor errors


def test_lab_with_an_unknown_model_raises_a_model_config_error(tmp_path):
    with pytest.raises(ModelConfigError) as caught:
        Lab("nosuch", out_dir=tmp_path / "runs")
    assert isinstance(caught.value, UmLabError) and caught.value.field == "model"
    assert "unknown model 'nosuch'" in str(caught.value) and "mlp" in str(caught.value)


@pytest.mark.parametrize(("kwargs", "error", "field", "quoted"), [
    ({"steps": "5"}, SpecError, "steps", "'5'"),
    ({"steps": 0}, SpecError, "steps", "got 0"),
    ({"steps": 2.0}, SpecError, "steps", "2.0"),
    ({"steps": True}, SpecError, "steps", "True"),
    ({"warmup_steps": -1}, SpecError, "warmup_steps", "-1"),
    ({"warmup_steps": "2"}, SpecError, "warmup_steps", "'2'"),
    ({"pace_s": -0.1}, SpecError, "pace_s", "-0.1"),
    ({"pace_s": "fast"}, SpecError, "pace_s", "'fast'"),
    ({"pace_s": float("inf")}, SpecError, "pace_s", "inf"),
    ({"capacity_gib": 0}, SpecError, "capacity_gib", "got 0"),
    ({"capacity_gib": -2.0}, SpecError, "capacity_gib", "-2.0"),
    ({"capacity_gib": float("nan")}, SpecError, "capacity_gib", "nan"),
    ({"capacity_gib": 1e300}, SpecError, "capacity_gib", "1e+300"),
    ({"budget": 5}, SpecError, "budget", "5"),
    ({"budget": "lots"}, SpecError, "budget", "'lots'"),
    ({"budget": "-1GiB"}, SpecError, "budget", "-1GiB"),
    ({"backend": "tpu"}, SpecError, "backend", "'tpu'"),
    ({"policy": "nope"}, PolicyError, "policy", "'nope'"),
    ({"telemetry": 3}, SpecError, "telemetry", "3"),
    ({"out_dir": 5}, SpecError, "out_dir", "5"),
    ({"model": 5}, ModelConfigError, "model", "5"),
])
def test_lab_checks_every_constructor_argument_with_a_typed_error(tmp_path, kwargs, error, field, quoted):
    options = {"model": "mlp", "model_kwargs": TINY_MLP, "backend": "sim", "out_dir": tmp_path / "runs", **kwargs}
    with pytest.raises(error) as caught:
        Lab(**options)
    assert isinstance(caught.value, UmLabError)
    assert caught.value.field == field, str(caught.value)
    assert quoted in str(caught.value)
    assert _no_runs(tmp_path)


@pytest.mark.parametrize(("kwargs", "error", "field", "quoted"), [
    ({"ratios": [1.5, 1.5]}, SpecError, "ratios", "1.5 given more than once"),
    ({"ratios": [None, None]}, SpecError, "ratios", "none given more than once"),
    ({"models": ["mlp", "mlp"]}, ModelConfigError, "models", "mlp given more than once"),
    ({"policies": ["gpu-first", "gpu-first"]}, PolicyError, "policies", "gpu-first given more than once"),
    ({"models": "mlp"}, ModelConfigError, "models", "'mlp'"),
    ({"models": ["nosuch"]}, ModelConfigError, "model", "'nosuch'"),
    ({"models": {"mlp": {"width": -3}}}, ModelConfigError, "width", "-3"),
    ({"policies": "gpu-first"}, PolicyError, "policies", "'gpu-first'"),
    ({"policies": ["nope"]}, PolicyError, "policies", "'nope'"),
    ({"ratios": [float("nan")]}, SpecError, "ratios", "nan"),
    ({"ratios": [-1.5]}, SpecError, "ratios", "-1.5"),
    ({"ratios": "1.5"}, SpecError, "ratios", "'1.5'"),
    ({"ratios": []}, SpecError, "ratios", "at least one"),
    ({"steps": "5"}, SpecError, "steps", "'5'"),
    ({"steps": 0}, SpecError, "steps", "got 0"),
    ({"warmup_steps": -1}, SpecError, "warmup_steps", "-1"),
    ({"backend": "tpu"}, SpecError, "backend", "'tpu'"),
    ({"out_dir": 5}, SpecError, "out_dir", "5"),
])
def test_compare_view_checks_every_constructor_argument_with_a_typed_error(tmp_path, kwargs, error, field, quoted):
    options = {"models": {"mlp": TINY_MLP}, "policies": ["gpu-first"], "ratios": [1.5], "steps": 1,
               "out_dir": tmp_path / "runs", **kwargs}
    with pytest.raises(error) as caught:
        CompareView(**options)
    assert isinstance(caught.value, UmLabError)
    assert caught.value.field == field, str(caught.value)
    assert quoted in str(caught.value)
    assert _no_runs(tmp_path)


@pytest.mark.parametrize("text", ["1.5, 1.5", "1.5, 1.5x", "1.5; 1.50", "none, card", "0.8, 1.5, 0.8"])
def test_compare_view_refuses_a_duplicated_ratio_in_the_status_line_before_the_first_run(tmp_path, monkeypatch,
                                                                                           text):
    def no_compare(*args, **kwargs):
        raise AssertionError("compare() must not be called with a duplicated ratio")

    monkeypatch.setattr(compare_view_module, "compare", no_compare)
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.5], steps=1,
                       out_dir=tmp_path / "runs")
    view.ratios.value = text
    view.run(wait=True, timeout=30)
    assert "given more than once" in view.status.value and "error" in view.status.value
    assert isinstance(view.last_error, SpecError) and view.last_error.field == "ratios"
    assert view.table is None and view.run_button.disabled is False
    assert _no_runs(tmp_path)


def test_parse_ratios_refuses_duplicates_and_non_finite_values_with_spec_errors():
    for bad in ("1.5, 1.5", "inf", "nan", "-1", "abc", ""):
        with pytest.raises(SpecError):
            parse_ratios(bad)
    assert parse_ratios("0.8, 1.5x; none") == [0.8, 1.5, None]


def test_compare_view_shows_the_ratios_given_exactly_not_rounded(tmp_path):
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.2345678, 1.2345679, None],
                       steps=1, out_dir=tmp_path / "runs")
    assert parse_ratios(view.ratios.value) == [1.2345678, 1.2345679, None]
    assert [ratio_text(r) for r in (1.5, 2.0, None)] == ["1.5", "2", "none"]


# ----------------------------------------------------------------------------- text, never HTML


def _evil_policy_file(tmp_path):
    path = tmp_path / "shared-policy.json"
    policy = Policy(f"shared {PAYLOAD}", {"param": Advice(preferred_location="gpu")}, f"from a colleague {PAYLOAD}")
    path.write_text(policy.to_json())
    return path


def test_a_policy_files_name_and_description_show_as_text_in_the_advice_grid(tmp_path):
    grid = AdviceGrid()
    assert grid.load(_evil_policy_file(tmp_path)) is not None
    for value in (grid.description.value, grid.file_status.value):
        assert "<img" not in value and "&lt;img" in value
    assert ESCAPED in grid.description.value and ESCAPED in grid.file_status.value


def test_a_policy_files_error_text_shows_as_text_in_the_file_status(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "advice": {PAYLOAD: {}}}))  # the error quotes the bad key
    grid = AdviceGrid()
    assert grid.load(bad) is None
    assert "not a valid policy" in grid.file_status.value
    assert "<img" not in grid.file_status.value and "&lt;img" in grid.file_status.value
    missing = tmp_path / f"{PAYLOAD}.json"  # a path in an error
    assert grid.load(missing) is None
    assert "<img" not in grid.file_status.value and "&lt;img" in grid.file_status.value
    assert grid.save(tmp_path / "no-such-folder" / f"{PAYLOAD}.json") is None
    assert "cannot save" in grid.file_status.value and "<img" not in grid.file_status.value


def test_the_labs_status_line_shows_a_loaded_policys_name_and_errors_as_text(tmp_path):
    lab = _lab(tmp_path)
    assert lab.advice.load(_evil_policy_file(tmp_path)) is not None
    assert "<img" not in lab.advice.description.value
    lab.budget.value = PAYLOAD  # the refusal quotes it
    assert lab.run() is None and lab.state == "error"
    assert "GPU budget" in lab.status.value
    assert "<img" not in lab.status.value and "&lt;img" in lab.status.value
    lab.budget.value = ""
    lab.run(wait=True, timeout=120)
    assert lab.state == "complete", lab.status.value
    assert "shared &lt;img" in lab.status.value and "<img" not in lab.status.value
    title = lab.static_figure().layout.title.text
    assert "<img" not in title and "&lt;img" in title


def test_the_estimate_line_shows_a_models_error_as_text(tmp_path, thread_errors):
    import torch

    def evil(width: int = 8, batch_size: int = 2):
        if width == 7:
            raise ValueError(f"width 7 is {PAYLOAD}")

        def batch(g):
            return torch.randn(batch_size, width, generator=g), torch.randint(0, 2, (batch_size,))

        return models.custom("evil-net", lambda: torch.nn.Linear(width, 2), batch)

    models.register("evil-net", evil)
    try:
        lab = Lab(model="evil-net", backend="sim", steps=1, out_dir=tmp_path / "runs")
        lab.workload.wait_estimate()
        lab.workload.knobs["width"].value = 7
        lab.workload.wait_estimate()
        assert "cannot size evil-net" in lab.workload.estimate.value
        assert "<img" not in lab.workload.estimate.value and "&lt;img" in lab.workload.estimate.value
        with pytest.raises(ModelConfigError) as caught:
            Lab(model="evil-net", model_kwargs={"width": 7}, backend="sim", out_dir=tmp_path / "runs")
        assert PAYLOAD in str(caught.value)  # the exception keeps the text as it is; only the page escapes
    finally:
        models.ZOO.pop("evil-net", None)
    assert thread_errors == []


def test_the_compare_views_status_line_shows_errors_as_text(tmp_path):
    view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.5], steps=1,
                       out_dir=tmp_path / "runs")
    view.ratios.value = PAYLOAD
    view.run(wait=True, timeout=30)
    assert "not a ratio" in view.status.value
    assert "<img" not in view.status.value and "&lt;img" in view.status.value


def test_plotly_titles_names_and_labels_show_user_text_literally():
    table = pd.DataFrame({"model": [f"m{PAYLOAD}"] * 2, "policy": ["um-default", f"p{PAYLOAD}"],
                          "ratio": [1.5, 1.5], "median_ms": [2.0, 1.0], "speedup_vs_um-default": [1.0, 2.0]})
    bars = speedup_figure(table)
    assert all("<img" not in str(t.name) and "<img" not in str(t.hovertemplate) for t in bars.data)
    assert "p&lt;img" in [t.name for t in bars.data][1]
    assert all("<img" not in str(x) and "&lt;img" in str(x) for t in bars.data for x in t.x)
    record = StepRecord(step=0, wall_ms=1.0, live_bytes={"param": 2**20}, cap_bytes=None, gpu_capacity_bytes=2**30)
    overlay = step_time_overlay([(f"run {PAYLOAD}", [record])])
    assert "<img" not in overlay.data[0].name and "&lt;img" in overlay.data[0].name
    board = dashboard_figure([record], title=f"t {PAYLOAD}")
    assert "<img" not in board.layout.title.text and "&lt;img" in board.layout.title.text
    assert display_bundle(board)["data"]["text/plain"] == f"<plotly figure: t {PAYLOAD}>"  # plain text: as given


def test_lab_refuses_a_ratio_and_a_capacity_given_together():
    from um_lab.errors import SpecError
    from um_lab.widgets import Lab

    with pytest.raises(SpecError, match="ratio=2.0 and capacity_gib=8"):
        Lab(model="mlp", backend="sim", ratio=2.0, capacity_gib=8)
    lab = Lab(model="mlp", backend="sim", capacity_gib=8)  # the default ratio gives way to a capacity given
    assert lab.workload.capacity_mode.value == "capacity GiB"


def test_status_line_names_unexpected_errors_by_class() -> None:
    """um_lab's own errors are shown by their message; anything else keeps its class name, escaped."""
    from um_lab.errors import SpecError
    from um_lab.widgets._html import error_text

    assert error_text(SpecError("ratio: got -1.5", "ratio")) == "ratio: got -1.5"
    assert error_text(KeyError("<b>x</b>")) == "KeyError: '<b>x</b>'"
    assert error_text(RuntimeError()) == "RuntimeError: "


@pytest.mark.parametrize("panel", [Lab, CompareView])
@pytest.mark.parametrize("where", ["/dev/null", "a-file"])
def test_a_panel_refuses_an_out_dir_that_is_not_a_folder_when_it_is_made(tmp_path, monkeypatch, panel, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UmLabError, match="not a folder"):
        panel(out_dir=where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
