"""The ``um-lab`` commands: ``run``, ``compare``, ``calibrate``, ``lab``, ``show``, ``models`` and ``policies``.

Each ``cmd_*`` takes the parsed arguments (:func:`um_lab.app.cli.parse_args`), prints what it does and returns
the exit status; :func:`um_lab.app.cli.main` dispatches to them and turns their errors into one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import numbers
import re
import signal
import sys
from pathlib import Path
from typing import Any

from um_lab.app import labserver
from um_lab.app.cli_args import (
    CliError,
    check_batch_size,
    check_capacity_and_ratios,
    check_out_dir,
    format_table,
    load_policy_arg,
    parse_model_kwargs,
    ratio_text,
    recompute_arg,
)
from um_lab.errors import UmLabError
from um_lab.streams import QuietBar, silence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  #: the reader of our output went away (``um-lab show ... | head``)


_outlive_stdout = False  #: set while a run or comparison works: a closed stdout drops output, not the work


def _say(text: str = "") -> None:
    """Print a line. While a run or comparison works (:func:`_outliving_stdout`), a closed stdout (``um-lab run
    ... | head -1``) silences the rest of the output and the work goes on; elsewhere its BrokenPipeError ends the
    command, quietly (``um-lab show ... | head``)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        if not _outlive_stdout:
            raise
        silence(sys.stdout)


@contextlib.contextmanager
def _outliving_stdout() -> Any:
    """While inside, :func:`_say` drops output to a closed stdout instead of raising (the run goes on)."""
    global _outlive_stdout
    before, _outlive_stdout = _outlive_stdout, True
    try:
        yield
    finally:
        _outlive_stdout = before


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
    """``um-lab run``. A closed stdout or stderr (``| head -1``) stops the output, not the run: it runs to the
    end and its exit status is the run's."""
    with _outliving_stdout():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
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
    bar = QuietBar(total=args.warmup + args.steps, unit="step", disable=args.no_progress)
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
    shows and exports the table of the runs made, then reports why it stopped. A closed stdout (``| head``)
    stops the output, not the comparison nor its exports."""
    with _outliving_stdout():
        return _compare(args)


def _compare(args: argparse.Namespace) -> int:
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
MACHINE_PROBE_NAMES = ("the host probes, GPT-2-small and ResNet-50 at full batches, an MLP whose parameters are read "
                       "and whose optimizer state is updated over the host link, and a 64-layer MLP under a budget")


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
        from um_lab.sim.machine_calibration import fit_host_scale, measure_host_probes
        from um_lab.sim.profile import load_profile

        base = load_profile(args.host_only)
        _say(f"calibrating the host: timing host-bound zoo steps ({HOST_PROBE_NAMES})...")
        probes = measure_host_probes()
        profile, scale = fit_host_scale(base, probes)
        profile = profile.replace(name=args.name or f"{base.name}-host-{name}")
        return _save_profile(profile, args.out, {"host_probes": probes, "host_scale": scale, "base_profile": base.name},
                             f"host {scale:.2f}x the {base.name} profile's")
    if args.machine is not None:
        from um_lab.sim.machine_calibration import fit_machine, measure_machine_probes
        from um_lab.sim.profile import load_profile

        base = load_profile(args.machine)
        _say(f"calibrating this machine: timing zoo steps ({MACHINE_PROBE_NAMES}), then fitting (a minute or two)...")
        fit = fit_machine(base, measure_machine_probes())
        profile = fit.profile.replace(name=args.name or f"{base.name}-{name}",
                                      gpu_memory_bytes=torch.cuda.mem_get_info()[1])  # this card's, not the base's
        factors = ", ".join(f"{kind} {value:.2f}x" for kind, value in fit.scales.items())
        return _save_profile(profile, args.out, {"machine_probes": list(fit.probes), "scales": dict(fit.scales),
                                                 "base_profile": base.name},
                             f"this machine against the {base.name} profile, in time: {factors}")
    _, total = torch.cuda.mem_get_info()
    _say("calibrating: measuring host<->GPU bandwidth and step times of the reference models...")
    measured = measure_on_gpu()
    profile = calibrate(measured["targets"], measured["bandwidth_GBps"], name=name, gpu_memory_bytes=total)
    return _save_profile(profile, args.out, measured, f"profile {name!r}")


def _save_profile(profile: Any, out: Path, measured: dict[str, Any], what: str) -> int:
    """Write a calibrated ``profile`` with what it was fitted on to ``out`` and say how to use it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out, measured=measured)
    _say(f"{what}: {out} (use it with --backend sim --profile {out})")
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
    _say(f"{loaded.path}: {loaded.model_text} under {loaded.spec.policy} on "
         f"{loaded.environment.get('backend', '?')}, state {loaded.state}, {loaded.steps_text} steps")
    for key in ("error", "interrupted_by", "note"):  # why it ended (a run left running: interrupted, a note)
        if loaded.status.get(key):
            _say(f"{key.replace('_', ' ')}: {loaded.status[key]}")
    _say_summary(loaded.summary())
    return EXIT_OK


def _is_sweep(path: Path) -> bool:
    summary = path / "summary.csv"
    return summary.exists() or summary.is_symlink() or (path.name.startswith("compare-") and path.is_dir())


def _show_sweep(path: Path) -> int:
    """A comparison folder: its table (summary.csv), or each run's state while none is written yet. A
    summary.csv that is not a regular file, or not CSV, is a :class:`~um_lab.errors.FileReadError` naming it."""
    from um_lab.files import TABLE_LIMIT, read_csv
    from um_lab.runs.runlog import list_runs
    from um_lab.runs.runread import load

    summary = path / "summary.csv"
    if summary.exists() or summary.is_symlink():
        table = read_csv(summary, "comparison's summary", TABLE_LIMIT)
        _say(f"{path}: comparison, {len(list_runs(path))} run folders")
        _say(format_table(table))
        return EXIT_OK
    runs = list_runs(path)
    _say(f"{path}: comparison without summary.csv (running, or stopped before the end), "
         f"{len(runs)} run folders")
    for run_dir in runs:
        loaded = load(run_dir)
        median = loaded.summary().get("median_ms")
        median_text = f", median {median:.3f} ms" if isinstance(median, float) and median == median else ""
        _say(f"  {loaded.model_text} under {loaded.spec.policy}, ratio "
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
