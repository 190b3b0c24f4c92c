"""Bad input gets a clear, typed error (a ``UmLabError``) before anything is run or allocated.

Model knobs, run specs and sizes, the simulator's host memory, ``compare``'s up-front checks, ``um-lab
show`` on a comparison folder, and the CLI's sizes, ratios, ``--out`` and policy files. No torchvision.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import tracemalloc

import numpy as np
import pandas as pd
import pytest
from test_runner import FakeBackend

import um_lab
import um_lab.runs.sweep
import um_lab.sim.backend
import um_lab.sim.trace
import um_lab.sizing
from um_lab.app.cli import main
from um_lab.app.cli_args import parse_bytes, parse_ratio
from um_lab.errors import HostMemoryRefused, ModelConfigError, PolicyError, SpecError, UmLabError
from um_lab.models import get_model
from um_lab.policy import Advice, Policy, presets
from um_lab.runs.runlog import list_runs
from um_lab.runs.runread import load
from um_lab.runs.sweep import compare
from um_lab.sim import SimBackend
from um_lab.sim.backend import batch_bytes, host_bytes_to_simulate
from um_lab.sim.placement import place
from um_lab.sim.trace import cached_trace
from um_lab.sizing import size_for_ratio
from um_lab.types import RunSpec

TINY = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]
TINY_GPT2 = {"batch_size": 1, "seq_len": 16, "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 97}


@pytest.fixture
def fake_backend(monkeypatch):
    """Instant runs (the CLI and compare logic only); ``created`` lists the backends made."""
    created = []

    def make(name="auto", **options):
        created.append(FakeBackend())
        return created[-1]

    monkeypatch.setattr(um_lab.runs.runner, "get_backend", make)
    monkeypatch.setattr(um_lab.runs.sweep, "get_backend", make)
    return created


def cli_error(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


# --------------------------------------------------------------------------- 1, 2: model knobs


@pytest.mark.parametrize("name, knobs, knob, words", [
    ("gpt2-small", {"n_layer": "two"}, "n_layer", ["must be an integer", "'two'", "default is 12"]),
    ("gpt2-small", {"use_cache": "yes"}, "use_cache", ["true/false", "'yes'"]),
    ("gpt2-small", {"layer_norm_epsilon": "small"}, "layer_norm_epsilon", ["a number", "'small'"]),
    ("gpt2-small", {"n_inner": "wide"}, "n_inner", ["an integer or None"]),
    ("bert-base", {"hidden_size": 32.5}, "hidden_size", ["must be an integer", "32.5"]),
    ("bert-base", {"num_hidden_layers": True}, "num_hidden_layers", ["must be an integer", "True"]),
    ("gpt2-small", {"n_embd": 100, "n_head": 3}, "n_embd", ["n_embd=100 must be a multiple of n_head=3"]),
    ("gpt2-small", {"n_positions": 128, "seq_len": 256}, "n_positions", ["seq_len=256 is longer"]),
    ("gpt2-small", {"vocab_size": 0}, "vocab_size", ["vocab_size must be a positive integer"]),
    ("resnet50", {"depth": 3}, "depth", ["set by the model's name", "resnet18", "resnet152"]),
    ("gpt2-small", {"size": "xl"}, "size", ["set by the model's name", "gpt2-xl"]),
    ("bert-base", {"size": "large"}, "size", ["set by the model's name", "bert-large"]),
    ("mlp", {"colour": 3}, "colour", ["has no knob 'colour'", "its knobs: width=4096"]),
])
def test_a_bad_knob_is_a_typed_error_naming_it(name, knobs, knob, words):
    with pytest.raises(ModelConfigError) as info:
        get_model(name, **knobs)
    assert isinstance(info.value, UmLabError) and isinstance(info.value, ValueError)
    assert info.value.field == knob and knob in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_well_typed_config_knobs_still_build_and_train():
    case = get_model("gpt2-small", **TINY_GPT2, resid_pdrop=0, layer_norm_epsilon=1e-6, use_cache=False,
                     activation_function="relu", n_inner=None, eos_token_id=None)
    model = case.build_model()
    assert model.config.resid_pdrop == 0 and model.config.activation_function == "relu"
    loss = case.loss_fn(model, *case.batch())
    assert math.isfinite(float(loss.detach()))


def test_a_wrongly_typed_knob_from_the_cli_fails_before_any_run(fake_backend, tmp_path, capsys):
    rc, err = cli_error(capsys, ["run", "--model", "gpt2-small", "--model-kw", "n_layer=two", "--backend",
                                 "sim", "--out", str(tmp_path)])
    assert rc == 2 and err.startswith("um-lab: error:") and "knob n_layer must be an integer" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- 3: sizes and specs


@pytest.mark.parametrize("capacity, ratio, field", [
    (2**30, math.inf, "ratio"), (2**30, math.nan, "ratio"), (2**30, 0.0, "ratio"), (2**30, -1.5, "ratio"),
    (2**30, True, "ratio"), (math.nan, 1.5, "capacity_bytes"), (math.inf, 1.5, "capacity_bytes"),
    (-(2**30), 1.5, "capacity_bytes"), (1.5, 1.5, "capacity_bytes"), ("1GiB", 1.5, "capacity_bytes"),
])
def test_size_for_ratio_refuses_bad_numbers_before_estimating(monkeypatch, capacity, ratio, field):
    monkeypatch.setattr(um_lab.sizing, "estimate_memory", lambda *a, **k: pytest.fail("estimated"))
    with pytest.raises(SpecError) as info:
        size_for_ratio("mlp", capacity, ratio, width=64, depth=1)
    assert info.value.field == field and field in str(info.value)


def test_size_for_ratio_accepts_a_whole_float_capacity():
    sized = size_for_ratio("mlp", 64e6, 1.5, width=256, depth=2, use_sim_trace=False)
    assert sized.capacity_bytes == 64_000_000 and sized.ratio >= 1.5


@pytest.mark.parametrize("fields, field", [
    ({"capacity_bytes": math.nan}, "capacity_bytes"), ({"capacity_bytes": math.inf}, "capacity_bytes"),
    ({"capacity_bytes": -1}, "capacity_bytes"), ({"capacity_bytes": 1.5}, "capacity_bytes"),
    ({"capacity_bytes": "16GiB"}, "capacity_bytes"), ({"capacity_bytes": True}, "capacity_bytes"),
    ({"oversubscription_ratio": math.nan}, "oversubscription_ratio"),
    ({"oversubscription_ratio": math.inf}, "oversubscription_ratio"),
    ({"oversubscription_ratio": "1.5"}, "oversubscription_ratio"),
    ({"steps": "3"}, "steps"), ({"steps": 2.0}, "steps"), ({"batch_size": 0}, "batch_size"),
    ({"model_kwargs": ["width"]}, "model_kwargs"), ({"model": None}, "model"),
])
def test_runspec_refuses_bad_fields_at_construction(fields, field):
    with pytest.raises(SpecError) as info:
        RunSpec(**fields)
    assert info.value.field == field and field in str(info.value) and isinstance(info.value, UmLabError)


def test_runspec_normalises_whole_numbers():
    spec = RunSpec(capacity_bytes=1e9, steps=np.int64(3))
    assert spec.capacity_bytes == 1_000_000_000 and type(spec.capacity_bytes) is int and type(spec.steps) is int
    assert json.loads(json.dumps(spec.to_dict()))["capacity_bytes"] == 1_000_000_000
    assert type(RunSpec(oversubscription_ratio=np.float64(1.5)).oversubscription_ratio) is float


def test_typed_errors_survive_pickling():  # the policy search raises them in worker processes
    for error in (ModelConfigError("bad", "n_layer"), SpecError("bad", "ratio"), PolicyError("name", "bad"),
                  HostMemoryRefused(10, 5, "the input batch of mlp")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert getattr(again, "field", None) == getattr(error, "field", None)


# --------------------------------------------------------------------------- 4: host memory


def test_a_batch_beyond_host_memory_is_refused_before_tracing(monkeypatch):
    monkeypatch.setattr(um_lab.sim.backend, "cached_trace", lambda *a, **k: pytest.fail("traced"))
    case = get_model("mlp", width=1024, depth=1, batch_size=10**12)  # a 4 PB batch
    with pytest.raises(HostMemoryRefused) as info:
        SimBackend().prepare(case)
    error = info.value
    assert isinstance(error, UmLabError) and error.needed == batch_bytes(case) > 4 * 10**15
    assert error.available < error.needed
    text = str(error)
    assert f"{error.needed} B" in text and f"{error.available} B" in text and "input batch of mlp" in text


def test_arrays_beyond_host_memory_are_refused_after_tracing_before_expanding(monkeypatch):
    case = get_model("mlp", width=64, depth=2, batch_size=8)
    needed = host_bytes_to_simulate(cached_trace(case))
    assert needed > batch_bytes(case)
    monkeypatch.setattr(um_lab.sim.backend, "available_host_bytes", lambda: needed - 1)
    monkeypatch.setattr(um_lab.sim.backend, "expand", lambda *a, **k: pytest.fail("expanded"))
    with pytest.raises(HostMemoryRefused, match=rf"needs about .*\({needed} B\).*\({needed - 1} B\) available"):
        SimBackend().prepare(case)


@pytest.mark.parametrize("refused_at", ["before placement", "after placement"])
def test_a_trace_the_host_check_refuses_is_not_kept_in_the_trace_cache(monkeypatch, refused_at):
    case = get_model("mlp", width=48, depth=2, batch_size=8)
    um_lab.sim.trace.forget_trace(case)
    calls = []
    real_trace_step = um_lab.sim.trace.trace_step
    monkeypatch.setattr(um_lab.sim.trace, "trace_step", lambda *a, **k: calls.append(1) or real_trace_step(*a, **k))
    trace = cached_trace(case)
    first = host_bytes_to_simulate(trace)
    layouts = place(trace)
    second = host_bytes_to_simulate(trace, len(layouts.layouts), layouts.final.n_blocks)
    available = first - 1 if refused_at == "before placement" else max(first, second - 1)
    assert available < max(first, second) and (refused_at == "before placement" or available >= first)
    monkeypatch.setattr(um_lab.sim.backend, "available_host_bytes", lambda: available)
    with pytest.raises(HostMemoryRefused):
        SimBackend().prepare(case)
    cached_trace(case)
    assert len(calls) == 2  # traced again: the refused trace was dropped
    monkeypatch.setattr(um_lab.sim.backend, "available_host_bytes", lambda: None)
    SimBackend().prepare(case)
    cached_trace(case)
    assert len(calls) == 2  # an accepted trace stays cached


def test_the_host_estimate_bounds_what_the_simulator_builds():
    case = get_model("mlp", width=512, depth=2, batch_size=8192)
    trace = cached_trace(case)
    batch_bytes(case)  # its first call imports modules: outside the measured window
    tracemalloc.start()
    try:
        prepared = SimBackend().prepare(case)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    layouts = prepared.placement.layouts
    estimate = host_bytes_to_simulate(trace, len(layouts), prepared.placement.final.n_blocks)
    assert 0.5 * estimate < peak <= estimate  # an upper bound, and not a loose one


def test_normal_sizes_pass_the_host_check():
    gpt2 = get_model("gpt2-small", batch_size=8, seq_len=1024)
    assert host_bytes_to_simulate(cached_trace(gpt2), layouts=4) < 2**30
    # the batches of GPT-2-XL bs 8 x 1024 and ResNet-152 bs 128, made before tracing (no torchvision needed)
    assert batch_bytes(get_model("gpt2-xl", batch_size=8, seq_len=1024)) == 8 * 1024 * 8
    assert batch_bytes(get_model("resnet152", batch_size=128)) == 128 * (3 * 224 * 224 * 4 + 8)
    records = list(SimBackend().run(RunSpec(model="mlp", steps=1, warmup_steps=0),
                                    get_model("mlp", width=64, depth=1, batch_size=4), "um-default"))
    assert len(records) == 1


def test_the_cli_refuses_a_batch_beyond_host_memory_before_writing_a_run(tmp_path, capsys):
    rc, err = cli_error(capsys, ["run", "--backend", "sim", "--model-kw", "width=1024", "--batch-size",
                                 str(10**12), "--out", str(tmp_path)])
    assert rc == 1 and "refused to build the input batch of mlp" in err and "available here" in err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- 5: compare checks first


def test_compare_checks_every_models_knobs_before_the_first_run(fake_backend, tmp_path):
    with pytest.raises(ModelConfigError, match="knob n_layer must be an integer"):
        compare({"mlp": {"width": 16, "depth": 1}, "gpt2-small": {**TINY_GPT2, "n_layer": "two"}},
                ["gpu-first"], backend="sim", steps=1, out_dir=tmp_path)
    with pytest.raises(ModelConfigError, match=r"\['width'\] for model 'gpt2-small'"):  # shared knobs fit mlp only
        compare(["mlp", "gpt2-small"], ["gpu-first"], model_kwargs={"width": 16}, backend="sim", steps=1,
                out_dir=tmp_path)
    with pytest.raises(SpecError, match="oversubscription_ratio"):
        compare(["mlp"], ["gpu-first"], ratios=[1.5, math.inf], backend="sim", steps=1, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == [] and fake_backend == []


def test_compare_refuses_a_batch_beyond_host_memory_before_the_first_run(fake_backend, tmp_path):
    with pytest.raises(HostMemoryRefused, match="input batch of mlp"):
        compare({"gpt2-small": TINY_GPT2, "mlp": {"batch_size": 10**12}}, ["gpu-first"], backend="sim",
                steps=1, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == [] and fake_backend == []


def test_compare_csv_path_is_checked_before_the_first_run(fake_backend, tmp_path, capsys):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for target, words in ((folder, "it is a folder"), (blocker / "t.csv", "cannot write the table")):
        rc, err = cli_error(capsys, ["compare", "--models", "mlp", "--backend", "sim", "--steps", "1",
                                     "--out", str(tmp_path / "runs"), "--csv", str(target), *TINY])
        assert rc == 2 and words in err
    assert not (tmp_path / "runs").exists() and fake_backend == []


def test_an_existing_csv_is_kept_until_the_table_replaces_it(fake_backend, tmp_path, capsys):
    csv = tmp_path / "table.csv"
    csv.write_text("old\n")
    assert main(["compare", "--backend", "sim", "--steps", "1", "--out", str(tmp_path / "runs"),
                 "--csv", str(csv), "--force", "--no-progress", *TINY]) == 0
    assert len(pd.read_csv(csv)) == 2


# --------------------------------------------------------------------------- 6: show a comparison


def test_show_on_a_comparison_folder_shows_the_sweep(fake_backend, tmp_path, capsys):
    assert main(["compare", "--policies", "gpu-first", "prefetch-all", "--ratios", "none", "2", "--backend",
                 "sim", "--steps", "2", "--out", str(tmp_path), "--no-progress", *TINY]) == 0
    capsys.readouterr()
    (sweep,) = [p for p in tmp_path.iterdir() if p.name.startswith("compare-")]
    assert main(["show", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "comparison, 6 run folders" in out and "speedup_vs_um-default" in out
    assert "prefetch-all" in out and "none" in out and "NaN" not in out
    (sweep / "summary.csv").unlink()  # as a sweep that is still running, or was stopped
    assert main(["show", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "without summary.csv" in out and out.count(": complete, 4/4 steps") == 6
    assert "gpu-first, ratio none" in out and "gpu-first, ratio 2" in out


# --------------------------------------------------------------------------- 7: CLI sizes, ratios, --out


@pytest.mark.parametrize("command", ["run", "compare"])
def test_out_pointing_at_a_file_says_it_already_exists(fake_backend, tmp_path, capsys, command):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    rc, err = cli_error(capsys, [command, "--backend", "sim", "--steps", "1", "--out", str(target), *TINY])
    assert rc == 2 and f"{target} already exists and is a file, not a folder" in err
    assert target.read_text() == "keep me" and fake_backend == []


def test_sizes_in_scientific_notation(tmp_path, capsys):
    assert parse_bytes("1e9") == 10**9 and parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes("2E3 KiB") == 2000 * 1024 and parse_bytes("8GiB") == 8 * 2**30
    for bad in ("1e999", "1e", "e9", "1eb"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    rc = main(["run", "--backend", "sim", "--capacity", "1e9", "--steps", "1", "--out", str(tmp_path),
               "--no-progress", *TINY])
    assert rc == 0 and load(list_runs(tmp_path)[0]).spec.capacity_bytes == 10**9


def test_ratios_are_finite_and_none_is_shown_as_none(fake_backend, tmp_path, capsys):
    for bad in ("inf", "nan", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            parse_ratio(bad)
    assert main(["compare", "--ratios", "none", "1.5", "--backend", "sim", "--steps", "1", "--out",
                 str(tmp_path), "--no-progress", *TINY]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "nan" not in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["mlp"]]
    assert sorted(row[2] for row in rows) == ["1.5", "1.5", "none", "none"]


# --------------------------------------------------------------------------- 8: policy files


def test_a_policy_file_may_not_take_a_presets_name(fake_backend, tmp_path, capsys):
    impostor = tmp_path / "baseline.json"
    presets["gpu-first"].replace(name="um-default").save(impostor)
    for command in (["run", "--policy"], ["compare", "--policies"]):
        rc, err = cli_error(capsys, [*command, str(impostor), "--backend", "sim", "--out",
                                     str(tmp_path / "runs"), *TINY])
        assert rc == 2 and "named 'um-default', the name of a preset" in err and "my-um-default" in err
    assert not (tmp_path / "runs").exists()
    other = presets["gpu-first"].replace(name="um-default")
    with pytest.raises(PolicyError, match="reuses the name of a preset \\(the baseline\\)"):
        compare(["mlp"], [other], backend="sim", out_dir=tmp_path / "runs")
    with pytest.raises(PolicyError, match="two different policies are named 'mine'"):
        compare(["mlp"], [Policy("mine"), presets["gpu-first"].replace(name="mine")], backend="sim",
                out_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists() and fake_backend == []


def test_a_bare_preset_name_always_means_the_preset(fake_backend, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sneaky = Policy("mine", {"param": Advice(preferred_location="cpu")})
    sneaky.save(tmp_path / "gpu-first")
    sneaky.save(tmp_path / "mine")
    assert main(["run", "--policy", "gpu-first", "--backend", "sim", "--steps", "1", "--out", "runs",
                 "--no-progress", *TINY]) == 0
    (first,) = list_runs(tmp_path / "runs")
    assert load(first).policy == presets["gpu-first"]
    rc, err = cli_error(capsys, ["run", "--policy", "mine", "--backend", "sim", "--out", "runs", *TINY])
    assert rc == 2 and "'mine' is not a preset" in err and "./mine" in err
    assert main(["run", "--policy", "./mine", "--backend", "sim", "--steps", "1", "--out", "runs",
                 "--no-progress", *TINY]) == 0
    assert sorted(load(p).spec.policy for p in list_runs(tmp_path / "runs")) == ["gpu-first", "mine"]


def test_run_refuses_a_batch_beyond_host_memory_before_its_folder_is_written(tmp_path, capsys):
    from um_lab.runs.runner import Run

    with pytest.raises(HostMemoryRefused, match="input batch of mlp"):
        Run(RunSpec(model="mlp", model_kwargs={"batch_size": 10**12}, backend="sim", steps=1), out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    rc, err = cli_error(capsys, ["run", "--model", "mlp", "--batch-size", str(10**12), "--backend", "sim",
                                 "--steps", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1 and "input batch of mlp" in err and list(tmp_path.iterdir()) == []


def test_a_model_whose_library_is_missing_is_refused_before_any_folder(tmp_path, monkeypatch) -> None:
    import um_lab.models as models
    from um_lab.errors import MissingDependencyError

    monkeypatch.setitem(models._IMPORTABLE, "torchvision", False)
    with pytest.raises(MissingDependencyError, match="needs torchvision") as info:
        um_lab.run(RunSpec(model="resnet18", backend="sim", steps=1), out_dir=tmp_path / "runs")
    assert isinstance(info.value, ImportError) and info.value.module == "torchvision"
    assert not (tmp_path / "runs").exists()
    assert main(["run", "--model", "resnet18", "--backend", "sim", "--out", str(tmp_path / "cli")]) == 2
    assert not (tmp_path / "cli").exists()


def test_run_names_a_wrong_argument_before_anything_runs(tmp_path) -> None:
    with pytest.raises(SpecError, match=r"RunSpec\(model='mlp'\)"):
        um_lab.run("mlp", out_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="steps is a RunSpec field"):
        um_lab.run(case=get_model("mlp", width=16, depth=1, batch_size=4), steps=2, out_dir=tmp_path)
    with pytest.raises(SpecError, match="case must be a ModelCase"):
        um_lab.run(RunSpec(backend="sim"), case=3, out_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(um_lab.RunDirError, match="got int 5"):
        compare(["mlp"], ["gpu-first"], backend="sim", out_dir=5)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_one_policy_or_processor_given_alone_is_not_split_into_characters(tmp_path) -> None:
    table = compare(["mlp"], "gpu-first", ratios=1.5, backend="sim", steps=2, warmup_steps=1,
                    model_kwargs={"width": 16, "depth": 1, "batch_size": 4}, out_dir=tmp_path)
    assert list(table["policy"]) == ["um-default", "gpu-first"] and list(table["ratio"]) == [1.5, 1.5]
    assert Advice(accessed_by="gpu") == Advice(accessed_by=frozenset({"gpu"}))


def test_presets_cannot_be_changed_by_accident() -> None:
    with pytest.raises(TypeError):
        del presets["um-default"]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        presets["um-default"] = presets["gpu-first"]  # type: ignore[index]
    assert presets["um-default"].name == "um-default"


def test_an_unknown_config_field_suggests_the_close_one() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ModelConfigError, match="did you mean n_layer"):
        get_model("gpt2-small", n_layers=2)


def test_listing_runs_in_a_folder_that_is_not_there_says_so(tmp_path) -> None:
    with pytest.raises(um_lab.RunDirError, match="does not exist"):
        list_runs(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(um_lab.RunDirError, match="is a file"):
        list_runs(tmp_path / "file")
    assert list_runs(tmp_path) == []
