"""um_lab: CUDA Unified Memory in PyTorch training, per data type — real GPU or simulated.

Core library; no UI imports. See README.md for the tour.
"""

from um_lab.errors import (
    CudaUnavailableError,
    OversubscriptionRefused,
    PolicyError,
    SessionStateError,
    UmLabError,
    UnsupportedDeviceError,
)
from um_lab.policy import Advice, Policy, get_policy, presets
from um_lab.types import DATA_TYPES, PAPER_GROUPS, DataType, RunSpec, StepRecord

__version__ = "0.1.0"

__all__ = [
    "Advice", "CudaUnavailableError", "DATA_TYPES", "DataType", "OversubscriptionRefused", "PAPER_GROUPS",
    "Policy", "PolicyError", "RunSpec", "Session", "SessionStateError", "StepRecord", "UmLabError",
    "UnsupportedDeviceError", "get_policy", "presets",
]


def __getattr__(name: str):
    if name == "Session":  # the real backend; importing it needs no GPU
        from um_lab.cuda.session import Session

        return Session
    raise AttributeError(f"module 'um_lab' has no attribute {name!r}")
