"""What a run trains: :class:`ModelCase` (a model factory, a synthetic batch factory and a loss) and the
factories that build one: the built-in families (a GELU MLP; torchvision ResNet and ViT; transformers GPT-2 and
BERT, built from configs with no downloads) and :func:`custom` for your own model. torchvision and
transformers are imported lazily, only by the models that need them. :mod:`um_lab.models` names these in the zoo.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from um_lab.errors import MissingDependencyError, ModelConfigError, ModelTypeError
from um_lab.knobs import check_overrides, check_positive, check_transformer, knob_error

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
    logits = model(x)
    _check_labels_once(model, logits, y)
    return nn.functional.cross_entropy(logits, y)


_LABELS_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  #: models whose labels were checked


def _check_labels_once(model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse, on a model's first step, class labels its outputs cannot take (a model built without its head, or
    with fewer classes than the batch uses): on a GPU cross entropy would end the CUDA context with a device-side
    assert. One read of the labels per model; probabilities as targets, fake and meta tensors are not checked."""
    from torch._subclasses.fake_tensor import is_fake

    if (model in _LABELS_CHECKED or y.is_floating_point() or is_fake(y)
            or y.device.type == "meta" or logits.dim() == 0):
        return
    classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    bad = ((y < 0) & (y != -100)) | (y >= classes)  # -100: cross entropy's ignore_index
    if bool(bad.any()):
        lo, hi = int(y.min()), int(y.max())
        raise ModelConfigError(f"the batch's class labels run from {lo} to {hi}, but the model gives {classes} "
                               f"classes (outputs of shape {tuple(logits.shape)}): build it with as many classes "
                               "as the labels use, or pass a loss_fn", "make_batch")
    _LABELS_CHECKED.add(model)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def install_hint(module: str) -> str:
    """The command that installs ``module`` and keeps this torch: on a CPU build (``torch.version.cuda`` is
    None) torchvision from PyTorch's CPU index (PyPI's would replace the CPU torch with a CUDA build) and
    transformers alone; on a CUDA build, the ``models`` extra."""
    if torch.version.cuda is not None:
        return "pip install 'um_lab[models]'"
    if module == "torchvision":
        return "pip install torchvision --index-url https://download.pytorch.org/whl/cpu"
    return f"pip install {module}"


def _require(module: str, model_name: str) -> Any:
    """Import an optional dependency, or say which model needs it and how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(model_name, module, str(e)) from e


def _missing(model_name: str, module: str, why: str) -> MissingDependencyError:
    return MissingDependencyError(
        model_name, module, f"model {model_name!r} needs {module}, which is not importable here ({why}). "
        f"Install it with `{install_hint(module)}` (a {module} build that matches this torch).")


# --------------------------------------------------------------------------------------------- MLP


def mlp(width: int = 4096, depth: int = 8, batch_size: int = 256, classes: int = 10) -> ModelCase:
    """A GELU MLP: ``depth`` square layers of ``width`` and a classifier."""
    check_positive(width=width, depth=depth, batch_size=batch_size, classes=classes)

    def build() -> nn.Module:
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        return nn.Sequential(*layers, nn.Linear(width, classes))

    def batch(g: torch.Generator) -> Batch:
        x = torch.randn(batch_size, width, generator=g)
        return x, torch.randint(0, classes, (batch_size,), generator=g)

    return ModelCase("mlp", build, batch, _classification_loss,
                     info={"width": width, "depth": depth, "batch_size": batch_size, "classes": classes})


# ------------------------------------------------------------------------------------ torchvision


def _image_batch(batch_size: int, image_size: int, classes: int) -> Callable[[torch.Generator], Batch]:
    def batch(g: torch.Generator) -> Batch:
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        return x, torch.randint(0, classes, (batch_size,), generator=g)

    return batch


def resnet(depth: int = 50, batch_size: int = 128, image_size: int = 224, classes: int = 1000) -> ModelCase:
    """torchvision ResNet-18/34/50/101/152 from its constructor (random weights)."""
    if depth not in (18, 34, 50, 101, 152):
        raise ModelConfigError(f"ResNet depth must be one of 18, 34, 50, 101, 152; got {depth!r}", "depth")
    check_positive(batch_size=batch_size, image_size=image_size, classes=classes)
    name = f"resnet{depth}"

    def build() -> nn.Module:
        torchvision = _require("torchvision", name)  # lazy: only this model needs it
        return getattr(torchvision.models, name)(num_classes=classes)

    return ModelCase(name, build, _image_batch(batch_size, image_size, classes), _classification_loss,
                     info={"depth": depth, "batch_size": batch_size, "image_size": image_size,
                           "classes": classes})


VIT_SIZES = {
    "b16": dict(patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072),
    "l16": dict(patch_size=16, num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
    "b32": dict(patch_size=32, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072),
    "l32": dict(patch_size=32, num_layers=24, num_heads=16, hidden_dim=1024, mlp_dim=4096),
    "h14": dict(patch_size=14, num_layers=32, num_heads=16, hidden_dim=1280, mlp_dim=5120),
}


def vit(size: str = "b16", batch_size: int = 64, image_size: int = 224, classes: int = 1000,
        **overrides: int) -> ModelCase:
    """torchvision Vision Transformer (ViT-B/16 by default); ``overrides`` change ``patch_size``,
    ``num_layers``, ``num_heads``, ``hidden_dim`` or ``mlp_dim`` (the width knob)."""
    if size not in VIT_SIZES:
        raise ModelConfigError(f"ViT size must be one of {', '.join(VIT_SIZES)}; got {size!r}", "size")
    unknown = sorted(set(overrides) - set(VIT_SIZES[size]))
    if unknown:
        raise ModelConfigError(f"unknown ViT knob(s) {unknown}; valid: {', '.join(VIT_SIZES[size])}",
                               unknown[0])
    config = {**VIT_SIZES[size], **overrides}
    check_positive(batch_size=batch_size, image_size=image_size, classes=classes, **config)
    if image_size % config["patch_size"]:
        raise ModelConfigError(f"image_size {image_size} must be a multiple of patch_size {config['patch_size']}",
                               "image_size")
    name = f"vit-{size}"

    def build() -> nn.Module:
        tv = _require("torchvision", name)
        return tv.models.vision_transformer.VisionTransformer(
            image_size=image_size, num_classes=classes, **config)

    return ModelCase(name, build, _image_batch(batch_size, image_size, classes), _classification_loss,
                     info={"size": size, "batch_size": batch_size, "image_size": image_size,
                           "classes": classes, **config})


# ----------------------------------------------------------------------------------- transformers


GPT2_SIZES = {
    "small": dict(n_layer=12, n_embd=768, n_head=12),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "large": dict(n_layer=36, n_embd=1280, n_head=20),
    "xl": dict(n_layer=48, n_embd=1600, n_head=25),
}


def _with_causal_lm_loss(model: nn.Module) -> nn.Module:
    """Name GPT-2's loss for transformers: ``GPT2LMHeadModel`` matches no ``LOSS_MAPPING`` key, so its
    ``loss_type`` is None and every loss call logs "`loss_type=None` was set in the config but it is
    unrecognized" (a red box in notebooks). It computes the causal-LM loss either way; saying so silences
    that one message and nothing else."""
    if getattr(model, "loss_type", "") is None:  # transformers 5.x reads the model's attribute
        setattr(model, "loss_type", "ForCausalLM")  # noqa: B010 - not a declared nn.Module attribute
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "loss_type", None) is None:  # some versions read the config's
        config.loss_type = "ForCausalLM"
    return model


def _transformer_config(family: str, name: str, sizes: Mapping[str, Mapping[str, Any]], size: str, batch_size: int,
                        seq_len: int, overrides: Mapping[str, Any], config_class: str, vocab: int,
                        positions: str, min_positions: int, shape_keys: tuple[str, str, str]) -> dict[str, Any]:
    """The checked config of Hugging Face model ``name`` built from ``sizes[size]`` and ``overrides``."""
    if size not in sizes:
        raise ModelConfigError(f"{family} size must be one of {', '.join(sizes)}; got {size!r}", "size")
    check_positive(batch_size=batch_size, seq_len=seq_len)
    if overrides:
        overrides = check_overrides(getattr(_require("transformers", name), config_class), overrides, name)
    config = {"vocab_size": vocab, positions: max(min_positions, seq_len), **sizes[size], **overrides}
    check_transformer(config, seq_len, name, *shape_keys, positions)
    return config


def _checked_config(name: str, config_class: str, config: Mapping[str, Any], knobs: Mapping[str, Any]) -> None:
    """Build the library's config object from ``config`` (cheap: no tensors) so that a value it refuses is a
    :class:`ModelConfigError` naming the knob now, before any run folder exists."""
    try:
        getattr(_require("transformers", name), config_class)(**config)
    except Exception as e:  # noqa: BLE001 - the library's own validation errors have no common base
        raise knob_error(name, knobs, e) from None


def _token_batch(vocab: int, batch_size: int, seq_len: int) -> Callable[[torch.Generator], Batch]:
    def batch(g: torch.Generator) -> Batch:
        return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)

    return batch


def gpt2(size: str = "medium", batch_size: int = 8, seq_len: int = 1024, **overrides: Any) -> ModelCase:
    """Hugging Face GPT-2 built from a config (no weights downloaded), language-model loss.

    ``overrides`` are GPT2Config fields (``n_layer``, ``n_embd``, ``n_head``, ``vocab_size``, ...):
    ``gpt2("small", 2, 32, n_layer=2, n_embd=64, n_head=2, vocab_size=1000)`` is a tiny test model.
    """
    vocab = overrides.get("vocab_size", 50257)
    name = f"gpt2-{size}"
    config = _transformer_config("GPT-2", name, GPT2_SIZES, size, batch_size, seq_len, overrides, "GPT2Config",
                                 vocab, "n_positions", 1024, ("n_layer", "n_embd", "n_head"))
    if vocab <= 50256:  # a small test vocabulary: keep the special tokens inside it
        config.setdefault("bos_token_id", vocab - 1)
        config.setdefault("eos_token_id", vocab - 1)
    if overrides:
        _checked_config(name, "GPT2Config", config, overrides)

    def build() -> nn.Module:
        transformers = _require("transformers", name)  # lazy
        return _with_causal_lm_loss(transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)))

    return ModelCase(name, build, _token_batch(vocab, batch_size, seq_len), _lm_loss,
                     info={"size": size, "batch_size": batch_size, "seq_len": seq_len, **config})


BERT_SIZES = {
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}


def bert(size: str = "base", batch_size: int = 16, seq_len: int = 512, **overrides: Any) -> ModelCase:
    """Hugging Face BERT (masked-LM head) from a config, trained on every token of a random batch.

    ``overrides`` are BertConfig fields (``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ...).
    """
    vocab = overrides.get("vocab_size", 30522)
    name = f"bert-{size}"
    config = _transformer_config("BERT", name, BERT_SIZES, size, batch_size, seq_len, overrides, "BertConfig",
                                 vocab, "max_position_embeddings", 512,
                                 ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    if overrides:
        _checked_config(name, "BertConfig", config, overrides)

    def build() -> nn.Module:
        transformers = _require("transformers", name)
        return transformers.BertForMaskedLM(transformers.BertConfig(**config))

    return ModelCase(name, build, _token_batch(vocab, batch_size, seq_len), _lm_loss,
                     info={"size": size, "batch_size": batch_size, "seq_len": seq_len, **config})


# ----------------------------------------------------------------------------------- user models


def custom(
    name: str,
    model: nn.Module | Callable[[], nn.Module],
    make_batch: Callable[[torch.Generator], Batch] | Callable[[], Batch] | Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    make_optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] | None = None,
    info: Mapping[str, Any] | None = None,
) -> ModelCase:
    """Wrap your own model as a :class:`ModelCase`.

    ``model``: an ``nn.Module`` (each run trains a deep copy, so runs stay independent) or a factory. The
    simulator traces either at any size: it builds the model with its large tensors on the meta device and its
    small ones real (a constructor may compute with them), so a factory costs no memory (a module given here
    already holds its own); a step it cannot trace raises :class:`~um_lab.sim.trace.TraceError`, naming the op.
    ``make_batch``: ``f(generator) -> tuple of CPU tensors``, ``f() -> tuple``, or a fixed tuple.
    ``loss_fn(model, *batch) -> scalar``; default: cross entropy of ``model(x)`` against ``y``.
    ``make_optimizer(params)``; default: AdamW(lr=1e-5).
    """
    if not isinstance(name, str):
        raise ModelTypeError(f"custom model name must be a string, got {type(name).__name__} {name!r}"[:200], "name")
    if not name.strip() or not name.isprintable():
        raise ModelConfigError(f"custom model needs a non-empty printable name, got {name!r}"[:200], "name")
    if isinstance(model, nn.Module):
        template = model
        build: Callable[[], nn.Module] = lambda: copy.deepcopy(template)
        build.__um_lab_template__ = template  # type: ignore[attr-defined]  # the trace key reads its shapes
    elif callable(model):
        build = model
    else:
        raise ModelTypeError(f"custom model {name!r}: model must be an nn.Module or a factory returning one, "
                             f"got {type(model).__name__} {model!r}"[:300], "model")
    for arg, value in (("loss_fn", loss_fn), ("make_optimizer", make_optimizer)):
        if value is not None and not callable(value):
            raise ModelTypeError(f"custom model {name!r}: {arg} must be callable or None, got "
                                 f"{type(value).__name__} {value!r}"[:300], arg)
    if info is not None and not isinstance(info, Mapping):
        raise ModelTypeError(f"custom model {name!r}: info must be a mapping or None, got {type(info).__name__}",
                             "info")
    batch_factory = _as_batch_factory(make_batch, name)
    case = ModelCase(name, build, batch_factory, loss_fn or _classification_loss, info=dict(info or {}))
    if make_optimizer is not None:
        case.make_optimizer = make_optimizer
    case.info.setdefault("custom", True)
    return case


def _as_batch_factory(make_batch: Any, name: str = "custom") -> Callable[[torch.Generator], Batch]:
    if isinstance(make_batch, torch.Tensor):
        fixed: Batch = (make_batch,)
        return lambda g: fixed
    if isinstance(make_batch, (tuple, list)):
        if not make_batch or not all(isinstance(t, torch.Tensor) for t in make_batch):
            raise ModelTypeError(f"custom model {name!r}: a fixed batch must be a non-empty tuple of tensors, got "
                                 f"{[type(t).__name__ for t in make_batch]}"[:300], "make_batch")
        fixed = tuple(make_batch)
        return lambda g: fixed
    if not callable(make_batch):
        raise ModelTypeError(f"custom model {name!r}: make_batch must be callable or a tuple of tensors, got "
                             f"{type(make_batch).__name__} {make_batch!r}"[:300], "make_batch")
    try:
        takes_generator = len(inspect.signature(make_batch).parameters) >= 1
    except (TypeError, ValueError):
        takes_generator = True

    def batch(g: torch.Generator) -> Batch:
        out = make_batch(g) if takes_generator else make_batch()
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    return batch
