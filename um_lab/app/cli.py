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
"""

from __future__ import annotations

import argparse
import importlib.util
import numbers
import os
import re
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from um_lab.app import cli_search, labserver
from um_lab.app.cli_args import (
    CliError,
    check_batch_size,
    check_capacity_and_ratios,
    check_out_dir,
    format_table,
    join_signed_values,
    load_policy_arg,
    parse_budget,
    parse_capacity,
    parse_model_kwargs,
    parse_ratio,
    ratio_text,
    recompute_arg,
)
from um_lab.errors import UmLabError
from um_lab.types import PRECISIONS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  #: the reader of our output went away (``um-lab show ... | head``)


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
    p.add_argument("--host-only", metavar="PROFILE", default=None,
                   help="only fit PROFILE's host constants (name or JSON path, e.g. h200) to this machine's host: "
                        "a few seconds of host-bound zoo steps")

    p = sub.add_parser(
        "lab", help="start JupyterLab on the notebooks (127.0.0.1, token auth on)", allow_abbrev=False,
        usage="um-lab lab [--notebooks DIR] [--port PORT] [--no-browser] [JUPYTER_ARG ...] [-- JUPYTER_ARG ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start JupyterLab on the notebooks, bound to 127.0.0.1 with Jupyter's token authentication.",
        epilog=LAB_EPILOG)
    p.add_argument("--notebooks", type=Path, default=None, metavar="DIR",
                   help="notebook folder (default: working copies of the repository's notebooks/, in "
                        "$UM_LAB_RUNS_DIR/notebooks)")
    p.add_argument("--port", type=int, default=None, help="the server's port (default: Jupyter's, 8888)")
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


# ------------------------------------------------------------------------------------- commands


def _say(text: str = "") -> None:
    print(text, flush=True)


def summary_line(key: str, value: Any) -> str:
    """One summary value as the CLI prints it: bytes in B/KiB/MiB/GiB/TiB (never a raw byte count), times
    as ``12.345 ms``, counts with thousands separators, other floats to 3 decimals, a value not measured
    (None, NaN) as ``—``."""
    from um_lab.summary import NOT_MEASURED
    from um_lab.units import format_bytes

    if value is None or (isinstance(value, float) and value != value):
        text = NOT_MEASURED
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        text = str(value)
    elif key.endswith("_bytes"):
        text = format_bytes(float(value))
    elif key.endswith("_ms"):
        text = f"{float(value):,.3f} ms"
    elif isinstance(value, numbers.Integral):
        text = f"{int(value):,}"
    else:
        text = f"{float(value):.3f}"
    return f"  {key:18s} {text}"


def _say_summary(summary: dict[str, Any]) -> None:
    """One line per summary value (see :func:`summary_line`)."""
    for key, value in summary.items():
        _say(summary_line(key, value))


def _announce_backend(requested: str) -> str:
    from um_lab.backend import resolve_backend_name
    from um_lab.runs.runlog import backend_note

    resolved = resolve_backend_name(requested)
    _say(f"backend: {backend_note(requested, resolved)}")
    return resolved


def _takes_option(name: str, option: str) -> bool:
    """True when backend ``name`` is built with keyword ``option`` (False for one that cannot be imported)."""
    from um_lab.backend import backend_options

    try:
        return option in backend_options(name)
    except Exception:  # a backend whose module cannot be imported here takes nothing we could pass
        return False


def _backend_instance(resolved: str, profile: str | None) -> Any:
    """A backend built with the CLI's options (None: let the runner build the default one)."""
    if profile is None:
        return None
    from um_lab.backend import backend_names, get_backend

    if not _takes_option(resolved, "profile"):
        takers = [name for name in backend_names() if _takes_option(name, "profile")]
        raise CliError(f"--profile is not an option of backend {resolved!r} (it takes no calibration profile); "
                       f"backends that take one: {', '.join(takers) or 'none registered'}")
    return get_backend(resolved, profile=profile)


def cmd_run(args: argparse.Namespace) -> int:
    """``um-lab run``."""
    from tqdm.auto import tqdm

    from um_lab.runs.runner import Run
    from um_lab.types import RunSpec

    model_kwargs = _model_kwargs(args)
    check_capacity_and_ratios(args.capacity, [args.ratio], "--ratio")
    policy = load_policy_arg(args.policy)
    check_out_dir(args.out)
    resolved = _announce_backend(args.backend)
    backend = _backend_instance(resolved, args.profile)
    spec = RunSpec(model=args.model, policy=policy.name, backend=args.backend, steps=args.steps,
                   warmup_steps=args.warmup, batch_size=args.batch_size,
                   model_kwargs=model_kwargs, capacity_bytes=args.capacity,
                   oversubscription_ratio=args.ratio, seed=args.seed, budget=args.budget,
                   precision=args.precision, recompute=recompute_arg(args.recompute))
    active = Run(spec, policy=policy, out_dir=args.out, backend=backend)
    _say(f"run: {active.case.name} under {policy.name}, {args.warmup} warm-up + {args.steps} steps -> "
         f"{active.path}")
    if active.plan is not None:
        _say(f"memory planner: {active.plan.describe()}")
    bar = tqdm(total=args.warmup + args.steps, unit="step", disable=args.no_progress)
    try:
        for record in active:
            bar.set_postfix_str(f"{record.wall_ms:.2f} ms{' (warm-up)' if record.warmup else ''}")
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        _say(f"interrupted: {active.steps_completed} completed steps kept in {active.path}")
        return EXIT_INTERRUPTED
    bar.close()
    summary = active.summary()
    _say(f"status: {active.status}")
    _say_summary({key: summary[key] for key in ("steps", "median_ms", "mean_ms", "p90_ms", "migrated_bytes",
                                                "remote_bytes", "gpu_page_faults", "evictions",
                                                "peak_live_bytes", "oversubscription", "last_loss")})
    _say(f"log: {active.path}")
    return EXIT_OK


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--model-kw`` as a dict, refused when its ``batch_size`` disagrees with ``--batch-size``."""
    kwargs = parse_model_kwargs(args.model_kw)
    check_batch_size(args.batch_size, kwargs)
    return kwargs


def _check_exports(args: argparse.Namespace) -> None:
    from um_lab.runs.sweep import check_export_path

    if args.parquet is not None and importlib.util.find_spec("pyarrow") is None:
        raise CliError("--parquet needs pyarrow, which is not installed: `pip install pyarrow`, "
                       "or export with --csv instead")
    if args.csv is not None and args.parquet is not None and args.csv.resolve() == args.parquet.resolve():
        raise CliError(f"--csv and --parquet name one file, {args.csv}; give each its own")
    for path in (args.csv, args.parquet):
        if path is not None:
            check_export_path(path, force=args.force)


def _export(table: Any, args: argparse.Namespace) -> bool:
    """Write the table to ``--csv`` / ``--parquet``; False when one of them could not be written (said why:
    the table is still in the comparison folder's summary.csv)."""
    from um_lab.runs.sweep import write_export

    written = True
    for path, fmt in ((args.csv, "csv"), (args.parquet, "parquet")):
        if path is None:
            continue
        try:
            write_export(table, path, force=args.force, fmt=fmt)
            _say(f"{fmt}: {path}")
        except (UmLabError, OSError) as e:
            sweep = table.attrs.get("sweep_dir")
            print(f"um-lab: error: {e}" + (f"; the table is in {sweep}/summary.csv" if sweep else ""),
                  file=sys.stderr, flush=True)
            written = False
    return written


def cmd_compare(args: argparse.Namespace) -> int:
    """``um-lab compare``. A comparison that stops early (a run failed, without --keep-going, or Ctrl-C) still
    shows and exports the table of the runs made, then reports why it stopped."""
    from um_lab.runs.sweep import compare

    model_kwargs = _model_kwargs(args)
    check_capacity_and_ratios(args.capacity, args.ratios, "--ratios")
    _check_exports(args)  # before the sweep, not after it
    policies = [load_policy_arg(p) for p in args.policies]
    check_out_dir(args.out)
    backend = _announce_backend(args.backend)
    instance = _backend_instance(backend, args.profile)
    try:
        table = compare(args.models, policies, args.ratios, backend=backend, backend_instance=instance,
                        steps=args.steps,
                        warmup_steps=args.warmup, batch_size=args.batch_size,
                        model_kwargs=model_kwargs, capacity_bytes=args.capacity,
                        seed=args.seed, out_dir=args.out, progress=not args.no_progress,
                        keep_going=args.keep_going, budget=args.budget, precision=args.precision,
                        recompute=recompute_arg(args.recompute))
    except BaseException as e:
        partial = getattr(e, "compare_table", None)
        if partial is not None:  # the runs made before it stopped: shown and exported, then the error
            _say(format_table(partial))
            _say(f"runs: {partial.attrs['sweep_dir']} (stopped early)")
            _export(partial, args)
        raise
    _say(format_table(table))
    _say(f"runs: {table.attrs['sweep_dir']}")
    exported = _export(table, args)
    return EXIT_OK if exported and (table["status"] == "complete").all() else EXIT_FAILED


HOST_PROBE_NAMES = "GPT-2-small, ResNet-50 and an MLP at tiny batches"


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``um-lab calibrate``: measure this GPU, fit a simulator profile (``um_lab.sim.calibration``)."""
    from um_lab.backend import cuda_available

    if not cuda_available():
        raise CliError("calibrate needs CUDA: run it on a machine with an NVIDIA GPU and a CUDA build of "
                       "torch. The simulator's packaged profile (h200) needs no calibration.")
    try:
        from um_lab.sim.calibration import calibrate, measure_on_gpu
    except ImportError as e:
        raise CliError(f"calibration is not available in this um_lab ({e})") from None
    import torch

    name = args.name or re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    if args.host_only is not None:
        from um_lab.sim.host_calibration import fit_host_scale, measure_host_probes
        from um_lab.sim.profile import load_profile

        base = load_profile(args.host_only)
        _say(f"calibrating the host: timing {len(HOST_PROBE_NAMES)} host-bound zoo steps ({HOST_PROBE_NAMES})...")
        probes = measure_host_probes()
        profile, scale = fit_host_scale(base, probes)
        profile = profile.replace(name=args.name or f"{base.name}-host-{name}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        profile.save(args.out, measured={"host_probes": probes, "host_scale": scale, "base_profile": base.name})
        _say(f"host {scale:.2f}x the {base.name} profile's: {args.out} "
             f"(use it with --backend sim --profile {args.out})")
        return EXIT_OK
    _, total = torch.cuda.mem_get_info()
    _say("calibrating: measuring host<->GPU bandwidth and step times of the reference models...")
    measured = measure_on_gpu()
    profile = calibrate(measured["targets"], measured["bandwidth_GBps"], name=name, gpu_memory_bytes=total)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out, measured=measured)
    _say(f"profile {name!r}: {args.out} (use it with --backend sim --profile {args.out})")
    return EXIT_OK


def _has_jupyterlab() -> bool:
    return importlib.util.find_spec("jupyterlab") is not None


def cmd_lab(args: argparse.Namespace) -> int:
    """``um-lab lab``."""
    if not _has_jupyterlab():
        raise CliError("jupyterlab is not installed: `pip install 'um_lab[notebook]'` (or pip install "
                       "jupyterlab), then run `um-lab lab` again")
    notebooks = (args.notebooks or labserver.default_notebooks_dir()).resolve()
    if not notebooks.is_dir():
        raise CliError(f"notebook folder {notebooks} not found (pass --notebooks DIR)")
    extra = list(getattr(args, "jupyter_args", ()))
    port = labserver.named_port(args.port, extra)
    if port is not None:  # named: Jupyter would stop on a busy one (not move on); say so before starting it
        labserver.check_port_free(port, labserver.user_ip(extra))
    env, runs = labserver.lab_environment()
    own_root = labserver.jupyter_setting(extra, labserver.ROOT_DIR_NAMES) is not None
    if labserver.is_checkout_notebooks(notebooks) and not own_root:
        committed, notebooks = notebooks, runs / labserver.WORKING_COPIES
        newer = labserver.working_copies(committed, notebooks)
        _say(f"working copies of {committed} in {notebooks}: run, edit and save them there (outputs and live "
             "widgets kept); the repository's notebooks stay as committed")
        for name in newer:
            _say(f"{name} changed in the repository since your copy was made: delete {notebooks / name} to "
                 "take the new one")
    cmd = labserver.lab_command(notebooks, args.port, args.no_browser, extra)
    for line in labserver.lab_banner(notebooks, port, extra):
        _say(line)
    for warning in labserver.lab_warnings(extra):
        print(f"um-lab: WARNING: {warning}", file=sys.stderr, flush=True)
    _say(f"runs from the notebooks go to {runs} (UM_LAB_RUNS_DIR)")
    status = labserver.serve_lab(cmd, env)
    if status > 128:
        _say(f"JupyterLab stopped ({signal.Signals(status - 128).name})")
    return status


def cmd_show(args: argparse.Namespace) -> int:
    """``um-lab show``: a run folder, or a comparison folder written by ``compare``."""
    from um_lab.runs.runread import load

    if not (args.path / "spec.json").is_file() and _is_sweep(args.path):
        return _show_sweep(args.path)
    loaded = load(args.path)
    _say(f"{loaded.path}: {loaded.spec.model} under {loaded.spec.policy} on "
         f"{loaded.environment.get('backend', '?')}, state {loaded.state}, {loaded.steps_text} steps")
    for key in ("error", "interrupted_by", "note"):  # why it ended (a run left running: interrupted, a note)
        if loaded.status.get(key):
            _say(f"{key.replace('_', ' ')}: {loaded.status[key]}")
    _say_summary(loaded.summary())
    return EXIT_OK


def _is_sweep(path: Path) -> bool:
    return (path / "summary.csv").is_file() or (path.name.startswith("compare-") and path.is_dir())


def _show_sweep(path: Path) -> int:
    """A comparison folder: its table (summary.csv), or each run's state while none is written yet."""
    import pandas as pd

    from um_lab.runs.runlog import list_runs
    from um_lab.runs.runread import load

    runs = list_runs(path)
    summary = path / "summary.csv"
    if summary.is_file():
        _say(f"{path}: comparison, {len(runs)} run folders")
        _say(format_table(pd.read_csv(summary)))
        return EXIT_OK
    _say(f"{path}: comparison without summary.csv (running, or stopped before the end), "
         f"{len(runs)} run folders")
    for run_dir in runs:
        loaded = load(run_dir)
        median = loaded.summary().get("median_ms")
        median_text = f", median {median:.3f} ms" if isinstance(median, float) and median == median else ""
        _say(f"  {loaded.spec.model} under {loaded.spec.policy}, ratio "
             f"{ratio_text(loaded.spec.oversubscription_ratio)}: {loaded.state}, {loaded.steps_text} steps"
             f"{median_text}")
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    """``um-lab models``."""
    from um_lab.models import buildable_models, describe_models, get_model, model_needs

    if args.model_kw and args.layers is None:
        raise CliError("--model-kw sizes the model that --layers lists; give --layers MODEL with it")
    if args.layers is not None:
        import torch

        from um_lab.training import layer_names

        case = get_model(args.layers, **parse_model_kwargs(args.model_kw or []))
        with torch.device("meta"):
            names = layer_names(case.build_model())
        _say(f"{case.name}: {len(names)} layers" + (" (none: --recompute has nothing to choose)" if not names else ""))
        for name in names:
            _say(f"  {name}")
        return EXIT_OK
    buildable = set(buildable_models())
    for name, knobs in describe_models().items():
        missing = "" if name in buildable else f"  [not here: {model_needs(name)}]"
        _say(f"{name:12s} {knobs}{missing}")
    return EXIT_OK


def cmd_policies(args: argparse.Namespace) -> int:
    """``um-lab policies``: every name ``--policy`` takes (the presets and the scheduled policies)."""
    from um_lab.policy import named_policies

    for name, policy in named_policies().items():
        _say(f"{name:18s} {policy.description}")
    return EXIT_OK


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
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured)
        pass
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
