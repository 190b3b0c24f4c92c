"""Every documented install line installs: extras that exist, whose version constraints can hold together.

environment.yml once combined the cuda12 extra (cuda-bindings < 13) with telemetry (cupti-python 13.0.x, which
requires cuda-bindings 13) and left out the dev extra that the README's test command needs. pyproject.toml is the one
source of truth for versions. These tests read every ``pip install`` line in README.md, docs/*.md, environment.yml
(its pip section and its comments) and .ci/run, and check them against it:

- offline and fast: the extras named exist; the requirements of everything one line installs, plus the recorded
  Requires-Dist of the packages that pin the CUDA stack (cupti-python, torch's CUDA 13 build), leave a version of
  every package that meets every specifier; environment.yml installs the dev extra and restates no version; the dev
  extra holds what the test suite imports;
- online (``pip install --dry-run`` for Linux x86_64 / CPython 3.12 with a stand-in torch wheel, so torch is never
  downloaded and nothing is installed): pip resolves each distinct line; skipped when no package index answers.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import shlex
import subprocess
import sys
import time
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = canonicalize_name("um_lab")

# The GPU machine the CUDA lines are for: Linux x86_64, CPython 3.12 (the H200 test machine runs 3.12.3).
TARGET_PYTHON = "3.12"
TARGET_ENV = default_environment() | {
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "python_version": TARGET_PYTHON, "python_full_version": TARGET_PYTHON + ".3",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}

# Requires-Dist of the released wheels that pin the CUDA stack (manylinux x86_64, cp312), read with
# `pip install --dry-run --no-deps --report -` on 2026-12-01. The offline check adds the dependencies of the version it
# picks (one level deep); a version not recorded here is not considered.
RECORDED_REQUIRES: dict[str, dict[str, list[str]]] = {
    "cupti-python": {
        "12.6.0": ["cuda-python==12.6.0", "nvidia-cuda-cupti-cu12==12.6.37"],
        "12.8.0": ["cuda-bindings==12.8.0", "numpy>=1.23", "nvidia-cuda-cupti-cu12>=12.8.1"],
        "13.0.0": ["cuda-bindings==13.0.0", "numpy>=1.23", "nvidia-cuda-cupti~=13.0.0"],
        "13.0.1": ["cuda-bindings~=13.0", "numpy>=1.23", "nvidia-cuda-cupti~=13.0"],
        "13.2.0": ["nvidia-cuda-cupti~=13.2", "cuda-bindings>=13.0.2", "numpy>=1.23"],
        "13.3.1": ["nvidia-cuda-cupti~=13.3", "cuda-bindings>=13.0.2", "cuda-pathfinder>=1.4.1", "numpy>=1.23"],
        "13.4.0": ["nvidia-cuda-cupti~=13.4", "cuda-bindings>=13.0.2", "cuda-pathfinder>=1.4.1", "numpy>=1.23"],
    },
}

# What a torch build brings of the CUDA stack. "cu130": PyPI's Linux torch 2.11.0 and 2.13.0 (read as above) require
# cuda-bindings>=13.0.3,<14 and cuda-toolkit[cupti]==13.0.x, which pins nvidia-cuda-cupti 13.0.x; the H200 machine
# runs torch 2.11.0+cu130. "cu12": a CUDA 12 build from download.pytorch.org (installed first; nothing recorded).
# "cpu": the CPU build the README and .ci/run install first.
TORCH_BUILDS: dict[str, tuple[str, list[str]]] = {  # build: (torch version of the stand-in wheel, its requirements)
    "cu130": ("2.11.0", ["cuda-bindings>=13.0.3,<14", "nvidia-cuda-cupti==13.0.*"]),
    "cu12": ("2.11.0", []),
    "cpu": ("2.13.0", []),
}


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def base_requirements() -> list[str]:
    return list(pyproject()["project"]["dependencies"])


def extras() -> dict[str, list[str]]:
    """pyproject's extras by normalized name (PEP 685)."""
    return {canonicalize_name(k): list(v) for k, v in pyproject()["project"]["optional-dependencies"].items()}


# ------------------------------------------------------------------------------------------ install lines


@dataclass(frozen=True)
class InstallLine:
    where: str                      # file:line (#n for the n-th command on one line)
    text: str
    extras: frozenset[str] | None   # um_lab's extras when the line installs um_lab, else None
    others: tuple[str, ...]         # every other requirement the line names (e.g. torch==2.13.0)
    torch_from_index: bool = False  # this very install resolves torch (no torch build installed first)
    block: str | None = None        # the fenced code block (its first line) the line sits in, if any

    @property
    def build(self) -> str:
        """The torch build this line goes with (the keys of TORCH_BUILDS)."""
        if self.extras and "cuda12" in self.extras and not self.torch_from_index:
            return "cu12"
        if self.torch_from_index or (self.extras and self.extras & {"cuda13", "telemetry"}):
            return "cu130"
        return "cpu"

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


_PIP = re.compile(r"\bpip3? install\b")
_SHELL_BREAKS = {"&&", "||", "|", ";"}
_VALUE_OPTIONS = {
    "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-t", "--target",
    "--platform", "--python-version", "--implementation", "--abi", "--report", "--prefix", "--root", "--src",
    "--upgrade-strategy", "--progress-bar", "--log", "--cache-dir", "--timeout", "--retries", "-C",
    "--config-settings", "--trusted-host", "--proxy", "--no-binary", "--only-binary",
}
_LOCAL_PROJECT = re.compile(r"(?:\.{1,2}(?:/[^\[]*)?|/[^\[]*|file:[^\[]*)(?:\[(?P<extras>[^\]]*)\])?")


def parse_pip_args(tokens: list[str], where: str, text: str, *, torch_from_index: bool = False,
                   block: str | None = None) -> InstallLine:
    """The arguments after ``pip install`` (as a shell or a requirements file splits them)."""
    project_extras: set[str] | None = None
    others: list[str] = []
    tokens = iter(tokens)
    for token in tokens:
        if token in _SHELL_BREAKS or token.endswith(";"):
            break
        if token in ("-e", "--editable"):
            token = next(tokens)
        elif token in ("-r", "--requirement"):
            raise AssertionError(f"{where}: requirement files are not followed by this test: {text}")
        elif token.startswith("-"):
            if token in _VALUE_OPTIONS:
                next(tokens, None)
            continue
        local = _LOCAL_PROJECT.fullmatch(token)
        if local:
            names = local["extras"].split(",") if local["extras"] else []
        else:
            try:
                req = Requirement(token)
            except InvalidRequirement as e:
                raise AssertionError(f"{where}: {token!r} is not a requirement ({e}): {text}") from e
            if canonicalize_name(req.name) != PROJECT:
                others.append(token)
                continue
            names = sorted(req.extras)
        project_extras = (project_extras or set()) | {canonicalize_name(n.strip()) for n in names if n.strip()}
    return InstallLine(where, text, None if project_extras is None else frozenset(project_extras), tuple(others),
                       torch_from_index, block)


def _command(command: str, where: str, block: str | None = None) -> InstallLine:
    tokens = shlex.split(command, comments=True)
    assert tokens[:2] in (["pip", "install"], ["pip3", "install"]), f"{where}: {command}"
    return parse_pip_args(tokens[2:], where, command.strip(), block=block)


def _commands_in_text(line: str, where: str, *, spans: bool | None) -> list[InstallLine]:
    """``pip install`` commands in one line: in its `code spans` (spans=True), in the whole line (False, a shell
    line: shlex drops its comment), or in its code spans where it has some, else in the whole line (None)."""
    spans = re.findall(r"`([^`]+)`", line) if spans or (spans is None and "`" in line) else [line]
    found = [span[m.start():] for span in spans if (m := _PIP.search(span))]
    return [_command(cmd, where if len(found) == 1 else f"{where}#{i}") for i, cmd in enumerate(found, 1)]


def markdown_lines(path: Path) -> list[InstallLine]:
    out: list[InstallLine] = []
    fence: str | None = None
    rel = path.relative_to(ROOT).as_posix()
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = None if fence else f"{rel}:{no}"
            continue
        if fence:
            if m := _PIP.search(line):
                out.append(_command(line[m.start():], f"{rel}:{no}", fence))
        else:
            out += _commands_in_text(line, f"{rel}:{no}", spans=True)
    return out


def shell_lines(path: Path) -> list[InstallLine]:
    rel = path.relative_to(ROOT).as_posix()
    return [cmd for no, line in enumerate(path.read_text().splitlines(), 1)
            if not line.lstrip().startswith("#") and _PIP.search(line)
            for cmd in _commands_in_text(line, f"{rel}:{no}", spans=False)]


@dataclass(frozen=True)
class Environment:
    conda: tuple[str, ...]   # the conda dependencies (python=3.12, pip, ...)
    pip: InstallLine | None  # its pip section as one install
    commented: tuple[InstallLine, ...]


def environment_yml() -> Environment:
    """environment.yml, read by hand (no YAML parser among the test tools): conda deps, pip section, comments."""
    conda: list[str] = []
    pip_entries: list[str] = []
    commented: list[InstallLine] = []
    section, pip_line, in_pip, dep_indent = None, 0, False, None
    for no, line in enumerate((ROOT / "environment.yml").read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            commented += _commands_in_text(stripped, f"environment.yml:{no}", spans=None)
            continue
        stripped = stripped.split(" #")[0].strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            section = stripped.rstrip(":") if stripped.endswith(":") else None
            continue
        if section != "dependencies" or not stripped.startswith("-"):
            continue
        entry = stripped[1:].strip()
        if dep_indent is None:
            dep_indent = indent
        if indent == dep_indent:
            in_pip = entry == "pip:"
            if in_pip:
                pip_line = no
            else:
                conda.append(entry)
        elif in_pip:
            pip_entries.append(entry)
    tokens = [t for entry in pip_entries for t in shlex.split(entry, comments=True)]
    pip = (parse_pip_args(tokens, f"environment.yml:{pip_line}", "pip: " + "; ".join(pip_entries),
                          torch_from_index=True) if pip_entries else None)
    return Environment(tuple(conda), pip, tuple(commented))


@cache
def documented_lines() -> tuple[InstallLine, ...]:
    lines = markdown_lines(ROOT / "README.md")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        lines += markdown_lines(doc)
    env = environment_yml()
    lines += [env.pip] if env.pip else []
    lines += env.commented
    lines += shell_lines(ROOT / ".ci" / "run")
    return tuple(lines)


def lines_installing_um_lab() -> list[InstallLine]:
    return [line for line in documented_lines() if line.extras is not None]


# ------------------------------------------------------------------------------- offline satisfiability


def _bumps(version: Version) -> set[Version]:
    r = version.release
    return {Version(".".join(map(str, rel))) for rel in (r, r[:-1] + (r[-1] + 1,), r + (1,), r + (0, 1))}


def first_version(specifiers: list[SpecifierSet]) -> Version | None:
    """A version that meets every specifier, or None. Candidates: each bound and the versions just past it (a set of
    bounds that leaves any version free leaves one of these)."""
    candidates = {Version("0")}
    for spec in specifiers:
        for one in spec:
            try:
                version = Version(one.version.removesuffix(".*"))
            except InvalidVersion:
                continue
            candidates |= {version} | _bumps(version)
    return next((v for v in sorted(candidates) if all(s.contains(v, prereleases=True) for s in specifiers)), None)


Sourced = list[tuple[Requirement, str]]  # a requirement and where it comes from


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


def _unmet(reqs: Sourced) -> list[str]:
    by_name: dict[str, list[tuple[SpecifierSet, str]]] = {}
    for req, source in reqs:
        by_name.setdefault(canonicalize_name(req.name), []).append((req.specifier, source))
    return [f"{name}: " + " and ".join(f"{spec or 'any'} ({source})" for spec, source in items)
            for name, items in sorted(by_name.items()) if first_version([spec for spec, _ in items]) is None]


def find_conflicts(reqs: Sourced) -> list[str]:
    """Why no set of versions meets ``reqs`` (one line per package); [] when one does. The packages of
    RECORDED_REQUIRES bring their recorded dependencies: every recorded version their specifiers allow is tried."""
    reqs = [(req, source) for req, source in reqs if _applies(req)]
    names = sorted({canonicalize_name(req.name) for req, _ in reqs} & RECORDED_REQUIRES.keys())
    choices = []
    for name in names:
        specs = [req.specifier for req, _ in reqs if canonicalize_name(req.name) == name]
        allowed = sorted((v for v in RECORDED_REQUIRES[name] if all(s.contains(v, prereleases=True) for s in specs)),
                         key=Version, reverse=True)  # newest first, as pip tries them
        choices.append([(name, v) for v in allowed] or [(name, None)])
    best: list[str] | None = None
    for combo in itertools.product(*choices):
        extended = list(reqs)
        for name, version in combo:
            if version is not None:
                extended += [(Requirement(r), f"{name} {version}") for r in RECORDED_REQUIRES[name][version]]
                extended.append((Requirement(f"{name}=={version}"), "tried"))
        unmet = _unmet([(req, source) for req, source in extended if _applies(req)])
        if not unmet:
            return []
        best = unmet if best is None or len(unmet) < len(best) else best
    return best or []


def torch_build_requirements(build: str) -> Sourced:
    version, reqs = TORCH_BUILDS[build]
    return [(Requirement(r), f"torch {version} {build} build") for r in reqs]


def line_requirements(line: InstallLine) -> Sourced:
    """Everything ``line`` asks for: um_lab's dependencies and extras, the line's other requirements (for those that
    um_lab also requires, um_lab's specifier: a torch installed first must still satisfy it), the torch build's."""
    out: Sourced = [(Requirement(r), "the line") for r in line.others]
    named = {canonicalize_name(req.name) for req, _ in out}
    for r in base_requirements():
        if line.extras is not None or canonicalize_name(Requirement(r).name) in named:
            out.append((Requirement(r), "um_lab"))
    for extra in sorted(line.extras or ()):
        out += [(Requirement(r), f"um_lab[{extra}]") for r in extras().get(extra, [])]
    return out + torch_build_requirements(line.build)


# ---------------------------------------------------------------------------------------- offline tests


def _id(line: InstallLine) -> str:
    return line.where


def test_the_documented_install_lines_are_found():
    lines = documented_lines()
    files = {line.where.split(":")[0] for line in lines}
    assert {"README.md", "environment.yml", ".ci/run"} <= files, files
    readme = [line for line in lines if line.where.startswith("README.md") and line.extras is not None]
    assert any("cuda13" in line.extras for line in readme), [str(line) for line in readme]
    assert any(line.extras == {"dev"} for line in readme), [str(line) for line in readme]
    # every `pip install` in the README is one of them (none slipped past the parser)
    text = (ROOT / "README.md").read_text().splitlines()
    mentioned = [f"README.md:{no}" for no, t in enumerate(text, 1) for _ in _PIP.finditer(t)]
    parsed = [line.where.split("#")[0] for line in lines if line.where.startswith("README.md")]
    assert parsed and sorted(mentioned) == sorted(parsed), (
        f"`pip install` in README.md at {mentioned}, parsed at {parsed}: put each command in a code span or block")


@pytest.mark.parametrize("line", lines_installing_um_lab(), ids=_id)
def test_install_line_names_only_extras_that_exist(line):
    unknown = sorted(line.extras - extras().keys())
    assert not unknown, f"{line}\n  extras not in pyproject.toml: {unknown} (there: {sorted(extras())})"


@pytest.mark.parametrize("line", documented_lines(), ids=_id)
def test_install_line_constraints_can_hold_together(line):
    reqs = line_requirements(line)
    if not any(source != "the line" and not source.startswith("torch ") for _, source in reqs):
        pytest.skip(f"names nothing that pyproject.toml constrains: {line}")
    conflicts = find_conflicts(reqs)
    assert not conflicts, f"{line}\n  (torch build: {line.build})\n  no version meets:\n    " + "\n    ".join(conflicts)


def test_the_checker_catches_issue_11s_combination():
    """The checker itself, on requirements written out here (independent of what pyproject says today)."""
    cuda12 = [(Requirement("cuda-bindings>=12.2,<13"), "cuda12")]
    telemetry = [(Requirement("cupti-python>=13.0,<13.1"), "telemetry")]
    conflicts = find_conflicts(cuda12 + telemetry)  # through cupti-python's recorded Requires-Dist only
    assert conflicts and all(c.startswith("cuda-bindings:") for c in conflicts), conflicts
    assert find_conflicts([(Requirement("cuda-bindings>=13,<14"), "cuda13")] + telemetry) == []
    assert find_conflicts(telemetry + torch_build_requirements("cu130")) == []
    # PyPI's torch (CUDA 13 build) resolved in the same install excludes the cuda12 extra, with or without telemetry
    assert find_conflicts(cuda12 + torch_build_requirements("cu130"))
    # cupti-python 13.2+ wants nvidia-cuda-cupti 13.2+, torch cu130 pins 13.0.x: why telemetry stays below 13.1
    assert find_conflicts([(Requirement("cupti-python>=13.2"), "x")] + torch_build_requirements("cu130"))
    # and the version search on its own
    assert first_version([SpecifierSet(">13"), SpecifierSet("<13.1")]) is not None
    assert first_version([SpecifierSet("~=13.0"), SpecifierSet(">=13.0.3,<14"), SpecifierSet("==13.*")]) is not None
    assert first_version([SpecifierSet("~=13.0"), SpecifierSet("<13")]) is None
    assert first_version([SpecifierSet("==12.8.0"), SpecifierSet(">=12.2,<13")]) == Version("12.8.0")
    assert first_version([SpecifierSet("==2.13.0"), SpecifierSet(">=2.11")]) == Version("2.13.0")
    assert first_version([SpecifierSet("==13.0.85.*"), SpecifierSet("~=13.2")]) is None
    # and the parser on the old environment.yml's pip section
    old = parse_pip_args(["torch>=2.11", "-e", ".[cuda12,models,notebook,telemetry]"], "old", "", torch_from_index=True)
    assert old.extras == {"cuda12", "models", "notebook", "telemetry"} and old.others == ("torch>=2.11",)
    assert old.build == "cu130"


# Pairs of extras that cannot be installed together: the two CUDA stacks (pyproject.toml's comment says so).
EXCLUSIVE_EXTRAS = {frozenset({"cuda12", "cuda13"}), frozenset({"cuda12", "telemetry"})}


def test_extras_that_install_together_agree_on_every_shared_package():
    base: Sourced = [(Requirement(r), "um_lab") for r in base_requirements()]
    exclusive, disagree = set(), []
    for a, b in itertools.combinations(sorted(extras()), 2):
        ra = [(Requirement(r), f"um_lab[{a}]") for r in extras()[a]]
        rb = [(Requirement(r), f"um_lab[{b}]") for r in extras()[b]]
        if find_conflicts(base + ra + rb):
            exclusive.add(frozenset({a, b}))
            continue
        spec_a = {canonicalize_name(r.name): str(r.specifier) for r, _ in ra}
        for r, _ in rb:  # one specifier per package in extras installed together: none can drift from the other
            name = canonicalize_name(r.name)
            if name in spec_a and spec_a[name] != str(r.specifier):
                disagree.append(f"{name}: {spec_a[name]} in {a}, {r.specifier} in {b}")
    assert not disagree, disagree
    assert exclusive == EXCLUSIVE_EXTRAS, (
        f"extras that cannot be installed together: {sorted(map(sorted, exclusive))}; if this is meant, update "
        "EXCLUSIVE_EXTRAS and pyproject.toml's comment")


def test_environment_yml_installs_the_gpu_stack_and_the_test_tools_from_pyproject_only():
    env = environment_yml()
    assert env.pip is not None and env.pip.extras is not None, "environment.yml's pip section does not install um_lab"
    assert "dev" in env.pip.extras, f"{env.pip}: the README's test command needs the dev extra"
    assert not env.pip.others, f"{env.pip}: versions live in pyproject.toml only; drop {list(env.pip.others)}"
    declared = {canonicalize_name(Requirement(r).name) for r in base_requirements()}
    declared |= {canonicalize_name(Requirement(r).name) for reqs in extras().values() for r in reqs}
    conda = {canonicalize_name(re.split(r"[=<>!~ ]", dep, maxsplit=1)[0]): dep for dep in env.conda}
    restated = sorted(conda.keys() & declared)
    assert not restated, f"conda restates what pyproject.toml declares: {restated}"
    assert {"python", "pip", "c-compiler"} <= conda.keys(), env.conda  # c-compiler: the C segment source
    python = Version(conda["python"].split("=", 1)[1])
    assert SpecifierSet(pyproject()["project"]["requires-python"]).contains(python), python
    assert python.release[:2] in ((3, 11), (3, 12)), f"python {python}: the GPU machine runs 3.11/3.12"


def _modules_the_tests_need() -> dict[str, str]:
    """Top-level modules the CPU suite imports at module level or skips without (importorskip, the browser test's
    tools), by the file that first needs them. tests/gpu is left out (it runs with the GPU extras)."""
    needed: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "gpu" in path.relative_to(ROOT / "tests").parts[:-1]:
            continue
        tree = ast.parse(path.read_text())
        names = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
        names += [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names.append(node.args[0].value)
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple) and "find_spec" in ast.unparse(node):
                # browser_helpers.missing_tools: for module, what in (("playwright", "..."), ...): find_spec(module)
                # (a lone find_spec, as in test_models, tests both branches: not a need)
                for item in node.iter.elts:
                    first = item.elts[0] if isinstance(item, ast.Tuple) else item
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        names.append(first.value)
        for name in names:
            needed.setdefault(name.split(".")[0], path.relative_to(ROOT).as_posix())
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "um_lab"}
    local |= {p.stem for p in (ROOT / "bench").rglob("*.py")}  # the project's own scripts (sys.path)
    return {m: f for m, f in needed.items() if m not in sys.stdlib_module_names and m not in local}


def test_the_dev_extra_holds_what_the_test_command_needs():
    needed = _modules_the_tests_need()
    assert {"pytest", "hypothesis", "torch", "nbclient", "playwright"} <= needed.keys(), sorted(needed)
    provided = {canonicalize_name(Requirement(r).name) for r in base_requirements() + extras()["dev"]}
    dists = packages_distributions()
    missing = []
    for module, where in sorted(needed.items()):
        names = {canonicalize_name(d) for d in dists.get(module, [module])}  # not installed here: its own name
        if not names & provided:
            missing.append(f"{module} ({where}): none of {sorted(names)} in um_lab's dependencies or dev extra")
    ini = pyproject()["tool"]["pytest"]["ini_options"]
    if "timeout" in ini:  # an unknown ini key under --strict-config fails the whole run
        if "pytest-timeout" not in provided:
            missing.append("pytest-timeout (pyproject's timeout ini option)")
    assert not missing, "\n".join(missing)
    # the README block that shows the test command installs the dev extra with it
    blocks = {line.block for line in documented_lines() if line.block and line.extras and "dev" in line.extras}
    test_blocks, fence = set(), None
    for no, text in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if text.lstrip().startswith("```"):
            fence = None if fence else f"README.md:{no}"
        elif fence and "python -m pytest" in text:
            test_blocks.add(fence)
    assert test_blocks and test_blocks <= blocks, f"README blocks with the test command: {test_blocks}; " \
        f"blocks that install the dev extra: {blocks}"


# ------------------------------------------------------------------------- online: pip's own resolver

PIP_BUDGET_S = 60.0
_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)]
_PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def _stand_in_torch(folder: Path, build: str) -> str:
    """A wheel named torch with the build's version and CUDA requirements and nothing else: pip resolves against it
    instead of downloading a torch wheel (hundreds of MB). Returns the pinned requirement."""
    version, reqs = TORCH_BUILDS[build]
    version = f"{version}+umlabstandin{build}"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
                       + "".join(f"Requires-Dist: {r}\n" for r in reqs))
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: um_lab tests\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return f"torch=={version}"


def _pip_dry_run(requirements: list[str], folder: Path, timeout_s: float, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-input",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "15", "--report", "-",
           "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp",
           *[a for p in _PLATFORMS for a in ("--platform", p)], "--find-links", str(folder), *extra, *requirements]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=folder)


def _index_problem(out: str) -> str | None:
    """Why pip's failure says nothing about our constraints (None when it does)."""
    if "ResolutionImpossible" in out or "conflicting dependencies" in out:
        return None
    if m := re.search(r"requirement (\S+) \(from versions: none\)", out):
        return f"the package index offers no wheel of {m[1]} for Linux x86_64 / CPython {TARGET_PYTHON}"
    if re.search(r"Connection|Network is unreachable|timed out|Temporary failure|SSLError|ProxyError|Max retries|"
                 r"HTTPError|HTTP error|Client Error|Server Error", out):
        return "the package index did not answer: " + out.strip().splitlines()[-1][:200]
    return None


@pytest.mark.slow
def test_pip_resolves_every_documented_install_line(tmp_path):
    """pip's resolver on each distinct line (um_lab's requirements as pyproject lists them; torch a stand-in)."""
    deadline = time.monotonic() + PIP_BUDGET_S
    try:
        probe = _pip_dry_run(["packaging"], tmp_path, 30, "--no-deps")
    except subprocess.TimeoutExpired:
        pytest.skip("no package index answered within 30 s")
    if probe.returncode != 0:
        pytest.skip("no package index answers here: " + (probe.stderr.strip().splitlines() or ["?"])[-1][:200])

    jobs: dict[tuple, list[InstallLine]] = {}
    for line in lines_installing_um_lab():
        if line.extras <= extras().keys():  # unknown extras fail test_install_line_names_only_extras_that_exist
            jobs.setdefault((line.extras, line.build), []).append(line)
    assert jobs

    def resolve(numbered):  # one pip process per distinct line, all at once
        number, ((extra_names, build), lines) = numbered
        folder = tmp_path / f"line{number}"
        folder.mkdir()
        pin = _stand_in_torch(folder, build)
        (folder / "constraints.txt").write_text(pin + "\n")
        reqs = base_requirements() + [r for e in sorted(extra_names) for r in extras()[e]]
        try:
            done = _pip_dry_run(sorted(set(reqs)), folder, max(1.0, deadline - time.monotonic()),
                                "-c", str(folder / "constraints.txt"))
        except subprocess.TimeoutExpired:
            done = None
        return ", ".join(line.where for line in lines), build, pin, reqs, done

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(resolve, enumerate(sorted(jobs.items(), key=lambda kv: (sorted(kv[0][0]), kv[0][1])))))
    slow = [where for where, *_, done in results if done is None]
    failed = [(where, build, done) for where, build, _, _, done in results if done and done.returncode]
    for where, build, done in failed:
        if _index_problem(done.stdout + done.stderr) is None:
            said = "\n".join(t for t in done.stderr.splitlines() if not t.startswith("WARNING: Location"))
            pytest.fail(f"pip cannot resolve {where} (torch build {build}):\n{said[-3000:]}")
    for where, pin, reqs, done in [(w, p, r, d) for w, _, p, r, d in results if d and not d.returncode]:
        installed = {canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"])
                     for item in json.loads(done.stdout)["install"]}
        assert str(installed.get("torch")) == pin.split("==")[1], f"{where}: pip did not take the stand-in torch"
        for r in map(Requirement, reqs):
            name = canonicalize_name(r.name)
            assert name in installed and r.specifier.contains(installed[name], prereleases=True), (where, r)
    if failed or slow:  # what could not be judged, after checking all that could
        reasons = [f"{where}: {_index_problem(done.stdout + done.stderr)}" for where, _, done in failed]
        reasons += [f"{where}: no answer from the package index within {PIP_BUDGET_S:.0f} s" for where in slow]
        pytest.skip("; ".join(reasons))
