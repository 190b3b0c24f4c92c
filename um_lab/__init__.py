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


class _SourceWidgetsFinder:
    """Finds ``um_lab.widgets`` in a source checkout used without installing (``PYTHONPATH=.``): the UI lives
    in the top-level ``widgets/`` folder, which an install maps to ``um_lab.widgets`` (package-dir)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> object:
        if name != "um_lab.widgets":
            return None
        import importlib.util
        from pathlib import Path

        init = Path(__file__).resolve().parent.parent / "widgets" / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


if not any(isinstance(f, _SourceWidgetsFinder) for f in __import__("sys").meta_path):
    __import__("sys").meta_path.append(_SourceWidgetsFinder())  # after the normal finders: installs win

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
