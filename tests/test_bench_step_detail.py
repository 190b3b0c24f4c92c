"""The GPU diagnostics' shared runner (bench/diagnostics/profiled_runs.py) keeps what was measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench" / "diagnostics"))

from profiled_runs import run_config  # noqa: E402


def test_a_failing_configuration_is_recorded_and_the_others_are_kept(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    result: dict = {"device": "test", "configs": []}
    run_config(result, str(out), {"model": "a", "policy": "p"}, lambda: {"step_ms": 1.5})

    def broken() -> dict:
        raise RuntimeError("no memory")

    run_config(result, str(out), {"model": "b", "policy": "p"}, broken)
    saved = json.loads(out.read_text())
    assert [c["model"] for c in saved["configs"]] == ["a", "b"]
    assert saved["configs"][0]["step_ms"] == 1.5 and "error" not in saved["configs"][0]
    assert saved["configs"][1]["error"] == "RuntimeError: no memory"
    assert all(c["seconds"] >= 0 for c in saved["configs"])
    assert "no memory" in capsys.readouterr().out


def test_step_gaps_charges_gpu_idle_to_the_op_that_launched_the_late_work(tmp_path) -> None:
    from step_gaps import analyse

    def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = [
        x("user_annotation", "um_lab_step", 0, 100),
        x("cpu_op", "aten::mm", 1, 4), x("cuda_runtime", "cudaLaunchKernel", 2, 2, correlation=1),
        x("kernel", "gemm", 5, 20, tid=7, correlation=1),           # busy 5..25
        x("cpu_op", "slow_host_thing", 6, 40),
        x("cuda_runtime", "cudaStreamSynchronize", 10, 30),
        x("cpu_op", "aten::add", 50, 4), x("cuda_runtime", "cudaLaunchKernel", 51, 2, correlation=2),
        x("kernel", "add", 55, 10, tid=7, correlation=2),          # idle 25..55, busy 55..65
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    r = analyse(trace)
    assert r["steps"] == 1
    assert r["gpu_busy_ms"] == 0.03 and r["gpu_idle_in_span_ms"] == 0.03 and r["gpu_span_ms"] == 0.06
    assert r["idle_ms_by_next_op"] == [("aten::add", 0.03)]
    assert r["idle_ms_by_op_pair"] == [("aten::mm -> aten::add", 0.03)]
    assert dict(r["api_calls_per_step"]) == {"cudaLaunchKernel": 2, "cudaStreamSynchronize": 1}


def test_the_stack_sampler_sees_where_another_thread_spends_its_time() -> None:
    """bench/budget_profile.py's sampler: a thread busy in one function shows it as its commonest frame."""
    import threading
    import time

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from bench.budget_profile import StackSampler

    stop = threading.Event()

    def spin_in_here() -> None:
        while not stop.is_set():
            sum(range(200))

    worker = threading.Thread(target=spin_in_here, name="spinner")
    with StackSampler(period_s=0.001) as sampler:
        worker.start()
        time.sleep(0.3)
        stop.set()
        worker.join()
    report = sampler.summary(top=3)
    assert report["spinner"]["samples"] > 5
    top_frame, share = report["spinner"]["leaf"][0]
    assert "spin_in_here" in top_frame and share > 0.5
    assert "MainThread" in report and report["MainThread"]["um_lab"] == []


def test_the_profile_timeline_splits_copies_by_direction_and_bins_them_by_time() -> None:
    """bench/budget_profile.py's timeline: a copy of 2 GB over 40 ms (50 GB/s) and a kernel land in the bins
    they overlap, and the copy's rate while busy is its bytes over its duration."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from bench.budget_profile import timeline

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 20_000, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 20_000, "dur": 40_000,
         "args": {"stream": 9, "bytes": 2e9}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99_000},
    ]}
    out = timeline(trace, bins=3)
    assert out["span_ms"] == 60.0 and out["bin_ms"] == 20.0
    assert out["copies"] == {"dtoh@9": {"GB": 2.0, "busy_ms": 40.0, "count": 1, "GBps_busy": 50.0}}
    assert out["bins"][0] == {"kernel@7_ms": 20.0}
    assert out["bins"][1] == {"dtoh@9_GB": 1.0, "dtoh@9_ms": 20.0}
    assert out["bins"][2] == out["bins"][1]
    assert timeline({"traceEvents": []}, bins=3) == {}


def test_copy_interference_reports_each_configuration_against_the_same_operands_alone() -> None:
    """bench/diagnostics/copy_interference.py: medians per configuration and the slowdown against no copy."""
    from copy_interference import slowdowns

    out = slowdowns({"managed|none": [10.0, 12.0, 11.0], "managed|managed->host": [22.0, 20.0, 24.0],
                     "device|none": [10.0], "device|device->host": [10.5]})
    assert out["managed|managed->host"] == {"ms": 22.0, "slowdown": 2.0, "n": 3}
    assert out["managed|none"]["slowdown"] == 1.0 and out["device|device->host"]["slowdown"] == 1.05
