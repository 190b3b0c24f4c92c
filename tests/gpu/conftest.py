"""Every GPU test must leave no managed bytes behind: a leak is reported at the test that caused it,
not at a later test that counts segments (tests/gpu/test_telemetry_gpu.py does)."""

import gc

import pytest
import torch


def _leftover() -> str:
    from um_lab.cuda.allocator import SegmentSource

    source = SegmentSource()
    if source.stats()["live_total"] == 0:
        return ""
    counts: dict[str, list[int]] = {}
    for seg in source.segments():
        counts.setdefault(seg.data_type.value, []).append(seg.size)
    return ", ".join(f"{t}: {len(s)} segments, {sum(s)} B" for t, s in sorted(counts.items()))


@pytest.fixture(autouse=True)
def _no_managed_bytes_left_behind():
    yield
    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.empty_cache()
    left = _leftover()
    assert not left, f"this test left managed segments behind ({left})"
