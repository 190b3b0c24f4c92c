"""Policies and models given bad input: each is refused with a typed error naming the input before any run
folder exists, or (a custom model the simulator cannot trace) with a typed error naming the op.

Covered: a policy named like a preset in other spelling, policy names and descriptions that do not read as
what they are, a policy path that is not one, model knobs the model library refuses or that um_lab relies on,
a custom model whose batch does not fit it, and layer counts too large to build.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import um_lab
from um_lab.app.cli import main
from um_lab.errors import ModelConfigError, UmLabError
from um_lab.knobs import LAYER_LIMIT
from um_lab.models import custom, get_model
from um_lab.policy import Advice, Policy, PolicyError, check_preset_name, presets
from um_lab.runs.runlog import list_runs
from um_lab.runs.sweep import compare
from um_lab.sim.trace import TraceError
from um_lab.types import RunSpec

TINY = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]
TINY_GPT2 = ["--model-kw", "n_layer=1", "--model-kw", "n_embd=32", "--model-kw", "n_head=2", "--model-kw",
             "vocab_size=97", "--model-kw", "seq_len=16", "--batch-size", "1"]
OTHER_ADVICE = {"param": Advice(preferred_location="cpu")}


def cli(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


# ------------------------------------------------------------ a preset's name in other spelling


@pytest.mark.parametrize("name", ["gpu-first ", " gpu-first", "gpu-first\t"])
def test_a_policy_name_with_surrounding_whitespace_is_refused(tmp_path, name):
    with pytest.raises(PolicyError, match="leading or trailing whitespace") as caught:
        um_lab.run(RunSpec(backend="sim", steps=1), policy=Policy(name, OTHER_ADVICE), out_dir=tmp_path / "runs")
    assert caught.value.field == "name" and ascii(name) in str(caught.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["GPU-First", "GPU-FIRST", "Um-Default", "Layer-Ahead"])
def test_a_custom_policy_under_a_presets_name_in_other_case_is_refused(tmp_path, name):
    impostor = Policy(name, OTHER_ADVICE)
    with pytest.raises(PolicyError, match="reuses the name .*of a preset") as caught:
        um_lab.run(RunSpec(backend="sim", steps=1), policy=impostor, out_dir=tmp_path / "runs")
    assert caught.value.field == "name" and repr(name) in str(caught.value)
    with pytest.raises(PolicyError, match="reuses the name .*of a preset"):
        compare(["mlp"], ["gpu-first", impostor], backend="sim", out_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_policy_under_a_presets_name_in_other_case_with_its_advice_is_that_preset():
    same = Policy("GPU-First", dict(presets["gpu-first"].advice))
    assert check_preset_name(same) is same
    with pytest.raises(PolicyError, match=r"\(the baseline\)"):
        check_preset_name(Policy("UM-Default", OTHER_ADVICE), baseline="um-default")


# ------------------------------------------------------------ names that do not read as what they are


@pytest.mark.parametrize("name, words", [
    ("\ud800", ["lone surrogate", "U+D800"]),
    ("two\nlines", ["control character", "U+000A"]),
    ("abc\u202edef", ["format (bidi", "U+202E RIGHT-TO-LEFT OVERRIDE"]),
])
def test_a_policy_name_with_control_bidi_or_surrogate_characters_is_refused(name, words):
    with pytest.raises(PolicyError) as caught:
        Policy(name)
    assert caught.value.field == "name"
    str(caught.value).encode("utf-8")  # the message itself prints
    for word in words:
        assert word in str(caught.value)


def test_a_policy_file_with_a_surrogate_name_is_refused_before_any_folder(tmp_path, capsys):
    policy = tmp_path / "sur.json"
    policy.write_text('{"name": "\\ud800", "advice": {}}')
    with pytest.raises(PolicyError, match="lone surrogate") as caught:
        Policy.load(policy)
    assert caught.value.field == "name" and "sur.json" in str(caught.value)
    rc, err = cli(capsys, ["run", "--policy", str(policy), "--backend", "sim", "--steps", "1", "--out",
                           str(tmp_path / "runs"), "--no-progress", *TINY])
    assert rc == 2 and "lone surrogate" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_policy_description_may_hold_newlines_but_not_surrogates():
    assert Policy("mine", {}, "line one\nline two\tand a tab").description.count("\n") == 1
    with pytest.raises(PolicyError, match="lone surrogate") as caught:
        Policy.from_dict({"name": "mine", "description": "bad \udc80 text"})
    assert caught.value.field == "description"


def test_policy_load_refuses_a_path_that_is_not_one():
    with pytest.raises(PolicyError, match="must be a str or path-like, got int 123") as caught:
        Policy.load(123)  # type: ignore[arg-type]
    assert isinstance(caught.value, UmLabError) and caught.value.field == "path"


# ------------------------------------------------------------ knobs the model library refuses


def test_an_integer_for_a_float_knob_is_taken_as_that_float(tmp_path, capsys):
    case = get_model("gpt2-small", layer_norm_epsilon=1, initializer_range=1, n_layer=1, n_embd=32, n_head=2)
    assert case.info["layer_norm_epsilon"] == 1.0 and isinstance(case.info["layer_norm_epsilon"], float)
    assert isinstance(case.info["initializer_range"], float)
    assert main(["run", "--model", "gpt2-small", "--model-kw", "layer_norm_epsilon=1", "--backend", "sim",
                 "--steps", "1", "--out", str(tmp_path), "--no-progress", *TINY_GPT2]) == 0
    (path,) = list_runs(tmp_path)
    assert json.loads((path / "spec.json").read_text())["model_kwargs"]["layer_norm_epsilon"] == 1


@pytest.mark.parametrize("knob, words", [
    ("layer_norm_epsilon=-1", ["layer_norm_epsilon must be positive", "-1"]),
    ("layer_norm_epsilon=0", ["layer_norm_epsilon must be positive"]),
    ("initializer_range=-1", ["initializer_range must be zero or more"]),
    ("resid_pdrop=2", ["resid_pdrop must be a probability within [0, 1]"]),
    ("n_inner=0", ["n_inner must be a positive integer"]),
    ("return_dict=false", ["return_dict must stay True"]),
])
def test_a_knob_out_of_range_is_refused_before_any_folder(tmp_path, capsys, knob, words):
    rc, err = cli(capsys, ["run", "--model", "gpt2-small", "--model-kw", knob, "--backend", "sim", "--steps", "1",
                           "--out", str(tmp_path / "runs"), "--no-progress", *TINY_GPT2])
    assert rc == 2 and err.startswith("um-lab: error:") and "Traceback" not in err
    for word in words:
        assert word in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name, knobs, field", [
    ("gpt2-small", {"layer_norm_epsilon": math.nan}, "layer_norm_epsilon"),
    ("bert-base", {"return_dict": False}, "return_dict"),
    ("bert-base", {"hidden_dropout_prob": -0.5}, "hidden_dropout_prob"),
    ("bert-base", {"type_vocab_size": 0}, "type_vocab_size"),
    ("gpt2-small", {"eos_token_id": [1, "a"]}, "eos_token_id"),  # refused by the library's own validation
])
def test_a_refused_config_value_is_a_model_config_error_naming_the_knob(name, knobs, field):
    with pytest.raises(ModelConfigError) as caught:
        get_model(name, **knobs)
    assert caught.value.field == field and field in str(caught.value)


# ------------------------------------------------------------ a custom model whose batch does not fit it


def test_a_custom_model_whose_batch_does_not_fit_is_a_trace_error_naming_the_op(tmp_path, capfd):
    case = custom("shape", nn.Linear(8, 2), (torch.zeros(4, 9), torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TraceError) as caught:
        um_lab.run(RunSpec(backend="sim", steps=1), case=case, out_dir=tmp_path / "runs")
    error = caught.value
    assert isinstance(error, UmLabError) and error.op == "aten.addmm" and error.phase == "forward"
    assert error.module is not None and "Linear" in error.module
    assert "[4, 9] X [8, 2]" in str(error)
    assert "Traceback" not in capfd.readouterr().err
    with pytest.raises(TraceError, match="aten.addmm"):  # with a ratio the trace runs before the folder
        um_lab.run(RunSpec(backend="sim", steps=1, oversubscription_ratio=1.5), case=case,
                   out_dir=tmp_path / "ratio")
    assert not (tmp_path / "ratio").exists()


class _FallsBack(nn.Module):
    """Tries a product that does not fit, catches the error, and takes the one that does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return x @ self.weight.T
        except RuntimeError:
            return x @ self.weight


def test_a_model_that_catches_a_shape_error_still_traces(tmp_path):
    case = custom("fallback", _FallsBack(), (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)))
    loaded = um_lab.run(RunSpec(backend="sim", steps=1), case=case, out_dir=tmp_path)
    assert loaded.state == "complete" and loaded.status["steps_completed"] >= 1


# ------------------------------------------------------------ layer counts too large to build


def test_a_huge_layer_count_is_refused_up_front(tmp_path, capsys):
    rc, err = cli(capsys, ["run", "--model", "mlp", "--model-kw", "depth=1000000000", "--model-kw", "width=16",
                           "--backend", "sim", "--out", str(tmp_path / "runs"), "--no-progress"])
    assert rc == 2 and "depth=1,000,000,000 is more than the 4,096" in err and "Traceback" not in err
    rc, err = cli(capsys, ["run", "--model", "gpt2-small", "--model-kw", "n_layer=100000", "--backend", "sim",
                           "--out", str(tmp_path / "runs"), "--no-progress"])
    assert rc == 2 and "n_layer=100,000 is more than the 4,096" in err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ModelConfigError) as caught:
        get_model("bert-base", num_hidden_layers=LAYER_LIMIT + 1)
    assert caught.value.field == "num_hidden_layers"
    assert get_model("mlp", depth=LAYER_LIMIT, width=16).info["depth"] == LAYER_LIMIT


@pytest.mark.parametrize("knobs, field", [({"width": 2**21}, "width"), ({"classes": 2**25}, "classes")])
def test_huge_widths_and_class_counts_are_refused_naming_the_limit(knobs, field):
    with pytest.raises(ModelConfigError, match="more than the") as caught:
        get_model("mlp", **knobs)
    assert caught.value.field == field


def test_the_lab_refuses_a_huge_depth_before_estimating(tmp_path):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from um_lab.widgets import Lab

    with pytest.raises(ModelConfigError, match="4,096") as caught:
        Lab(model="mlp", model_kwargs={"depth": 10**9}, backend="sim", out_dir=tmp_path / "runs")
    assert caught.value.field == "depth"
    assert not (tmp_path / "runs").exists()


def test_a_trace_that_fails_leaves_no_hook_on_the_model_it_was_given(tmp_path):
    """A factory may hand the trace the user's own module: the scheduler's hooks the trace counts with come off it
    even when the step fails."""
    shared = nn.Linear(8, 2)
    case = custom("shared", lambda: shared, (torch.zeros(4, 9), torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TraceError):
        um_lab.run(RunSpec(backend="sim", steps=1), case=case, out_dir=tmp_path / "runs")
    assert not shared._forward_pre_hooks and not shared._forward_hooks


def test_labels_a_model_cannot_take_are_refused_on_its_first_step_naming_the_batch():
    """A model built with fewer classes than its batch's labels (timm builds some without a head) would end a
    GPU's CUDA context with a device-side assert in cross entropy: the default loss refuses it first, once."""
    torch.manual_seed(0)
    case = custom("three-classes", nn.Linear(8, 3), (torch.randn(4, 8), torch.tensor([0, 1, 2, 9])))
    model = case.build_model()
    x, y = case.make_batch(torch.Generator())
    with pytest.raises(ModelConfigError, match=r"labels run from 0 to 9, but the model gives 3 classes") as e:
        case.loss_fn(model, x, y)
    assert e.value.field == "make_batch"
    ok = custom("fits", nn.Linear(8, 3), (torch.randn(4, 8), torch.tensor([0, 2, -100, 1])))
    model = ok.build_model()
    assert torch.isfinite(ok.loss_fn(model, *ok.make_batch(torch.Generator())))  # -100 is cross entropy's ignore
    from um_lab.model_cases import _LABELS_CHECKED

    assert model in _LABELS_CHECKED  # checked once: later steps read no labels back
    soft = custom("soft", nn.Linear(8, 3), (torch.randn(4, 8), torch.softmax(torch.randn(4, 3), 1)))
    assert torch.isfinite(soft.loss_fn(soft.build_model(), *soft.make_batch(torch.Generator())))
