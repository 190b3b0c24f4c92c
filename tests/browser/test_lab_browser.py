"""The quick start in a real browser: JupyterLab + headless Chromium, the panel's Run / Stop, live Plotly.

Opens ``notebooks/01_quickstart.ipynb`` (its CI parameters plus a per-step pace) in a test-only JupyterLab,
runs all cells from the Run menu, picks a preset and a long run in the panel, clicks Run and checks that the live
dashboard's traces are drawn and gain points, that Stop stops the run (on screen and on disk), and that a
short run completes with its last state drawn and a static figure; that the dashboard's y axes start at zero,
that picking another model clears the plots, and that a comparison stopped in the page shows its own runs,
never the previous comparison's. Screenshots go to the test's tmp dir, and ``lab.png`` / ``lab-stopped.png`` /
``compare-stopped.png`` also to ``$UM_LAB_SCREENSHOTS`` when set (the README's picture).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Container
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import JupyterLab, prepare_notebook, publish_screenshots, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(480)]

QUICKSTART = Path(__file__).parents[2] / "notebooks" / "01_quickstart.ipynb"
LONG_STEPS = 400  #: the Run that gets stopped (typed into the steps field): far more than it runs before Stop
PACE_S = 0.2  #: seconds the panel waits after each simulated step (so the run can be watched)
SHORT_STEPS = 3  #: the Run that completes by itself
PREFERRED_PRESETS = ("prefetch-all", "gpu-first", "paper-3type")
NEW_RATIOS = ("0.9", "1.1", "1.3")  #: the comparison made in the page (the notebook's own used others)
COMPARE_STEPS = 5000  #: steps per run of that comparison: long enough to press Stop while it runs

# Kernel status, execution prompts and error outputs of the open notebook.
NOTEBOOK_STATE_JS = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const ctx = panel && panel.sessionContext;
  const kernel = ctx && ctx.session && ctx.session.kernel;
  const root = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;
  const prompts = [...root.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim());
  const errors = [...root.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')]
    .map(e => e.textContent.slice(0, 3000));
  return {kernel: kernel ? kernel.status : null, prompts, errors};
}"""

# Every Plotly graph under `selector`: its traces' point counts (gd.data; x a plain or typed array, or plotly's
# base64 form {dtype, bdata}) and what the SVG draws per trace.
PLOTS_JS = """(selector) => {
  const size = {i1: 1, u1: 1, i2: 2, u2: 2, i4: 4, u4: 4, f4: 4, f8: 8, int8: 1, uint8: 1, int16: 2, uint16: 2,
                int32: 4, uint32: 4, float32: 4, float64: 8};
  const count = x => x == null ? 0 : typeof x.length === 'number' ? x.length
    : x.bdata && size[x.dtype] ? Math.round(atob(x.bdata).length / size[x.dtype]) : -1;  // -1: unreadable
  return [...document.querySelectorAll(selector + ' .js-plotly-plot')].map(gd => ({
  data: (gd.data || []).map(t => ({name: String(t.name || ''), n: count(t.x)})),
  drawn: [...gd.querySelectorAll('g.trace')].map(g => {
    const cd = g.__data__, tr = cd && cd[0] && cd[0].trace;
    const line = g.querySelector('path.js-line');
    return {name: String((tr && tr.name) || ''),
            size: (line ? (line.getAttribute('d') || '').length : 0) + g.querySelectorAll('path.point').length};
  }),
}));
}"""


# The y-axis ranges plotly drew for the first graph under `selector` (null for an axis it does not have).
Y_RANGES_JS = """(selector) => {
  const gd = document.querySelector(selector + ' .js-plotly-plot');
  const layout = gd && gd._fullLayout;
  if (!layout) return null;
  return ['yaxis', 'yaxis2', 'yaxis3', 'yaxis4', 'yaxis5'].map(a => layout[a] ? [...layout[a].range] : null);
}"""

# The trace names of the first graph under `selector` (None while it is not drawn).
TRACE_NAMES_JS = """(selector) => {
  const gd = document.querySelector(selector + ' .js-plotly-plot');
  return gd && gd.data && gd.data.length ? gd.data.map(t => String(t.name || '')) : null;
}"""

# Every graph under `selector`: its category labels (x values that are text) and its annotations' texts.
LABELS_JS = """(selector) => [...document.querySelectorAll(selector + ' .js-plotly-plot')].map(gd => ({
  x: (gd.data || []).flatMap(t => Array.isArray(t.x) ? t.x.filter(v => typeof v === 'string') : []),
  notes: ((gd.layout && gd.layout.annotations) || []).map(a => String(a.text || '')),
  traces: (gd.data || []).length,
}))"""


# A readable table's column headers and its ratio column.
TABLE_JS = """(table) => {
  const heads = [...table.querySelectorAll('thead th')].map(h => h.textContent.trim());
  const at = heads.indexOf('ratio');
  return {heads, ratios: [...table.querySelectorAll('tbody tr')].map(r => r.children[at].textContent.trim())};
}"""


def notebook_state(page: Any) -> dict[str, Any]:
    """Kernel status, prompts and error outputs of the open notebook."""
    return page.evaluate(NOTEBOOK_STATE_JS)


def step_time(page: Any, selector: str = ".um-lab-live") -> tuple[int, int]:
    """(points in the longest trace named "step time", size of what the SVG draws for it) under ``selector``."""
    points = drawn = 0
    for plot in page.evaluate(PLOTS_JS, selector):
        points = max([points] + [t["n"] for t in plot["data"] if "step time" in t["name"].lower()])
        drawn = max([drawn] + [t["size"] for t in plot["drawn"] if "step time" in t["name"].lower()])
    return points, drawn


def status_text(page: Any) -> str:
    """The panel's status line."""
    return page.locator(".um-lab-status").first.inner_text().strip()


def run_folders(lab: JupyterLab, skip: Container[str] = ()) -> dict[str, dict[str, Any]]:
    """``{folder: {"status": status.json, "spec": spec.json, "records": n, "warmup": n}}`` for the runs on
    disk (folders relative to the runs folder), leaving out those in ``skip``."""
    found = {}
    for status in sorted(lab.runs_dir.rglob("status.json")):
        folder = status.parent
        key = str(folder.relative_to(lab.runs_dir))
        if key in skip:
            continue
        records = folder / "records.jsonl"
        lines = records.read_text().splitlines() if records.exists() else []
        found[key] = {
            "status": json.loads(status.read_text()), "spec": json.loads((folder / "spec.json").read_text()),
            "records": len(lines), "warmup": sum(bool(json.loads(line).get("warmup")) for line in lines),
        }
    return found


def shows_all_steps(page: Any, run: dict[str, Any], selector: str = ".um-lab-live") -> bool:
    """True when the step-time trace under ``selector`` has one point per step of ``run`` on disk (the
    warm-up steps drawn or not)."""
    return step_time(page, selector)[0] in (run["records"], run["records"] - run["warmup"])


def run_all_cells(page: Any, n_code_cells: int, timeout_s: float = 240.0) -> None:
    """Run > Run All Cells, then wait until every code cell has run and the kernel is idle."""
    wait_until(lambda: notebook_state(page)["kernel"] == "idle", 120, "the kernel to start (idle)",
               describe=lambda: str(notebook_state(page)))
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

    def finished() -> bool:
        state = notebook_state(page)
        if state["errors"]:
            raise AssertionError("a notebook cell failed:\n" + "\n---\n".join(state["errors"]))
        numbered = [p for p in state["prompts"] if p[:1] == "[" and p[1:2].isdigit()]
        return state["kernel"] == "idle" and len(numbered) == n_code_cells == len(state["prompts"])

    wait_until(finished, timeout_s, f"all {n_code_cells} code cells to run",
               interval_s=0.5, describe=lambda: str(notebook_state(page)))


def panel_screenshot(page: Any, path: Path) -> Path:
    """Screenshot of the whole panel with its dashboards (``.um-lab`` and ``.um-lab-live``): the viewport is
    made tall enough for it and the notebook scrolled so that the panel starts at the top."""
    panel = page.locator(".um-lab").first
    height = panel.evaluate("e => e.getBoundingClientRect().height")
    size = page.viewport_size
    if size["height"] < height + 300:
        page.set_viewport_size({"width": size["width"], "height": int(height) + 300})
    panel.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
    boxes = [b for b in (page.locator(s).first.bounding_box() for s in (".um-lab", ".um-lab-live")) if b]
    x0, y0 = min(b["x"] for b in boxes), min(b["y"] for b in boxes)
    x1 = max(b["x"] + b["width"] for b in boxes)
    y1 = max(b["y"] + b["height"] for b in boxes)
    pad = 8
    clip = {"x": max(0, x0 - pad), "y": max(0, y0 - pad), "width": x1 - x0 + 2 * pad, "height": y1 - y0 + 2 * pad}
    page.screenshot(path=str(path), clip=clip)
    return path


def test_quickstart_lab_in_chromium(jupyter_lab: JupyterLab, page: Any, tmp_path: Path) -> None:
    lab = jupyter_lab
    shots = tmp_path / "screenshots"
    shots.mkdir()
    n_code = prepare_notebook(QUICKSTART, lab.root / "quickstart.ipynb", {"PACE_S": PACE_S})
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    page.goto(lab.url("/lab/tree/quickstart.ipynb"), wait_until="domcontentloaded", timeout=90_000)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
    timings["lab open"] = time.monotonic() - t0

    run_all_cells(page, n_code)
    timings["all cells run"] = time.monotonic() - t0
    page.screenshot(path=str(shots / "notebook-after-run-all.png"))

    panel = page.locator(".um-lab").first
    panel.wait_for(state="visible", timeout=30_000)
    for part in (".um-lab-preset select", ".um-lab-model", ".um-lab-steps input", ".um-lab-run", ".um-lab-stop",
                 ".um-lab-status", ".um-lab-progress", ".um-lab-live .js-plotly-plot"):
        assert page.locator(part).count() >= 1, f"the panel has no {part}"
    before = set(run_folders(lab))  # the notebook's own cells ran some already

    # -- a policy: pick a preset other than the current one
    preset = page.locator(".um-lab-preset select").first
    options = preset.evaluate("s => [...s.options].map(o => o.value)")
    current = preset.input_value()
    choice = next((p for p in PREFERRED_PRESETS if p in options and p != current),
                  next((o for o in options if o not in (current, "custom")), None))
    assert choice, f"the preset dropdown offers nothing but {current!r}: {options}"
    preset.select_option(choice)
    assert preset.input_value() == choice

    steps = page.locator(".um-lab-steps input").first
    steps.fill(str(LONG_STEPS))
    steps.press("Tab")  # ipywidgets commits a number field on change (blur)

    # -- Run: the live traces are drawn and gain points
    page.locator(".um-lab-run").first.click()
    wait_until(lambda: "running" in status_text(page).lower(), 60, "the status to say running",
               describe=lambda: f"status: {status_text(page)!r}")
    timings["running"] = time.monotonic() - t0
    first = wait_until(lambda: (s := step_time(page))[0] >= 3 and s[1] > 0 and s, 60,
                       "the live 'step time' trace to be drawn with 3 points",
                       describe=lambda: json.dumps(page.evaluate(PLOTS_JS, ".um-lab-live"))[:3000])
    later = wait_until(lambda: (s := step_time(page))[0] >= first[0] + 8 and s, 60,
                       "the live 'step time' trace to gain 8 more points",
                       describe=lambda: f"first {first}, now {step_time(page)}, status {status_text(page)!r}")
    assert later[1] > first[1], f"the drawn step-time trace did not grow: {first} -> {later}"
    assert "running" in status_text(page).lower(), status_text(page)
    # every y axis of the live dashboard starts at zero: a steady step time is a line, not noise filling the panel
    ranges = page.evaluate(Y_RANGES_JS, ".um-lab-live")
    assert ranges and all(r is not None and r[0] == 0 and r[1] > 0 for r in ranges), f"y ranges: {ranges}"
    live = panel_screenshot(page, shots / "lab.png")

    # -- Stop: the status says stopped, the traces stop growing, the run on disk stopped early
    page.locator(".um-lab-stop").first.click()
    wait_until(lambda: "stopped" in status_text(page).lower(), 60, "the status to say stopped",
               describe=lambda: f"status: {status_text(page)!r}")
    timings["stopped"] = time.monotonic() - t0
    runs = run_folders(lab, skip=before)
    assert len(runs) == 1, f"expected one new run on disk, found {list(runs)}"
    (name, stopped), = runs.items()
    assert stopped["status"]["status"] == "stopped", stopped["status"]
    assert stopped["spec"]["policy"] == choice, f"the run used {stopped['spec']['policy']!r}, not {choice!r}"
    assert stopped["spec"]["steps"] == LONG_STEPS, stopped["spec"]
    assert stopped["records"] < stopped["status"]["steps_planned"], stopped["status"]
    wait_until(lambda: shows_all_steps(page, stopped), 10, "the live trace to show every step of the stopped run",
               describe=lambda: f"trace {step_time(page)}, on disk {stopped['records']} ({stopped['warmup']} warm-up)")
    at_stop = step_time(page)
    time.sleep(1.5)  # the paced run would have added ~7 points by now
    assert step_time(page) == at_stop, "the live trace kept growing after Stop"
    assert run_folders(lab)[name]["records"] == stopped["records"], "the run kept writing steps after Stop"
    wait_until(lambda: shows_all_steps(page, stopped, ".um-lab-static"), 30,
               "a static figure of the stopped run in .um-lab-static",
               describe=lambda: json.dumps(page.evaluate(PLOTS_JS, ".um-lab-static"))[:2000])
    stopped_shot = panel_screenshot(page, shots / "lab-stopped.png")

    # -- a short run ends by itself: complete, its last state drawn, live and static
    steps.fill(str(SHORT_STEPS))
    steps.press("Tab")
    page.locator(".um-lab-run").first.click()
    wait_until(lambda: "complete" in status_text(page).lower(), 90, "the short run to complete",
               describe=lambda: f"status: {status_text(page)!r}")
    timings["complete"] = time.monotonic() - t0
    short = run_folders(lab, skip=before | {name})
    assert len(short) == 1, f"expected one more run on disk, found {list(short)}"
    (done,) = short.values()
    assert done["status"]["status"] == "complete" and done["spec"]["steps"] == SHORT_STEPS, done
    assert done["spec"]["policy"] == choice, done["spec"]
    wait_until(lambda: shows_all_steps(page, done), 10, "the live trace to show exactly the short run's steps",
               describe=lambda: f"trace {step_time(page)}, on disk {done['records']} ({done['warmup']} warm-up)")
    wait_until(lambda: shows_all_steps(page, done, ".um-lab-static"), 30,
               "a static figure of the short run in .um-lab-static",
               describe=lambda: json.dumps(page.evaluate(PLOTS_JS, ".um-lab-static"))[:2000])
    assert "error" not in status_text(page).lower(), status_text(page)
    panel_screenshot(page, shots / "lab-complete.png")

    # -- inside a step: the timeline tab simulates the panel's workload, two policies on one time axis; Play walks
    tab = page.locator(".um-lab-tabs .lm-TabBar-tab", has_text="inside a step").first
    tab.click()
    timeline = page.locator(".um-lab-timeline").first
    traces = wait_until(lambda: (names := page.evaluate(TRACE_NAMES_JS, ".um-lab-timeline")) and names, 120,
                        "the step timeline to be drawn", describe=lambda: status_text(page))
    titles = " ".join(texts(page, ".um-lab-timeline .gtitle, .um-lab-timeline .annotation-text"))
    assert sum(t in titles for t in ("um-default", "prefetch-all", choice)) >= 2, f"two policies: {titles!r}"
    assert any("param" in n for n in traces) and any("act" in n for n in traces), traces
    ranges = page.evaluate(Y_RANGES_JS, ".um-lab-timeline")
    assert ranges and ranges[0] and ranges[0][0] == 0, f"the timeline's resident bytes from zero: {ranges}"
    slider = timeline.locator(".widget-slider .noUi-handle, .widget-slider input").first
    before_t = timeline.locator(".widget-html").last.inner_text()
    timeline.locator(".widget-play button").first.click()  # Play
    readout = lambda: timeline.locator(".widget-html").last.inner_text()  # noqa: E731
    wait_until(lambda: readout() != before_t, 30, "Play to move the timeline's cursor", describe=readout)
    assert slider.count() >= 1
    timeline_shot = panel_screenshot(page, shots / "timeline.png")
    timings["timeline"] = time.monotonic() - t0
    page.locator(".um-lab-tabs .lm-TabBar-tab", has_text="per step").first.click()

    # -- another model: the last model's plots go (live and static), the panels say there is no data yet
    model = page.locator(".um-lab-model select").first
    other = next(o for o in model.evaluate("s => [...s.options].map(o => o.value)") if o != model.input_value())
    model.select_option(other)

    def cleared() -> bool:
        live_notes = texts(page, ".um-lab-live .annotation-text")
        return (step_time(page)[0] == 0 and page.locator(".um-lab-static .js-plotly-plot").count() == 0
                and page.locator(".um-lab-live .js-plotly-plot").first.is_visible()
                and live_notes.count("no data yet") == 5)

    wait_until(cleared, 30, f"switching the model to {other!r} to clear the dashboard",
               describe=lambda: f"trace {step_time(page)}, notes {texts(page, '.um-lab-live .annotation-text')}, "
                                f"static plots {page.locator('.um-lab-static .js-plotly-plot').count()}")
    assert other in status_text(page), status_text(page)
    assert all(r[0] == 0 for r in page.evaluate(Y_RANGES_JS, ".um-lab-live")), "an empty panel's range is 0..1"
    timings["model switched"] = time.monotonic() - t0

    # -- CompareView: a new comparison clears the last one's figures at once; Stop shows only the new runs
    compare = page.locator(".um-lab-compare").first
    compare.scroll_into_view_if_needed()
    wait_until(lambda: len(page.evaluate(LABELS_JS, ".um-lab-compare-output")) >= 2, 30,
               "the notebook's comparison figures in the view")
    before_labels = " ".join(x for plot in page.evaluate(LABELS_JS, ".um-lab-compare-output") for x in plot["x"])
    ratios = page.locator(".um-lab-compare-ratios input").first
    ratios.fill(", ".join(NEW_RATIOS))
    ratios.press("Tab")
    compare_steps = page.locator(".um-lab-compare-steps input").first
    compare_steps.fill(str(COMPARE_STEPS))
    compare_steps.press("Tab")
    page.locator(".um-lab-compare-run").first.click()
    compare_status = lambda: page.locator(".um-lab-compare-status").first.inner_text().strip()  # noqa: E731
    wait_until(lambda: "running" in compare_status(), 60, "the comparison to start",
               describe=lambda: f"status: {compare_status()!r}")
    assert page.evaluate(LABELS_JS, ".um-lab-compare-output") == [], "the last comparison's figures are still shown"
    wait_until(lambda: re.search(r"running ([2-9]|\d\d)/", compare_status()), 120,
               "the comparison's first run to finish", describe=lambda: f"status: {compare_status()!r}")
    page.locator(".um-lab-compare-stop").first.click()
    wait_until(lambda: "stopped after" in compare_status(), 120, "the comparison to stop",
               describe=lambda: f"status: {compare_status()!r}")
    plots = wait_until(lambda: len(p := page.evaluate(LABELS_JS, ".um-lab-compare-output")) == 2 and p, 30,
                       "the stopped comparison's figures", describe=lambda: compare_status())
    shown = [label for plot in plots for label in plot["x"] + plot["notes"] if " @ " in label]
    assert shown and all(any(f"@ {r}x" in label for r in NEW_RATIOS) for label in shown), \
        f"a figure after Stop shows runs not of this comparison: {shown} (before: {before_labels})"
    table = page.locator(".um-lab-compare-output table").first.evaluate(TABLE_JS)
    assert table["ratios"] and set(table["ratios"]) <= {f"{float(r):.2f}" for r in NEW_RATIOS}, table
    assert any(h.startswith("remote") for h in table["heads"]), table  # read over the link, next to migrated
    compare_shot = shots / "compare-stopped.png"
    compare.screenshot(path=str(compare_shot))
    timings["compare stopped"] = time.monotonic() - t0

    published = publish_screenshots({"lab.png": live, "lab-stopped.png": stopped_shot,
                                     "compare-stopped.png": compare_shot, "timeline.png": timeline_shot})
    print(f"browser test timings (s from opening the page): {timings}; screenshots: {shots} {published}")


# ----------------------------------------------------------------------------- text from files stays text

PAYLOAD = '<img src=x onerror="window.__pwned=1">'  #: runs script in the page if rendered as HTML
TINY_MLP = {"width": 256, "depth": 2, "batch_size": 32}

#: the cells of the notebook the injection test runs: a shared policy file whose name and description hold
#: PAYLOAD, loaded into a Lab that then runs; a Lab whose error quotes PAYLOAD; an AdviceGrid loading a bad file
#: whose error quotes it; a CompareView whose error quotes it
INJECTION_CELLS = [
    f"""import json, pathlib
from um_lab.policy import Advice, Policy
from um_lab.widgets import AdviceGrid, CompareView, Lab
PAYLOAD = {PAYLOAD!r}
TINY_MLP = {TINY_MLP!r}
shared = pathlib.Path("shared-policy.json")
shared.write_text(Policy("shared " + PAYLOAD, {{"param": Advice(preferred_location="gpu")}},
                         "from a colleague " + PAYLOAD).to_json())
bad = pathlib.Path("bad-policy.json")
bad.write_text(json.dumps({{"name": "bad", "advice": {{PAYLOAD: {{}}}}}}))""",
    """lab = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=2, warmup_steps=0)
assert lab.advice.load(shared) is not None
lab.run(wait=True, timeout=120)
assert lab.state == "complete", lab.status.value
lab""",
    """refused = Lab(model="mlp", model_kwargs=TINY_MLP, backend="sim", steps=2, budget="")
refused.budget.value = PAYLOAD
assert refused.run() is None and refused.state == "error"
refused""",
    """grid = AdviceGrid()
assert grid.load(bad) is None
grid.widget""",
    """view = CompareView(models={"mlp": TINY_MLP}, policies=["gpu-first"], ratios=[1.5], steps=1)
view.ratios.value = PAYLOAD
view.run(wait=True, timeout=60)
view""",
]


def write_notebook(path: Path, cells: list[str]) -> int:
    """A notebook of code ``cells`` (Python 3 kernel) at ``path``; returns the number of cells."""
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "cells": [{"cell_type": "code", "id": f"cell-{i}", "execution_count": None, "metadata": {}, "outputs": [],
                     "source": source} for i, source in enumerate(cells)]}
    path.write_text(json.dumps(nb, indent=1))
    return len(cells)


def texts(page: Any, selector: str) -> list[str]:
    """The text (as the page shows it) of every element matching ``selector`` (an SVG element's textContent)."""
    return [t.strip() for t in page.locator(selector).evaluate_all(
        "els => els.map(e => (typeof e.innerText === 'string' ? e.innerText : e.textContent) || '')")]


def test_policy_file_and_error_text_show_literally_and_run_no_script_in_chromium(jupyter_lab: JupyterLab,
                                                                                 page: Any, tmp_path: Path) -> None:
    lab = jupyter_lab
    n_code = write_notebook(lab.root / "injection.ipynb", INJECTION_CELLS)
    page.goto(lab.url("/lab/tree/injection.ipynb"), wait_until="domcontentloaded", timeout=90_000)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
    run_all_cells(page, n_code)

    def shown() -> bool:
        return (len(texts(page, ".um-lab-status")) >= 2 and bool(texts(page, ".um-lab-compare-status"))
                and len(texts(page, ".um-lab-file-status")) >= 3
                and any("shared" in t for t in texts(page, ".um-lab-static .gtitle")))

    wait_until(shown, 60, "the panels, their status lines and the static figure to be drawn",
               describe=lambda: "\n".join(f"{s}: {texts(page, s)}" for s in (
                   ".um-lab-status", ".um-lab-compare-status", ".um-lab-file-status", ".um-lab-static .gtitle")))
    page.screenshot(path=str(tmp_path / "injection.png"), full_page=True)
    time.sleep(1.0)  # an <img src=x> would have failed to load and run its onerror by now

    assert page.evaluate("() => window.__pwned") is None, "script from a policy file or an error ran in the page"
    assert page.evaluate("() => document.querySelectorAll('img[src=\"x\"]').length") == 0, \
        "an <img> from a policy file or an error was rendered as HTML"
    statuses = texts(page, ".um-lab-status")
    assert any("complete" in t and f"shared {PAYLOAD}" in t for t in statuses), statuses  # the policy's name
    assert any("GPU budget" in t and PAYLOAD in t for t in statuses), statuses  # an error quoting it
    assert f"from a colleague {PAYLOAD}" in texts(page, ".um-lab-policy-description"), \
        texts(page, ".um-lab-policy-description")
    files = texts(page, ".um-lab-file-status")
    assert any(f"loaded policy 'shared {PAYLOAD}'" in t for t in files), files
    assert any("not a valid policy" in t and PAYLOAD in t for t in files), files
    compare = texts(page, ".um-lab-compare-status")
    assert any("not a ratio" in t and PAYLOAD in t for t in compare), compare
    assert any(f"shared {PAYLOAD}" in t for t in texts(page, ".um-lab-static .gtitle"))  # the plotly title
    assert not notebook_state(page)["errors"]


RELOAD_CELLS = [
    "from um_lab.widgets import Lab\n"
    "lab = Lab(model='mlp', model_kwargs={'width': 64, 'depth': 2, 'batch_size': 4}, backend='sim', steps=2)\n"
    "lab",
]


def test_a_saved_notebook_finds_its_live_panel_after_a_page_reload(jupyter_lab: JupyterLab, page: Any,
                                                                  tmp_path: Path) -> None:
    """As in ``um-lab lab``'s working copies: a notebook saved with its outputs, reloaded in the browser while its
    kernel runs, shows the same live panel again, and its Run button still runs."""
    lab = jupyter_lab
    n_code = write_notebook(lab.root / "reload.ipynb", RELOAD_CELLS)
    page.goto(lab.url("/lab/tree/reload.ipynb"), wait_until="domcontentloaded", timeout=90_000)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
    run_all_cells(page, n_code)
    page.locator(".um-lab").first.wait_for(state="visible", timeout=30_000)
    page.keyboard.press("Control+s")
    wait_until(lambda: "widget-view+json" in (lab.root / "reload.ipynb").read_text(), 30,
               "the notebook to be saved with its panel's output")

    page.reload(wait_until="domcontentloaded")
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=90_000)
    page.locator(".um-lab .um-lab-run").first.wait_for(state="visible", timeout=60_000)
    page.screenshot(path=str(tmp_path / "after-reload.png"), full_page=True)
    page.locator(".um-lab .um-lab-run").first.click()
    wait_until(lambda: status_text(page).startswith("complete"), 60, "the reloaded panel's run to complete",
               describe=lambda: status_text(page))
    runs = run_folders(lab)
    assert any(r["status"].get("status") == "complete" for r in runs.values()), runs
