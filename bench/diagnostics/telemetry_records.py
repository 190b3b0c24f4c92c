"""Diagnostic: which CUPTI unified-memory records arrive, and when, for known migrations.

Runs the known-tensor sequence of tests/gpu/test_telemetry_gpu.py (two 32 MiB tensors per data type;
first touch, prefetch half to the host, back, to the host again, then GPU demand faults) and prints,
for every flush, the records per kind / cause / data type and how long after the action they came.
After the last stage it waits, pokes the driver with an unrelated migration, and reads what CUPTI
still holds at disable. About 0.4 GiB of managed memory, safety cap on (the session's).

    python bench/diagnostics/telemetry_records.py > records.json
"""

import collections
import json
import threading
import time

import torch

from um_lab import DataType
from um_lab.cuda import driver
from um_lab.cuda.allocator import SegmentSource
from um_lab.cuda.residency import Kind
from um_lab.cuda.session import Session
from um_lab.cuda.telemetry import Telemetry

MiB = 1 << 20
N = 32 * MiB
LIMIT = 1 << 30  # this script's own ceiling on live managed bytes


def owner(index, address):
    """The data type name whose segment holds ``address``, or "none"."""
    data_type = index.data_type_of(address)
    return "none" if data_type is None else data_type.value


def summarise(records, index, causes):
    out = collections.Counter()
    for kind, value, address, _start, _end, flags in records:
        k = Kind(kind).name
        label = f"{k}/{causes.get(flags, flags)}" if kind in (1, 2) else k
        out[f"{label}/{owner(index, address)}"] += value if kind in (1, 2, 7) else 1
    return dict(sorted(out.items()))


def main():
    tel = Telemetry(flush="step", nvml=False)
    log = []
    with Session("um-default", telemetry=tel) as lab:
        assert tel.available, tel.status
        src = tel._source
        causes = src.cause_names
        dev = lab.device.index
        keep, away = {}, {}
        for t in DataType:
            with lab.allocating(t):
                keep[t.value] = torch.empty(N // 4, dtype=torch.float32, device=lab.device)
                away[t.value] = torch.empty(N // 4, dtype=torch.float32, device=lab.device)
        live = sum(SegmentSource().live_bytes().values())
        assert live < LIMIT, live
        stream = torch.cuda.current_stream().cuda_stream

        def to(where, tensors):
            for x in tensors.values():
                driver.prefetch(x.data_ptr(), N, where, dev, stream)

        def watch(stage, seconds=1.5, period=0.1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                src.flush()
                got = src.drain()
                if got:
                    log.append({"stage": stage, "after_ms": round((time.perf_counter() - t0) * 1e3, 1),
                                "n": len(got), "summary": summarise(got, SegmentSource().index(), causes)})
                time.sleep(period)

        watch("before")
        for t in keep:
            keep[t].fill_(1.0)
            away[t].fill_(2.0)
        watch("1 first touch")
        to("cpu", away)
        watch("1b prefetch away to cpu")
        to("gpu", away)
        watch("2 prefetch away to gpu")
        to("cpu", away)
        watch("3a prefetch away to cpu")
        for t in away:
            away[t].add_(1.0)
        watch("3b demand faults on gpu", seconds=3.0)
        for t in away:  # a second touch of the same pages: nothing should migrate
            away[t].add_(1.0)
        watch("3c second touch")
        to("cpu", {"keep_input": keep["input"]})
        to("gpu", {"keep_input": keep["input"]})
        watch("4 poke: keep[input] to cpu and back")
        def htod_per_type():
            src.flush()
            got = src.drain()
            out = dict.fromkeys((t.value for t in DataType), 0)
            index = SegmentSource().index()
            for kind, value, address, *_ in got:
                name = owner(index, address)
                if kind == 1 and name != "none":
                    out[name] += value
            return out, len(got)

        def read_ms(x, reps=5):
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                x.sum()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            return round(sorted(times)[reps // 2], 4)

        def flushing_every(period_s):
            halt = threading.Event()

            def loop():
                while not halt.wait(period_s):
                    src.flush()

            thread = threading.Thread(target=loop, daemon=True)
            thread.start()
            return halt, thread

        trials = ("serial", "burst", "burst, flushing every 5 ms", "burst, flushing every 20 ms", "burst again",
                  "burst, flushing every 5 ms, again", "serial again")
        for trial in trials:
            to("cpu", away)
            torch.cuda.synchronize()
            time.sleep(0.2)
            htod_per_type()  # the DtoH records of the prefetch
            if trial.startswith("serial"):
                moved, n = dict.fromkeys(keep, 0), 0
                for t in away:
                    away[t].add_(1.0)
                    torch.cuda.synchronize()
                    time.sleep(0.2)
                    part, k = htod_per_type()
                    moved = {u: moved[u] + part[u] for u in moved}
                    n += k
            else:
                period_ms = int(trial.split("every ")[1].split(" ms")[0]) if "every" in trial else None
                flusher = flushing_every(period_ms / 1e3) if period_ms else None
                t_burst = time.perf_counter()
                for t in away:
                    away[t].add_(1.0)
                torch.cuda.synchronize()
                burst_ms = (time.perf_counter() - t_burst) * 1e3
                if flusher is not None:
                    flusher[0].set()
                    flusher[1].join()
                time.sleep(0.5)
                moved, n = htod_per_type()
                time.sleep(0.5)
                late, k = htod_per_type()
                moved = {u: moved[u] + late[u] for u in moved}
                n += k
            burst = None if trial.startswith("serial") else round(burst_ms, 1)
            log.append({"trial": trial, "records": n, "burst_ms": burst,
                        "htod_MiB": {t: round(v / MiB, 2) for t, v in moved.items()},
                        "read_ms_away": {t: read_ms(away[t]) for t in away},
                        "read_ms_keep": {t: read_ms(keep[t]) for t in keep}})
        cupti = src._cupti
        cupti.activity_disable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        src.flush()
        got = src.drain()
        log.append({"stage": "5 at disable", "n": len(got), "summary": summarise(got, SegmentSource().index(),
                                                                                   causes)})
        log.append({"values": {t: [float(away[t][0]), float(away[t][-1])] for t in away}})
        del keep, away
    for entry in log:
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
