"""Measured residency on the H200: known tensors of each type, then one ResNet-50 step.

Skips cleanly without CUDA (gpu marker) and, for the CUPTI checks, without cupti-python or when
CUPTI cannot be enabled (the skip reason carries the telemetry status). Managed memory stays small
(< 0.5 GiB here) and the safety cap stays on.
"""

import json
import time

import pytest
import torch

from um_lab import DataType
from um_lab.models import get_model

pytestmark = pytest.mark.gpu

MiB = 1 << 20
N = 32 * MiB  # bytes per tensor: > 10 MiB, so each tensor gets a segment of its own (32 MiB)
TYPES = [t.value for t in DataType]


def _source():
    from um_lab.cuda.allocator import SegmentSource

    return SegmentSource()


def _collect(tel, settle_s=0.1, max_s=3.0):
    """Flush until two flushes in a row bring nothing new (UM records can trail the kernels that
    caused them); residency from the last flush, migrations summed over all of them."""
    torch.cuda.synchronize()
    parts = [tel.collect(_source().segments(), settle=True)]
    quiet, t0 = 0, time.time()
    while quiet < 2 and time.time() - t0 < max_s:
        time.sleep(settle_s)
        parts.append(tel.collect(_source().segments(), settle=True))
        assert parts[-1] is not None, tel.status
        quiet = quiet + 1 if parts[-1].extra.get("um_records", 0) == 0 else 0
    first, second = parts[0], parts[-1]
    assert first is not None and second is not None, tel.status
    both = tuple(parts)
    return {
        "resident": second.resident_bytes,
        "htod": {t: sum(s.htod_bytes[t] for s in both) for t in TYPES},
        "dtoh": {t: sum(s.dtoh_bytes[t] for s in both) for t in TYPES},
        "faults": sum(s.gpu_page_faults for s in both),
        "evictions": sum(s.evictions for s in both),
        "unattributed": [s.extra["unattributed"] for s in both],
        "dtoh_by_cause": [s.extra["dtoh_by_cause"] for s in both],
        "htod_by_cause": [s.extra["htod_by_cause"] for s in both],
    }


def _segments_per_type():
    counts = dict.fromkeys(TYPES, 0)
    for seg in _source().segments():
        counts[seg.data_type.value] += 1
    return counts


def _close(actual, expected, slack):
    return all(abs(actual[t] - expected[t]) <= 2 * MiB * slack[t] for t in TYPES)


def test_known_tensors_resident_and_migrated_bytes_per_type():
    pytest.importorskip("cupti", reason="cupti-python is not installed")
    from um_lab.cuda import driver
    from um_lab.cuda.session import Session
    from um_lab.cuda.telemetry import Telemetry

    leftover = _segments_per_type()
    assert not any(leftover.values()), f"managed segments from an earlier test: {leftover}"
    tel = Telemetry()
    with Session("um-default", telemetry=tel) as lab:
        if not tel.available:
            pytest.skip(f"CUPTI: {tel.status}")
        dev = lab.device.index
        keep, away = {}, {}
        for t in DataType:
            with lab.allocating(t):
                keep[t.value] = torch.empty(N // 4, dtype=torch.float32, device=lab.device)
                away[t.value] = torch.empty(N // 4, dtype=torch.float32, device=lab.device)
        slack = _segments_per_type()
        assert all(n == 2 for n in slack.values()), slack
        _collect(tel)  # whatever happened before (nothing resident yet)
        stream = torch.cuda.current_stream().cuda_stream

        def to(where, tensors):
            for x in tensors.values():
                driver.prefetch(x.data_ptr(), N, where, dev, stream)

        # 1. first touch on the GPU (faults populate), then half of it prefetched to the host
        for t in TYPES:
            keep[t].fill_(1.0)
            away[t].fill_(2.0)
        torch.cuda.synchronize()
        to("cpu", away)
        one = _collect(tel)
        print("step 1", json.dumps(one))
        expect = dict.fromkeys(TYPES, N)
        assert one["faults"] > 0
        assert _close(one["resident"], expect, slack), one["resident"]
        assert _close(one["dtoh"], expect, slack), one["dtoh"]
        assert sum(u["dtoh_bytes"] + u["htod_bytes"] for u in one["unattributed"]) == 0

        # 2. prefetched back to the GPU: HtoD equals the bytes moved, everything resident
        to("gpu", away)
        two = _collect(tel)
        print("step 2", json.dumps(two))
        assert _close(two["htod"], expect, slack), two["htod"]
        assert _close(two["resident"], dict.fromkeys(TYPES, 2 * N), slack), two["resident"]
        assert sum(two["dtoh"].values()) == 0

        # 3. to the host again, then demand faults on the GPU bring it back, one type at a time: a
        # burst of demand migrations (~160 MiB here) can overflow the driver's event queue and lose
        # the newest records (docs/telemetry.md, "Limits")
        to("cpu", away)
        moved_out = _collect(tel)
        parts = []
        for t in TYPES:
            away[t].add_(1.0)
            parts.append(_collect(tel))
        three = {"resident": parts[-1]["resident"], "dtoh": moved_out["dtoh"],
                 "htod": {t: sum(p["htod"][t] for p in parts) for t in TYPES},
                 "htod_by_cause": [p["htod_by_cause"] for p in parts]}
        print("step 3", json.dumps(three))
        assert _close(three["dtoh"], expect, slack), three["dtoh"]
        assert _close(three["resident"], dict.fromkeys(TYPES, 2 * N), slack), three["resident"]
        assert all(0 < three["htod"][t] <= N + 2 * MiB * slack[t] for t in TYPES), three["htod"]
        assert float(away["act"][0]) == 3.0 and float(keep["param"][-1]) == 1.0
        del keep, away


def test_resnet50_step_resident_is_at_most_live_per_type():
    pytest.importorskip("cupti", reason="cupti-python is not installed")
    from um_lab.cuda.session import Session

    case = get_model("resnet50", batch_size=16)  # < 1 GiB managed in all
    torch.manual_seed(0)
    model = case.build_model()
    with Session("um-default", telemetry=True, evacuate_on_close=False) as lab:
        if not lab.telemetry.available:
            pytest.skip(f"CUPTI: {lab.telemetry.status}")
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        records = []
        for _ in range(3):
            batch = lab.inputs(*case.batch(0))
            records.append(lab.step(lambda b=batch: case.loss_fn(model, *b), opt))
            batch = None
        for r in records:
            print(json.dumps({k: r.to_dict()[k] for k in ("step", "wall_ms", "live_bytes", "resident_bytes",
                                                         "htod_bytes", "dtoh_bytes", "gpu_page_faults",
                                                         "evictions", "telemetry", "extra")}, default=str))
        first, last = records[0], records[-1]
        # background flush (the default): a step's records may land in the next step's record
        assert first.telemetry.startswith("cupti") and first.extra["telemetry_flush"] == "background"
        assert first.extra["telemetry_flush_via"] == "ctypes"  # the GIL-free flush path was found
        assert sum(r.gpu_page_faults for r in records) > 0
        for r in records:
            assert all(r.resident_bytes[t] <= r.live_bytes[t] for t in TYPES), (r.resident_bytes, r.live_bytes)
        assert last.resident_bytes["act"] > 0 and last.extra["telemetry_ms"] >= 0
        model = opt = None  # drop managed tensors before close


def test_auto_never_crashes_and_never_invents_numbers():
    from um_lab.cuda.session import Session

    case = get_model("mlp", width=256, depth=2, batch_size=32)
    torch.manual_seed(0)
    model = case.build_model()
    with Session("um-default", telemetry="auto", evacuate_on_close=False) as lab:
        model = lab.place(model)
        opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
        x, y = lab.inputs(*case.batch(0))
        r = lab.step(lambda: case.loss_fn(model, x, y), opt)
        print("telemetry:", r.telemetry, json.dumps(r.extra, default=str)[:600])
        assert r.loss is not None
        if r.telemetry.startswith("unavailable: "):
            assert (r.resident_bytes, r.htod_bytes, r.dtoh_bytes, r.gpu_page_faults) == (None,) * 4
        else:
            assert r.telemetry.startswith("cupti") and r.resident_bytes is not None
        assert "nvml_used_bytes" in r.extra or r.extra.get("nvml", "").startswith("unavailable")
        if "nvml_used_bytes" in r.extra:
            assert 0 < r.extra["nvml_used_bytes"] <= r.extra["nvml_total_bytes"]
        x = y = model = opt = None  # drop managed tensors before close
