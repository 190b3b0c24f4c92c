"""The notebook UI, imported as ``um_lab.widgets``: the lab panel, live dashboards, the comparison view and
figures. ipywidgets and plotly are imported when a name is first used (``pip install 'um_lab[notebook]'``).

::

    from um_lab.widgets import Lab, CompareView
    Lab()            # pick a model, set advice per data type, Run, watch
    CompareView()    # policies x ratios x models, side by side
    TimelineView()   # inside one step: two policies on one time axis, Play walks through it
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdviceGrid", "CompareView", "Lab", "LiveDashboard", "TimelineView", "WorkloadPicker", "timeline_figure"]

_WHERE = {"AdviceGrid": "advice_grid", "CompareView": "compare_view", "Lab": "lab", "LiveDashboard": "dashboard",
          "TimelineView": "timeline", "WorkloadPicker": "workload", "timeline_figure": "timeline"}


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
