"""Helpers for the real-browser test: a throw-away JupyterLab server, the notebook copy, DOM polling.

Nothing here touches the user's Jupyter setup: the server gets its own root, config, data, runtime and
IPython folders, a random token and a free port on 127.0.0.1. Chromium is Debian's ``/usr/bin/chromium``,
driven by Playwright for Python (never a Playwright browser download).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

CHROMIUM = Path(os.environ.get("UM_LAB_CHROMIUM", "/usr/bin/chromium"))
# Without the background-networking flags Chromium keeps dialling out, which this closed network refuses.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCREENSHOTS_ENV = "UM_LAB_SCREENSHOTS"  #: folder that receives lab.png / lab-stopped.png when set
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never goes through a proxy


def missing_tools() -> str | None:
    """Why the browser test cannot run here (None when chromium, playwright and jupyterlab are present)."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    for module, what in (("playwright", "playwright (pip)"), ("jupyterlab", "jupyterlab (pip)"),
                         ("ipywidgets", "ipywidgets (pip)"), ("plotly", "plotly (pip)"),
                         ("anywidget", "anywidget (pip)")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------- the notebook


def parameter_cell_source(values: Mapping[str, Any]) -> str:
    """Python assignments of ``values`` (repr of each), one a line."""
    return "".join(f"{name} = {value!r}\n" for name, value in values.items())


def prepare_notebook(src: Path, dst: Path, overrides: Mapping[str, Any]) -> int:
    """Copy notebook ``src`` to ``dst`` with a cell assigning its CI parameters plus ``overrides`` inserted
    right after the cell tagged ``parameters``, outputs cleared; returns the number of code cells."""
    nb = json.loads(src.read_text())
    cells = nb["cells"]
    tagged = [i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not tagged:
        raise AssertionError(f"{src.name} has no cell tagged 'parameters'")
    ci = nb.get("metadata", {}).get("um_lab", {}).get("ci_parameters")
    if not isinstance(ci, dict):
        raise AssertionError(f"{src.name} has no metadata um_lab.ci_parameters")
    values = {**ci, **overrides}
    injected = {
        "cell_type": "code", "id": "browser-test-parameters", "execution_count": None, "outputs": [],
        "metadata": {"tags": ["injected-parameters"]},
        "source": "# injected by tests/browser: CI values and the browser test's overrides\n"
                  + parameter_cell_source(values),
    }
    cells.insert(tagged[0] + 1, injected)
    for cell in cells:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))
    return sum(c["cell_type"] == "code" for c in cells)


# ----------------------------------------------------------------------------------- the server


@dataclasses.dataclass
class JupyterLab:
    """A running test-only JupyterLab server."""

    proc: subprocess.Popen[bytes]
    port: int
    token: str
    root: Path
    runs_dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        """``path`` on the server (e.g. ``/lab/tree/x.ipynb``) with the token as a query argument."""
        return f"{self.base_url}{path}?token={self.token}"

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log (stdout and stderr together)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _write_test_config(config_dir: Path) -> None:
    """Lab settings that keep the page quiet and every cell in the DOM."""
    (config_dir / "labconfig").mkdir(parents=True, exist_ok=True)
    (config_dir / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab"
    (settings / "notebook-extension").mkdir(parents=True, exist_ok=True)
    # no virtual scrolling: every cell (and its outputs) stays rendered, so the DOM can be queried
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))


def start_jupyterlab(base: Path, timeout_s: float = 120.0) -> JupyterLab:
    """Start JupyterLab under ``base`` (root ``base/root``, runs in ``base/runs``) and wait until it answers.

    The server runs in its own process group (see :func:`stop_jupyterlab`)."""
    root, runs = base / "root", base / "runs"
    dirs = {name: base / name for name in ("jupyter-config", "jupyter-data", "jupyter-runtime", "ipython")}
    for path in (root, runs, *dirs.values()):
        path.mkdir(parents=True, exist_ok=True)
    _write_test_config(dirs["jupyter-config"])
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(dirs["jupyter-config"]),
        "JUPYTER_DATA_DIR": str(dirs["jupyter-data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["jupyter-runtime"]),
        "IPYTHONDIR": str(dirs["ipython"]),
        "UM_LAB_RUNS_DIR": str(runs),
        # the kernel's `python` is this interpreter (the venv's), whatever PATH the caller had
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "JUPYTER_PLATFORM_DIRS": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    env.pop("JUPYTER_PATH", None)
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
        "--ServerApp.terminals_enabled=False", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = base / "jupyterlab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    lab = JupyterLab(proc, port, token, root, runs, log_path)
    try:
        _wait_for_server(lab, timeout_s)
    except BaseException:
        stop_jupyterlab(lab)
        raise
    return lab


def _wait_for_server(lab: JupyterLab, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {lab.proc.returncode}:\n{lab.log_tail()}")
        try:
            with _DIRECT.open(lab.url("/api/status"), timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer on port {lab.port} within {timeout_s:.0f} s:\n{lab.log_tail()}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_jupyterlab(lab: JupyterLab, grace_s: float = 15.0) -> None:
    """Shut the server down: its REST shutdown (which stops the kernels), then SIGTERM / SIGKILL to its
    process group, then SIGKILL to any of its kernels still alive (they run in sessions of their own)."""
    kernels = _descendants(lab.proc.pid)
    if lab.proc.poll() is None:
        try:
            req = urllib.request.Request(lab.url("/api/shutdown"), method="POST", data=b"")
            _DIRECT.open(req, timeout=5).close()
        except (urllib.error.URLError, OSError):
            pass
        try:
            lab.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if lab.proc.poll() is not None:
            break
        try:
            os.killpg(lab.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            lab.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(lab.proc.pid, signal.SIGKILL)  # anything left in the server's group
    except (ProcessLookupError, PermissionError):
        pass
    for pid in kernels:
        _kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------- waiting


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25,
               describe: Callable[[], str] | None = None) -> Any:
    """Poll ``condition()`` until it returns something truthy (returned); ``AssertionError`` naming ``what``
    (and ``describe()``) on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}")
        time.sleep(interval_s)


def publish_screenshots(paths: Mapping[str, Path]) -> list[Path]:
    """Copy ``{name: png}`` into ``$UM_LAB_SCREENSHOTS`` when set; the copies written."""
    folder = os.environ.get(SCREENSHOTS_ENV, "").strip()
    if not folder:
        return []
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, path in paths.items():
        shutil.copyfile(path, out / name)
        written.append(out / name)
    return written
