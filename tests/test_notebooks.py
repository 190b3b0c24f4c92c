"""The notebooks are committed executed, small and readable without a kernel; each one executes headless
(nbclient, a real kernel) on the simulator with its CI parameters, and an HTML export of the executed quick start
keeps its plots.

The committed outputs come from :func:`publish`, run from the repository's root::

    python tests/test_notebooks.py                  # every notebook; or name some: 01_quickstart 04_um_basics

A notebook executed on a machine without a browser (a GPU machine) is published from its executed copy here,
where kaleido draws the figures' PNGs::

    python tests/test_notebooks.py --execute-only OUT_DIR 04_um_basics      # on the GPU machine
    python tests/test_notebooks.py --from OUT_DIR 04_um_basics              # here: PNGs, slim, write back

Each notebook runs on the simulator (or on the GPU where one is) with the values in its metadata
``um_lab.committed_parameters`` (smaller than its parameters cell's, so that it ends in minutes on a laptop; a
markdown cell after the parameters cell says which), then :func:`slim` keeps what GitHub, nbconvert and the
documentation site show (PNG figures, tables, text) and drops what only a live kernel shows (plotly JSON, widget
views, saved widget state).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from um_lab.widgets.figures import static_images_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_quickstart", "02_compare_policies", "03_paper_three_types", "04_um_basics", "05_sim_vs_gpu",
            "06_fit_in_less_memory"]
MAX_BYTES = 2 * 2**20  #: the most a committed notebook may weigh
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
KERNEL_ONLY = (PLOTLY, WIDGET)  #: what only a live kernel (or saved widget state) shows: never committed
WIDGET_TEXT = "[an interactive panel: it shows when the notebook runs in JupyterLab]"  #: a widget, as committed
PROGRESS_BARS = ("FloatProgress(", "IntProgress(")  #: what a progress bar's repr holds
NOTE_TAG = "committed-parameters"  #: the markdown cell that says which values made the committed outputs
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTLY_JS = ("window.PlotlyConfig", "Plotly.newPlot", "* plotly.js v")  #: plotly.js inlined in an HTML output


def parameters_index(nb: Any) -> int:
    return next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))


def with_ci_parameters(nb, overrides=None, key="ci_parameters"):
    """A copy of ``nb`` with a cell assigning the values of its metadata ``um_lab.<key>`` (and ``overrides``)
    after the parameters cell, and without a committed-parameters note."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.cells = [c for c in nb.cells if NOTE_TAG not in c.metadata.get("tags", [])]
    values = {**nb.metadata.get("um_lab", {}).get(key, {}), **(overrides or {})}
    source = "# injected by the CI test\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(parameters_index(nb) + 1, cell)
    return nb


def execute(path, workdir, overrides=None, key="ci_parameters", timeout=300):
    """Execute the notebook at ``path`` in ``workdir`` with its ``key`` parameters (runs go to ``workdir/runs``);
    returns the executed notebook, with the injected parameters cell."""
    nb = with_ci_parameters(nbformat.read(path, as_version=4), overrides, key)
    env_runs = workdir / "runs"
    old = os.environ.get("UM_LAB_RUNS_DIR")
    os.environ["UM_LAB_RUNS_DIR"] = str(env_runs)
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                         resources={"metadata": {"path": str(workdir)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop("UM_LAB_RUNS_DIR", None)
        else:
            os.environ["UM_LAB_RUNS_DIR"] = old
    return nb


def _figure_title(figure: dict[str, Any]) -> str:
    title = figure.get("layout", {}).get("title", "")
    text = title.get("text", "") if isinstance(title, dict) else str(title)
    return re.sub(r"<[^>]+>", " ", text).strip() or "untitled"


def _relative(text: str, folders: list[Path | str | None]) -> str:
    """``text`` with the folders where it executed (the execution folder, the checkout) written relative."""
    for folder in [*folders, ROOT]:
        if folder is not None:
            text = text.replace(str(folder) + os.sep, "").replace(str(folder), ".")
    return text


def slim(nb, workdir: Path | None = None, elsewhere: tuple[str, ...] = ()):
    """A copy of the executed ``nb`` as committed: figures as their PNG (plotly JSON and inlined plotly.js
    dropped; a figure without a PNG is an error), widget views as their text, no saved widget state, no timing
    metadata, this machine's folders written relative (``workdir``: where it executed; ``elsewhere``: the
    execution folder and checkout of another machine that executed it)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            if out.output_type in ("display_data", "execute_result"):
                data = out.data
                if PLOTLY in data:
                    if "image/png" not in data:
                        raise ValueError(f"a figure without its PNG ({_figure_title(data[PLOTLY])!r}): install "
                                         "kaleido and Chromium, and leave UM_LAB_STATIC_IMAGES unset")
                    data["text/plain"] = f"<plotly figure: {_figure_title(data[PLOTLY])}>"
                    data.pop("text/html", None)  # the inlined-plotly.js fallback
                if WIDGET in data:  # its text is the widget's repr: a long nesting of boxes
                    if any(bar in data.get("text/plain", "") for bar in PROGRESS_BARS):
                        continue  # a progress bar (tqdm's): nothing to see once the cell has run
                    data["text/plain"] = WIDGET_TEXT
                if any(marker in data.get("text/html", "") for marker in PLOTLY_JS):
                    data.pop("text/html")  # plotly.js itself (an HTML fallback's loader): megabytes
                for mime in KERNEL_ONLY:
                    data.pop(mime, None)
                    out.metadata.pop(mime, None)
                if not data:
                    continue
                for mime, value in data.items():
                    if isinstance(value, str) and not mime.startswith("image/"):
                        data[mime] = _relative(value, [workdir, *elsewhere])
            elif out.output_type == "stream":
                out.text = _relative(out.text, [workdir, *elsewhere])
            kept.append(out)
        cell.outputs = kept
    return nb


def add_pngs(nb):
    """Draw the PNG of every figure that has none (it executed where kaleido found no browser), as the export
    renderer of :func:`um_lab.widgets.figures.keep_plots_in_exports` would have; drops the HTML fallback."""
    import plotly.io as pio

    for out in outputs(nb):
        data = out.get("data", {})
        if PLOTLY in data and "image/png" not in data:
            data.update(pio.renderers["png"].to_mimebundle(dict(data[PLOTLY])))
            data.pop("text/html", None)
    return nb


def execute_only(path: Path, out_dir: Path, timeout: float = 900) -> Path:
    """Execute the notebook at ``path`` with its committed parameters on this machine (no PNGs needed) and write
    it, unslimmed, to ``out_dir``, with where it executed in ``<name>.where.json``; :func:`publish` with
    ``executed=out_dir`` finishes it on a machine with kaleido and a browser."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="um-lab-notebook-") as tmp:
        workdir = Path(tmp).resolve()
        nb = execute(path, workdir, key="committed_parameters", timeout=int(timeout))
    nbformat.write(nb, out_dir / path.name)
    (out_dir / f"{path.stem}.where.json").write_text(json.dumps({"workdir": str(workdir), "root": str(ROOT)}))
    return out_dir / path.name


def publish(path: Path, timeout: float = 900, executed: Path | None = None) -> float:
    """Execute the notebook at ``path`` with its committed parameters, slim it and write it back in place;
    returns the seconds it took. The values used are stated in a markdown cell after the parameters cell
    (the injected code cell that set them is not kept: opening the notebook runs with its own defaults).
    ``executed``: a folder where :func:`execute_only` left it executed on another machine (a GPU's): its
    figures get their PNGs here instead."""
    if not static_images_available():
        raise SystemExit("figures need kaleido and a Chrome or Chromium here (a committed notebook shows PNGs)")
    start = time.monotonic()
    if executed is not None:
        where = json.loads((executed / f"{path.stem}.where.json").read_text())
        ran = nbformat.read(executed / path.name, as_version=4)
        nb = slim(add_pngs(ran), None, elsewhere=(where["workdir"], where["root"]))
    else:
        with tempfile.TemporaryDirectory(prefix="um-lab-notebook-") as tmp:
            workdir = Path(tmp).resolve()
            nb = slim(execute(path, workdir, key="committed_parameters", timeout=int(timeout)), workdir)
    index = parameters_index(nb) + 1
    assert "injected-parameters" in nb.cells[index].metadata.get("tags", [])
    values = nb.metadata.get("um_lab", {}).get("committed_parameters", {})
    if values:
        note = nbformat.v4.new_markdown_cell(
            "The outputs saved with this notebook were made with smaller values than the defaults above, so that "
            "it runs in minutes on a laptop (`python tests/test_notebooks.py` makes them again); run it for the "
            "full-size results:\n\n```python\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items()) + "\n```")
        note.id = NOTE_TAG
        note.metadata["tags"] = [NOTE_TAG]
        nb.cells[index] = note
    else:
        del nb.cells[index]
    count = 0
    for cell in nb.cells:  # numbered as if the notebook ran as it is saved
        if cell.cell_type == "code" and cell.execution_count is not None:
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                if out.output_type == "execute_result":
                    out.execution_count = count
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return time.monotonic() - start


def outputs(nb: Any) -> list[Any]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def pngs(nb: Any) -> list[bytes]:
    return [base64.b64decode(o.data["image/png"]) for o in outputs(nb) if "image/png" in o.get("data", {})]


def kernel_only_left(nb: Any) -> list[str]:
    """What in ``nb`` only a live kernel shows (an empty list for a committed notebook)."""
    found = [f"metadata: {key}" for key in ("widgets",) if key in nb.metadata]
    for o in outputs(nb):
        found += [mime for mime in o.get("data", {}) if mime in KERNEL_ONLY]
        found += ["inlined plotly.js" for v in o.get("data", {}).values()
                  if isinstance(v, str) and any(marker in v for marker in PLOTLY_JS)]
    return found


# ------------------------------------------------------------------------------------ committed copies


def test_the_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_ids_and_a_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(c.get("id") for c in nb.cells), "every cell has an id"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1
    params = next(c for c in code if "parameters" in c.metadata.get("tags", []))
    for key in ("ci_parameters", "committed_parameters"):
        values = nb.metadata["um_lab"][key]
        assert all(f"{name} =" in params.source for name in values), f"{key} override names of the parameters cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_executed_small_and_readable_without_a_kernel(path):
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size / 2**20:.2f} MiB"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "every code cell executed"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "executed top to bottom"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, "it shows its results"
    assert not [o for o in outputs(nb) if o.output_type == "error"]
    assert not kernel_only_left(nb), "plotly JSON, widget views and widget state stay out of the file"
    assert not any("execution" in c.metadata for c in nb.cells), "no timing metadata"
    images = pngs(nb)
    assert images and all(p[:8] == PNG_MAGIC for p in images), "figures are PNGs that GitHub shows"
    text = json.dumps(outputs(nb))
    assert str(ROOT) not in text and "/tmp/" not in text, "no folder of the machine that executed it"
    assert nbformat.writes(nb) + "\n" == path.read_text(), "written as Jupyter writes it: a save changes nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_say_which_values_made_them(path):
    nb = nbformat.read(path, as_version=4)
    values = nb.metadata["um_lab"]["committed_parameters"]
    notes = [i for i, c in enumerate(nb.cells) if NOTE_TAG in c.metadata.get("tags", [])]
    if not values:
        assert not notes
        return
    assert notes == [parameters_index(nb) + 1] and nb.cells[notes[0]].cell_type == "markdown"
    assert all(f"{k} = {v!r}" in nb.cells[notes[0]].source for k, v in values.items())


def test_um_basics_says_where_its_outputs_were_measured_and_how_to_run_it():
    nb = nbformat.read(ROOT / "notebooks" / "04_um_basics.ipynb", as_version=4)
    first = nb.cells[0].source
    assert "simulator" in first and "outputs" in first and "um-lab lab" in first
    said = json.dumps(outputs(nb))
    if "measured on a GPU" in first:  # the committed run names the card itself
        assert "This notebook uses the GPU: NVIDIA" in said and len(pngs(nb)) >= 4
    else:
        assert "come from the simulator" in first and "This notebook uses the simulator" in said


def test_sim_vs_gpu_shows_the_h200_measurements():
    nb = nbformat.read(ROOT / "notebooks" / "05_sim_vs_gpu.ipynb", as_version=4)
    text = json.dumps(outputs(nb))
    assert "NO FIDELITY RESULTS" not in text and "H200" in text and len(pngs(nb)) >= 1


def test_a_figure_executed_where_no_browser_was_gets_its_png_here():
    if not static_images_available():
        pytest.skip("kaleido and a Chromium draw the PNG")
    figure = {"data": [{"type": "bar", "x": ["a", "b"], "y": [1, 3]}], "layout": {"title": {"text": "on a GPU"}}}
    cell = nbformat.v4.new_code_cell("fig")
    cell.outputs = [nbformat.v4.new_output("display_data", data={PLOTLY: figure, "text/html": "<div>plotly.js</div>",
                                                                   "text/plain": "Figure()"})]
    nb = nbformat.v4.new_notebook(cells=[cell])
    slimmed = slim(add_pngs(nb), None, elsewhere=("/elsewhere/run", "/elsewhere/repo"))
    (png,) = pngs(slimmed)
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    data = outputs(slimmed)[0].data
    assert "text/html" not in data and data["text/plain"] == "<plotly figure: on a GPU>"
    assert not kernel_only_left(slimmed)


def test_slim_keeps_what_static_viewers_show_and_drops_the_rest(tmp_path):
    png = base64.b64encode(PNG_MAGIC + b"rest").decode()
    figure = {PLOTLY: {"data": [{"y": list(range(5000))}], "layout": {"title": {"text": "<b>residency</b>"}}},
              "image/png": png, "text/plain": "Figure({'data': [...]})"}
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {}}})
    cell = nbformat.v4.new_code_cell("x", execution_count=1, outputs=[
        nbformat.v4.new_output("display_data", data=figure),
        nbformat.v4.new_output("display_data", data={WIDGET: {"model_id": "m"}, "text/plain": "Lab(gpt2-small)"}),
        nbformat.v4.new_output("display_data", data={WIDGET: {"model_id": "n"}}),
        nbformat.v4.new_output("display_data", data={WIDGET: {"model_id": "p"},
                                                      "text/plain": "HBox(children=(HTML(value=''), FloatProgress("}),
        nbformat.v4.new_output("display_data", data={"text/html": "<script>window.PlotlyConfig = {};</script>"}),
        nbformat.v4.new_output("stream", name="stdout", text=f"runs go to {tmp_path}/runs/lab-1 from {ROOT}/bench"),
    ])
    cell.metadata["execution"] = {"iopub.status.busy": "now"}
    nb.cells.append(cell)
    out = slim(nb, tmp_path)
    assert "widgets" not in out.metadata and "execution" not in out.cells[0].metadata
    first, second, third, stream = out.cells[0].outputs
    assert dict(first.data) == {"image/png": png, "text/plain": "<plotly figure: residency>"}
    assert dict(second.data) == dict(third.data) == {"text/plain": WIDGET_TEXT}, "a widget: a line saying so"
    assert stream.text == "runs go to runs/lab-1 from bench"
    assert not kernel_only_left(out) and PLOTLY in nb.cells[0].outputs[0].data, "the input is left as it was"
    del nb.cells[0].outputs[0].data["image/png"]
    with pytest.raises(ValueError, match="without its PNG"):
        slim(nb)


# ------------------------------------------------------------------------------------ executing them


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_on_the_simulator_and_slims_below_the_limit(path, tmp_path):
    nb = execute(path, tmp_path)
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for o in outputs(nb) if o.output_type == "stream" and o.name == "stderr")
    assert "Traceback" not in stderr and "loss_type" not in stderr, stderr[-2000:]
    assert not (tmp_path / "notebooks").exists()
    if not static_images_available():
        if os.environ.get("UM_LAB_BROWSER_REQUIRED") == "1":
            pytest.fail("kaleido and a Chromium are required here: without them GitHub shows no plots")
        return
    slimmed = slim(nb, tmp_path)
    assert len(nbformat.writes(slimmed).encode()) < MAX_BYTES and not kernel_only_left(slimmed)
    committed = nbformat.read(path, as_version=4)
    assert len(pngs(slimmed)) == len(pngs(committed)), "as many figures as the committed copy shows"


def test_quickstart_runs_are_logged_and_its_html_export_keeps_the_plots(tmp_path):
    nbconvert = pytest.importorskip("nbconvert")
    nb = execute(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path)
    statuses = {p.parent.name: json.loads(p.read_text())["status"] for p in (tmp_path / "runs").rglob("status.json")}
    lab_runs = [name for name in statuses if not name.startswith("compare-")]
    assert lab_runs and all(statuses[n] == "complete" for n in lab_runs), statuses
    compared = [p for p in (tmp_path / "runs").glob("compare-*/*/status.json")]
    assert len(compared) >= 3 and all(json.loads(p.read_text())["status"] == "complete" for p in compared)
    figure_outputs = [o for o in outputs(nb) if PLOTLY in o.get("data", {})]
    assert len(figure_outputs) >= 3, "static dashboard, bars and overlay are cell outputs"
    titles = json.dumps([o["data"][PLOTLY]["layout"] for o in figure_outputs])
    assert "GPU-resident bytes per data type" in titles, "the static dashboard (not only the comparison) is kept"
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert "speed-up vs um-default" in html, "the readable comparison table is in the export"
    if static_images_available():  # GitHub shows these: it runs no plotly.js
        assert all("image/png" in o["data"] and "text/html" not in o["data"] for o in figure_outputs)
        images = len(re.findall(r'<img [^>]*src="data:image/png;base64,', html))
        assert images >= 3, f"the export should show every figure as an image, found {images}"
        slim_html, _ = nbconvert.HTMLExporter().from_notebook_node(slim(nb, tmp_path))
        assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', slim_html)) == images
    else:
        if os.environ.get("UM_LAB_BROWSER_REQUIRED") == "1":
            pytest.fail("kaleido and a Chromium are required here: without them GitHub shows no plots")
        plots = html.count('class="plotly-graph-div"')
        assert plots >= 3 and "Plotly.newPlot" in html, f"the export should keep every figure, found {plots}"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Execute the notebooks and write them back, slimmed, with outputs.")
    ap.add_argument("names", nargs="*", help="notebooks by name (default: all)")
    side = ap.add_mutually_exclusive_group()
    side.add_argument("--execute-only", type=Path, metavar="OUT_DIR",
                      help="execute here (a GPU machine without a browser) into OUT_DIR; nothing is written back")
    side.add_argument("--from", dest="executed", type=Path, metavar="OUT_DIR",
                      help="publish the copies executed elsewhere into OUT_DIR (draws their PNGs here)")
    args = ap.parse_args()
    for nb_path in NOTEBOOKS:
        if args.names and nb_path.stem not in args.names:
            continue
        if args.execute_only is not None:
            print(f"{nb_path.name}: executed into {execute_only(nb_path, args.execute_only)}", flush=True)
            continue
        seconds = publish(nb_path, executed=args.executed)
        print(f"{nb_path.name}: {seconds:.0f} s, {nb_path.stat().st_size / 2**10:.0f} KiB", flush=True)
