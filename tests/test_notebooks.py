"""Every notebook's code cells run top to bottom (as plain Python, on the simulator without a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ should hold at least the quick start"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_runs(path, tmp_path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert code.strip()
    # the last expression of a cell is displayed in Jupyter; here it just runs
    script = tmp_path / "notebook.py"
    script.write_text(code + "\nprint('NOTEBOOK-OK')\n")
    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOTEBOOK-OK" in out.stdout
    assert list((tmp_path / "runs").iterdir()), "the notebook's runs should be logged under runs/"
