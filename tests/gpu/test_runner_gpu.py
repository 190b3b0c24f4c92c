"""Runner, compare, run logs and the CLI on the real cuda backend (H200 test machine, safety cap on).

Two models x three policies, small sizes: live managed bytes stay far below the card. Skipped cleanly
without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from run_helpers import stop_in_background

from um_lab.runs.runlog import list_runs
from um_lab.runs.runner import Run, run
from um_lab.runs.runread import load
from um_lab.runs.sweep import compare
from um_lab.sizing import SizeRefused
from um_lab.types import RunSpec

pytestmark = pytest.mark.gpu

MODELS = {
    "mlp": {"width": 1024, "depth": 4, "batch_size": 64},
    "gpt2-small": {"batch_size": 2, "seq_len": 128, "n_layer": 2},
}
POLICIES = ["um-default", "gpu-first", "offload-optimizer"]
STEPS, WARMUP = 6, 2


def check_run_log(path, model: str, policy: str) -> None:
    """The folder of one complete cuda run: every file, every step, sane records."""
    loaded = load(path)
    assert loaded.complete and loaded.state == "complete", loaded.status
    assert loaded.spec.model == model and loaded.spec.policy == policy
    assert loaded.policy is not None and loaded.policy.name == policy
    env = loaded.environment
    assert env["backend"] == "cuda"
    assert env["device"]["name"] and env["device"]["total_memory_bytes"] > 0
    assert env["versions"]["torch"] == torch.__version__
    preflight = loaded.model["preflight"]
    assert preflight["estimate"]["total_bytes"] > 0 and preflight["cap_bytes"] > 0
    records = list(loaded.records())
    assert [r.step for r in records] == list(range(WARMUP + STEPS))
    assert [r.warmup for r in records] == [True] * WARMUP + [False] * STEPS
    for record in records:
        assert record.backend == "cuda" and record.policy == policy
        assert record.wall_ms > 0 and math.isfinite(record.loss)
        assert record.cap_bytes is not None and record.live_total <= record.cap_bytes
        assert record.gpu_capacity_bytes == pytest.approx(env["device"]["total_memory_bytes"], rel=0.02)
        for dtype in ("param", "grad", "optim", "act", "input"):
            assert record.live_bytes[dtype] > 0, (dtype, record.live_bytes)
    summary = loaded.summary()
    assert summary["steps"] == STEPS and summary["warmup_steps"] == WARMUP
    assert 0 < summary["median_ms"] <= summary["p90_ms"]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_run_on_cuda_writes_a_complete_log(tmp_path, model, policy):
    spec = RunSpec(model=model, policy=policy, backend="cuda", steps=STEPS, warmup_steps=WARMUP,
                   model_kwargs=MODELS[model])
    result = run(spec, out_dir=tmp_path)
    check_run_log(result.path, result.spec.model, policy)


def test_compare_on_cuda_two_models_three_policies(tmp_path):
    table = compare(MODELS, POLICIES, backend="cuda", steps=STEPS, warmup_steps=WARMUP, out_dir=tmp_path)
    assert len(table) == 6 and (table["status"] == "complete").all()
    assert set(table["policy"]) == set(POLICIES) and (table["backend"] == "cuda").all()
    baseline = table[table["policy"] == "um-default"]
    assert (baseline["speedup_vs_um-default"] == 1.0).all()
    # with everything resident, advice that keeps data on the GPU cannot be far off the baseline
    gpu_first = table[table["policy"] == "gpu-first"]["speedup_vs_um-default"]
    assert ((gpu_first > 0.5) & (gpu_first < 2.0)).all(), table
    assert len(list_runs(tmp_path)) == 6
    for row in table.itertuples():
        check_run_log(row.run_dir, row.model, row.policy)


def test_size_above_the_cap_is_refused_before_any_allocation(tmp_path):
    from um_lab.cuda.backend import CudaBackend

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(SizeRefused, match=r"does not fit under the safety cap.*param"):
        Run(RunSpec(model="gpt2-small", backend="cuda", steps=2, model_kwargs={"batch_size": 2,
                                                                                "seq_len": 128}),
            out_dir=tmp_path, backend=CudaBackend(cap_bytes=64 << 20))
    assert torch.cuda.memory_allocated() == before
    assert list(tmp_path.iterdir()) == []


def test_background_stop_on_cuda_keeps_steps_and_next_run_works(tmp_path):
    spec = RunSpec(model="mlp", backend="cuda", steps=100_000, warmup_steps=1, model_kwargs=MODELS["mlp"])
    stop_in_background(spec, tmp_path, min_steps=5, timeout_s=120, poll_s=0.05)
    after = run(RunSpec(model="mlp", backend="cuda", steps=2, warmup_steps=0, model_kwargs=MODELS["mlp"]),
                out_dir=tmp_path)
    assert after.complete


def test_cli_auto_picks_cuda_and_says_so(tmp_path, capsys):
    from um_lab.app.cli import main

    rc = main(["run", "--model", "mlp", "--model-kw", "width=256", "--model-kw", "depth=2", "--steps", "3",
               "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[0] == "backend: cuda (auto: a CUDA GPU is available)"
    (path,) = list_runs(tmp_path)
    env = json.loads((path / "environment.json").read_text())
    assert env["backend"] == "cuda" and env["backend_requested"] == "auto"


@pytest.mark.slow
def test_cli_calibrate_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    from um_lab.app.cli import main
    from um_lab.sim.profile import load_profile

    out = tmp_path / "profile.json"
    assert main(["calibrate", "--out", str(out), "--name", "test-gpu"]) == 0
    profile = load_profile(out)
    assert profile.name == "test-gpu"
    _, total = torch.cuda.mem_get_info()
    assert profile.gpu_memory_bytes == total
    capsys.readouterr()
    rc = main(["run", "--backend", "sim", "--profile", str(out), "--model", "mlp", "--model-kw", "width=256",
               "--steps", "2", "--out", str(tmp_path / "runs"), "--no-progress"])
    assert rc == 0
    (path,) = list_runs(tmp_path / "runs")
    assert load(path).environment["calibration_profile"] == "test-gpu"


def test_a_run_after_another_counts_only_its_own_managed_bytes(tmp_path):
    """The first run's model and batch are gone when the second starts: both report the same live bytes."""
    spec = RunSpec(model="mlp", backend="cuda", steps=2, warmup_steps=0, model_kwargs=MODELS["mlp"])
    first, second = (list(run(spec, out_dir=tmp_path / name).records()) for name in ("first", "second"))
    for dtype in ("param", "grad", "input"):
        assert second[-1].live_bytes[dtype] == first[-1].live_bytes[dtype], (dtype, first[-1].live_bytes,
                                                                             second[-1].live_bytes)
