"""Every notebook executes headless (nbclient, a real kernel) on the simulator with its CI parameters, and an
HTML export of the executed quick start keeps its plots."""

import json
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from um_lab.widgets.figures import static_images_available  # noqa: E402

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_quickstart", "02_compare_policies", "03_paper_three_types", "04_um_basics", "05_sim_vs_gpu"]


def with_ci_parameters(nb, overrides=None):
    """A copy of ``nb`` with a cell assigning its CI parameters (and ``overrides``) after the parameters cell."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    values = {**nb.metadata.get("um_lab", {}).get("ci_parameters", {}), **(overrides or {})}
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "# injected by the CI test\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(index + 1, cell)
    return nb


def execute(path, workdir, overrides=None):
    """Execute the notebook at ``path`` in ``workdir`` with its CI parameters; returns the executed notebook."""
    nb = with_ci_parameters(nbformat.read(path, as_version=4), overrides)
    env_runs = workdir / "runs"
    old = os.environ.get("UM_LAB_RUNS_DIR")
    os.environ["UM_LAB_RUNS_DIR"] = str(env_runs)
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(workdir)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop("UM_LAB_RUNS_DIR", None)
        else:
            os.environ["UM_LAB_RUNS_DIR"] = old
    return nb


def test_the_five_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_with_ids_and_a_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(c.get("id") for c in nb.cells), "every cell has an id"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "committed without outputs"
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1
    ci = nb.metadata["um_lab"]["ci_parameters"]
    params = next(c for c in code if "parameters" in c.metadata.get("tags", []))
    assert all(f"{name} =" in params.source for name in ci), "CI values override names of the parameters cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_on_the_simulator(path, tmp_path):
    nb = execute(path, tmp_path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.output_type == "stream" and o.name == "stderr")
    assert "Traceback" not in stderr and "loss_type" not in stderr, stderr[-2000:]
    assert not (tmp_path / "notebooks").exists()


def test_quickstart_runs_are_logged_and_its_html_export_keeps_the_plots(tmp_path):
    nbconvert = pytest.importorskip("nbconvert")
    nb = execute(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path)
    statuses = {p.parent.name: json.loads(p.read_text())["status"] for p in (tmp_path / "runs").rglob("status.json")}
    lab_runs = [name for name in statuses if not name.startswith("compare-")]
    assert lab_runs and all(statuses[n] == "complete" for n in lab_runs), statuses
    compared = [p for p in (tmp_path / "runs").glob("compare-*/*/status.json")]
    assert len(compared) >= 3 and all(json.loads(p.read_text())["status"] == "complete" for p in compared)
    figure_outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                      if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figure_outputs) >= 3, "static dashboard, bars and overlay are cell outputs"
    titles = json.dumps([o["data"]["application/vnd.plotly.v1+json"]["layout"] for o in figure_outputs])
    assert "GPU-resident bytes per data type" in titles, "the static dashboard (not only the comparison) is kept"
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert "speed-up vs um-default" in html, "the readable comparison table is in the export"
    if static_images_available():  # GitHub shows these: it runs no plotly.js
        assert all("image/png" in o["data"] and "text/html" not in o["data"] for o in figure_outputs)
        images = len(re.findall(r'<img [^>]*src="data:image/png;base64,', html))
        assert images >= 3, f"the export should show every figure as an image, found {images}"
    else:
        if os.environ.get("UM_LAB_BROWSER_REQUIRED") == "1":
            pytest.fail("kaleido and a Chromium are required here: without them GitHub shows no plots")
        plots = html.count('class="plotly-graph-div"')
        assert plots >= 3 and "Plotly.newPlot" in html, f"the export should keep every figure, found {plots}"
