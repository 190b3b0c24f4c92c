"""Allocator overhead on a real GPU: native PyTorch vs um_lab (um-default) vs the naive global pool.

Each (model, mode) runs in a fresh process: the naive way swaps a CuPy ``MemoryPool(malloc_managed)``
in as torch's global allocator, which only works before CUDA is initialised. Every mode runs the
same loop (copy the batch to the GPU, forward, backward, AdamW step, zero_grad) with a synchronise
around each step, and reports the median over the timed steps.

    python bench/allocator_overhead.py [--steps 20] [--warmup 5] [--models mlp resnet50 gpt2-medium]
    python bench/allocator_overhead.py --alternate 6 --repeats 3 --models mlp   # both in one process

With ``--alternate BLOCKS`` each process instead runs native and um_lab blocks in turn on one model and
optimizer (a session opened, the model placed, the block run, the session closed, which moves the model
back), so each adjacent pair is compared inside one process: the MLP's spread between processes (9-11 ms)
is ten times the 1% the bar allows. ``--modes native um_lab+VARIANT`` alternates native with a variant.

Prints a table and writes bench/results/allocator_overhead.json. Bar: um_lab / native <= 1.01.
The um_lab safety cap is on; the naive mode has no cap, so the models stay far below the card.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"mlp": {}, "resnet50": {"batch_size": 128}, "gpt2-medium": {"batch_size": 8, "seq_len": 1024}}
MODES = ("native", "um_lab", "naive")  # also: um_lab+worker (backward on autograd's device thread), um_lab@POLICY
NAIVE_LIMIT = 60 << 30  # the naive pool's own abort counter: far below the card
DEFAULT_OUT = ROOT / "bench" / "results" / "allocator_overhead.json"


def _install_naive_allocator() -> None:
    import cupy
    import torch

    pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)
    live: dict[int, object] = {}
    alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

    @alloc_t
    def alloc(size, device, stream):
        if pool.total_bytes() + size > NAIVE_LIMIT:
            return None
        mem = pool.malloc(size)
        live[mem.ptr] = mem
        return mem.ptr

    @free_t
    def free(ptr, size, device, stream):
        live.pop(ptr, None)

    _install_naive_allocator.keep = (alloc, free, pool, live)  # type: ignore[attr-defined]
    raw = torch._C._cuda_customAllocator(ctypes.cast(alloc, ctypes.c_void_p).value,
                                         ctypes.cast(free, ctypes.c_void_p).value)
    torch.cuda.memory.change_current_allocator(torch.cuda.memory._CUDAAllocator(raw))


#: um_lab variants that leave out one piece each (``--modes um_lab+no_timer ...``), with the
#: effect on the step predicted before measuring (ms per step, MLP / ResNet-50 bs 128).
VARIANTS: dict[str, tuple[str, str]] = {
    "no_timer": ("the step's CUDA-event timer (record + synchronize) replaced by a wall clock",
                 "-0.02 / -0.02 ms: one event pair and a sync the loop does anyway"),
    "loss_item": ("the loss read with float(loss) after the step's synchronisation (the session's earlier timer) "
                  "instead of a pinned copy queued before the end event",
                  "+0.05 / +0.6 ms: with that timer um_lab's wall minus GPU span was 0.15 / 0.65 ms above native's"),
    "no_record": ("the StepRecord's live bytes per type (a locked copy in the C shim) read once, not per step",
                  "-0.01 / -0.01 ms"),
    "no_gradcheck": ("the per-step scan for parameters whose .grad is None skipped",
                     "-0.005 / -0.03 ms: a Python loop over 16 / 161 parameters"),
    "no_prefetch": ("the policy's prefetch calls at phase boundaries skipped (none for um-default)",
                    "0 / 0 ms: um-default issues no prefetch"),
    "caller": ("backward on the calling thread (no autograd hook and engine callback to route it); the "
               "session's default, so a no-op", "-0.02 / -0.02 ms against backward on autograd's device thread"),
    "worker": ("(added, not left out) backward on autograd's device thread, routed by a hook on the loss and an "
               "engine callback (the session's earlier default)",
               "+0.15 ms on the MLP: its kernel gaps put +62-66 and +32-34 us at backward's start"),
    "one_pool": ("every step-time allocation routed into the activation pool (params, grads, optimizer "
                 "state stay in theirs)", "0 / 0 ms: pool lookups are per segment, not per allocation"),
    "no_routing": ("no routing during the step: temporaries from torch's native caching allocator, "
                   "parameters, gradients and optimizer state still managed",
                   "-0.4 / -1.5 ms if the begin/end/release calls or managed activations are the cost"),
    "native_persistent": ("parameters, gradients and optimizer state (and the optimizer's temporaries) in torch's "
                          "own allocator: their routes are no-ops from before place(); activations and input "
                          "still managed", "-0.4 / -0.8 ms if the persistent tensors' managed placement is the cost "
                          "(the MLP's gap measured as GPU time, and it survives no_routing)"),
    "no_staging": ("the batch copied pageable -> input pool directly (synchronous), not through the pinned buffer",
                   "+0.6 / +5 ms: staging variants measured on the MLP (3 repeats): pinned buffer "
                   "9.75/9.40/9.95 ms vs direct 10.43/9.76/10.51 ms; a device buffer then a copy, 10.70/10.26/10.99"),
}
#: Variants applied before the model is placed (the others after attach).
BEFORE_PLACE = frozenset({"native_persistent"})
#: Variants --alternate cannot apply to one placed model moved between blocks: before placing; a session
#: option other than the backward thread (passed to each block's session); or one that stops close() from
#: moving the model back (no_gradcheck).
NOT_ALTERNATING = BEFORE_PLACE | {"no_gradcheck"}


class _WallTimer:
    """Stand-in for the session's CUDA-event timer (variant ``no_timer``)."""

    def __init__(self, device: object) -> None:
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, loss: object) -> tuple[float, float]:
        import torch

        assert isinstance(loss, torch.Tensor)
        return (time.perf_counter() - self._t0) * 1e3, float(loss.detach())


class _ItemReadTimer:
    """The session's earlier timer (variant ``loss_item``): the loss is read with
    ``float(loss)`` after the end event's synchronisation, a second device-to-host round trip."""

    def __init__(self, device: object) -> None:
        import torch

        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self, loss: object) -> tuple[float, float]:
        import torch

        assert isinstance(loss, torch.Tensor)
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)), float(loss.detach())


class _StepEnd:
    """The session timer's end event of the last step: recorded after the optimizer's last kernel and
    before the session synchronises and builds its record, so a GPU span ending there holds the same
    work as the native loop's (host work after the sync is in the wall time only)."""

    event: object = None
    host_stopped: float | None = None  # perf_counter when the timer's stop() returned: the host tail follows


def _exposed(base: type) -> type:
    """``base`` (a step timer class) whose ``stop`` leaves its end event and return time in :class:`_StepEnd`."""

    class Exposed(base):  # type: ignore[misc, valid-type]
        def stop(self, loss: object) -> tuple[float, float]:
            out = super().stop(loss)
            _StepEnd.event = getattr(self, "_end", None)
            _StepEnd.host_stopped = time.perf_counter()
            return out

    return Exposed


def expose_step_end() -> None:
    """Make the session's step timer leave its end event in :class:`_StepEnd`."""
    from um_lab.cuda import session as session_module

    session_module._StepTimer = _exposed(session_module._StepTimer)  # type: ignore[misc]


def backward_thread_of(variants: list[str]) -> str:
    """The session's ``backward_thread`` for these variants: ``worker`` asks for autograd's device thread."""
    return "worker" if "worker" in variants else "caller"


def apply_variants(lab: object, variants: list[str]) -> None:
    """Leave out the pieces named by ``variants`` (see :data:`VARIANTS`) on an open, attached session."""
    import contextlib

    from um_lab.cuda import session as session_module
    from um_lab.types import DataType

    pools = lab._pools  # type: ignore[attr-defined]
    for v in variants:
        if v == "no_timer":
            session_module._StepTimer = _exposed(_WallTimer)  # type: ignore[misc]
        elif v == "loss_item":
            session_module._StepTimer = _exposed(_ItemReadTimer)  # type: ignore[misc]
        elif v == "no_record":
            frozen = pools.source.live_bytes()
            pools.source.live_bytes = lambda frozen=frozen: dict(frozen)
        elif v == "no_gradcheck":
            lab._modules = []  # type: ignore[attr-defined]
        elif v == "no_prefetch":
            lab._prefetch_phase = lambda phase: None  # type: ignore[attr-defined]
            lab._prefetch_to_cpu_after_use = lambda: None  # type: ignore[attr-defined]
        elif v == "one_pool":
            act = pools.pool_id(DataType.ACT)
            pools.pool_id = lambda data_type, act=act: act
        elif v == "no_routing":
            pools.route = lambda data_type: contextlib.nullcontext()
            pools.route_backward = lambda data_type, root: contextlib.nullcontext()
        elif v == "native_persistent":
            persistent = (DataType.PARAM, DataType.GRAD, DataType.OPTIM)
            route = pools.route
            pools.route = lambda data_type, route=route, persistent=persistent: (
                contextlib.nullcontext() if data_type in persistent else route(data_type))
        elif v == "no_staging":
            lab.stage_inputs = False  # type: ignore[attr-defined]
        elif v not in ("caller", "worker"):
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")


def build_bench_case(model_name: str) -> tuple[Any, Any, Any]:
    """The benchmark's case for ``model_name`` at its size, its model (seed 0) and its first batch (CPU)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from um_lab.models import get_model

    case = get_model(model_name, **MODELS[model_name])
    torch.manual_seed(0)
    return case, case.build_model(), case.batch(0)


def _um_lab_block(lab: Any, case: Any, model: Any, opt: Any, batch_cpu: tuple, steps: int, warmup: int,
                  fixed_batch: bool) -> tuple[list[float], list[float], list[float], float]:
    """``warmup + steps`` training steps through an open, attached session: wall times (s) and GPU spans (ms)
    of the timed steps, host tails (s) and the last loss."""
    import torch

    times: list[float] = []
    gpu_times: list[float] = []
    tails: list[float] = []  # host time from the step timer's return to the step's (record, listeners)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + steps)]
    loss_value = float("nan")
    fixed = lab.inputs(*batch_cpu) if fixed_batch else None
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events[i][0].record()
        batch = fixed if fixed_batch else lab.inputs(*batch_cpu)
        batch = batch if isinstance(batch, tuple) else (batch,)
        _StepEnd.event, _StepEnd.host_stopped = None, None
        rec = lab.step(lambda batch=batch: case.loss_fn(model, *batch), opt)
        if _StepEnd.host_stopped is not None:
            tails.append(time.perf_counter() - _StepEnd.host_stopped)
        events[i][1].record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            end = _StepEnd.event if _StepEnd.event is not None else events[i][1]
            gpu_times.append(events[i][0].elapsed_time(end))
        loss_value = rec.loss
        del batch
    return times, gpu_times, tails, loss_value


def _native_block(case: Any, model: Any, opt: Any, batch_cpu: tuple, steps: int, warmup: int,
                  fixed_batch: bool) -> tuple[list[float], list[float], float]:
    """The same loop in plain PyTorch (model and optimizer in ordinary CUDA memory)."""
    import torch

    times: list[float] = []
    gpu_times: list[float] = []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + steps)]
    loss_value = float("nan")
    fixed = tuple(t.cuda() for t in batch_cpu)
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events[i][0].record()
        batch = fixed if fixed_batch else tuple(t.cuda() for t in batch_cpu)
        loss = case.loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        events[i][1].record()
        loss_value = float(loss)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            gpu_times.append(events[i][0].elapsed_time(events[i][1]))
    return times, gpu_times, loss_value


def _native_setup(case: Any, model: Any) -> tuple[Any, Any]:
    import torch

    model = model.cuda()
    opt = case.make_optimizer(list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, opt


def worker(mode: str, model_name: str, steps: int, warmup: int, fixed_batch: bool = False) -> dict:
    """Run one (mode, model) in this process; returns median step time (wall, and the GPU span by CUDA
    events from before the batch copy to after the optimizer's last kernel) and the last loss."""
    if mode == "naive":
        _install_naive_allocator()
    case, model, batch_cpu = build_bench_case(model_name)
    tails: list[float] = []
    if mode.startswith("um_lab"):
        from um_lab import experimental
        from um_lab.cuda.session import Session

        base, *variants = mode.split("+")
        backward_thread = backward_thread_of(variants)
        policy = base.split("@", 1)[1] if "@" in base else "um-default"  # e.g. um_lab@gpu-first
        expose_step_end()
        with experimental.options(backward_thread=backward_thread), \
                Session(policy, evacuate_on_close=False) as lab:
            apply_variants(lab, [v for v in variants if v in BEFORE_PLACE])
            model = lab.place(model)
            opt = lab.attach(model, case.make_optimizer(list(model.parameters())))
            apply_variants(lab, [v for v in variants if v not in BEFORE_PLACE])  # no_timer: span ends below
            times, gpu_times, tails, loss_value = _um_lab_block(lab, case, model, opt, batch_cpu, steps, warmup,
                                                                fixed_batch)
            stats = lab.stats()
            extra = {"segments": stats["segments"], "managed_GiB": round(stats["live_total"] / 2**30, 2),
                     "cap_GiB": round(lab.cap_bytes / 2**30, 1)}
            del model, opt
    else:
        model, opt = _native_setup(case, model)
        times, gpu_times, loss_value = _native_block(case, model, opt, batch_cpu, steps, warmup, fixed_batch)
        extra = {}
    return {"mode": mode, "model": model_name, "median_ms": statistics.median(times) * 1e3,
            "median_gpu_ms": statistics.median(gpu_times), "loss": loss_value,
            "median_host_tail_ms": statistics.median(tails[warmup:]) * 1e3 if tails else None, **extra}


def alternating_worker(model_name: str, blocks: int, steps: int, warmup: int, fixed_batch: bool = False,
                       um_lab_mode: str = "um_lab") -> dict:
    """Native and um_lab (um-default) blocks of ``warmup + steps`` steps alternating in this one process on
    one model and optimizer (order native, um_lab, then um_lab, native, ...): each um_lab block opens a
    session, places and attaches them, and closes it, which moves them back to ordinary CUDA memory. Pairs
    of adjacent blocks share the process, its GPU clocks and its host, so their ratio is free of the
    process-to-process spread. ``um_lab_mode`` ``um_lab+VARIANT[+...]`` applies variants (not those that
    act before placing) to each um_lab block. Returns each block's median wall and GPU ms, and each pair's
    ratios."""
    from um_lab import experimental
    from um_lab.cuda.session import Session

    case, model, batch_cpu = build_bench_case(model_name)
    model, opt = _native_setup(case, model)
    expose_step_end()
    per_mode: dict[str, list[dict[str, float]]] = {"native": [], "um_lab": []}
    for block in range(blocks):
        for mode in (("native", "um_lab") if block % 2 == 0 else ("um_lab", "native")):
            if mode == "native":
                times, gpu_times, _ = _native_block(case, model, opt, batch_cpu, steps, warmup, fixed_batch)
            else:
                with warnings.catch_warnings():  # a model left in managed memory at close must stop the run
                    warnings.simplefilter("error", RuntimeWarning)
                    thread = backward_thread_of(um_lab_mode.split("+")[1:])
                    with experimental.options(backward_thread=thread), \
                            Session("um-default") as lab:  # evacuate_on_close: model back
                        lab.place(model)
                        lab.attach(model, opt)
                        apply_variants(lab, um_lab_mode.split("+")[1:])
                        times, gpu_times, _, _ = _um_lab_block(lab, case, model, opt, batch_cpu, steps, warmup,
                                                               fixed_batch)
            per_mode[mode].append({"median_ms": statistics.median(times) * 1e3,
                                   "median_gpu_ms": statistics.median(gpu_times)})
    pairs = [{"wall": u["median_ms"] / n["median_ms"], "gpu": u["median_gpu_ms"] / n["median_gpu_ms"]}
             for n, u in zip(per_mode["native"], per_mode["um_lab"], strict=True)]
    return {"model": model_name, "um_lab_mode": um_lab_mode, "blocks": per_mode, "pair_ratios": pairs}


def _gpu_local_cpus(count: int = 2) -> set[int]:
    """The first ``count`` CPUs of GPU 0's NUMA affinity (NVML) that this process may run on."""
    import pynvml

    pynvml.nvmlInit()
    try:
        words = pynvml.nvmlDeviceGetCpuAffinity(pynvml.nvmlDeviceGetHandleByIndex(0), 16)
    finally:
        pynvml.nvmlShutdown()
    local = {64 * i + b for i, word in enumerate(words) for b in range(64) if word >> b & 1}
    usable = sorted(local & os.sched_getaffinity(0)) or sorted(os.sched_getaffinity(0))
    return set(usable[:count])


def _cpu_list(text: str) -> set[int]:
    """``2,3`` -> {2, 3} (each CPU must be one this process may run on); ``auto``: two CPUs near GPU 0."""
    if text == "auto":
        return _gpu_local_cpus()
    try:
        cpus = {int(c) for c in text.split(",") if c.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of CPU numbers: {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(cpus)} are not all in this process's set {sorted(allowed)}")
    return cpus


def versions() -> dict:
    """Library and device versions, read in a child process so this one never touches CUDA."""
    code = (
        "import json,sys,torch,cupy;from cuda import bindings;"
        "print(json.dumps({'python':sys.version.split()[0],'torch':torch.__version__,"
        "'cuda':torch.version.cuda,'cupy':cupy.__version__,'cuda_bindings':bindings.__version__,"
        "'device':torch.cuda.get_device_name(0)}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="result JSON (default bench/results/allocator_overhead.json)")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        help="native, um_lab, naive, um_lab@POLICY (a preset name), or "
                             "um_lab+VARIANT[+VARIANT] (one piece left out: " + ", ".join(VARIANTS) + ")")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per mode, interleaved; the row reports the median of their medians")
    parser.add_argument("--fixed-batch", action="store_true",
                        help="copy the batch to the GPU once (isolates the per-step input copy)")
    parser.add_argument("--cpus", type=_cpu_list, default=None, metavar="LIST",
                        help="pin every worker process to these CPUs (e.g. 2,3; auto: two CPUs local to GPU 0): "
                             "host-bound steps then run on the same cores in every mode and repeat")
    parser.add_argument("--alternate", type=int, default=0, metavar="BLOCKS",
                        help="native and um_lab blocks alternating inside each process (BLOCKS pairs of "
                             "--warmup + --steps steps; --repeats processes): a ratio free of the spread "
                             "between processes")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-alternate", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--worker-alternate-mode", default="um_lab", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.alternate < 0:
        parser.error("--alternate must be >= 0 (0: one process per mode)")
    if args.alternate:
        modes = ["native", "um_lab"] if tuple(args.modes) == MODES else list(args.modes)
        if len(modes) != 2 or modes[0] != "native" or modes[1].split("+")[0] != "um_lab":
            parser.error("--alternate compares two modes: --modes native um_lab[+VARIANT...]")
        if NOT_ALTERNATING & set(modes[1].split("+")[1:]):
            parser.error("--alternate moves one placed model between blocks: "
                         f"{', '.join(sorted(NOT_ALTERNATING))} cannot apply")
        args.modes = modes
    unknown = sorted({v for m in args.modes for v in m.split("+")[1:]} - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.worker:
        if args.cpus:
            os.sched_setaffinity(0, args.cpus)
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps, args.warmup, args.fixed_batch)), flush=True)
        return
    if args.worker_alternate:
        if args.cpus:
            os.sched_setaffinity(0, args.cpus)
        print(json.dumps(alternating_worker(args.worker_alternate, args.alternate, args.steps, args.warmup,
                                            args.fixed_batch, args.worker_alternate_mode)), flush=True)
        return
    info = versions()
    if args.alternate:
        _run_alternating(args, info)
        return
    rows = []
    for model_name in args.models:
        runs: dict[str, list[dict]] = {m: [] for m in args.modes}
        for _ in range(args.repeats):  # modes interleaved, so drift on the machine hits each alike
            for mode in args.modes:
                cmd = [sys.executable, __file__, "--worker", mode, model_name, "--steps", str(args.steps),
                       "--warmup", str(args.warmup)] + (["--fixed-batch"] if args.fixed_batch else [])
                cmd += ["--cpus", ",".join(map(str, sorted(args.cpus)))] if args.cpus else []
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{mode} {model_name} failed:\n{out.stderr[-3000:]}")
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"  {model_name:12s} {mode:22s} {runs[mode][-1]['median_ms']:9.2f} ms "
                      f"(GPU {runs[mode][-1]['median_gpu_ms']:9.2f} ms)", flush=True)
        ms = {m: statistics.median(r["median_ms"] for r in rs) for m, rs in runs.items()}
        gpu = {m: statistics.median(r["median_gpu_ms"] for r in rs) for m, rs in runs.items()}
        row: dict = {"model": model_name, **{f"{m}_ms": round(v, 3) for m, v in ms.items()},
                     **{f"{m}_gpu_ms": round(v, 3) for m, v in gpu.items()}}
        for m in ms:
            if m != "native" and "native" in ms:
                row[f"{m}_over_native"] = round(ms[m] / ms["native"], 4)
                row[f"{m}_gpu_over_native"] = round(gpu[m] / gpu["native"], 4)
        for m, rs in runs.items():
            tails = [r["median_host_tail_ms"] for r in rs if r.get("median_host_tail_ms") is not None]
            if tails:
                row[f"{m}_host_tail_ms"] = round(statistics.median(tails), 4)
        if args.repeats > 1:
            row["runs_ms"] = {m: [round(r["median_ms"], 3) for r in rs] for m, rs in runs.items()}
            row["runs_gpu_ms"] = {m: [round(r["median_gpu_ms"], 3) for r in rs] for m, rs in runs.items()}
        if "um_lab" in runs and "native" in runs:
            row["losses_equal"] = runs["um_lab"][0]["loss"] == runs["native"][0]["loss"]
            row["um_lab_segments"] = runs["um_lab"][0].get("segments")
            row["um_lab_managed_GiB"] = runs["um_lab"][0].get("managed_GiB")
        rows.append(row)
        _write_report(args, info, rows)  # after every model: a timeout keeps what was measured
    print(f"\n{'model':12s} " + " ".join(f"{m + ' ms':>10s}" for m in args.modes) + f" {'um_lab/native':>14s}")
    for r in rows:
        ratio = r.get("um_lab_over_native")
        print(f"{r['model']:12s} " + " ".join(f"{r[m + '_ms']:10.2f}" for m in args.modes)
              + f" {'-' if ratio is None else f'{ratio:.4f}':>14s}")
    print(f"wrote {args.out}: {len(rows)} models")


def alternating_row(model_name: str, runs: list[dict]) -> dict:
    """One table row from :func:`alternating_worker` results (one per process): the block medians' medians,
    ``um_lab_over_native`` = the median of every adjacent pair's ratio, and the per-process medians."""
    native = [b["median_ms"] for r in runs for b in r["blocks"]["native"]]
    um_lab = [b["median_ms"] for r in runs for b in r["blocks"]["um_lab"]]
    wall = [p["wall"] for r in runs for p in r["pair_ratios"]]
    gpu = [p["gpu"] for r in runs for p in r["pair_ratios"]]
    return {"model": model_name, "um_lab_mode": runs[0].get("um_lab_mode", "um_lab"),
            "native_ms": round(statistics.median(native), 3),
            "um_lab_ms": round(statistics.median(um_lab), 3),
            "um_lab_over_native": round(statistics.median(wall), 4),
            "um_lab_gpu_over_native": round(statistics.median(gpu), 4),
            "pair_ratio_range": [round(min(wall), 4), round(max(wall), 4)], "pairs": len(wall),
            "per_process_over_native": [round(statistics.median(p["wall"] for p in r["pair_ratios"]), 4)
                                        for r in runs]}


def _run_alternating(args: argparse.Namespace, info: dict) -> None:
    rows = []
    for model_name in args.models:
        runs = []
        for _ in range(args.repeats):
            cmd = [sys.executable, __file__, "--worker-alternate", model_name, "--alternate", str(args.alternate),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--worker-alternate-mode", args.modes[1]]
            cmd += ["--fixed-batch"] if args.fixed_batch else []
            cmd += ["--cpus", ",".join(map(str, sorted(args.cpus)))] if args.cpus else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"alternating {model_name} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            ratios = [round(p["wall"], 4) for p in runs[-1]["pair_ratios"]]
            print(f"  {model_name:12s} process {len(runs)}: um_lab / native per pair {ratios}", flush=True)
        rows.append(alternating_row(model_name, runs))
        report = _write_report(args, info, rows)
        report["method"] = (f"native and {args.modes[1]} blocks alternating in each process ({args.alternate} pairs, "
                            "order native-um_lab then um_lab-native), one model and optimizer moved between them")
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['model']:12s} native {r['native_ms']:9.2f} ms  um_lab {r['um_lab_ms']:9.2f} ms  um_lab/native "
              f"{r['um_lab_over_native']:.4f} (pairs {r['pair_ratio_range'][0]:.4f}-{r['pair_ratio_range'][1]:.4f})")
    print(f"wrote {args.out}: {len(rows)} models")


def _write_report(args: argparse.Namespace, info: dict, rows: list[dict]) -> dict:
    report = {
        "device": info["device"],
        "versions": {k: v for k, v in info.items() if k != "device"},
        "date": datetime.date.today().isoformat(),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": "copied once" if args.fixed_batch else "copied to the GPU every step (pageable source)",
        "repeats": args.repeats,
        "cpus": sorted(args.cpus) if args.cpus else "unpinned",
        "rows": rows,
    }
    variants = sorted({v for m in args.modes for v in m.split("+")[1:]})
    if variants:
        report["variants"] = {v: {"left_out": VARIANTS[v][0], "predicted": VARIANTS[v][1]} for v in variants}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
