"""Model zoo with synthetic batches (no downloads): what a run trains.

A :class:`ModelCase` bundles a model factory, a batch factory and a loss, so every backend (real or
simulated) and every benchmark trains the same thing. torchvision and transformers are imported
lazily, only for the models that need them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, ...]


@dataclasses.dataclass
class ModelCase:
    """A trainable workload: ``loss_fn(model, *batch)`` returns a scalar loss."""

    name: str
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]  #: CPU tensors; the backend moves them
    loss_fn: Callable[..., torch.Tensor]
    make_optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] = dataclasses.field(
        default=lambda params: torch.optim.AdamW(params, lr=1e-5)
    )
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def batch(self, seed: int = 0) -> Batch:
        """A deterministic synthetic batch on the CPU."""
        return self.make_batch(torch.Generator().manual_seed(seed))


def _classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def mlp(width: int = 4096, depth: int = 8, batch_size: int = 256, classes: int = 10) -> ModelCase:
    """A GELU MLP: ``depth`` square layers of ``width`` and a classifier."""

    def build() -> nn.Module:
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        return nn.Sequential(*layers, nn.Linear(width, classes))

    def batch(g: torch.Generator) -> Batch:
        return torch.randn(batch_size, width, generator=g), torch.randint(0, classes, (batch_size,), generator=g)

    return ModelCase("mlp", build, batch, _classification_loss,
                     info={"width": width, "depth": depth, "batch_size": batch_size})


def resnet(depth: int = 50, batch_size: int = 128, image_size: int = 224, classes: int = 1000) -> ModelCase:
    """torchvision ResNet-18/50/152 from its constructor (random weights)."""
    if depth not in (18, 34, 50, 101, 152):
        raise ValueError(f"ResNet depth must be one of 18, 34, 50, 101, 152; got {depth}")

    def build() -> nn.Module:
        import torchvision  # lazy: only this model needs it

        return getattr(torchvision.models, f"resnet{depth}")(num_classes=classes)

    def batch(g: torch.Generator) -> Batch:
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        return x, torch.randint(0, classes, (batch_size,), generator=g)

    return ModelCase(f"resnet{depth}", build, batch, _classification_loss,
                     info={"depth": depth, "batch_size": batch_size, "image_size": image_size})


GPT2_SIZES = {
    "small": dict(n_layer=12, n_embd=768, n_head=12),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "large": dict(n_layer=36, n_embd=1280, n_head=20),
    "xl": dict(n_layer=48, n_embd=1600, n_head=25),
}


def gpt2(size: str = "medium", batch_size: int = 8, seq_len: int = 1024) -> ModelCase:
    """Hugging Face GPT-2 built from a config (no weights downloaded), language-model loss."""
    if size not in GPT2_SIZES:
        raise ValueError(f"GPT-2 size must be one of {', '.join(GPT2_SIZES)}; got {size!r}")
    vocab = 50257

    def build() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel  # lazy

        cfg = GPT2Config(vocab_size=vocab, n_positions=max(1024, seq_len), **GPT2_SIZES[size])
        return GPT2LMHeadModel(cfg)

    def batch(g: torch.Generator) -> Batch:
        return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)

    return ModelCase(f"gpt2-{size}", build, batch, _lm_loss,
                     info={"size": size, "batch_size": batch_size, "seq_len": seq_len})


ZOO: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp,
    "resnet18": lambda **kw: resnet(18, **kw),
    "resnet50": lambda **kw: resnet(50, **kw),
    "resnet152": lambda **kw: resnet(152, **kw),
    "gpt2-small": lambda **kw: gpt2("small", **kw),
    "gpt2-medium": lambda **kw: gpt2("medium", **kw),
    "gpt2-large": lambda **kw: gpt2("large", **kw),
    "gpt2-xl": lambda **kw: gpt2("xl", **kw),
}


def get_model(name: str, **kwargs: Any) -> ModelCase:
    """The zoo entry ``name`` with size knobs; unknown names list the valid ones."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(ZOO)}")
    return ZOO[name](**kwargs)
