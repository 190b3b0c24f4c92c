"""The budget scheduler's peers: what a user would reach for to fit a model in less GPU memory, each in a
process of its own, on the same model and batch as ``bench/budget.py`` (its ``build_case``).

    python bench/peers.py --model gpt2-large --peer checkpoint --precision bf16 --steps 6   # one JSON line

PEER (every one trains natively, through PyTorch's caching allocator, not managed memory):

* ``fits``: everything on the GPU, nothing recomputed (the everything-fits step).
* ``checkpoint``: activation checkpointing of every layer (a Hugging Face model's own switch,
  non-reentrant; else ``um_lab.training.apply_recompute``).
* ``checkpoint-offload-optimizer``: checkpointing plus torchao's ``CPUOffloadOptimizer`` (the model's
  AdamW, fused, on the CPU; gradients offloaded).
* ``fsdp2-offload``: FSDP2 with ``CPUOffloadPolicy`` on one GPU (world size 1): every layer (an element of
  an ``nn.ModuleList`` or ``nn.Sequential`` that holds parameters) a unit of its own, then the root;
  parameters, gradients and optimizer state in pinned host memory, the optimizer stepping on the CPU.
* ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved activation in pinned
  host memory.

``--precision bf16`` / ``fp16``: autocast with fp32 master weights (fp16 with ``torch.amp.GradScaler``).
Reports the median step (the steps after two warm-up steps, synchronised, batch copied every step),
``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` over the measured steps. Without CUDA a
peer runs on the CPU with nothing offloaded or pinned: a check of the code path, not a number to report.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from um_lab.training import apply_recompute, autocast_loss  # noqa: E402

WARMUP = 2
PEERS = ("fits", "checkpoint", "checkpoint-offload-optimizer", "fsdp2-offload", "save-on-cpu")


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's layers, deepest first: elements of ModuleLists and Sequentials that hold parameters
    (nested FSDP units must be sharded before the units that contain them)."""
    layers: list[tuple[int, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            depth = name.count(".") + 1 if name else 0
            layers += [(depth + 1, child) for child in module if any(True for _ in child.parameters())]
    return [m for _, m in sorted(layers, key=lambda pair: -pair[0])]


def _budget_bench() -> Any:
    """bench/budget.py as a module (its ``build_case`` sizes the models), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_budget", ROOT / "bench" / "budget.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_budget", module)  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _one_rank_group(cuda: bool) -> Iterator[None]:
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def checkpoint_every_layer(model: nn.Module, name: str) -> str:
    """Checkpoint every layer the way a user would: a Hugging Face model's own switch (non-reentrant), else
    um_lab's wrapping of each repeated layer. Returns which."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False
        return "gradient_checkpointing_enable (non-reentrant)"
    apply_recompute(model, "every-layer", name)
    return "torch.utils.checkpoint per layer (non-reentrant)"


def prepare(peer: str, case: Any, device: torch.device, mesh: Any = None) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The peer's model (on ``device`` unless FSDP2 keeps it on the host), optimizer and what it chose."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = case.build_model()
    info: dict[str, Any] = {}
    if peer in ("checkpoint", "checkpoint-offload-optimizer"):
        info["checkpointing"] = checkpoint_every_layer(model, case.name)
    if peer == "fsdp2-offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        offload = CPUOffloadPolicy() if cuda else OffloadPolicy()
        units = layer_modules(model)
        for layer in units:
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        info.update(units=len(units) + 1, offload="CPUOffloadPolicy" if cuda else "none")
        return model, case.make_optimizer(list(model.parameters())), info
    model = model.to(device)
    optimizer = case.make_optimizer(list(model.parameters()))
    if peer == "checkpoint-offload-optimizer":
        if not cuda:
            info["optimizer"] = "not offloaded (no CUDA)"
            return model, optimizer, info
        from torchao.optim import CPUOffloadOptimizer

        group, kind = optimizer.param_groups[0], type(optimizer)
        settings = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
        optimizer = CPUOffloadOptimizer(model.parameters(), kind, offload_gradients=True, fused=True, **settings)
        info["optimizer"] = f"torchao CPUOffloadOptimizer({kind.__name__}, fused, gradients offloaded)"
    return model, optimizer, info


def run(name: str, peer: str, steps: int, precision: str = "fp32") -> dict[str, Any]:
    """Train ``name`` (bench/budget.py's size) as ``peer`` does for ``WARMUP + steps`` steps; one JSON-ready
    row."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; peers: {', '.join(PEERS)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    case = _budget_bench().build_case(name)
    group = _one_rank_group(cuda) if peer == "fsdp2-offload" else contextlib.nullcontext()
    with group:
        mesh = None
        if peer == "fsdp2-offload":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (1,))
        model, optimizer, info = prepare(peer, case, device, mesh)
        loss_fn: Callable[..., torch.Tensor] = autocast_loss(case.loss_fn, precision)
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        saving = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)) if peer == "save-on-cpu" \
            else contextlib.nullcontext
        batch_cpu = case.batch(0)
        times: list[float] = []
        loss = torch.zeros(())
        for i in range(WARMUP + steps):
            if cuda and i == WARMUP:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            batch = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch_cpu)
            with saving():
                loss = loss_fn(model, *batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
    return {"model": name, "peer": peer, "precision": precision,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (code path check)", **info,
            "step_ms": statistics.median(times), "step_ms_all": times,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "loss": float(loss.detach())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a bench/budget.py model (gpt2-large, resnet50, mlp-small, ...)")
    ap.add_argument("--peer", choices=PEERS, default="fits")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.model, args.peer, args.steps, args.precision)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
