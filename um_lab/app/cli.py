"""``um-lab``: run, compare, calibrate, and start the notebooks from a shell.

::

    um-lab run --model mlp --model-kw width=1024 --policy gpu-first --backend sim --steps 50
    um-lab compare --models mlp gpt2-small --policies um-default gpu-first --ratios 0.8 1.5 --csv out.csv
    um-lab compare --models mlp --ratios 1.5 2 --csv out.csv --force    # --force: replace an existing out.csv
    um-lab run --model gpt2-small --policy layer-ahead --budget 0.5x      # GPU-resident bytes <= half the footprint
    um-lab compare --models mlp --policies um-default layer-ahead --ratios 1.5 2 --backend sim
    um-lab calibrate --out calibration/my-gpu.json        # needs a CUDA GPU
    um-lab lab                                            # JupyterLab on notebooks/, 127.0.0.1, token on
    um-lab lab --allow-root -- --ServerApp.port=9999      # other arguments go to Jupyter as they are
    um-lab show runs/<run folder>                         # a run's status and summary (or a comparison's table)
    um-lab models | um-lab policies                       # what can be named

``--backend auto`` (the default) picks cuda when a GPU is available, else sim; the choice is printed.
Any registered backend can be named (an installed package registers one with an entry point in the
``um_lab.backends`` group; see :mod:`um_lab.backend`). Options go to the backends that take them:
``--profile`` to one whose class takes ``profile``; ``--capacity`` and ratios to one that simulates capacity.
A bare preset name always means the preset; a policy file is given with a path or a ``.json`` name and
may not take a preset's name.
Runs go to ``--out``, else ``$UM_LAB_RUNS_DIR``, else ``runs/`` in the current folder.
Every run of a comparison is checked before the first one starts; one that still fails stops it, but the
table of the runs made is shown, written to ``--csv`` and to the comparison folder's ``summary.csv``.
um_lab's own errors are one line, ``um-lab: error: ...`` (exit status 2 for bad input, 1 otherwise).
This module parses the command line and reports errors; the commands themselves are :mod:`um_lab.app.commands`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from um_lab.app import cli_search
from um_lab.app.cli_args import (
    CliError,
    join_signed_values,
    parse_budget,
    parse_capacity,
    parse_ratio,
    port_number,
)
from um_lab.app.commands import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    cmd_calibrate,
    cmd_compare,
    cmd_lab,
    cmd_models,
    cmd_policies,
    cmd_run,
    cmd_show,
    summary_line,
)
from um_lab.errors import UmLabError
from um_lab.streams import silence
from um_lab.types import PRECISIONS

__all__ = ["COMMANDS", "EXIT_BROKEN_PIPE", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser",
           "main", "parse_args", "summary_line"]


LAB_EPILOG = """\
Any other argument is passed to Jupyter as it is; everything after `--` is passed unread:
  um-lab lab --allow-root                    (as root, e.g. in a container)
  um-lab lab -- --ServerApp.port=9999 --ServerApp.open_browser=False

Runs made from the notebooks go to $UM_LAB_RUNS_DIR: um-lab lab sets it to runs/ in the folder it was
started from, unless it is already set (a relative path is taken from that folder too). The repository's
notebooks are served as working copies in $UM_LAB_RUNS_DIR/notebooks, made when missing and never overwritten:
what you run, edit and save stays there, and the repository stays as committed.
Ctrl-C (or SIGTERM to um-lab) stops the Jupyter server it started, and its kernels.
"""


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from um_lab.backend import backend_names

    p.add_argument("--backend", default="auto",
                   help=f"a registered backend ({', '.join(backend_names())}) or auto (cuda when a GPU is "
                        "available, else sim)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, recorded but not summarised")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    p.add_argument("--model-kw", action="append", metavar="KEY=VALUE",
                   help="a model size knob, repeatable (e.g. width=1024, seq_len=256, n_layer=2)")
    p.add_argument("--capacity", type=parse_capacity, default=None,
                   help="simulated GPU capacity, e.g. 16GiB or 1e9 (backends that simulate capacity, such "
                        "as sim; default: the profile's card); not with a ratio")
    p.add_argument("--profile", default=None,
                   help="calibration profile, for backends that take one (sim's: a packaged name such as "
                        "h200, or a profile JSON)")
    p.add_argument("--budget", type=parse_budget, default=None, metavar="SIZE|Fx",
                   help="train under the layer-ahead scheduler with GPU-resident managed bytes at most this: a "
                        "size (8GiB) or a fraction of the footprint (0.5x: footprint/budget = 2); on compare it "
                        "applies to the layer-ahead runs. Policy layer-ahead without it: on sim the simulated "
                        "capacity; on cuda required")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="what the step computes in: fp32, or autocast to bf16 / fp16 with fp32 master weights "
                        "(fp16 with a dynamic loss scale)")
    p.add_argument("--recompute", default="none", metavar="none|every-layer|auto|N|LAYER[,LAYER]",
                   help="recompute these layers' activations in backward instead of keeping them: every layer, "
                        "the first N, or layer names (see `um-lab models --layers MODEL`); auto: with --budget, "
                        "the memory planner chooses the layers and whether activations are staged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="folder for run logs (default: $UM_LAB_RUNS_DIR if set, else runs/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The ``um-lab`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="um-lab", description="CUDA Unified Memory lab: per-data-type advice, real GPU or simulated.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run one model under one policy and log every step")
    p.add_argument("--model", default="mlp", help="zoo name (see `um-lab models`)")
    p.add_argument("--policy", default="um-default",
                   help="preset name, or a policy JSON file given with a path or .json (./mine, mine.json)")
    p.add_argument("--ratio", type=parse_ratio, default=None, help="simulated oversubscription ratio")
    _add_run_options(p)

    p = sub.add_parser("compare", help="sweep models x policies x ratios; table, CSV/Parquet")
    p.add_argument("--models", nargs="+", default=["mlp"], help="zoo names")
    p.add_argument("--policies", nargs="+", default=["um-default", "gpu-first"],
                   help="preset names or policy JSON files given with a path or .json "
                        "(um-default is added as the baseline)")
    p.add_argument("--ratios", nargs="+", type=parse_ratio, default=[None],
                   help="simulated oversubscription ratios (backends that simulate capacity, such as sim); "
                        "'none' = the profile's card")
    p.add_argument("--csv", type=Path, help="write the table as CSV (a new file, unless --force)")
    p.add_argument("--parquet", type=Path, help="write the table as Parquet (needs pyarrow; a new file, unless "
                                                  "--force)")
    p.add_argument("--force", action="store_true", help="let --csv / --parquet replace a file that exists")
    p.add_argument("--keep-going", action="store_true", help="record a failed run and go on")
    _add_run_options(p)

    p = sub.add_parser("calibrate", help="measure this GPU and write a simulator calibration profile")
    p.add_argument("--out", type=Path, default=Path("calibration/profile.json"), help="profile JSON path")
    p.add_argument("--name", default=None, help="profile name (default: the GPU's name)")
    fit = p.add_mutually_exclusive_group()
    fit.add_argument("--host-only", metavar="PROFILE", default=None,
                     help="only fit PROFILE's host constants (name or JSON path, e.g. h200) to this machine's host: "
                          "a few seconds of host-bound zoo steps")
    fit.add_argument("--machine", metavar="PROFILE", default=None,
                     help="fit PROFILE's host constants, GPU rates and host-link rates (name or JSON path, e.g. "
                          "h200) to this machine: a minute of zoo steps, then the fit")

    p = sub.add_parser(
        "lab", help="start JupyterLab on the notebooks (127.0.0.1, token auth on)", allow_abbrev=False,
        usage="um-lab lab [--notebooks DIR] [--port PORT] [--no-browser] [JUPYTER_ARG ...] [-- JUPYTER_ARG ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start JupyterLab on the notebooks, bound to 127.0.0.1 with Jupyter's token authentication.",
        epilog=LAB_EPILOG)
    p.add_argument("--notebooks", type=Path, default=None, metavar="DIR",
                   help="notebook folder (default: working copies of the repository's notebooks/, in "
                        "$UM_LAB_RUNS_DIR/notebooks)")
    p.add_argument("--port", type=port_number, default=None, help="the server's port (default: Jupyter's, 8888)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")

    p = sub.add_parser("show", help="status and summary of a run folder, or a comparison folder's table")
    p.add_argument("path", type=Path)

    p = sub.add_parser("models", help="list the model zoo and its size knobs")
    p.add_argument("--layers", metavar="MODEL", default=None,
                   help="list MODEL's layers instead (the names --recompute takes), built on the meta device")
    p.add_argument("--model-kw", action="append", metavar="KEY=VALUE", help="with --layers: a size knob")
    sub.add_parser("policies", help="list the policy presets and the scheduled policies")
    cli_search.add_parser(sub)
    return parser


COMMANDS = {"run": cmd_run, "compare": cmd_compare, "calibrate": cmd_calibrate, "lab": cmd_lab,
            "show": cmd_show, "models": cmd_models, "policies": cmd_policies, "search": cli_search.command}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line. ``lab`` keeps the arguments it does not know, and every one after ``--``,
    in ``jupyter_args`` (for Jupyter); other commands reject unknown arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] != "lab":
        return parser.parse_args(join_signed_values(argv))  # --budget -1GiB: a value, refused as one
    cut = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:cut])
    args.jupyter_args = [*unknown, *argv[cut + 1:]]
    return args


def _say_error(e: BaseException) -> None:
    """``um-lab: error: <message>``, then the notes added to it (e.g. where a stopped comparison's table is)."""
    print(f"um-lab: error: {e}", file=sys.stderr)
    for note in getattr(e, "__notes__", ()):
        print(f"um-lab: {note}", file=sys.stderr)


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): nothing more can be shown; no error, no second one when
    Python flushes stdout at exit."""
    silence(sys.stdout)
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``um-lab``; returns the exit status (errors print ``um-lab: error: ...``, never a traceback
    for um_lab's own errors: bad input 2, other refusals and failures 1)."""
    args = parse_args(argv)
    formatted = warnings.formatwarning
    warnings.formatwarning = _format_warning  # the format only: recorded warnings (catch_warnings) stay recorded
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as e:
        for note in getattr(e, "__notes__", ()):
            print(f"um-lab: {note}", file=sys.stderr)
        print("um-lab: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except (CliError, ValueError, FileNotFoundError, ImportError, OSError) as e:
        _say_error(e)
        return EXIT_USAGE
    except (UmLabError, RuntimeError) as e:  # e.g. no GPU, a size refused under the safety cap
        _say_error(e)
        return EXIT_FAILED
    finally:
        warnings.formatwarning = formatted


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """A warning as one line for the command line's user (no source path, no source line)."""
    return f"um-lab: warning: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
