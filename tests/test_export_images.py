"""Figures in a saved notebook: plotly JSON for JupyterLab plus a PNG for GitHub and nbconvert (kaleido)."""

from __future__ import annotations

import base64
import os
import struct

import pytest

pio = pytest.importorskip("plotly.io")
go = pytest.importorskip("plotly.graph_objects")

from um_lab.widgets import figures  # noqa: E402


@pytest.fixture
def renderer_default():
    """Give each test the bare mimetype renderer (a kernel's) and put the old default back."""
    before = pio.renderers.default
    pio.renderers.default = "plotly_mimetype"
    yield
    pio.renderers.default = before


def _bundle(fig):
    return pio.renderers[pio.renderers.default].to_mimebundle(fig.to_dict())


def _images_or_skip() -> None:
    if not figures.static_images_available():
        if os.environ.get("UM_LAB_BROWSER_REQUIRED") == "1":
            pytest.fail("kaleido and a Chromium are required here (.ci/run installs both)")
        pytest.skip("no kaleido or no Chrome/Chromium on this machine")


def test_shared_figures_carry_plotly_json_and_a_png(renderer_default):
    _images_or_skip()
    assert figures.keep_plots_in_exports() == "png"
    fig = go.Figure(go.Scatter(y=[1, 3, 2]), layout={"width": 400, "height": 300})
    bundle = _bundle(fig)
    assert "application/vnd.plotly.v1+json" in bundle, "JupyterLab draws the interactive figure"
    assert "text/html" not in bundle, "GitHub would pick the HTML, whose plotly.js it does not run"
    png = base64.b64decode(bundle["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (400, 300)


def test_a_png_that_cannot_be_drawn_falls_back_to_html(renderer_default, monkeypatch):
    monkeypatch.setattr(figures, "static_images_available", lambda: True)
    monkeypatch.setattr(figures, "_start_image_server", lambda: None)
    assert figures.keep_plots_in_exports() == "png"

    def broken(fig_dict):
        raise RuntimeError("no browser after all")

    monkeypatch.setattr(pio.renderers["png"], "to_mimebundle", broken)
    bundle = _bundle(go.Figure(go.Bar(y=[1, 2])))
    assert "image/png" not in bundle and "Plotly.newPlot" in bundle["text/html"]
    assert figures.keep_plots_in_exports() == "html", "after a failure it says what figures carry"


def test_without_images_figures_carry_inlined_html(renderer_default, monkeypatch):
    monkeypatch.setenv("UM_LAB_STATIC_IMAGES", "0")
    assert not figures.static_images_available()
    assert figures.keep_plots_in_exports() == "html"
    assert pio.renderers.default == "plotly_mimetype+notebook"


def test_other_renderer_choices_are_left_alone():
    before = pio.renderers.default
    try:
        pio.renderers.default = "json"
        assert figures.keep_plots_in_exports() == "unchanged"
        assert pio.renderers.default == "json"
    finally:
        pio.renderers.default = before
