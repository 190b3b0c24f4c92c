"""Telemetry without a GPU: attribution and residency logic, the CUPTI adapter against a fake
``cupti`` module, degradation without cupti-python, and the session integration (fake driver)."""

import enum
import sys
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch
from fakes import FakePoolAPI, FakeRuntime, drain, install_fake_driver, new_session

from um_lab import DataType
from um_lab.cuda import cupti_source as tm
from um_lab.cuda.allocator import Segment
from um_lab.cuda.telemetry import BLOCK, CuptiSource, Kind, ResidencyTracker, Telemetry, TelemetryUnavailable

MiB = 1 << 20
CAUSES = {0: "UNKNOWN", 1: "USER", 2: "COHERENCE", 3: "PREFETCH", 4: "EVICTION", 5: "ACCESS_COUNTERS"}
H, D, F, R = Kind.BYTES_TRANSFER_HTOD, Kind.BYTES_TRANSFER_DTOH, Kind.GPU_PAGE_FAULT, Kind.REMOTE_MAP
BASE = 1 << 40


def seg(offset_mib, size_mib, t):
    return Segment(BASE + offset_mib * MiB, size_mib * MiB, DataType(t))


SEGS = [seg(0, 8, "param"), seg(16, 5, "act"), seg(32, 4, "input")]  # act: 5 MiB = 2 + 2 + 1


def rec(kind, value, address, start=0, flags=0):
    return (int(kind), int(value), int(address), start, start + 1, flags)


def tracker():
    return ResidencyTracker(cause_names=CAUSES)


# ---- attribution and residency (pure logic) ----


def test_faults_and_htod_make_blocks_resident_and_are_attributed_per_type():
    t = tracker()
    p, a = SEGS[0].ptr, SEGS[1].ptr
    out = t.update(SEGS, [
        rec(F, 3, p + 100),                       # block 0 of param
        rec(H, 64 << 10, p + 2 * MiB + 4096, 1),  # block 1 of param, 64 KiB moved
        rec(F, 1, a + 4 * MiB + 10, 2),           # the last (1 MiB) block of act
    ])
    assert out.resident_bytes == {"param": 4 * MiB, "grad": 0, "optim": 0, "act": 1 * MiB, "input": 0}
    assert out.htod_bytes["param"] == 64 << 10 and sum(out.htod_bytes.values()) == 64 << 10
    assert out.gpu_page_faults == 4 and out.extra["gpu_faults_by_type"]["act"] == 1
    assert out.dtoh_bytes == {t.value: 0 for t in DataType} and out.evictions == 0
    assert out.extra["unattributed"]["records"] == 0 and out.extra["um_records"] == 3


def test_dtoh_moves_blocks_back_to_the_host_and_counts_evictions_by_cause():
    t = tracker()
    p = SEGS[0].ptr
    t.update(SEGS, [rec(F, 1, p + i * BLOCK) for i in range(4)])
    out = t.update(SEGS, [
        rec(D, BLOCK, p, 10, flags=4),              # eviction of block 0
        rec(D, BLOCK // 2, p + BLOCK, 11, flags=4),  # eviction of half of block 1 (still one block)
        rec(D, BLOCK // 2, p + BLOCK + BLOCK // 2, 12, flags=4),
        rec(D, BLOCK, p + 2 * BLOCK, 13, flags=3),   # prefetch to host of block 2
    ])
    assert out.resident_bytes["param"] == 1 * BLOCK
    assert out.dtoh_bytes["param"] == 3 * BLOCK
    assert out.extra["dtoh_by_cause"] == {"PREFETCH": BLOCK, "EVICTION": 2 * BLOCK}
    assert out.evictions == 2
    assert out.htod_bytes["param"] == 0 and out.gpu_page_faults == 0  # per step, not cumulative


def test_events_apply_in_start_time_order_not_arrival_order():
    t = tracker()
    p = SEGS[0].ptr
    out = t.update(SEGS, [
        rec(D, BLOCK, p, start=50),          # block 0: fault at 10, back to host at 50 -> host
        rec(F, 1, p, start=10),
        rec(H, BLOCK, p + BLOCK, start=90),  # block 1: host at 20, back on the GPU at 90 -> GPU
        rec(D, BLOCK, p + BLOCK, start=20),
    ])
    assert out.resident_bytes["param"] == BLOCK


def test_a_record_arriving_a_step_late_does_not_undo_a_newer_one():
    t = tracker()
    p = SEGS[0].ptr
    assert t.update(SEGS, [rec(F, 1, p, start=1)]).resident_bytes["param"] == 2 * MiB
    assert t.update(SEGS, [rec(D, BLOCK, p, start=10)]).resident_bytes["param"] == 0
    late = t.update(SEGS, [rec(F, 1, p, start=5)])  # happened before the DtoH, delivered after it
    assert late.resident_bytes["param"] == 0 and late.gpu_page_faults == 1  # still counted as a fault
    assert t.update(SEGS, [rec(H, BLOCK, p, start=10)]).resident_bytes["param"] == 2 * MiB  # ties: arrival


def test_a_transfer_spanning_blocks_marks_each_and_is_clipped_to_its_segment():
    t = tracker()
    p, i = SEGS[0].ptr, SEGS[2].ptr
    out = t.update(SEGS, [rec(H, 3 * BLOCK, p + BLOCK, 0), rec(H, 10 * BLOCK, i, 1)])
    assert out.resident_bytes["param"] == 3 * BLOCK
    assert out.resident_bytes["input"] == 4 * MiB  # clipped at the segment's end
    assert out.htod_bytes["input"] == 10 * BLOCK   # bytes are reported as CUPTI said


def test_remote_map_means_not_resident_and_is_reported_per_type():
    t = tracker()
    p = SEGS[0].ptr
    out = t.update(SEGS, [rec(F, 1, p, 1), rec(R, BLOCK, p, 2)])
    assert out.resident_bytes["param"] == 0
    assert out.extra["remote_map_bytes"]["param"] == BLOCK


def test_addresses_outside_every_segment_are_counted_apart():
    t = tracker()
    out = t.update(SEGS, [rec(H, 4096, BASE - 4096), rec(F, 2, BASE + 12 * MiB), rec(D, 8, BASE + 99 * MiB)])
    assert sum(out.resident_bytes.values()) == 0 and sum(out.htod_bytes.values()) == 0
    assert out.extra["unattributed"] == {"htod_bytes": 4096, "dtoh_bytes": 8, "gpu_faults": 2, "records": 3}
    assert out.gpu_page_faults == 2  # the device total still counts them


def test_residency_follows_segments_across_steps():
    t = tracker()
    p = SEGS[0].ptr
    t.update(SEGS, [rec(F, 1, p), rec(F, 1, SEGS[1].ptr), rec(F, 1, SEGS[2].ptr)])
    # act freed, input re-created with another size at the same address, a new grad segment
    new = [SEGS[0], Segment(SEGS[2].ptr, 6 * MiB, DataType.INPUT), seg(64, 2, "grad")]
    out = t.update(new, [])
    assert out.resident_bytes == {"param": BLOCK, "grad": 0, "optim": 0, "act": 0, "input": 0}
    out = t.update([], [rec(F, 1, p)])
    assert sum(out.resident_bytes.values()) == 0 and out.extra["unattributed"]["records"] == 1


def test_no_records_no_segments():
    out = tracker().update([], [])
    assert out.resident_bytes == {t.value: 0 for t in DataType} and out.gpu_page_faults == 0
    assert out.evictions == 0 and out.extra["um_records"] == 0


def test_fields_whose_counter_kind_was_not_collected_stay_none():
    t = ResidencyTracker(enabled=[H, D], cause_names={})
    out = t.update(SEGS, [rec(H, 10, SEGS[0].ptr)])
    assert out.resident_bytes is None and out.gpu_page_faults is None and out.evictions is None
    assert out.htod_bytes["param"] == 10
    assert "thrashing_records" not in out.extra and "remote_map_bytes" not in out.extra


def _reference(segments, steps):
    """Brute force: per-block dicts, one record at a time; a block keeps its latest-starting event,
    across steps too (a record that arrives a step late cannot undo a newer one)."""
    state, when, results = {}, {}, []
    for records in steps:
        live = {}
        for s in segments:
            for b in range((s.size + BLOCK - 1) // BLOCK):
                key = (s.ptr, s.size, s.data_type, b)
                live[key] = state.get(key, False)
        state = live
        for kind, value, addr, start, _end, _flags in sorted(records, key=lambda r: r[3]):
            owner = next((s for s in segments if s.ptr <= addr < s.ptr + s.size), None)
            if owner is None or kind not in (H, D, F, R):
                continue
            length = 1 if kind == F else max(value, 1)
            end = min(addr - owner.ptr + length, owner.size) - 1
            for b in range((addr - owner.ptr) // BLOCK, end // BLOCK + 1):
                key = (owner.ptr, owner.size, owner.data_type, b)
                if start >= when.get(key, -1):
                    state[key], when[key] = kind in (H, F), start
        res = {t.value: 0 for t in DataType}
        for (_ptr, size, dt, b), on in state.items():
            if on:
                res[dt.value] += min(BLOCK, size - b * BLOCK)
        results.append(res)
    return results


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_brute_force_reference_on_random_records(seed):
    rng = np.random.default_rng(seed)
    segments = [seg(16 * i, int(rng.integers(1, 12)), DataType.parse(["param", "grad", "optim", "act", "input"][i % 5]))
                for i in range(8)]
    steps = []
    for _ in range(4):
        n = 300
        kinds = rng.choice([H, D, F, R, Kind.THRASHING], n)
        addr = BASE + rng.integers(-MiB, 16 * 8 * MiB, n)
        value = rng.integers(1, 3 * BLOCK, n)
        start = rng.integers(0, 50, n)  # many ties: arrival order decides them
        rows = zip(kinds, value, addr, start, strict=True)
        steps.append([(int(k), int(v), int(a), int(s), int(s), 0) for k, v, a, s in rows])
    t = tracker()
    got = [t.update(segments, records).resident_bytes for records in steps]
    # the reference sorts stably by start, like the tracker's tie rule (arrival order)
    assert got == _reference(segments, steps)


def test_a_large_flush_is_processed_quickly():
    segments = [seg(4 * i, 4, "act") for i in range(500)]
    rng = np.random.default_rng(0)
    n = 100_000
    addr = BASE + rng.integers(0, 2000 * MiB, n)
    kinds = rng.choice([H, D, F], n)
    records = [(int(k), 65536, int(a), i, i, 0) for i, (k, a) in enumerate(zip(kinds, addr, strict=True))]
    t0 = time.perf_counter()
    out = tracker().update(segments, records)
    assert time.perf_counter() - t0 < 2.0
    assert out.extra["um_records"] == n


# ---- the CUPTI adapter against a fake cupti module ----


def _fake_cupti(reject=(), enable_error=None):
    """A stand-in for ``cupti.cupti``: configure/enable/flush, calling back like CUPTI does."""
    m = types.SimpleNamespace()
    m.ActivityUnifiedMemoryCounterKind = enum.IntEnum("K", {k.name: int(k) for k in Kind})
    m.ActivityUnifiedMemoryMigrationCause = enum.IntEnum("C", {v: k for k, v in CAUSES.items()})
    m.ActivityUnifiedMemoryCounterScope = enum.IntEnum("S", {"PROCESS_SINGLE_DEVICE": 1})
    m.ActivityKind = enum.IntEnum("A", {"UNIFIED_MEMORY_COUNTER": 25})
    m.Result = enum.IntEnum("R", {"SUCCESS": 0, "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED": 39})

    class cuptiError(Exception):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    m.cuptiError = cuptiError
    m.calls, m.pending, m.callbacks, m.flush_threads = [], [], None, []

    class Config(list):
        def __init__(self, n):
            super().__init__(types.SimpleNamespace() for _ in range(n))
            self.ptr = id(self)

    m.ActivityUnifiedMemoryCounterConfig = Config
    configs = {}

    def configure(ptr, count):
        cfg = next(c for c in configs.values() if c.ptr == ptr) if configs else None
        kinds = [c.kind.name for c in cfg]
        if set(kinds) & set(reject):
            raise cuptiError(27)  # ERROR_NOT_SUPPORTED
        m.calls.append(("configure", kinds))

    def make_config(n):
        c = Config(n)
        configs[c.ptr] = c
        return c

    m.ActivityUnifiedMemoryCounterConfig = make_config
    m.activity_configure_unified_memory_counter = configure
    m.activity_register_callbacks = lambda req, done: setattr(m, "callbacks", (req, done))

    def enable(kind):
        if enable_error is not None:
            raise cuptiError(enable_error)
        m.calls.append(("enable", int(kind)))

    m.activity_enable = enable
    m.activity_disable = lambda kind: m.calls.append(("disable", int(kind)))

    def flush(flag):
        m.calls.append(("flush", flag))
        m.flush_threads.append(threading.get_ident())
        size, _ = m.callbacks[0]()
        assert size > 0
        acts, m.pending = m.pending, []
        m.callbacks[1](acts)

    m.activity_flush_all = flush
    m.activity_flush_period = lambda ms: m.calls.append(("period", ms))
    return m


def _activity(kind, value, address, start, flags=0, activity_kind=25):
    return types.SimpleNamespace(kind=activity_kind, counter_kind=int(kind), value=value, address=address,
                                 start=start, end=start + 5, flags_=flags)


@pytest.fixture
def fake_cupti(monkeypatch):
    def install(**kw):
        mod = _fake_cupti(**kw)
        pkg = types.ModuleType("cupti")
        pkg.cupti = mod
        monkeypatch.setitem(sys.modules, "cupti", pkg)
        monkeypatch.setitem(sys.modules, "cupti.cupti", mod)
        return mod

    monkeypatch.setattr(tm._Hub, "sink", None)
    monkeypatch.setattr(tm._Hub, "registered", False)
    monkeypatch.setattr(tm._Hub, "configured", None)
    # flush through the fake module even where a real libcupti is loaded (CUDA torch)
    monkeypatch.setattr(tm, "_flush_function", lambda cupti: (cupti.activity_flush_all, "cupti-python"))
    return install


def test_cupti_source_collects_compact_tuples_and_skips_other_activity_kinds(fake_cupti):
    m = fake_cupti()
    src = CuptiSource()
    src.start(0)
    assert src.enabled == frozenset(Kind) and src.cause_names[4] == "EVICTION"
    assert ("enable", 25) in m.calls
    m.pending = [_activity(H, 4096, 123, 7, flags=3), _activity(H, 1, 1, 1, activity_kind=10)]
    assert src.drain() == []  # nothing delivered before a flush
    src.flush()
    assert ("flush", 1) in m.calls  # forced: incomplete buffers too
    assert src.drain() == [(1, 4096, 123, 7, 12, 3)]
    assert src.drain() == []
    src.stop()
    assert ("disable", 25) in m.calls and tm._Hub.sink is None
    src.stop()  # idempotent


def test_kinds_the_runtime_rejects_are_left_out(fake_cupti):
    m = fake_cupti(reject=("THROTTLING", "REMOTE_MAP"))
    tel = Telemetry(nvml=False)
    assert tel.start(0) == "cupti (not collected: REMOTE_MAP, THROTTLING)"
    configures = [c for c in m.calls if c[0] == "configure"]
    assert "THROTTLING" not in configures[-1][1] and "BYTES_TRANSFER_HTOD" in configures[-1][1]
    r = _record()
    tel.fill(r, SEGS)
    assert r.resident_bytes is not None and "remote_map_bytes" not in r.extra
    tel.close()


def test_cupti_held_by_another_profiler_degrades_with_the_reason(fake_cupti):
    fake_cupti(enable_error=39)
    tel = Telemetry(nvml=False)
    status = tel.start(0)
    assert status.startswith("unavailable: CUPTI could not enable unified-memory counters")
    assert "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED" in status and "another profiler" in status
    assert not tel.available and tm._Hub.sink is None
    r = _record()
    tel.fill(r, SEGS)
    assert r.telemetry == status and r.resident_bytes is None and r.gpu_page_faults is None


def test_only_one_collector_per_process(fake_cupti):
    fake_cupti()
    first, second = Telemetry(nvml=False), Telemetry(nvml=False)
    assert first.start(0) == "cupti"
    assert "another um_lab Telemetry" in second.start(0)
    first.close()
    assert second.start(0) == "cupti"  # re-enabling later works (callbacks registered once)
    second.close()


# ---- degradation without cupti-python ----


def _record():
    from um_lab.types import StepRecord

    return StepRecord(step=0, wall_ms=1.0, live_bytes={t.value: 0 for t in DataType}, cap_bytes=None,
                      gpu_capacity_bytes=1, telemetry="unavailable: telemetry not enabled")


@pytest.fixture
def no_cupti(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import fails as if not installed


def test_without_cupti_python_the_reason_is_recorded_and_nothing_is_invented(no_cupti):
    with pytest.raises(TelemetryUnavailable, match="cupti-python is not importable"):
        CuptiSource().start(0)
    tel = Telemetry(nvml=False)
    assert tel.start(0).startswith("unavailable: cupti-python is not importable")
    assert "um_lab[telemetry]" in tel.status
    r = _record()
    tel.fill(r, SEGS)
    assert r.telemetry.startswith("unavailable: cupti-python is not importable")
    assert (r.resident_bytes, r.htod_bytes, r.dtoh_bytes, r.gpu_page_faults, r.evictions) == (None,) * 5
    assert "telemetry_ms" not in r.extra


class _FailingSource:
    enabled = frozenset(Kind)
    cause_names = CAUSES

    def start(self, device):
        pass

    def flush(self):
        pass

    def drain(self):
        raise RuntimeError("boom")

    def stop(self):
        self.stopped = True


def test_a_failure_while_collecting_degrades_instead_of_crashing():
    src = _FailingSource()
    tel = Telemetry(source=src, nvml=False)
    assert tel.start(0) == "cupti"
    r = _record()
    tel.fill(r, SEGS)
    assert r.telemetry == "unavailable: telemetry failed (RuntimeError: boom)" and r.resident_bytes is None
    assert src.stopped and not tel.available


def test_nvml_missing_is_reported_in_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    tel = Telemetry(source=_ListSource([]))
    tel.start(0)
    r = _record()
    tel.fill(r, [])
    assert r.extra["nvml"].startswith("unavailable: ")
    assert r.telemetry == "cupti"


# ---- session integration (fake driver, fake source) ----


class _ListSource:
    """Hands out records built by a function of the live segments, once per drain."""

    enabled = frozenset(Kind)
    cause_names = CAUSES

    def __init__(self, make):
        self.make = make if callable(make) else (lambda: make)
        self.started, self.stopped, self.drains, self.flushes = [], 0, 0, 0

    def start(self, device):
        self.started.append(device)

    def flush(self):
        self.flushes += 1

    def drain(self):
        self.drains += 1
        return self.make()

    def stop(self):
        self.stopped += 1


@pytest.fixture
def env():
    source, driver = install_fake_driver(cap=1 << 40)
    yield source, FakePoolAPI(), FakeRuntime()
    drain(source)


def _session(env, **kw):
    source, api, runtime = env
    return new_session("um-default", _pool_api=api, _runtime=runtime, _source=source, **kw)


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_session_fills_measured_fields_every_step(env):
    source = env[0]
    box = {}
    fake = _ListSource(lambda: [rec(F, 2, box["param"] + 100, 1), rec(H, 4096, box["act"], 2)])
    tel = Telemetry(source=fake, nvml=False)
    with _session(env, telemetry=tel) as lab:
        assert lab.telemetry is tel and fake.started == [0]
        box["param"] = source.allocate(DataType.PARAM, 4 * MiB)
        box["act"] = source.allocate(DataType.ACT, 2 * MiB)
        model, opt = _tiny()
        lab.attach(model, opt)
        x = torch.randn(4, 8)
        seen = []
        lab.add_listener(seen.append)
        r1 = lab.step(lambda: model(x).sum(), opt)
        r2 = lab.step(lambda: model(x).sum(), opt)
        assert r1.telemetry == "cupti" and seen == [r1, r2]
        assert r1.resident_bytes == {"param": 2 * MiB, "grad": 0, "optim": 0, "act": 2 * MiB, "input": 0}
        assert r1.htod_bytes["act"] == 4096 and r1.gpu_page_faults == 2 and r1.evictions == 0
        assert r2.gpu_page_faults == 2 and r2.resident_bytes == r1.resident_bytes
        assert r1.extra["telemetry_ms"] >= 0 and r1.live_bytes["param"] == 4 * MiB
        assert all(v <= r1.live_bytes[t] for t, v in r1.resident_bytes.items())
        assert fake.drains == 2
        source.free(box["param"])
        source.free(box["act"])
    assert fake.stopped == 1 and not tel.available


def test_session_telemetry_true_without_cupti_warns_and_trains_on(env, no_cupti):
    with pytest.warns(RuntimeWarning, match="unavailable: cupti-python is not importable"):
        lab = _session(env, telemetry=True).open()
    try:
        model, opt = _tiny()
        lab.attach(model, opt)
        rec_ = lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        assert rec_.telemetry.startswith("unavailable: cupti-python is not importable")
        assert rec_.resident_bytes is None and rec_.htod_bytes is None and rec_.gpu_page_faults is None
        assert rec_.loss is not None
    finally:
        lab.close()


def test_session_auto_is_quiet_and_false_is_off(env, no_cupti):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _session(env, telemetry="auto") as lab:
            model, opt = _tiny()
            lab.attach(model, opt)
            r = lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
            assert r.telemetry.startswith("unavailable: cupti-python")
    with _session(env) as lab:
        assert lab.telemetry is None
        model, opt = _tiny()
        lab.attach(model, opt)
        r = lab.step(lambda: model(torch.randn(2, 8)).sum(), opt)
        assert r.telemetry == "unavailable: telemetry not enabled"
    with pytest.raises(ValueError, match="telemetry must be"):
        _session(env, telemetry="yes")


def test_cuda_backend_passes_telemetry_to_the_session(monkeypatch):
    from um_lab.cuda import backend as cb

    seen = {}

    class Stop(Exception):
        pass

    def fake_session(*args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(cb, "Session", fake_session)
    from um_lab.models import get_model
    from um_lab.policy import get_policy
    from um_lab.types import RunSpec

    case = get_model("mlp", width=8, depth=1, batch_size=2)
    for value, expected in ((None, "auto"), (False, False), (True, True)):
        backend = cb.CudaBackend() if value is None else cb.CudaBackend(telemetry=value)
        with pytest.raises(Stop):
            next(backend.run(RunSpec(), case, get_policy("um-default")))
        assert seen["telemetry"] == expected


def test_every_kind_rejected_means_unavailable_with_the_reason(fake_cupti):
    fake_cupti(reject=tuple(k.name for k in Kind))
    tel = Telemetry(nvml=False)
    status = tel.start(0)
    assert status.startswith("unavailable: CUPTI rejected every unified-memory counter kind")
    assert "status 27" in status and not tel.available and tm._Hub.sink is None


def _wait_for(condition, timeout_s=5.0):
    t0 = time.perf_counter()
    while not condition():
        assert time.perf_counter() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.005)


def test_background_mode_flushes_on_its_own_thread_and_fill_never_flushes(fake_cupti):
    m = fake_cupti()
    tel = Telemetry(nvml=False, flush_period_ms=5)
    assert tel.start(0) == "cupti" and tel.flush_mode == "background"
    try:
        m.pending = [_activity(F, 3, BASE + 100, 1)]
        _wait_for(lambda: tel._source._chunks)  # the collector thread flushed it and the callback ran
        flushes = [c for c in m.calls if c[0] == "flush"]
        assert flushes and all(flag == 1 for _, flag in flushes)
        r = _record()
        tel.fill(r, SEGS)
        assert r.gpu_page_faults == 3 and r.resident_bytes["param"] == 2 * MiB
        assert r.extra["telemetry_flush"] == "background" and "telemetry_nvml_ms" not in r.extra
        assert m.flush_threads and threading.get_ident() not in m.flush_threads  # fill never flushed
    finally:
        tel.close()
    assert ("disable", 25) in m.calls and tm._Hub.sink is None


def test_collect_settle_flushes_on_the_caller_and_step_mode_flushes_every_fill(fake_cupti):
    m = fake_cupti()
    tel = Telemetry(nvml=False, flush_period_ms=60_000)  # the collector never wakes in this test
    tel.start(0)
    try:
        m.pending = [_activity(H, 4096, BASE, 1)]
        assert tel.collect(SEGS).htod_bytes["param"] == 0  # not flushed yet: nothing delivered
        m.pending = [_activity(H, 4096, BASE, 1)]
        assert tel.collect(SEGS, settle=True).htod_bytes["param"] == 4096
    finally:
        tel.close()
    src = _ListSource([])
    tel = Telemetry(source=src, nvml=False, flush="step")
    tel.start(0)
    for _ in range(3):
        tel.fill(_record(), SEGS)
    tel.close()
    assert src.flushes == 3 and src.drains == 3 and src.stopped == 1


def test_a_failure_on_the_collector_thread_degrades_at_the_next_step():
    class FlushFails(_ListSource):
        def flush(self):
            raise OSError("flush failed")

    src = FlushFails([])
    tel = Telemetry(source=src, nvml=False, flush_period_ms=1)
    tel.start(0)
    _wait_for(lambda: tel._collector.error is not None)
    r = _record()
    tel.fill(r, SEGS)
    assert r.telemetry == "unavailable: telemetry failed (OSError: flush failed)"
    assert r.resident_bytes is None and src.stopped == 1 and not tel.available


def test_starting_twice_keeps_the_running_collection():
    src = _ListSource([])
    tel = Telemetry(source=src, nvml=False, flush_period_ms=60_000)
    assert tel.start(0) == "cupti" and tel.start(0) == "cupti"
    assert src.started == [0] and tel.available
    collector = tel._collector
    tel.close()
    assert not collector.is_alive() and src.stopped == 1


def test_a_collector_thread_that_cannot_start_gives_cupti_back(monkeypatch):
    from um_lab.cuda import telemetry as tel_module

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(tel_module._Collector, "start", refuse)
    src = _ListSource([])
    tel = Telemetry(source=src, nvml=False)
    assert tel.start(0) == "unavailable: telemetry thread failed (RuntimeError: can't start new thread)"
    assert not tel.available and src.stopped == 1
    r = _record()
    tel.fill(r, SEGS)
    assert r.resident_bytes is None and r.telemetry.startswith("unavailable: telemetry thread failed")


def test_running_telemetries_are_closed_at_interpreter_exit():
    from um_lab.cuda import telemetry as tel_module

    src = _ListSource([])
    tel = Telemetry(source=src, nvml=False, flush_period_ms=60_000)
    tel.start(0)
    collector = tel._collector
    tel_module._close_at_exit()
    assert not tel.available and src.stopped == 1 and not collector.is_alive()


def test_bad_telemetry_settings_are_refused():
    with pytest.raises(ValueError, match="buffer_bytes"):
        CuptiSource(buffer_bytes=10)
    with pytest.raises(ValueError, match="flush must be"):
        Telemetry(flush="sometimes")
    with pytest.raises(ValueError, match="flush_period_ms"):
        Telemetry(flush_period_ms=0)


def test_fill_reports_where_the_telemetry_time_goes(fake_cupti):
    fake_cupti()
    tel = Telemetry(nvml=False)
    tel.start(0)
    try:
        r = _record()
        tel.fill(r, SEGS)
        for key in ("telemetry_flush_ms", "telemetry_attribution_ms", "telemetry_ms"):
            assert r.extra[key] >= 0
        assert r.extra["telemetry_ms"] >= r.extra["telemetry_flush_ms"]
    finally:
        tel.close()


FAKE_LIBCUPTI = r"""
static unsigned int last = 0;
int cuptiActivityFlushAll(unsigned int flag) { last = flag; return flag == 7 ? 5 : 0; }
unsigned int last_flag(void) { return last; }
"""

CTYPES_PROBE = r"""
import ctypes, json, sys, types
lib = ctypes.CDLL(sys.argv[1])  # now mapped in this process under .../libcupti.so
from um_lab.cuda.cupti_source import _flush_function

class cuptiError(Exception):
    def __init__(self, status):
        super().__init__(status)
        self.status = status

fake = types.SimpleNamespace(activity_flush_all=lambda flag: None, cuptiError=cuptiError)
flush, via = _flush_function(fake)
flush(1)
out = {"via": via, "last": lib.last_flag()}
try:
    flush(7)
except cuptiError as e:
    out["error"] = e.status
print(json.dumps(out))
"""


def test_the_flush_goes_through_ctypes_when_libcupti_is_loaded(tmp_path):
    import json
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libcupti.so")
    src = tmp_path / "fake.c"
    src.write_text(FAKE_LIBCUPTI)
    lib = tmp_path / "libcupti.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    # a fresh process: the stand-in library must not stay mapped in the test process
    out = subprocess.run([sys.executable, "-c", CTYPES_PROBE, str(lib)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"via": "ctypes", "last": 1, "error": 5}


def test_without_exactly_one_libcupti_the_flush_uses_cupti_pythons_wrapper(tmp_path):
    calls = []
    fake = types.SimpleNamespace(activity_flush_all=calls.append, cuptiError=RuntimeError)
    none = tmp_path / "maps_none"
    none.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libc.so.6\n")
    two = tmp_path / "maps_two"
    two.write_text("7f00-7f01 r-xp 0 00:00 0 /a/libcupti.so.13\n7f02-7f03 r-xp 0 00:00 0 /b/libcupti.so.12\n")
    for maps in (none, two):
        flush, via = tm._flush_function(fake, str(maps))
        flush(1)
        assert via == "cupti-python"
    assert calls == [1, 1]


def test_a_budget_session_reads_residency_only_after_the_steps_moves_completed(env):
    """With a budget, telemetry is read once the mover has issued every move of the step and the side stream
    is synchronised (the ledger counts a move when it is issued), outside the step's time."""
    state = {}

    def make():
        streams = state["lab"].budget.executor.streams
        state.setdefault("log_at_drain", []).append(list(streams.log))
        return []

    fake = _ListSource(make)
    tel = Telemetry(source=fake, nvml=False, flush="step")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _session(env, telemetry=tel, budget=24 * MiB) as lab:
        state["lab"] = lab
        lab.attach(lab.place(model), opt)
        x = torch.randn(64, 1024)
        records = [lab.step(lambda: model(x).square().mean(), opt) for _ in range(3)]
    assert fake.drains == 3
    for r, log in zip(records, state["log_at_drain"], strict=True):
        assert r.extra["budget"]["finish_moves_ms"] >= 0
        assert log and log[-1] == ("synchronize_side", 0)  # the last thing before residency was read
