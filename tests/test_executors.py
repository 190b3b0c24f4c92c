"""Sweeps on any concurrent.futures.Executor: compare, search_policy and the paper grid give exactly the
serial results on local processes and on a local Dask cluster; what cannot run in a worker is refused."""

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from um_lab.errors import SpecError
from um_lab.models import get_model
from um_lab.runs.sweep import compare
from um_lab.sim import search
from um_lab.sim.backend import SimBackend
from um_lab.sim.search import SearchError, search_policy
from um_lab.teaching import paper
from um_lab.teaching.paper import PaperExperimentError, run_grid

TINY_MLP = {"width": 16, "depth": 1, "batch_size": 4}
TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "batch_size": 2, "seq_len": 32}
COMPARE = {"models": {"mlp": TINY_MLP}, "policies": ["um-default", "gpu-first"], "ratios": [0.5, 2.0],
           "backend": "sim", "steps": 2, "warmup_steps": 0}
SEARCH = {"model_kwargs": TINY_GPT2, "space": "three-type", "steps": 2, "warmup_steps": 1, "progress": False}
#: where runs differ by nature: the folders they wrote and the wall clock
NOT_COMPARED = ["run_dir"]


@pytest.fixture(scope="module")
def pool():
    with ProcessPoolExecutor(2) as executor:
        yield executor


@pytest.fixture(scope="module")
def dask_executor():
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        yield client.get_executor()


@pytest.fixture(params=["processes", "dask"])
def executor(request):
    return request.getfixturevalue("pool" if request.param == "processes" else "dask_executor")


def _compare(out, **kwargs):
    args = {**COMPARE, **kwargs}
    return compare(args.pop("models"), args.pop("policies"), args.pop("ratios"), out_dir=out, **args)


def _search(**kwargs):
    search._PROBED.clear()  # each search probes the options itself (on its executor too)
    return search_policy("gpt2-small", 1.5, **SEARCH, **kwargs)


@pytest.fixture(scope="module")
def serial_table(tmp_path_factory):
    return _compare(tmp_path_factory.mktemp("serial"))


@pytest.fixture(scope="module")
def serial_search():
    return _search(workers=1)


def test_compare_on_an_executor_gives_the_serial_table(executor, serial_table, tmp_path):
    table = _compare(tmp_path, executor=executor)
    assert list(table.columns) == list(serial_table.columns) and (table["status"] == "complete").all()
    pd.testing.assert_frame_equal(table.drop(columns=NOT_COMPARED), serial_table.drop(columns=NOT_COMPARED))
    # every run wrote its folder under this comparison's folder, named as the serial comparison names it
    sweep_dir = Path(table.attrs["sweep_dir"])
    assert sweep_dir.parent == tmp_path and (sweep_dir / "summary.csv").is_file()
    assert all(Path(run_dir).parent == sweep_dir and (Path(run_dir) / "records.jsonl").is_file()
               for run_dir in table["run_dir"])


def test_search_on_an_executor_gives_the_serial_result(executor, serial_search):
    found = _search(executor=executor)
    for field in dataclasses.fields(found):
        if field.name == "seconds":
            continue
        mine, serial = getattr(found, field.name), getattr(serial_search, field.name)
        if isinstance(mine, pd.DataFrame):
            pd.testing.assert_frame_equal(mine, serial)
        else:
            assert mine == serial, field.name
    assert found.probe_evaluations > 0  # the probe ran on the executor too


def test_keep_going_on_an_executor_records_the_refused_runs_as_the_serial_one(pool, tmp_path):
    args = {"ratios": [2.0, 1e6], "keep_going": True}  # 1e6 leaves less than one chunk: refused in the run
    serial = _compare(tmp_path / "serial", **args)
    table = _compare(tmp_path / "pool", executor=pool, **args)
    assert table["status"].tolist() == ["complete", "complete", "refused", "refused"]
    pd.testing.assert_frame_equal(table.drop(columns=NOT_COMPARED), serial.drop(columns=NOT_COMPARED))
    assert table["run_dir"].isna().tolist() == [False, False, True, True]


def test_a_task_the_executor_cannot_send_ends_the_comparison_with_the_table_of_the_runs_made(pool, tmp_path):
    mine = dataclasses.replace(get_model("mlp", **TINY_MLP), name="mine")  # its functions are local: no pickle
    with pytest.raises(Exception, match="(?i)pickl") as raised:
        _compare(tmp_path, models=[mine], ratios=[2.0], executor=pool)
    assert any("ModelCase must be picklable" in note for note in getattr(raised.value, "__notes__", []))


def test_the_paper_grid_on_an_executor_gives_the_serial_table(pool):
    grid = paper.mappings({"model parameters": ("none", "pin-gpu"), "intermediate results": ("none", "zero-copy"),
                           "input data": ("none",)})
    args = ({"mlp": TINY_MLP}, [0.8, 2.0], grid)
    serial = run_grid(*args, steps=2, warmup_steps=1)
    pd.testing.assert_frame_equal(run_grid(*args, steps=2, warmup_steps=1, executor=pool), serial)
    profiled = SimBackend(prefetch_stream="copy")  # a SimBackend's profile and prefetch stream are sent
    pd.testing.assert_frame_equal(run_grid(*args, steps=2, warmup_steps=1, backend=profiled, executor=pool),
                                  run_grid(*args, steps=2, warmup_steps=1, backend=profiled))


def test_what_cannot_run_in_a_worker_is_refused_before_any_run(pool, tmp_path):
    with pytest.raises(SpecError, match="backend_instance") as raised:
        _compare(tmp_path, backend_instance=SimBackend(), executor=pool)
    assert raised.value.field == "executor"
    with pytest.raises(SpecError, match="only the simulator") as raised:
        _compare(tmp_path, backend="cuda", ratios=[None], executor=pool)
    assert raised.value.field == "executor"
    with pytest.raises(SpecError, match="concurrent.futures.Executor") as raised:
        _compare(tmp_path, executor=4)
    assert raised.value.field == "executor"
    assert not list(tmp_path.iterdir())  # nothing was run
    with pytest.raises(SearchError, match="not both"):
        search_policy("gpt2-small", 1.5, model_kwargs=TINY_GPT2, workers=2, executor=pool, progress=False)
    with pytest.raises(SearchError, match="concurrent.futures.Executor"):
        search_policy("gpt2-small", 1.5, model_kwargs=TINY_GPT2, executor="dask", progress=False)
    with pytest.raises(PaperExperimentError, match="concurrent.futures.Executor"):
        run_grid({"mlp": TINY_MLP}, [2.0], paper.mappings(), executor=object())
