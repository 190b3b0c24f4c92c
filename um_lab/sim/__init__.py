"""The simulated backend: a calibrated Unified Memory model that runs on the CPU.

``SimBackend().run(spec, case, policy)`` yields the shared :class:`um_lab.types.StepRecord` per step.
Pieces: :mod:`~um_lab.sim.trace` (fake-tensor step capture), :mod:`~um_lab.sim.placement` (PyTorch's
caching allocator, one pool per data type), :mod:`~um_lab.sim.access` (per-op VA-block accesses),
:mod:`~um_lab.sim.ops` (per-op knowledge), :mod:`~um_lab.sim.uvm` (the driver model),
:mod:`~um_lab.sim.stepper` (a step against two clocks), :mod:`~um_lab.sim.roofline` (compute time),
:mod:`~um_lab.sim.profile` / :mod:`~um_lab.sim.calibration` (machine constants).
"""

from um_lab.sim.backend import SimBackend
from um_lab.sim.calibration import calibrate
from um_lab.sim.profile import Profile, load_profile
from um_lab.sim.trace import StepTrace, cached_trace, trace_step

__all__ = ["Profile", "SimBackend", "StepTrace", "cached_trace", "calibrate", "load_profile", "trace_step"]
