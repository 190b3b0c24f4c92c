"""Session bookkeeping against a fake driver and fake torch pools: routing, pairing, cap, lifecycle."""

import pytest
import torch
from fakes import CODES, new_session

import um_lab
from um_lab import DataType, OversubscriptionRefused, SessionStateError
from um_lab.cuda import session as session_module
from um_lab.cuda.session import Session

MiB = 1 << 20


def make_session(env, policy="um-default", **kw):
    source, driver, api, runtime = env
    return new_session(policy, _pool_api=api, _runtime=runtime, _source=source, **kw)


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def routed_types(api):
    ids = {p.id: t for p, t in zip(api.pools, list(DataType) * 1000, strict=False)}
    return [ids[pid] for kind, pid in api.calls if kind == "begin"]


def test_step_routes_each_phase_to_its_pool_and_pairs_every_begin(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        model, opt = tiny()
        lab.place(model)
        lab.attach(model, opt)
        x, y = lab.inputs(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
        rec = lab.step(lambda: torch.nn.functional.cross_entropy(model(x), y), opt)
        assert api.balanced()
    # forward and backward each route into act
    assert routed_types(api) == [
        DataType.PARAM, DataType.GRAD, DataType.INPUT, DataType.ACT, DataType.ACT, DataType.OPTIM
    ]
    assert rec.step == 0 and rec.wall_ms > 0 and rec.loss is not None and rec.backend == "cuda"
    assert set(rec.live_bytes) == {t.value for t in DataType}
    assert all(p.grad is not None for p in model.parameters())
    assert api.empty_caches == 1


def test_exception_in_the_closure_ends_routing_and_the_session_stays_usable(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        x = torch.randn(4, 8)

        def boom():
            model(x)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            lab.step(boom, opt)
        assert api.balanced() and lab._pools.active_routes == {}
        rec = lab.step(lambda: model(x).sum(), opt)  # still usable
        assert rec.step == 0
    assert api.balanced()


@pytest.mark.parametrize("backward_thread", ["worker", "caller"])
def test_failure_inside_backward_still_pairs_every_begin(env, backward_thread):
    source, driver, api, runtime = env
    with make_session(env, backward_thread=backward_thread) as lab:
        model, opt = tiny()
        lab.attach(model, opt)

        def closure():
            h = model[0](torch.randn(4, 8))
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("bad hook")))
            return model[2](model[1](h)).sum()

        with pytest.raises(RuntimeError, match="bad hook"):
            lab.step(closure, opt)
        assert api.balanced() and lab._pools.active_routes == {}
        lab.step(lambda: model(torch.randn(4, 8)).sum(), opt)
        assert api.balanced()
    assert routed_types(api).count(DataType.ACT) == 4


def test_ctrl_c_landing_right_after_begin_still_ends_the_routing(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        api.interrupt_after_begin = True
        with pytest.raises(KeyboardInterrupt):
            lab.inputs(torch.ones(2))
        assert api.balanced() and lab._pools.active_routes == {}
        lab.inputs(torch.ones(2))  # the input pool is usable again
    assert api.balanced()


def test_a_second_thread_cannot_enter_a_busy_pool(env):
    import threading

    source, driver, api, runtime = env
    errors = []
    with make_session(env) as lab:
        inside, leave = threading.Event(), threading.Event()

        def hold():
            with lab.allocating("input"):
                inside.set()
                leave.wait(5)

        t = threading.Thread(target=hold)
        t.start()
        inside.wait(5)
        try:
            lab.inputs(torch.ones(2))
        except SessionStateError as e:
            errors.append(str(e))
        leave.set()
        t.join()
        assert api.balanced()
    assert errors and "another thread" in errors[0]


def test_before_optimizer_runs_between_backward_and_the_optimizer(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        seen = []
        lab.step(lambda: model(torch.randn(4, 8)).sum(), opt,
                 before_optimizer=lambda: seen.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))))
        assert seen and seen[0] > 0
        assert api.balanced()


def test_evacuation_failure_still_releases_every_pool(env, monkeypatch):
    source, driver, api, runtime = env
    lab = make_session(env).open()
    def full(*args):
        raise torch.cuda.OutOfMemoryError("full")

    monkeypatch.setattr(session_module, "evacuate", full)
    with pytest.warns(RuntimeWarning, match="could not move the model"):
        lab.close()
    assert not lab.is_open and api.empty_caches == 1 and Session._open_session is None


def test_bad_closure_result_is_a_clear_type_error(env):
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        with pytest.raises(TypeError, match="scalar loss tensor"):
            lab.step(lambda: model(torch.randn(4, 8)), opt)
        with pytest.raises(SessionStateError, match="attach the optimizer"):
            lab.step(lambda: model(torch.randn(4, 8)).sum(), torch.optim.SGD(model.parameters(), lr=1))


def test_refusal_by_the_cap_becomes_oversubscription_refused(env):
    source, driver, api, runtime = env
    with make_session(env, cap_bytes=64 * MiB) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        mallocs = len(driver.mallocs)

        def greedy():
            if not source.allocate(DataType.ACT, 65 * MiB):  # what the act pool's segment request does
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            raise AssertionError("the cap should have refused")

        with pytest.raises(OversubscriptionRefused) as err:
            lab.step(greedy, opt)
        assert isinstance(err.value, torch.cuda.OutOfMemoryError)
        assert (err.value.requested, err.value.live, err.value.cap) == (65 * MiB, 0, 64 * MiB)
        assert err.value.data_type == "act"
        assert "requested" in str(err.value) and "cap" in str(err.value)
        assert len(driver.mallocs) == mallocs
        assert api.balanced()


def test_other_ooms_pass_through_unchanged(env):
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)

        def oom():
            raise torch.cuda.OutOfMemoryError("real OOM")

        with pytest.raises(torch.cuda.OutOfMemoryError) as err:
            lab.step(oom, opt)
        assert not isinstance(err.value, OversubscriptionRefused)


def test_open_close_many_times_leaves_nothing_behind(env):
    source, driver, api, runtime = env
    for _ in range(20):
        with make_session(env) as lab:
            ptr = source.allocate(DataType.PARAM, 2 * MiB)
            assert lab.live_bytes()["param"] == 2 * MiB
            source.free(ptr)  # what torch does when the pool is dropped
    assert source.stats()["live_total"] == 0
    assert len(api.pools) == 100 and api.balanced() and api.empty_caches == 20


def test_only_one_open_session_and_closed_sessions_refuse_work(env):
    lab = make_session(env).open()
    with pytest.raises(SessionStateError, match="another um_lab Session"):
        make_session(env).open()
    lab.close()
    with pytest.raises(SessionStateError, match="not open"):
        lab.inputs(torch.ones(1))
    assert lab.close() == 0  # closing twice is harmless


def test_prefetch_follows_the_policy_at_phase_boundaries(env):
    source, driver, api, runtime = env
    policy = um_lab.presets["um-default"].replace(
        "pf", param=um_lab.Advice(prefetch="to-gpu-before-use"), optim=um_lab.Advice(prefetch="to-cpu-after-use")
    )
    with make_session(env, policy) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        p = source.allocate(DataType.PARAM, 4 * MiB)
        o = source.allocate(DataType.OPTIM, 2 * MiB)
        lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        source.free(p)
        source.free(o)
    assert runtime.prefetched == [
        (p, 4 * MiB, CODES.location_device, 0, 0),
        (o, 2 * MiB, CODES.location_host, 0, 0),
    ]


def test_the_prefetch_plan_follows_a_policy_switched_between_steps(env):
    source, driver, api, runtime = env
    to_gpu = um_lab.presets["um-default"].replace("pf", param=um_lab.Advice(prefetch="to-gpu-before-use"))
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        p = source.allocate(DataType.PARAM, 4 * MiB)
        lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        assert runtime.prefetched == []  # um-default prefetches nothing
        lab.set_policy(to_gpu)
        lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        assert [c[0] for c in runtime.prefetched] == [p]
        lab.set_policy("um-default")
        lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        assert len(runtime.prefetched) == 1
        source.free(p)


def test_gradients_set_to_none_are_recreated_in_the_grad_pool_every_time(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        model, opt = tiny()
        lab.attach(model, opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            assert all(p.grad is None for p in model.parameters())
            lab.step(lambda: model(torch.randn(2, 8)).sum(), opt, zero_grad=False)
            assert all(p.grad is not None for p in model.parameters())
        assert routed_types(api).count(DataType.GRAD) == 3  # attach, then once per step


def test_set_policy_readvises_live_segments_and_future_ones(env):
    source, driver, api, runtime = env
    with make_session(env) as lab:
        p = source.allocate(DataType.PARAM, 4 * MiB)
        a = source.allocate(DataType.ACT, 2 * MiB)
        assert driver.advice == []  # um-default: no advice on new segments
        assert lab.set_policy("zero-copy-params") == 2
        param_calls = [c for c in runtime.advised if c[0] == p]
        assert (p, 4 * MiB, CODES.set_preferred_location, CODES.location_host, 0) in param_calls
        assert (p, 4 * MiB, CODES.set_accessed_by, CODES.location_device, 0) in param_calls
        assert not [c for c in runtime.advised if c[0] == a and c[2] in (3, 5)]  # act: only resets
        q = source.allocate(DataType.PARAM, 2 * MiB)
        assert [c[2] for c in driver.advice if c[0] == q] == [CODES.set_preferred_location, CODES.set_accessed_by]
        assert lab.policy.name == "zero-copy-params"
        for ptr in (p, a, q):
            source.free(ptr)


def test_bad_arguments_fail_before_anything_is_allocated(env):
    with pytest.raises(um_lab.PolicyError):
        Session("no-such-policy")
    with pytest.raises(ValueError, match="cap_bytes"):
        Session(cap_bytes=-1)
    with pytest.raises(ValueError, match="device"):
        Session(device=-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_cuda_the_error_points_to_the_simulator():
    with pytest.raises(um_lab.CudaUnavailableError, match="simulator"):
        Session().open()
    assert Session._open_session is None


def test_a_cuda_run_drops_its_model_before_its_pools_close(env, monkeypatch):
    """Nothing the run's loop holds keeps a managed tensor alive when the session closes: else its segment stays
    until the next session empties the cache, and the next run in the process counts it as its own."""
    import gc
    import weakref

    from um_lab.cuda import backend as backend_module
    from um_lab.cuda.backend import CudaBackend
    from um_lab.models import get_model
    from um_lab.policy import get_policy
    from um_lab.types import RunSpec

    source, driver, api, runtime = env
    seen: dict = {}

    class WatchedSession(Session):
        def place(self, model):
            placed = super().place(model)
            seen["params"] = [weakref.ref(p) for p in placed.parameters()]
            return placed

        def inputs(self, *tensors):
            placed = super().inputs(*tensors)
            seen["inputs"] = [weakref.ref(t) for t in (placed if isinstance(placed, tuple) else (placed,))]
            return placed

        def close(self):
            seen["residual"] = super().close()  # managed bytes tensors still held when the pools closed
            gc.collect()
            seen["alive_after"] = sum(r() is not None for r in seen["params"] + seen["inputs"])
            return seen["residual"]

    def session(policy, **kw):
        return new_session(policy, _pool_api=api, _runtime=runtime, _source=source, session_class=WatchedSession,
                           **kw)

    monkeypatch.setattr(backend_module, "Session", session)
    case = get_model("mlp", width=64, depth=2, batch_size=8)
    spec = RunSpec(model="mlp", backend="cuda", steps=2, warmup_steps=0, model_kwargs={"width": 64, "depth": 2,
                                                                                     "batch_size": 8})
    records = list(CudaBackend(cap_bytes=1 << 30).run(spec, case, get_policy("um-default")))
    assert len(records) == 2 and all(r.loss is not None for r in records)
    assert seen["params"] and seen["inputs"]
    assert seen["residual"] == 0 and seen["alive_after"] == 0
