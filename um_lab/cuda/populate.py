"""Populate each new managed segment on the GPU whole (``Session(populate_segments=True)``).

Pages that kernels first touch piecemeal may be mapped with small GPU pages; a segment prefetched whole
to the GPU is populated in whole 2 MiB blocks. On the MLP (phase spans,
5 processes per mode on the H200): um_lab's step span went from +0.056 ms above native to 0.043 ms below
it once every segment had been prefetched whole (``bench/diagnostics/phase_spans.py``, variant
``um_lab_prefetched``). Only pools whose advice lets their data live on the GPU are populated
(:func:`populates`).
"""

from __future__ import annotations

from um_lab.cuda.allocator import ManagedPools
from um_lab.policy import Advice, Location, Policy, Prefetch


def populates(advice: Advice) -> bool:
    """True when a pool with ``advice`` may have its new segments placed on the GPU whole (not when its data
    prefers the host, is read-mostly, or is pushed to the host after each step)."""
    return (advice.preferred_location != Location.CPU and not advice.read_mostly
            and advice.prefetch != Prefetch.TO_CPU_AFTER_USE)


class SegmentPopulator:
    """Prefetches every managed segment it has not seen yet to the GPU, once, on the current stream."""

    def __init__(self, pools: ManagedPools) -> None:
        self.pools = pools
        self._generation: int | None = None
        self._seen: set[tuple[int, int]] = set()
        self.populated_bytes = 0  #: every byte populated so far

    def populate(self, policy: Policy) -> int:
        """Prefetch the segments allocated since the last call (of pools ``policy`` lets live on the GPU);
        returns their bytes. Costs one counter read when no segment was allocated or freed."""
        source = self.pools.source
        generation = source.generation()
        if generation == self._generation:
            return 0
        self._generation = generation
        segments = source.managed_segments()  # device-memory ones are resident already
        self._seen &= {(s.ptr, s.size) for s in segments}
        runtime, device = self.pools.runtime, self.pools.device
        stream = runtime.current_stream()
        done = 0
        try:
            for s in segments:
                if (s.ptr, s.size) in self._seen:
                    continue
                if populates(policy[s.data_type]):
                    runtime.prefetch(s.ptr, s.size, runtime.codes.location_device, device, stream)
                    done += s.size
                self._seen.add((s.ptr, s.size))  # after the call: a failed one is tried again next time
        except BaseException:
            self._generation = None
            raise
        finally:
            self.populated_bytes += done
        return done
