"""The one way to receive step records as they arrive: ``add_listener`` / ``remove_listener`` on Session and Run.

The rules (:mod:`um_lab.listeners`) on their own, then on a Session over the fake driver, then on a Run on
the simulator backend: each record once to each listener, in registration order; removal (the returned
function or ``remove_listener``) mid-run, from another thread too; what a listener that raises does.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fakes import FakePoolAPI, FakeRuntime, drain, install_fake_driver

from um_lab.cuda.session import Session
from um_lab.listeners import RecordListeners
from um_lab.runs.runner import Run
from um_lab.runs.runread import load
from um_lab.types import RunSpec, StepRecord

SIM_MLP = {"width": 32, "depth": 1, "batch_size": 8}


def record(step: int) -> StepRecord:
    return StepRecord(step=step, wall_ms=1.0, live_bytes={}, cap_bytes=None, gpu_capacity_bytes=1)


class Boom(Exception):
    pass


# ------------------------------------------------------------------------------------- the rules


def test_listeners_are_called_in_registration_order_and_a_duplicate_twice():
    listeners, seen = RecordListeners(), []
    listeners.add(lambda r: seen.append(("a", r.step)))
    twice = lambda r: seen.append(("b", r.step))  # noqa: E731
    listeners.add(twice)
    listeners.add(lambda r: seen.append(("c", r.step)))
    listeners.add(twice)
    listeners.emit(record(0))
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("b", 0)]
    listeners.remove(twice)  # the earliest registration
    seen.clear()
    listeners.emit(record(1))
    assert seen == [("a", 1), ("c", 1), ("b", 1)] and len(listeners) == 3


def test_the_remover_removes_its_own_registration_once_and_remove_listener_matches_bound_methods():
    class Owner:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on(self, r: StepRecord) -> None:
            self.steps.append(r.step)

    listeners, owner = RecordListeners(), Owner()
    first = listeners.add(owner.on)
    listeners.add(owner.on)
    first()
    first()  # already gone: does nothing, and does not remove the other registration
    listeners.emit(record(0))
    assert owner.steps == [0] and len(listeners) == 1
    listeners.remove(owner.on)  # a fresh bound method object: equal, so it matches
    listeners.emit(record(1))
    assert owner.steps == [0] and len(listeners) == 0
    with pytest.raises(ValueError, match="not a registered listener"):
        listeners.remove(owner.on)
    with pytest.raises(TypeError, match="must be callable"):
        listeners.add("not a function")  # type: ignore[arg-type]


def test_changes_during_delivery_take_effect_for_the_next_record_except_removal_which_is_at_once():
    listeners, seen = RecordListeners(), []
    removers: dict[str, object] = {}

    def a(r: StepRecord) -> None:
        seen.append(("a", r.step))
        if r.step == 0:
            removers["b"]()  # type: ignore[operator]  # b comes later in this delivery: not called
            listeners.add(lambda r: seen.append(("late", r.step)))  # from the next record on

    def c(r: StepRecord) -> None:
        seen.append(("c", r.step))
        removers["c"]()  # type: ignore[operator]  # removing itself: this call completes

    listeners.add(a)
    removers["b"] = listeners.add(lambda r: seen.append(("b", r.step)))
    removers["c"] = listeners.add(c)
    listeners.emit(record(0))
    listeners.emit(record(1))
    assert seen == [("a", 0), ("c", 0), ("a", 1), ("late", 1)]


def test_the_first_exception_propagates_and_the_later_listeners_miss_that_record():
    listeners, seen = RecordListeners(), []

    def fail(r: StepRecord) -> None:
        if r.step == 1:
            raise Boom("listener failed")

    listeners.add(lambda r: seen.append(("a", r.step)))
    listeners.add(fail)
    listeners.add(lambda r: seen.append(("c", r.step)))
    listeners.emit(record(0))
    with pytest.raises(Boom):
        listeners.emit(record(1))
    listeners.emit(record(2))
    assert seen == [("a", 0), ("c", 0), ("a", 1), ("a", 2), ("c", 2)]


def test_adding_and_removing_from_other_threads_while_delivering_is_safe():
    listeners, errors = RecordListeners(), []
    total = [0]
    listeners.add(lambda r: total.__setitem__(0, total[0] + 1))
    stop = threading.Event()

    def churn() -> None:
        try:
            while not stop.is_set():
                remove = listeners.add(lambda r: None)
                remove()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=churn) for _ in range(4)]
    for w in workers:
        w.start()
    for i in range(20_000):
        listeners.emit(record(i))
    stop.set()
    for w in workers:
        w.join(10)
    assert not errors and total[0] == 20_000 and len(listeners) == 1


# --------------------------------------------------------------------------- Session (fake driver)


@pytest.fixture
def env():
    source, driver = install_fake_driver(cap=1 << 40)
    yield source, FakePoolAPI(), FakeRuntime()
    drain(source)


@pytest.fixture
def lab(env):
    source, api, runtime = env
    with Session("um-default", _pool_api=api, _runtime=runtime, _source=source) as lab:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        lab.attach(model, opt)
        x = torch.randn(4, 8)
        lab.train_step = lambda: lab.step(lambda: model(x).sum(), opt)  # type: ignore[attr-defined]
        yield lab


def test_session_delivers_each_record_once_to_each_listener_in_order(lab):
    seen = []
    lab.add_listener(lambda r: seen.append(("a", r)))
    lab.add_listener(lambda r: seen.append(("b", r)))
    records = [lab.train_step() for _ in range(3)]
    assert seen == [(name, r) for r in records for name in ("a", "b")]
    assert [r.step for r in records] == [0, 1, 2] and lab.last_record is records[-1]
    assert not hasattr(lab, "on_step")  # one way: listeners


def test_session_listener_removed_between_steps_and_by_itself(lab):
    seen = []
    remove_a = lab.add_listener(lambda r: seen.append(("a", r.step)))

    def once(r: StepRecord) -> None:
        seen.append(("once", r.step))
        lab.remove_listener(once)

    lab.add_listener(once)
    lab.train_step()
    remove_a()
    lab.train_step()
    assert seen == [("a", 0), ("once", 0)]


def test_session_listener_that_raises_makes_step_raise_after_the_step_counted(lab):
    seen = []

    def fail(r: StepRecord) -> None:
        raise Boom(f"step {r.step}")

    lab.add_listener(lambda r: seen.append(("a", r.step)))
    remove = lab.add_listener(fail)
    lab.add_listener(lambda r: seen.append(("c", r.step)))
    with pytest.raises(Boom, match="step 0"):
        lab.train_step()
    assert lab.steps_done == 1 and lab.last_record.step == 0  # the step happened and counts
    assert seen == [("a", 0)]
    remove()
    assert lab.train_step().step == 1  # still usable
    assert seen == [("a", 0), ("a", 1), ("c", 1)]


# ------------------------------------------------------------------------------------ Run (sim)


def sim_spec(steps: int = 6) -> RunSpec:
    return RunSpec(model="mlp", model_kwargs=SIM_MLP, backend="sim", steps=steps, warmup_steps=1)


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines()]


def test_run_delivers_each_record_once_to_each_listener_in_order_after_it_is_on_disk(tmp_path):
    active = Run(sim_spec(), out_dir=tmp_path)
    seen, on_disk = [], []
    active.add_listener(lambda r: seen.append(("a", r)))
    active.add_listener(lambda r: on_disk.append(len(lines_of(active.path))))
    active.add_listener(lambda r: seen.append(("b", r)))
    yielded = list(active)
    assert [r.step for r in yielded] == list(range(7))
    assert seen == [(name, r) for r in yielded for name in ("a", "b")]
    assert on_disk == list(range(1, 8))  # each record is written before any listener sees it
    assert [line["step"] for line in lines_of(active.path)] == list(range(7))


def test_run_listeners_added_and_removed_from_another_thread_mid_run(tmp_path):
    active = Run(sim_spec(steps=7), out_dir=tmp_path)
    at_step_2, go_on = threading.Event(), threading.Event()
    a, b, c = [], [], []

    def pause(r: StepRecord) -> None:  # first: holds the run's thread inside delivery of step 2
        a.append(r.step)
        if r.step == 2:
            at_step_2.set()
            assert go_on.wait(10)

    active.add_listener(pause)
    remove_b = active.add_listener(lambda r: b.append(r.step))
    active.start()
    assert at_step_2.wait(30)
    remove_b()  # from this thread, while step 2 is being delivered: b does not get it
    active.add_listener(lambda r: c.append(r.step))  # gets the next record on
    go_on.set()
    assert active.join(timeout=60)
    assert active.status == "complete"
    assert a == list(range(8)) and b == [0, 1] and c == list(range(3, 8))


def test_run_listener_that_raises_fails_the_run_with_the_record_on_disk_foreground(tmp_path):
    active = Run(sim_spec(), out_dir=tmp_path)
    later = []

    def fail(r: StepRecord) -> None:
        if r.step == 3:
            raise Boom("listener failed at step 3")

    active.add_listener(fail)
    active.add_listener(lambda r: later.append(r.step))
    yielded = []
    with pytest.raises(Boom):
        for r in active:
            yielded.append(r.step)
    assert yielded == [0, 1, 2] and later == [0, 1, 2]  # nobody after the failing listener gets step 3
    assert [line["step"] for line in lines_of(active.path)] == [0, 1, 2, 3]  # but it is on disk
    loaded = load(active.path)
    assert active.status == "failed" and loaded.state == "failed" and not loaded.complete
    assert loaded.status["steps_completed"] == 4 and "listener failed at step 3" in loaded.status["error"]


def test_run_listener_that_raises_fails_a_background_run_and_join_raises_it(tmp_path):
    active = Run(sim_spec(), out_dir=tmp_path)

    def fail(r: StepRecord) -> None:
        if r.step == 2:
            raise Boom("listener failed at step 2")

    active.add_listener(fail)
    active.start()
    with pytest.raises(Boom, match="step 2"):
        active.join(timeout=60)
    assert isinstance(active.error, Boom) and active.status == "failed"
    assert active.steps_completed == 3 == len(lines_of(active.path)) and active.latest.step == 2
    assert load(active.path).status["steps_completed"] == 3


def test_run_has_no_on_record_argument(tmp_path):
    with pytest.raises(TypeError, match="on_record"):
        Run(sim_spec(), out_dir=tmp_path, on_record=print)  # type: ignore[call-arg]
