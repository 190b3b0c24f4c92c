"""Numbers and names the command line and the API must refuse up front: a ratio too large for a float, a
profile's GPU of 1 B or 10^30 B, a ratio with underscores, a knob given twice, ports outside 1-65535, a search
with 100,000 worker processes, a negative time limit and a folder as the policy file to save.
"""

from __future__ import annotations

import json

import pytest
from test_hardening_cli import cli_error, usage_error

from um_lab.errors import ProfileError, SpecError
from um_lab.sim.profile import load_profile
from um_lab.sim.search import SearchError, max_workers, search_policy
from um_lab.types import RunSpec

TINY = ["--model-kw", "width=16", "--model-kw", "depth=1", "--batch-size", "4"]


def test_a_ratio_past_what_a_float_holds_is_a_spec_error_with_a_short_message():
    with pytest.raises(SpecError, match="oversubscription_ratio must be > 0 and finite") as info:
        RunSpec(model="mlp", backend="sim", oversubscription_ratio=2**1100)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("size", [1, 10**30])
def test_a_profile_gpu_outside_what_the_simulator_models_is_refused_naming_the_file(tmp_path, capsys, size):
    profile = tmp_path / "tinymem.json"
    profile.write_text(json.dumps({"gpu_memory_bytes": size}))
    with pytest.raises(ProfileError, match="gpu_memory_bytes must be between") as info:
        load_profile(str(profile))
    assert "tinymem.json" in str(info.value)
    out = tmp_path / "runs"
    rc, err = cli_error(capsys, ["run", "--profile", str(profile), "--backend", "sim", "--out", str(out),
                                 "--no-progress", *TINY])
    assert rc == 2 and "tinymem.json" in err and "gpu_memory_bytes" in err and "ratio" not in err
    assert not out.exists()


def test_a_ratio_with_underscores_is_refused_not_read_as_another_number(capsys, tmp_path):
    err = usage_error(capsys, ["run", "--ratio", "1_5", "--backend", "sim", "--out", str(tmp_path), *TINY])
    assert "not a ratio: '1_5'" in err
    assert list(tmp_path.iterdir()) == []


def test_a_knob_given_twice_is_refused_naming_it(capsys, tmp_path):
    rc, err = cli_error(capsys, ["run", "--backend", "sim", "--out", str(tmp_path), "--model-kw", "width=16",
                                 "--model-kw", "width=32", "--model-kw", "depth=1"])
    assert rc == 2 and "--model-kw width is given twice" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("port", ["-1", "0", "99999", "http"])
def test_the_lab_refuses_a_port_outside_1_to_65535(capsys, port):
    err = usage_error(capsys, ["lab", "--no-browser", f"--port={port}"])
    assert "port" in err and "Traceback" not in err


def test_a_search_with_more_workers_than_the_machine_can_hold_is_refused_before_any_work(capsys, tmp_path):
    with pytest.raises(SearchError, match=f"more than {max_workers()} processes"):
        search_policy("mlp", 1.5, model_kwargs={"width": 16, "depth": 1}, workers=100_000)
    rc, err = cli_error(capsys, ["search", "--model", "mlp", *TINY[:4], "--ratio", "1.5", "--workers", "100000"])
    assert rc == 2 and "workers=100000" in err


def test_a_search_time_limit_is_named_as_the_flag_given(capsys):
    rc, err = cli_error(capsys, ["search", "--model", "mlp", *TINY[:4], "--ratio", "1.5", "--time-limit", "-1"])
    assert rc == 2 and "--time-limit must be a number of seconds > 0" in err and "budget_s" not in err


@pytest.mark.parametrize("folder", ["cr_dir/", "."])
def test_a_search_saving_to_a_folder_is_refused_and_writes_nothing(capsys, tmp_path, monkeypatch, folder):
    monkeypatch.chdir(tmp_path)
    rc, err = cli_error(capsys, ["search", "--model", "mlp", *TINY[:4], "--ratio", "1.5", "--save", folder])
    assert rc == 2 and "names a folder" in err
    assert list(tmp_path.iterdir()) == []


def test_out_pointing_at_a_device_says_what_is_there(capsys):
    rc, err = cli_error(capsys, ["run", "--backend", "sim", "--steps", "1", "--out", "/dev/null", *TINY])
    assert rc == 2 and "--out /dev/null already exists and is a device, not a folder" in err
