"""Fixtures of the real-browser tests: a test-only JupyterLab server and a headless Chromium page.

Both skip cleanly (with the reason) when Debian's chromium, playwright or jupyterlab is missing, and both
are always torn down: the server's process group and kernels are killed, the browser is closed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, JupyterLab, missing_tools, start_jupyterlab, stop_jupyterlab

REQUIRED_ENV = "UM_LAB_BROWSER_REQUIRED"


@pytest.fixture
def browser_tools() -> None:
    """Skip the test when chromium, playwright or jupyterlab is missing (fail instead where
    ``$UM_LAB_BROWSER_REQUIRED`` is 1, as in ``.ci/run``: there the test must run)."""
    reason = missing_tools()
    if reason and os.environ.get(REQUIRED_ENV, "").strip() == "1":
        pytest.fail(f"browser test required (${REQUIRED_ENV}=1) but {reason}")
    if reason:
        pytest.skip(f"browser test: {reason}")


@pytest.fixture
def jupyter_lab(browser_tools: None, tmp_path: Path) -> Iterator[JupyterLab]:
    """A JupyterLab server on 127.0.0.1 with its own root, config, data, runtime and IPython folders."""
    lab = start_jupyterlab(tmp_path / "jupyter")
    try:
        yield lab
    finally:
        stop_jupyterlab(lab)
        log = lab.log_tail(20000)
        (tmp_path / "jupyterlab-log-tail.txt").write_text(log)


@pytest.fixture
def page(browser_tools: None, tmp_path: Path) -> Iterator[object]:
    """A Playwright page in Debian's headless Chromium (tall viewport: the panel and its plots fit)."""
    from playwright.sync_api import sync_playwright

    console: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                                     timeout=60_000)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 1400})
            page = context.new_page()
            page.set_default_timeout(30_000)
            page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
            page.on("pageerror", lambda err: console.append(f"pageerror: {err}"))
            page.console_log = console  # type: ignore[attr-defined]  # read by the test on failure
            yield page
        finally:
            (tmp_path / "browser-console.txt").write_text("\n".join(console))
            try:  # what the page showed last (the first thing to look at when the test failed)
                for context in browser.contexts:
                    for each in context.pages:
                        each.screenshot(path=str(tmp_path / "last-page.png"), full_page=True, timeout=10_000)
            except Exception as e:  # a screenshot must never hide the test's own outcome
                (tmp_path / "last-page-error.txt").write_text(repr(e))
            browser.close()
