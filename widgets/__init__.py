"""The notebook UI, imported as ``um_lab.widgets``: the lab panel, live dashboards, the comparison view and
figures. ipywidgets and plotly are imported when a name is first used (``pip install 'um_lab[notebook]'``).

::

    from um_lab.widgets import Lab, CompareView
    Lab()            # pick a model, set advice per data type, Run, watch
    CompareView()    # policies x ratios x models, side by side
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdviceGrid", "CompareView", "Lab", "LiveDashboard", "WorkloadPicker"]

_WHERE = {"AdviceGrid": "advice_grid", "CompareView": "compare_view", "Lab": "lab", "LiveDashboard": "dashboard",
          "WorkloadPicker": "workload"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        try:
            module = importlib.import_module(f"um_lab.widgets.{_WHERE[name]}")
        except ImportError as e:
            if e.name in ("ipywidgets", "plotly", "anywidget"):
                raise ImportError(f"um_lab.widgets.{name} needs {e.name}: pip install 'um_lab[notebook]'") from e
            raise
        return getattr(module, name)
    raise AttributeError(f"module 'um_lab.widgets' has no attribute {name!r}")
