"""The README's Python examples run as written (on the simulator; the Session example reaches its
no-GPU message on a machine without CUDA), and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_is_short_and_has_examples():
    assert len(README.read_text().splitlines()) <= 300
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_each_readme_example_runs(index, tmp_path, monkeypatch, capsys):
    block = python_blocks()[index]
    monkeypatch.setenv("UM_LAB_RUNS_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    if "um_lab.widgets" in block:
        pytest.importorskip("ipywidgets")
    namespace: dict[str, object] = {}
    exec(compile(block, f"README.md example {index}", "exec"), namespace)  # noqa: S102 - the README's own code
    out = capsys.readouterr().out
    if "compare(" in block:
        assert "speedup_vs_um-default" in out
    if "um_lab.Session" in block:
        import torch

        if not torch.cuda.is_available():
            assert "simulator" in out  # the no-GPU message points to the simulator
