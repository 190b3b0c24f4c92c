"""Escaping of text shown as HTML: anything that did not come from um_lab's own code (policy names and
descriptions from a file, file paths, exception messages, model and profile names) reaches a
``widgets.HTML`` only through :func:`html_text`, and plotly titles, trace names and labels only through
:func:`plotly_text`, so a shared file holding ``<img src=x onerror=...>`` shows that text, never runs it. Also
the layout of a row of controls that wraps on a narrow screen (:func:`wrapping`) and how a status line names an
error (:func:`error_text`)."""

from __future__ import annotations

import html


def html_text(value: object) -> str:
    """``value`` as text for an HTML widget: ``<``, ``>``, ``&`` and quotes escaped (shown literally)."""
    return html.escape(str(value), quote=True)


def plotly_text(value: object) -> str:
    """``value`` as text for a plotly title, trace name or category: plotly renders a subset of HTML in
    them; ``<``, ``>`` and ``&`` are escaped (plotly shows these entities as the characters)."""
    return html.escape(str(value), quote=False)


def error_text(error: BaseException) -> str:
    """An error as a status line says it: um_lab's own errors by their message (it names the input), anything
    else with its class, so an unexpected failure still says what it is."""
    from um_lab.errors import UmLabError

    return str(error) if isinstance(error, UmLabError) and str(error) else f"{type(error).__name__}: {error}"


def wrapping() -> object:
    """The layout of a row of controls that wraps onto the next line on a narrow screen (a projector at 1024 px)
    instead of cutting its right end off."""
    import ipywidgets as w

    return w.Layout(flex_flow="row wrap")
