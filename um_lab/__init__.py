"""um_lab: CUDA Unified Memory in PyTorch training, per data type — real GPU or simulated.

Core library; no UI imports. See README.md for the tour.
"""

from typing import TYPE_CHECKING, Any

from um_lab.errors import (
    BudgetError,
    BudgetTooSmall,
    CudaUnavailableError,
    FileReadError,
    HostMemoryRefused,
    InputError,
    MissingDependencyError,
    ModelConfigError,
    OversubscriptionRefused,
    PolicyError,
    SessionStateError,
    SpecError,
    UmLabError,
    UnsupportedDeviceError,
    UnsupportedOptimizer,
)
from um_lab.policy import Advice, Policy, get_policy, presets
from um_lab.types import DataType, RunSpec, StepRecord

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

#: Names importable from ``um_lab`` whose modules load only when first used (torch models, the
#: simulator, the real backend): ``name -> module``.
_LAZY = {
    "run": "um_lab.runs.runner", "Run": "um_lab.runs.runner", "RunStateError": "um_lab.runs.runner",
    "compare": "um_lab.runs.sweep",
    "load": "um_lab.runs.runread", "LoadedRun": "um_lab.runs.runread", "RunLogError": "um_lab.runs.runread",
    "NotARunFolderError": "um_lab.runs.runread",
    "RunDirError": "um_lab.runs.runlog", "RunNameError": "um_lab.runs.runlog", "list_runs": "um_lab.runs.runlog",
    "get_model": "um_lab.models", "custom": "um_lab.models", "ModelCase": "um_lab.models",
    "SimBackend": "um_lab.sim.backend",
    "Session": "um_lab.cuda.session",
    "SizeRefused": "um_lab.sizing",
    "Budget": "um_lab.schedule.config",
}

#: The public surface: what a notebook or script needs (details live in the submodules), then the errors.
__all__ = [
    "Advice", "Budget", "DataType", "Policy", "Run", "RunSpec", "Session", "StepRecord", "__version__", "compare",
    "custom", "experimental", "get_model", "get_policy", "list_runs", "load", "presets", "run",
    # errors: every one a UmLabError
    "BudgetError", "BudgetTooSmall", "CudaUnavailableError", "FileReadError", "HostMemoryRefused", "InputError",
    "MissingDependencyError", "ModelConfigError", "NotARunFolderError", "OversubscriptionRefused", "PolicyError",
    "RunDirError", "RunLogError", "RunNameError", "RunStateError", "SessionStateError", "SizeRefused", "SpecError",
    "UmLabError", "UnsupportedDeviceError", "UnsupportedOptimizer",
]


if TYPE_CHECKING:  # the lazy names, typed for users' type checkers
    from um_lab import experimental
    from um_lab.cuda.session import Session
    from um_lab.models import custom, get_model
    from um_lab.runs.runlog import RunDirError, RunNameError, list_runs
    from um_lab.runs.runner import Run, RunStateError, run
    from um_lab.runs.runread import NotARunFolderError, RunLogError, load
    from um_lab.runs.sweep import compare
    from um_lab.schedule.config import Budget
    from um_lab.sizing import SizeRefused


def __getattr__(name: str) -> Any:
    if name == "experimental":
        import importlib

        return importlib.import_module("um_lab.experimental")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'um_lab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
