"""The compiled segment source against a fake CUDA driver: cap, registry, advice, counters."""

import threading

import pytest
from fakes import CODES, install_fake_driver

from um_lab.cuda.allocator import SegmentSource, advice_entries, default_cap
from um_lab.policy import Advice
from um_lab.types import DataType

MiB = 1 << 20


@pytest.fixture
def fake():
    source, driver = install_fake_driver(cap=100 * MiB)
    yield source, driver
    from fakes import drain

    drain(source)


def test_allocations_are_counted_per_type_and_freed(fake):
    source, driver = fake
    start = source.stats()
    a = source.allocate(DataType.PARAM, 20 * MiB)
    b = source.allocate(DataType.ACT, 2 * MiB)
    assert a and b and a != b
    assert source.live_bytes() == {"param": 20 * MiB, "grad": 0, "optim": 0, "act": 2 * MiB, "input": 0}
    assert source.data_type_of(a + 5 * MiB) is DataType.PARAM
    assert source.data_type_of(b) is DataType.ACT
    assert source.data_type_of(a + 20 * MiB + 10) is None
    assert source.data_type_of(a + 20 * MiB - 1) is DataType.PARAM and source.data_type_of(a - 1) is None
    source.free(a)
    assert driver.frees == [a]
    assert source.live_bytes()["param"] == 0
    end = source.stats()
    assert end["malloc_calls"] - start["malloc_calls"] == 2 and end["free_calls"] - start["free_calls"] == 1


def test_request_over_the_cap_is_refused_before_the_driver_is_called(fake):
    source, driver = fake
    source.allocate(DataType.PARAM, 60 * MiB)
    calls = len(driver.mallocs)
    refused = source.stats()["refused"]
    ptr = source.allocate(DataType.OPTIM, 41 * MiB)  # 60 + 41 > 100
    assert ptr == 0
    assert len(driver.mallocs) == calls, "the driver must not be called for a refused request"
    stats = source.stats()
    assert stats["refused"] == refused + 1 == source.refused()
    assert tuple(source.live_bytes().values()) == stats["live_by_tag"]
    assert source.generation() == stats["malloc_calls"] + stats["free_calls"]
    assert stats["last_refusal"] == (41 * MiB, 60 * MiB, 100 * MiB, 2)  # tag 2 = optim
    assert source.live_bytes()["optim"] == 0
    assert source.allocate(DataType.OPTIM, 40 * MiB) != 0  # exactly up to the cap is allowed


def test_allow_oversubscription_lifts_the_cap(fake):
    source, driver = fake
    source.set_cap(10 * MiB, True)
    refused = source.stats()["refused"]
    assert source.allocate(DataType.ACT, 50 * MiB) != 0
    assert source.stats()["refused"] == refused


def test_driver_error_leaves_nothing_live(fake):
    source, driver = fake
    driver.fail_next = 2  # cudaErrorMemoryAllocation
    errors = source.stats()["malloc_errors"]
    assert source.allocate(DataType.ACT, 4 * MiB) == 0
    stats = source.stats()
    assert stats["malloc_errors"] == errors + 1 and stats["last_error"] == 2
    assert stats["live_total"] == 0 and stats["reserved"] == 0


def test_advice_is_applied_to_each_new_segment_of_its_type(fake):
    source, driver = fake
    entries = advice_entries(Advice("cpu", frozenset({"gpu"}), False), device=0, codes=CODES)
    source.set_advice(DataType.PARAM, entries)
    p = source.allocate(DataType.PARAM, 4 * MiB)
    source.allocate(DataType.ACT, 4 * MiB)
    assert driver.advice == [
        (p, 4 * MiB, CODES.set_preferred_location, CODES.location_host, 0),
        (p, 4 * MiB, CODES.set_accessed_by, CODES.location_device, 0),
    ]


def test_unknown_pointer_is_never_passed_to_the_driver(fake):
    source, driver = fake
    unknown = source.stats()["unknown_frees"]
    source.free(12345)
    assert driver.frees == []
    assert source.stats()["unknown_frees"] == unknown + 1


def test_concurrent_requests_cannot_both_squeeze_under_the_cap(fake):
    source, driver = fake
    results = []

    def grab():
        results.append(source.allocate(DataType.ACT, 30 * MiB))

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    granted = [r for r in results if r]
    assert len(granted) == 3  # 3 * 30 <= 100 < 4 * 30
    assert source.stats()["live_total"] == 90 * MiB


def test_default_cap_keeps_a_reserve():
    GiB = 1 << 30
    assert default_cap(100 * GiB, 141 * GiB) == 100 * GiB - 141 * GiB // 20
    assert default_cap(10 * GiB, 16 * GiB) == 8 * GiB  # 2 GiB floor
    assert default_cap(1 * GiB, 16 * GiB) == 0


def test_addresses_are_distinct_entry_points():
    allocs, free = SegmentSource().addresses()
    assert len(set(allocs.values())) == 5 and free not in allocs.values()


def test_a_type_switched_to_device_memory_takes_cudamalloc_without_advice_under_the_same_cap(fake):
    source, driver = fake
    source.set_advice(DataType.ACT, [(CODES.set_preferred_location, CODES.location_host, 0)])
    source.set_device_memory(DataType.ACT, True)
    managed_before, advice_before = len(driver.mallocs), len(driver.advice)
    act = source.allocate(DataType.ACT, 30 * MiB)
    param = source.allocate(DataType.PARAM, 30 * MiB)
    assert act and param
    assert driver.device_mallocs[-1] == (act, 30 * MiB)
    assert len(driver.mallocs) == managed_before + 1 and driver.mallocs[-1][0] == param
    assert len(driver.advice) == advice_before, "device memory takes no advice"
    segs = {s.ptr: s for s in source.segments()}
    assert segs[act].managed is False and segs[param].managed is True
    assert [s.ptr for s in source.managed_segments()] == [param] and source.managed_segments(DataType.ACT) == []
    assert source.stats()["live_device"] == 30 * MiB
    assert source.live_bytes()["act"] == 30 * MiB  # counted as any segment
    assert source.allocate(DataType.ACT, 41 * MiB) == 0, "the cap covers device memory too"
    source.free(act)
    assert source.stats()["live_device"] == 0
    source.set_device_memory(DataType.ACT, False)
    again = source.allocate(DataType.ACT, 2 * MiB)
    assert driver.mallocs[-1][0] == again and {s.ptr: s.managed for s in source.segments()}[again]


def test_device_memory_needs_a_configured_allocator(fake):
    source, driver = fake
    source.configure(*driver.addresses())  # no malloc_device
    with pytest.raises(ValueError, match="device-memory allocator"):
        source.set_device_memory(DataType.ACT, True)
    source.set_device_memory(DataType.ACT, False)  # switching off needs none
