"""um_lab's public surface: one import for what the README uses, errors under one base class."""

from __future__ import annotations

import subprocess
import sys

import um_lab
from um_lab.errors import UmLabError


def test_every_public_name_resolves_and_lives_in_one_module():
    for name in um_lab.__all__:
        value = getattr(um_lab, name)
        assert value is not None, name
    from um_lab.runs.runner import run
    from um_lab.runs.sweep import compare

    assert um_lab.run is run and um_lab.compare is compare
    assert set(um_lab.__all__) <= set(dir(um_lab))


def loaded_after(imports: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after ``import {imports}``."""
    code = f"import sys, {imports}; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(out.stdout)  # noqa: S307 - a list of names printed by the child above


def test_import_um_lab_stays_light():
    heavy = ("um_lab.sim.backend", "um_lab.runs.runner", "transformers", "um_lab.cuda.session")
    assert loaded_after("um_lab", heavy) == []


def test_errors_um_lab_raises_on_purpose_share_the_base_class():
    from um_lab.cuda.cupti_source import TelemetryUnavailable
    from um_lab.sizing import SizeRefused

    assert issubclass(TelemetryUnavailable, UmLabError)
    refused = SizeRefused(10 << 30, 1 << 30, "params 10 GiB")
    assert isinstance(refused, um_lab.OversubscriptionRefused) and refused.requested == 10 << 30
    assert refused.cap == 1 << 30 and refused.live == 0 and "does not fit under the safety cap" in str(refused)
    for name in um_lab.__all__:
        value = getattr(um_lab, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, UmLabError), name


def test_the_real_backend_path_never_imports_cupy():
    real_backend = "um_lab.cuda.session, um_lab.cuda.backend, um_lab.cuda.allocator, um_lab.cuda.telemetry"
    assert loaded_after(real_backend, ("cupy",)) == []


def test_no_import_cycles_among_um_lab_modules():
    """Every import counts, lazy and typing-only ones too: a name lives in one module, layers point one way."""
    import ast
    from pathlib import Path

    root = Path(um_lab.__file__).parent
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and not node.level else [])
            for t in names:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != m and not m.startswith(t + ".") and t != "um_lab":
                    graph[m].add(t)

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                if nxt == dst:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert cycles == []


def test_every_subpackage_is_listed_for_installation():
    import tomllib
    from pathlib import Path

    root = Path(um_lab.__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"um_lab." + ".".join(p.parent.relative_to(root / "um_lab").parts)
             for p in (root / "um_lab").rglob("__init__.py") if p.parent != root / "um_lab"}
    assert found <= listed, f"packages missing from pyproject.toml's [tool.setuptools] packages: {found - listed}"
