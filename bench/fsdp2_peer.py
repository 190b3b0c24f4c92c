"""The budget scheduler's peer: PyTorch FSDP2 with ``CPUOffloadPolicy`` on one GPU (world size 1), same model
and batch as ``bench/budget.py`` (its ``build_case``).

    python bench/fsdp2_peer.py --model gpt2-large --steps 6          # prints one JSON line

Every layer (an element of an ``nn.ModuleList`` or ``nn.Sequential`` that holds parameters) is an FSDP unit of
its own, then the root: parameters, gradients and optimizer state live in pinned host memory, the optimizer
steps on the CPU, and the GPU holds a unit's parameters while it runs. Reports the median step time (the steps
after two warm-up steps, synchronised, batch copied every step) and ``torch.cuda.max_memory_allocated()``.
FSDP2 allocates through PyTorch's own allocator, not managed memory. Without CUDA it runs on the CPU with gloo
and no offload: a check of the code path, not a number to report (``bench/budget.py --fsdp2`` runs it on a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

WARMUP = 2


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


def run(name: str, steps: int) -> dict[str, Any]:
    """Train ``name`` (bench/budget.py's size) under FSDP2 for ``WARMUP + steps`` steps; one JSON-ready row."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    cuda = torch.cuda.is_available()
    build_case = _budget_bench().build_case
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        mesh = init_device_mesh(device.type, (1,))
        offload = CPUOffloadPolicy() if cuda else OffloadPolicy()
        case = build_case(name)
        torch.manual_seed(0)
        model = case.build_model()
        units = layer_modules(model)
        for layer in units:
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        optimizer = case.make_optimizer(list(model.parameters()))
        batch_cpu = case.batch(0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        loss = torch.zeros(())
        for i in range(WARMUP + steps):
            t0 = time.perf_counter()
            batch = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch_cpu)
            loss = case.loss_fn(model, *batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
        return {"model": name, "device": torch.cuda.get_device_name(0) if cuda else "cpu (code path check)",
                "units": len(units) + 1, "offload": "CPUOffloadPolicy" if cuda else "none",
                "fsdp2_step_ms": statistics.median(times), "fsdp2_step_ms_all": times,
                "fsdp2_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                "loss": float(loss.detach())}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a bench/budget.py model (gpt2-large, resnet50, mlp-small, ...)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.model, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
