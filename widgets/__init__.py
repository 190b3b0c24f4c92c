"""The notebook UI (control panel, live dashboards, comparison view). Imports ipywidgets/plotly lazily."""
