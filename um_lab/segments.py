"""Managed segments as the real backend hands them to torch, and what it needs from CUDA: the shared
vocabulary of the pools (:mod:`um_lab.cuda.allocator`) and the scheduler's live executor
(:mod:`um_lab.schedule.live`), with no torch or CUDA import of its own."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Protocol

from um_lab.types import DataType


@dataclasses.dataclass(frozen=True)
class AdviceCodes:
    """CUDA enum values the shim needs (taken from cuda-bindings on a real GPU)."""

    set_read_mostly: int
    unset_read_mostly: int
    set_preferred_location: int
    unset_preferred_location: int
    set_accessed_by: int
    unset_accessed_by: int
    location_device: int
    location_host: int



class Runtime(Protocol):
    """What the pools need from CUDA beyond the shim (a fake implements it in CPU tests)."""

    codes: AdviceCodes

    def advise(self, ptr: int, nbytes: int, code: int, location_type: int, location_id: int) -> None:
        """Apply one advice call to a range."""

    def prefetch(self, ptr: int, nbytes: int, location_type: int, location_id: int, stream: int) -> None:
        """Prefetch a range to a location on ``stream``."""

    def current_stream(self) -> int:
        """The raw handle of the stream prefetches go on."""



@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment handed to torch: managed memory, or plain device memory for a pool switched to it
    (``managed=False``: always GPU-resident, never advised, prefetched or discarded)."""

    ptr: int
    size: int
    data_type: DataType
    managed: bool = True

    def contains(self, address: int) -> bool:
        """True when ``address`` lies inside this segment."""
        return self.ptr <= address < self.ptr + self.size


class SegmentIndex:
    """Address -> data type lookups over a snapshot of segments (bisect, not a scan)."""

    def __init__(self, segments: list[Segment]) -> None:
        self._segs = sorted(segments, key=lambda seg: seg.ptr)
        self._starts = [seg.ptr for seg in self._segs]

    def data_type_of(self, address: int) -> DataType | None:
        """The data type whose segment holds ``address`` (None: in no segment)."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and self._segs[i].contains(address):
            return self._segs[i].data_type
        return None
