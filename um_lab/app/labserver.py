"""The Jupyter server behind ``um-lab lab``: its command line, its environment (where notebook runs go), the
working copies of the checkout's notebooks it serves (running and saving them leaves the repository as committed,
keeps what the user ran, and lets a reloaded page find its live widgets again), and running it so that stopping
``um-lab lab`` stops the server and its kernels."""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from um_lab.app.cli_args import CliError

LAB_STOP_GRACE_S = 10.0  #: seconds Jupyter gets to shut down (kernels included) before it is killed


def default_notebooks_dir() -> Path:
    """``notebooks/`` beside the um_lab package (a source checkout), else under the current folder."""
    import um_lab

    beside = Path(um_lab.__file__).resolve().parent.parent / "notebooks"
    return beside if beside.is_dir() else Path.cwd() / "notebooks"


def checkout_notebooks() -> Path | None:
    """The ``notebooks/`` folder of the source checkout um_lab is imported from; None for an installed um_lab."""
    import um_lab

    beside = Path(um_lab.__file__).resolve().parent.parent / "notebooks"
    return beside if beside.is_dir() else None


LOCAL_IP = "127.0.0.1"
JUPYTER_DEFAULT_PORT = 8888

# Jupyter's names for a setting on its command line (a ServerApp trait, its alias), as --name=value or --name value
IP_NAMES = ("ServerApp.ip", "ip", "NotebookApp.ip")
PORT_NAMES = ("ServerApp.port", "port", "NotebookApp.port")
PORT_RETRY_NAMES = ("ServerApp.port_retries", "port-retries", "NotebookApp.port_retries")
ROOT_DIR_NAMES = ("ServerApp.root_dir", "notebook-dir", "ServerApp.notebook_dir", "NotebookApp.notebook_dir")
TOKEN_NAMES = ("IdentityProvider.token", "ServerApp.token", "NotebookApp.token")
PASSWORD_NAMES = ("ServerApp.password", "NotebookApp.password", "PasswordIdentityProvider.hashed_password")
WORKING_COPIES = "notebooks"  #: the folder, inside the runs folder, of the working copies of the checkout's notebooks


def jupyter_setting(extra: Sequence[str], names: Sequence[str]) -> str | None:
    """The value ``extra`` (arguments for Jupyter) gives a setting named any of ``names`` (the last one wins),
    written ``--name=value`` or ``--name value``; None when it gives none."""
    value = None
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("-"):
            key, sep, given = arg.lstrip("-").partition("=")
            if key in names:
                if sep:
                    value = given
                elif i + 1 < len(extra):
                    value = extra[i + 1]
                    i += 1
        i += 1
    return value


def user_ip(extra: Sequence[str]) -> str | None:
    """The address the user's Jupyter arguments bind the server to (None: ours, 127.0.0.1)."""
    return jupyter_setting(extra, IP_NAMES)


def named_port(port: int | None, extra: Sequence[str]) -> int | None:
    """The port asked for: the user's Jupyter argument (it comes last), else ``--port``; None for Jupyter's."""
    given = jupyter_setting(extra, PORT_NAMES)
    if given is not None:
        try:
            return int(given.strip().strip("'\""))
        except ValueError:
            return None  # Jupyter says what is wrong with it
    return port


def is_local(ip: str | None) -> bool:
    """True when ``ip`` (None: ours) is reachable from this machine only (a loopback address)."""
    if ip is None:
        return True
    host = ip.strip().strip("'\"[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or '' / '*' (every interface): may be reached from the network


def auth_off(extra: Sequence[str]) -> bool:
    """True when the user's Jupyter arguments set an empty token and no password: anyone who reaches the
    server can run code."""
    token = jupyter_setting(extra, TOKEN_NAMES)
    password = jupyter_setting(extra, PASSWORD_NAMES)
    empty = ("", "''", '""')
    return token is not None and token.strip() in empty and (password is None or password.strip() in empty)


def port_in_use(port: int, ip: str | None = None) -> bool:
    """True when ``port`` on ``ip`` (None: 127.0.0.1) cannot be bound because something listens there; False
    when it can, or when this cannot tell (a privileged port, an address that is not ours: Jupyter says)."""
    host = (ip or LOCAL_IP).strip().strip("'\"[]")
    if host in ("", "*"):
        host = "0.0.0.0"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Jupyter binds: TIME_WAIT is free
            probe.bind(address)
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    return False


def check_port_free(port: int, ip: str | None = None) -> None:
    """Refuse a port asked for that is in use (Jupyter would move to another one, or stop)."""
    if port_in_use(port, ip):
        raise CliError(f"port {port} is in use on {ip or LOCAL_IP}: choose another one with --port, or leave "
                       f"--port out to take Jupyter's first free port from {JUPYTER_DEFAULT_PORT}")


def lab_command(notebooks: Path, port: int | None = None, no_browser: bool = False,
                extra: Sequence[str] = ()) -> list[str]:
    """The JupyterLab command line: bound to 127.0.0.1, Jupyter's token authentication left on; ``extra`` arguments
    come last, as given. A setting they give (the address, the root folder) is not
    given by us too (Jupyter refuses two values of one setting); a port that is named (``port``, or in
    ``extra``) is kept: Jupyter stops rather than moving to another one (``port_retries=0``)."""
    cmd = [sys.executable, "-m", "jupyterlab"]
    if user_ip(extra) is None:
        cmd.append(f"--ServerApp.ip={LOCAL_IP}")
    if jupyter_setting(extra, ROOT_DIR_NAMES) is None:
        cmd.append(f"--ServerApp.root_dir={notebooks}")
    if port is not None and jupyter_setting(extra, PORT_NAMES) is None:  # a port after ``--`` wins
        cmd.append(f"--ServerApp.port={port}")
    if named_port(port, extra) is not None and jupyter_setting(extra, PORT_RETRY_NAMES) is None:
        cmd.append("--ServerApp.port_retries=0")
    if no_browser:
        cmd.append("--no-browser")
    return [*cmd, *extra]


def serves_checkout_notebooks(notebooks: Path) -> bool:
    """True when the folder Jupyter serves holds the checkout's ``notebooks/`` or lies inside it."""
    committed = checkout_notebooks()
    if committed is None:
        return False
    served = Path(notebooks).resolve()
    return committed.is_relative_to(served) or served.is_relative_to(committed)


def is_checkout_notebooks(notebooks: Path) -> bool:
    """True when ``notebooks`` is the checkout's own ``notebooks/`` folder (served as working copies)."""
    committed = checkout_notebooks()
    return committed is not None and Path(notebooks).resolve() == committed


def working_copies(committed: Path, work: Path) -> list[str]:
    """Copy ``committed`` (the checkout's notebooks and what they read beside them) into ``work``, leaving every
    file already there as it is: the user's runs, edits and outputs stay theirs. Returns the names of the
    notebooks whose committed version differs from the user's copy and is newer (the banner names them)."""
    import shutil

    newer = []
    for source in sorted(committed.rglob("*")):
        relative = source.relative_to(committed)
        if not source.is_file() or any(part.startswith(".") for part in relative.parts):
            continue  # checkpoints, caches
        target = work / relative
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif (source.suffix == ".ipynb" and source.stat().st_mtime > target.stat().st_mtime
              and source.read_bytes() != target.read_bytes()):
            newer.append(str(relative))
    return newer


def lab_banner(notebooks: Path, port: int | None, extra: Sequence[str] = ()) -> list[str]:
    """What ``um-lab lab`` says before starting Jupyter: the folder, the address and port, and how to log in."""
    ip = user_ip(extra)
    where = f"{LOCAL_IP} only" if ip is None else (f"{ip} only" if is_local(ip) else f"{ip or 'every address'}, "
                                                                                    "reachable from the network")
    if port is not None:
        port_text = f"port {port} (a busy port stops it; it does not move to another)"
    elif port_in_use(JUPYTER_DEFAULT_PORT, ip):
        port_text = (f"port {JUPYTER_DEFAULT_PORT} is busy: Jupyter takes the next free one; the URL it prints "
                     "says which")
    else:
        port_text = f"port {JUPYTER_DEFAULT_PORT} (or the next free one if it is taken meanwhile: see the URL)"
    login = ("AUTHENTICATION OFF: no token, no password" if auth_off(extra)
             else "open the URL with the token it prints")
    lines = [f"starting JupyterLab on {notebooks} ({where}; {port_text}; {login})"]
    if serves_checkout_notebooks(notebooks):
        lines.append("this folder holds the repository's own notebooks: saving one writes into the repository "
                     "(`um-lab lab` without --notebooks works on copies of them)")
    return lines


def lab_warnings(extra: Sequence[str]) -> list[str]:
    """Loud warnings about what the user's Jupyter arguments open up: authentication off, an address that
    is reachable from the network."""
    ip = user_ip(extra)
    warnings = []
    if auth_off(extra):
        warnings.append("TOKEN AUTHENTICATION IS OFF (an empty token was passed to Jupyter): anyone who can reach "
                        "the server can run code as you" + ("" if is_local(ip) else ", FROM THE NETWORK")
                        + ". Remove the empty token to turn it back on.")
    if not is_local(ip):
        warnings.append(f"JupyterLab listens on {ip!r}, not on {LOCAL_IP} only: it is reachable from the network "
                        "(a notebook runs code as you). Use this on a trusted network only.")
    return warnings


def lab_environment(start_dir: Path | None = None) -> tuple[dict[str, str], Path]:
    """The Jupyter server's environment and where its notebooks' runs go: ``UM_LAB_RUNS_DIR`` as set,
    else ``runs``; made absolute against ``start_dir`` (default: the current folder), since the kernels
    run in the notebook folder."""
    from um_lab.runs.runlog import RUNS_DIR_ENV

    env = dict(os.environ)
    runs = ((start_dir or Path.cwd()) / Path(env.get(RUNS_DIR_ENV, "").strip() or "runs").expanduser()).resolve()
    env[RUNS_DIR_ENV] = str(runs)
    return env, runs


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the server leads its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def serve_lab(cmd: Sequence[str], env: Mapping[str, str], grace_s: float | None = None) -> int:
    """Run the Jupyter server in its own session and wait for it; returns its exit status.

    SIGINT, SIGTERM or SIGHUP to this process sends SIGTERM to the server's process group (Jupyter
    shuts its kernels down); after ``grace_s`` seconds (default :data:`LAB_STOP_GRACE_S`), or at a
    second signal, the group is killed. Then returns 128 + the signal's number (130 for Ctrl-C).
    """
    grace = LAB_STOP_GRACE_S if grace_s is None else grace_s
    received: list[int] = []
    deadline: list[float] = []
    proc: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        if proc is None:
            return  # Popen has not returned yet; handled right after it does
        if len(received) == 1:
            deadline.append(time.monotonic() + grace)
            signal_group(proc, signal.SIGTERM)
        else:
            signal_group(proc, signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
        if received:
            deadline.append(time.monotonic() + grace)
            signal_group(proc, signal.SIGTERM)
        while True:
            try:
                status = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    print(f"JupyterLab did not stop within {grace:g} s: killing it", flush=True)
                    deadline.clear()
                    signal_group(proc, signal.SIGKILL)
        if received:
            signal_group(proc, signal.SIGKILL)  # anything of the server's group still left
            return 128 + received[0]
        return status
    finally:
        if proc is not None and proc.poll() is None:  # an unexpected error while waiting
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
