"""``um-lab search``: the best per-type advice for a model on the simulator, as a policy file ``--policy`` takes.

    um-lab search --model gpt2-small --model-kw n_layer=4 --ratio 1.5 --save best.json
    um-lab run --model gpt2-small --model-kw n_layer=4 --ratio 1.5 --backend sim --policy best.json
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from um_lab.app.cli_args import CliError, parse_capacity, parse_model_kwargs, parse_ratio
from um_lab.errors import gib


def add_parser(sub: Any) -> None:
    """Add ``search`` to the ``um-lab`` subcommands."""
    p = sub.add_parser("search", help="find the best per-type advice for a model on the simulator")
    p.add_argument("--model", default="mlp", help="zoo name (see `um-lab models`)")
    p.add_argument("--model-kw", action="append", metavar="KEY=VALUE", help="a size knob (repeat for more)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--ratio", type=parse_ratio, help="oversubscription ratio: the model's footprint / the GPU")
    size.add_argument("--capacity", type=parse_capacity, help="the simulated GPU's memory, e.g. 8GiB")
    p.add_argument("--space", choices=("five-type", "three-type"), default="five-type",
                   help="advise all five data types, or the paper's three (parameters, gradients, optimizer state)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that simulate candidates (default 2, at most 4 a CPU core)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop with the best found so far after about this many seconds")
    p.add_argument("--steps", type=int, default=4, help="measured steps per candidate")
    p.add_argument("--profile", default="h200", help="simulator profile name or JSON path")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="write the best policy as JSON (a new file, unless --force)")
    p.add_argument("--force", action="store_true", help="let --save replace a file that exists")
    p.add_argument("--top", type=int, default=5, help="how many of the ranked candidates to print")


def command(args: argparse.Namespace) -> int:
    """``um-lab search``: prints the best policy, its speed-up and the top candidates; ``--save`` writes it."""
    from um_lab.runs.sweep import check_export_path
    from um_lab.sim.search import search_policy

    if args.ratio is None and args.capacity is None:
        raise CliError("give --ratio or --capacity (the simulated GPU's size)")
    if args.top < 0:
        raise CliError(f"--top must be >= 0, got {args.top}")
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise CliError(f"--time-limit must be a number of seconds > 0, got {args.time_limit:g}")
    if args.save is not None:
        if args.save.endswith(("/", os.sep)) or Path(args.save).is_dir():
            raise CliError(f"--save {args.save!r} names a folder: give the policy file's name (e.g. best.json)")
        args.save = Path(args.save)
        check_export_path(args.save, force=args.force)  # before the search, not after it
    result = search_policy(args.model, args.ratio, args.capacity, model_kwargs=parse_model_kwargs(args.model_kw),
                           space=args.space, workers=args.workers, budget_s=args.time_limit, profile=args.profile,
                           steps=args.steps, progress=True)
    stopped = "" if result.complete else " (stopped by --time-limit: the best found so far)"
    print(f"{result.model} at {result.ratio:.2f}x ({gib(result.capacity_bytes)} simulated GPU), {result.space}: "
          f"{result.evaluations} candidates in {result.seconds:.1f} s{stopped}")
    print(f"best: {result.best_ms:.2f} ms a step against {result.baseline_ms:.2f} ms with um-default "
          f"({result.speedup:.3f}x)")
    for data_type, advice in result.policy.advice.items():
        print(f"  {str(data_type):12s} {_advice_text(advice)}")
    if args.top:
        print(result.ranking.head(args.top).to_string(index=False))
    if args.save is not None:
        result.policy.save(args.save)
        print(f"policy written to {args.save} (use it with --policy {args.save})")
    return 0


def _advice_text(advice: Any) -> str:
    """One advice as words: preferred location, accessed-by, read-mostly, prefetch (only what is set)."""
    parts = [f"prefer {advice.preferred_location.value}" if advice.preferred_location.value != "none" else "",
             "accessed by " + ", ".join(sorted(p.value for p in advice.accessed_by)) if advice.accessed_by else "",
             "read-mostly" if advice.read_mostly else "",
             f"prefetch {advice.prefetch.value}" if advice.prefetch.value != "none" else ""]
    return "; ".join(p for p in parts if p) or "no advice (plain UM)"
