"""Bad input on the simulator side gets a typed error naming it, or the right result, never a silently wrong
one: the trace cache keys on everything that changes a step, optimizers that need a closure are refused,
profiles are validated field by field and read only as bounded regular files, model-library errors name the
knob, and the zoo's and ``custom``'s own mistakes are :class:`~um_lab.errors.ModelConfigError`.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
from torch import nn

from um_lab.errors import (
    FileReadError,
    ModelConfigError,
    OptimizerNeedsClosure,
    ProfileError,
    UmLabError,
)
from um_lab.models import ModelCase, check_case, custom, get_model
from um_lab.sim import SimBackend
from um_lab.sim.band import corner_profiles, profile_ranges
from um_lab.sim.profile import Profile, ProfileDefaultsWarning, load_profile, profile_sha256
from um_lab.sim.trace import cached_trace, case_key, clear_trace_cache
from um_lab.types import RunSpec

TINY_GPT2 = {"batch_size": 1, "seq_len": 16, "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 97}


# ------------------------------------------------------------------------------------ profiles


def profile_file(tmp_path, filename="mine.json", **changes):
    data = Profile(name="mine").to_dict()
    data.update(changes)
    path = tmp_path / filename
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field,value", [("hbm_GBps", float("nan")), ("remote_GBps", float("inf")),
                                         ("fault_block_us", float("-inf")), ("matmul_tflops", -1.0),
                                         ("prefetch_h2d_GBps", 0), ("tile_gemm_a", "fast"),
                                         ("evict_chunk_us", True), ("gpu_memory_bytes", 1.5e9 + 0.5),
                                         ("prefetch_host_sync", 0.5), ("name", "")])
def test_a_profile_field_that_is_not_finite_and_positive_is_refused_naming_the_file_and_field(
        tmp_path, field, value):
    path = profile_file(tmp_path, **{field: value})
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    error = info.value
    assert isinstance(error, UmLabError) and isinstance(error, ValueError)
    assert error.field == field and error.path == str(path)
    assert str(path) in str(error) and field in str(error)


def test_nan_and_infinity_written_as_json_literals_are_refused(tmp_path):
    path = tmp_path / "literal.json"
    path.write_text(json.dumps(Profile().to_dict()).replace('"hbm_GBps": 3000.0', '"hbm_GBps": NaN'))
    assert "NaN" in path.read_text()
    with pytest.raises(ProfileError, match="hbm_GBps.*nan"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="remote_GBps"):
        Profile.from_dict({**Profile().to_dict(), "remote_GBps": float("inf")})


def test_missing_profile_fields_take_the_defaults_with_a_warning_naming_them(tmp_path):
    data = Profile(name="partial").to_dict()
    del data["hbm_GBps"], data["fault_block_us"]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    with pytest.warns(ProfileDefaultsWarning) as record:
        profile = load_profile(str(path))
    text = str(record[0].message)
    assert "fault_block_us" in text and "hbm_GBps" in text and str(path) in text
    assert profile.hbm_GBps == Profile().hbm_GBps
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile("h200")  # the packaged profile is complete
        Profile.from_dict(Profile().to_dict())


def test_a_user_profile_named_like_the_packaged_one_is_told_apart_by_path_and_hash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    packaged = load_profile("h200")
    impostor = Profile(name="h200").to_dict()
    (tmp_path / "h200").write_text(json.dumps(impostor))
    (tmp_path / "h200.json").write_text(json.dumps(impostor))
    assert packaged.origin["kind"] == "packaged" and packaged.origin["name"] == "h200"
    with pytest.warns(UserWarning, match="not read"):
        assert load_profile("h200") is packaged  # the bare name is the packaged profile
    for given in ("./h200", "h200.json", tmp_path / "h200"):
        mine = load_profile(given)
        assert mine.name == "h200" and mine != packaged
        origin = mine.origin
        assert origin["kind"] == "file" and os.path.samefile(origin["path"], given)
        assert len(origin["file_sha256"]) == 64 and origin["file_sha256"] != packaged.origin["file_sha256"]
    env = SimBackend("./h200").environment()
    assert env["calibration_profile_origin"]["kind"] == "file"
    assert env["calibration_profile_origin"]["path"] == str(tmp_path / "h200")
    assert env["calibration_profile_sha256"] != profile_sha256(packaged)
    with pytest.warns(UserWarning, match="not read"):
        assert SimBackend("h200").environment()["calibration_profile_origin"]["kind"] == "packaged"
    assert packaged.replace(name="x").origin == {"kind": "code"}


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"um_lab_profile": 2, "hbm', b"\xff\xfe\x00garbage\x81",
                                     b"", b"null", b'"h200"', b"[" * 5000 + b"]" * 5000])
def test_a_profile_file_that_is_not_a_profile_object_is_a_typed_error_naming_it(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises((ProfileError, FileReadError)) as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and "profile" in str(info.value)
    with pytest.raises((ProfileError, FileReadError)):
        SimBackend(str(path))


def test_a_profile_path_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "folder.json").mkdir()
    for path in (str(fifo), str(tmp_path / "folder.json"), "/dev/zero", str(tmp_path / "absent.json")):
        with pytest.raises(FileReadError) as info:
            load_profile(path)  # a FIFO would hang, /dev/zero never end: neither is opened
        assert path in str(info.value) and "profile" in str(info.value)


def test_a_too_large_profile_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import um_lab.sim.profile

    monkeypatch.setattr(um_lab.sim.profile, "PROFILE_LIMIT", 1000)
    path = profile_file(tmp_path)
    with pytest.raises(FileReadError, match="more than the 1,000"):
        load_profile(str(path))


@pytest.mark.parametrize("given", ["no-such-card", "", 42, None, "a\0b.json"])
def test_an_unknown_profile_name_or_wrong_type_is_a_profile_error(given):
    with pytest.raises(ProfileError) as info:
        load_profile(given)
    assert repr(given)[:20] in str(info.value) or str(given) in str(info.value)


def test_the_cli_reports_a_bad_profile_without_a_traceback(tmp_path, capsys):
    from um_lab.app.cli import main

    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    rc = main(["run", "--backend", "sim", "--profile", str(path), "--model", "mlp", "--model-kw", "width=16",
               "--model-kw", "depth=1", "--batch-size", "4", "--steps", "1", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and str(path) in err and "profile" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_measured_ranges_of_a_user_profile_are_checked_and_used(tmp_path):
    data = Profile(name="ranged").to_dict()
    data["measured"] = {"primitives": {"remote_GBps": {"range": [40.0, 60.0]}}}
    good = tmp_path / "ranged.json"
    good.write_text(json.dumps(data))
    assert profile_ranges(str(good))["remote_GBps"] == (40.0, 60.0)
    assert profile_ranges(load_profile(str(good)))["remote_GBps"] == (40.0, 60.0)  # the object keeps them
    data["measured"]["primitives"]["remote_GBps"]["range"] = [40.0, float("nan")]
    bad = tmp_path / "nan-range.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        corner_profiles(str(bad))
    assert str(bad) in str(info.value) and "remote_GBps" in str(info.value)


def test_a_profile_built_in_code_with_nan_is_refused_by_the_simulator():
    with pytest.raises(ProfileError, match="hbm_GBps"):
        SimBackend(Profile(hbm_GBps=float("nan")))


def test_profile_errors_survive_pickling():
    error = ProfileError("field x must be positive", "x", "/tmp/p.json")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.field == "x" and again.path == "/tmp/p.json"


# ------------------------------------------------------------------------------ the trace cache


def tiny_gpt2_with(optimizer: type[torch.optim.Optimizer], **options) -> ModelCase:
    case = get_model("gpt2-small", **TINY_GPT2)
    case.make_optimizer = lambda params: optimizer(params, lr=1e-3, **options)
    return case


def test_the_same_model_with_another_optimizer_gets_its_own_trace():
    clear_trace_cache()
    state = {}
    for optimizer in (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad):
        trace = cached_trace(tiny_gpt2_with(optimizer))
        state[optimizer.__name__] = trace.bytes_by_type(persistent_only=True)["optim"]
    params = cached_trace(tiny_gpt2_with(torch.optim.SGD)).bytes_by_type(persistent_only=True)["param"]
    assert state["SGD"] == 0  # no momentum: no state
    steps = 4 * 1024  # at most a few scalar step counters beside the per-parameter state
    assert 2 * params <= state["Adam"] < 2 * params + steps  # exp_avg, exp_avg_sq
    assert params <= state["Adagrad"] < params + steps  # sum
    momentum = cached_trace(tiny_gpt2_with(torch.optim.SGD, momentum=0.9)).bytes_by_type(persistent_only=True)
    assert momentum["optim"] == params  # a hyper-parameter that adds state changes the trace too
    amsgrad = cached_trace(tiny_gpt2_with(torch.optim.Adam, amsgrad=True)).bytes_by_type(persistent_only=True)
    assert 3 * params <= amsgrad["optim"] < 3 * params + steps


def test_two_custom_models_of_one_name_get_their_own_traces_and_footprints():
    clear_trace_cache()
    batch = (torch.zeros(4, 64), torch.zeros(4, dtype=torch.long))
    small = custom("mine", nn.Sequential(nn.Linear(64, 10)), batch)
    big = custom("mine", nn.Sequential(nn.Linear(64, 16384), nn.Linear(16384, 10)), batch)
    backend = SimBackend()
    small_params = backend.prepare(small).trace.bytes_by_type()["param"]
    big_params = backend.prepare(big).trace.bytes_by_type()["param"]
    assert small_params == (64 * 10 + 10) * 4
    assert big_params == (64 * 16384 + 16384 + 16384 * 10 + 10) * 4
    spec = RunSpec(model="mine", steps=1, warmup_steps=0)
    records = [next(iter(backend.run(spec, case, "um-default"))) for case in (small, big)]
    assert records[0].live_bytes["param"] < big_params <= records[1].live_bytes["param"]


def test_the_trace_key_follows_batch_shape_loss_seed_and_in_place_changes():
    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    module = nn.Sequential(nn.Linear(8, 4))
    case = custom("keyed", module, batch)
    key = case_key(case)
    assert case_key(case) == key  # memoised, stable
    assert case_key(custom("keyed", nn.Sequential(nn.Linear(8, 4)), batch)) == key  # same content, same key
    assert case_key(custom("keyed", module, (torch.zeros(8, 8), batch[1].repeat(2)))) != key
    assert case_key(custom("keyed", module, batch, loss_fn=lambda m, x, y: m(x).sum())) != key
    assert case_key(case, seed=1) != key
    module.append(nn.Linear(4, 4))  # the module given to custom, changed in place
    assert case_key(case) != key


def test_the_trace_key_tells_apart_models_whose_forward_differs():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x)

    first = Twice
    class Twice(nn.Module):  # noqa: F811 - redefined, as a notebook cell run again does
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x).relu() * 2

    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    assert case_key(custom("twice", first(), batch)) != case_key(custom("twice", Twice(), batch))


@pytest.mark.parametrize("where", ["custom", "replaced"])
def test_an_optimizer_that_needs_a_closure_is_refused_before_any_run_folder(tmp_path, where):
    import um_lab

    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    if where == "custom":
        case = custom("lbfgs", nn.Linear(8, 4), batch, make_optimizer=lambda p: torch.optim.LBFGS(p))
    else:
        case = get_model("mlp", width=8, depth=1, batch_size=4)
        case.make_optimizer = lambda p: torch.optim.LBFGS(p)
    with pytest.raises(OptimizerNeedsClosure) as info:
        check_case(case)
    error = info.value
    assert isinstance(error, ModelConfigError) and error.field == "make_optimizer"
    assert "torch.optim.LBFGS" in str(error) and "closure" in str(error)
    with pytest.raises(OptimizerNeedsClosure):
        cached_trace(case)
    out = tmp_path / "runs"
    with pytest.raises(OptimizerNeedsClosure):
        um_lab.Run(RunSpec(model=case.name, backend="sim", steps=1), case=case, out_dir=out)
    assert not out.exists() or not any(out.iterdir())
    assert check_case(get_model("mlp", width=8, depth=1, batch_size=4)) is not None  # AdamW passes


# ------------------------------------------------------------------------ model knobs and custom


def test_a_knob_the_model_library_refuses_is_a_model_config_error_naming_it():
    with pytest.raises(ModelConfigError) as info:
        get_model("gpt2-small", **TINY_GPT2, activation_function="bogus")
    error = info.value
    assert error.field == "activation_function" and "activation_function='bogus'" in str(error)
    assert "KeyError" in str(error) and "Traceback" not in str(error)


def test_a_library_error_that_quotes_no_knob_names_all_knobs_given():
    from um_lab.models import knob_error

    error = knob_error("gpt2-small", {"n_layer": 1, "resid_pdrop": 0.5}, ValueError("something broke"))
    assert error.field is None and "n_layer=1" in str(error) and "resid_pdrop=0.5" in str(error)


def test_the_cli_refuses_a_bad_library_knob_before_any_run_folder(tmp_path, capsys):
    from um_lab.app.cli import main

    argv = ["run", "--backend", "sim", "--model", "gpt2-small", "--steps", "1", "--out", str(tmp_path / "runs")]
    for key, value in {**TINY_GPT2, "activation_function": "bogus"}.items():
        if key != "batch_size":
            argv += ["--model-kw", f"{key}={value}"]
    rc = main(argv + ["--batch-size", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and "activation_function" in err and "bogus" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_check_case_builds_on_meta_and_passes_good_cases():
    case = get_model("gpt2-small", **TINY_GPT2)
    assert check_case(case) is case
    with pytest.raises(ModelConfigError, match="ModelCase"):
        check_case("gpt2-small")


@pytest.mark.parametrize("given", ["nosuch", "", 42, None])
def test_an_unknown_zoo_name_is_a_model_config_error_naming_it(given):
    with pytest.raises(ModelConfigError) as info:
        get_model(given)
    assert repr(given) in str(info.value) and "valid: mlp" in str(info.value)


def test_an_unknown_model_in_the_lab_panel_is_a_model_config_error():
    widgets = pytest.importorskip("um_lab.widgets")
    with pytest.raises(ModelConfigError, match="'nosuch'"):
        widgets.Lab("nosuch")


BATCH = (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("args,field,quoted", [
    (("", nn.Linear(4, 2), BATCH), "name", "''"),
    (("   ", nn.Linear(4, 2), BATCH), "name", "'   '"),
    (("a\nb", nn.Linear(4, 2), BATCH), "name", "'a\\nb'"),
    ((None, nn.Linear(4, 2), BATCH), "name", "None"),
    ((7, nn.Linear(4, 2), BATCH), "name", "7"),
    (("m", 42, BATCH), "model", "42"),
    (("m", "linear", BATCH), "model", "'linear'"),
    (("m", nn.Linear(4, 2), "batch"), "make_batch", "'batch'"),
    (("m", nn.Linear(4, 2), ()), "make_batch", "[]"),
    (("m", nn.Linear(4, 2), (1, 2)), "make_batch", "int"),
    (("m", nn.Linear(4, 2), BATCH, "mse"), "loss_fn", "'mse'"),
    (("m", nn.Linear(4, 2), BATCH, None, "adam"), "make_optimizer", "'adam'"),
    (("m", nn.Linear(4, 2), BATCH, None, None, [1]), "info", "list"),
])
def test_custom_refuses_bad_arguments_naming_them(args, field, quoted):
    with pytest.raises(ModelConfigError) as info:
        custom(*args)
    error = info.value
    assert error.field == field and quoted in str(error) and isinstance(error, UmLabError)
    if field != "name" or not isinstance(args[0], str):
        assert isinstance(error, TypeError)  # wrong types stay TypeErrors too
