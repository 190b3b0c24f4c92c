"""Model zoo with synthetic batches (no downloads): what a run trains.

A :class:`ModelCase` bundles a model factory, a batch factory and a loss, so every backend (real or
simulated) and every benchmark trains the same thing. torchvision and transformers are imported
lazily, only for the models that need them.

Zoo (``get_model(name, **knobs)``; ``describe_models()`` lists the knobs):

- ``mlp`` (width, depth, batch_size, classes)
- ``resnet18`` / ``resnet34`` / ``resnet50`` / ``resnet101`` / ``resnet152`` and ``vit-b16`` / ``vit-l16`` /
  ``vit-b32`` / ``vit-l32`` / ``vit-h14`` (torchvision; batch_size, image_size, ...)
- ``gpt2-small`` .. ``gpt2-xl`` (transformers; batch_size, seq_len, and any GPT2Config field as an
  override, e.g. ``get_model("gpt2-small", n_layer=2, n_embd=64, n_head=2, vocab_size=1000)``)
- ``bert-base`` / ``bert-large`` (transformers; batch_size, seq_len, BertConfig overrides)

Your own model: ``custom("mine", model_or_factory, make_batch, loss_fn)``; ``register(case_factory)``
puts it in the zoo so runs, comparisons and the CLI can name it. ``check_case(case)`` is the cheap check
before a run: the model built on the meta device, its optimizer refused when ``step()`` needs a closure.

Memory per data type: ``estimate_memory(case)``; a size that oversubscribes a capacity by a chosen
ratio: ``size_for_ratio(name, capacity_bytes, ratio)``; the pre-flight check against a cap:
``check_fits(estimate, cap_bytes)``. These live in :mod:`um_lab.sizing`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from um_lab.errors import MissingDependencyError, ModelConfigError, ModelTypeError, OptimizerNeedsClosure, UmLabError
from um_lab.knobs import check_overrides, check_positive, check_transformer, did_you_mean

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


def gpt2(size: str = "medium", batch_size: int = 8, seq_len: int = 1024, **overrides: Any) -> ModelCase:
    """Hugging Face GPT-2 built from a config (no weights downloaded), language-model loss.

    ``overrides`` are GPT2Config fields (``n_layer``, ``n_embd``, ``n_head``, ``vocab_size``, ...):
    ``gpt2("small", 2, 32, n_layer=2, n_embd=64, n_head=2, vocab_size=1000)`` is a tiny test model.
    """
    if size not in GPT2_SIZES:
        raise ModelConfigError(f"GPT-2 size must be one of {', '.join(GPT2_SIZES)}; got {size!r}", "size")
    check_positive(batch_size=batch_size, seq_len=seq_len)
    name = f"gpt2-{size}"
    if overrides:
        check_overrides(_require("transformers", name).GPT2Config, overrides, name)
    vocab = overrides.get("vocab_size", 50257)
    config = {"vocab_size": vocab, "n_positions": max(1024, seq_len), **GPT2_SIZES[size], **overrides}
    check_transformer(config, seq_len, name, "n_layer", "n_embd", "n_head", "n_positions")
    if vocab <= 50256:  # a small test vocabulary: keep the special tokens inside it
        config.setdefault("bos_token_id", vocab - 1)
        config.setdefault("eos_token_id", vocab - 1)

    def build() -> nn.Module:
        transformers = _require("transformers", name)  # lazy
        return _with_causal_lm_loss(transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)))

    def batch(g: torch.Generator) -> Batch:
        return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)

    return ModelCase(name, build, batch, _lm_loss,
                     info={"size": size, "batch_size": batch_size, "seq_len": seq_len, **config})


BERT_SIZES = {
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}


def bert(size: str = "base", batch_size: int = 16, seq_len: int = 512, **overrides: Any) -> ModelCase:
    """Hugging Face BERT (masked-LM head) from a config, trained on every token of a random batch.

    ``overrides`` are BertConfig fields (``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ...).
    """
    if size not in BERT_SIZES:
        raise ModelConfigError(f"BERT size must be one of {', '.join(BERT_SIZES)}; got {size!r}", "size")
    check_positive(batch_size=batch_size, seq_len=seq_len)
    name = f"bert-{size}"
    if overrides:
        check_overrides(_require("transformers", name).BertConfig, overrides, name)
    vocab = overrides.get("vocab_size", 30522)
    config = {"vocab_size": vocab, "max_position_embeddings": max(512, seq_len), **BERT_SIZES[size],
              **overrides}
    check_transformer(config, seq_len, name, "num_hidden_layers", "hidden_size", "num_attention_heads",
                       "max_position_embeddings")

    def build() -> nn.Module:
        transformers = _require("transformers", name)
        return transformers.BertForMaskedLM(transformers.BertConfig(**config))

    def batch(g: torch.Generator) -> Batch:
        return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)

    return ModelCase(name, build, batch, _lm_loss,
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


# --------------------------------------------------------------------------------------- the zoo


ZOO: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp,
    "resnet18": lambda **kw: resnet(18, **kw),
    "resnet34": lambda **kw: resnet(34, **kw),
    "resnet50": lambda **kw: resnet(50, **kw),
    "resnet101": lambda **kw: resnet(101, **kw),
    "resnet152": lambda **kw: resnet(152, **kw),
    "vit-b16": lambda **kw: vit("b16", **kw),
    "vit-l16": lambda **kw: vit("l16", **kw),
    "vit-b32": lambda **kw: vit("b32", **kw),
    "vit-l32": lambda **kw: vit("l32", **kw),
    "vit-h14": lambda **kw: vit("h14", **kw),
    "gpt2-small": lambda **kw: gpt2("small", **kw),
    "gpt2-medium": lambda **kw: gpt2("medium", **kw),
    "gpt2-large": lambda **kw: gpt2("large", **kw),
    "gpt2-xl": lambda **kw: gpt2("xl", **kw),
    "bert-base": lambda **kw: bert("base", **kw),
    "bert-large": lambda **kw: bert("large", **kw),
}

_ZOO_BASE: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp, "resnet18": resnet, "resnet34": resnet, "resnet50": resnet, "resnet101": resnet,
    "resnet152": resnet, "vit-b16": vit, "vit-l16": vit, "vit-b32": vit, "vit-l32": vit, "vit-h14": vit,
    "gpt2-small": gpt2, "gpt2-medium": gpt2,
    "gpt2-large": gpt2, "gpt2-xl": gpt2, "bert-base": bert, "bert-large": bert,
}
_FIXED_BY_NAME: dict[Callable[..., ModelCase] | None, set[str]] = {
    resnet: {"depth"}, vit: {"size"}, gpt2: {"size"}, bert: {"size"}}  # set by the name
_CONFIG_FAMILIES = (gpt2, bert)  #: their knobs beyond the signature are the library's config fields
_ZOO_DEFAULT = dict(ZOO)  #: the built-in entries (a name replaced by register() is not checked as one)


def register(name: str, factory: Callable[..., ModelCase], replace: bool = False) -> None:
    """Add ``factory(**knobs) -> ModelCase`` to the zoo under ``name`` (runs and the CLI can name it)."""
    if name in ZOO and not replace:
        raise ModelConfigError(f"model {name!r} is already in the zoo (pass replace=True to replace it)")
    ZOO[name] = factory


def get_model(name: str, **kwargs: Any) -> ModelCase:
    """The zoo entry ``name`` with size knobs; unknown names list the valid ones.

    Bad knobs (unknown, wrongly typed, fixed by the name like ``resnet50``'s depth) raise
    :class:`~um_lab.errors.ModelConfigError` naming the knob; nothing is built, except that GPT-2 / BERT
    config fields are tried on the meta device (no memory): a value the model library refuses
    (``activation_function="bogus"``) is a ``ModelConfigError`` naming the knob here, not a ``KeyError`` later.
    Building the returned case raises the library's errors as ``ModelConfigError`` naming the knobs given.
    """
    if not isinstance(name, str) or name not in ZOO:
        raise ModelConfigError(f"unknown model {name!r}; valid: {', '.join(ZOO)}")
    base = _ZOO_BASE.get(name) if ZOO[name] is _ZOO_DEFAULT.get(name) else None
    fixed = sorted(set(kwargs) & _FIXED_BY_NAME.get(base, set()))
    if fixed:
        family = [n for n, b in _ZOO_BASE.items() if b is base and n != name]
        raise ModelConfigError(f"model {name!r}: {fixed[0]} is set by the model's name and cannot be a knob; "
                               f"name another model instead ({', '.join(family)})", fixed[0])
    try:
        case = ZOO[name](**kwargs)
    except TypeError as e:
        text = str(e)
        if "unexpected keyword argument" not in text and "multiple values for" not in text:
            raise
        knobs = describe_models().get(name, "")
        knob = re.search(r"argument '(\w+)'", text)
        if knob and "unexpected keyword argument" in text:
            factory = base if base is not None else ZOO[name]
            valid = [p for p in inspect.signature(factory).parameters if p not in _FIXED_BY_NAME.get(factory, set())]
            close = did_you_mean(knob.group(1), valid)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ModelConfigError(f"model {name!r} has no knob {knob.group(1)!r}{hint}; its knobs: {knobs}",
                                   knob.group(1)) from None
        raise ModelConfigError(f"model {name!r}: {e.args[0].split(': ', 1)[-1]}; its knobs: {knobs}",
                               knob.group(1) if knob else None) from None
    if kwargs and isinstance(case, ModelCase):
        case.build_model = _knob_checked_build(case.name, case.build_model, kwargs)
        if base in _CONFIG_FAMILIES and set(kwargs) - set(inspect.signature(base).parameters):
            check_builds(case)  # config fields reach the library's constructor: build it on meta (cheap) now
    return case


#: Errors a model library raises for a bad configuration value while building a model (a missing key, a
#: value it cannot use); wrapped in :class:`ModelConfigError` naming the knob.
_LIBRARY_ERRORS = (KeyError, ValueError, TypeError, AttributeError, AssertionError, IndexError, ZeroDivisionError,
                   NotImplementedError)


def _knob_checked_build(name: str, build: Callable[[], nn.Module], knobs: Mapping[str, Any]
                        ) -> Callable[[], nn.Module]:
    """``build`` with the model library's errors raised as :class:`ModelConfigError` naming the knob
    (the knobs whose name or value the error quotes; all knobs given when it quotes none)."""
    knobs = dict(knobs)

    def build_with_knobs() -> nn.Module:
        try:
            return build()
        except UmLabError:
            raise
        except _LIBRARY_ERRORS as e:
            raise knob_error(name, knobs, e) from e

    template = getattr(build, "__um_lab_template__", None)
    if template is not None:
        build_with_knobs.__um_lab_template__ = template  # type: ignore[attr-defined]
    return build_with_knobs


def knob_error(name: str, knobs: Mapping[str, Any], error: BaseException) -> ModelConfigError:
    """A :class:`ModelConfigError` for ``error``, raised by the model library while building ``name`` with
    ``knobs``: it names the knobs the error quotes (by name or value), else all knobs given."""
    text = str(error)

    def quoted(key: str, value: Any) -> bool:
        if re.search(rf"\b{re.escape(key)}\b", text):
            return True
        if isinstance(value, str) and value:
            return repr(value) in text or text.strip("'\"") == value or (len(value) >= 4 and value in text)
        return False

    named = [k for k, v in knobs.items() if quoted(k, v)]
    shown = ", ".join(f"{k}={knobs[k]!r}" for k in (named or knobs))
    which = f"knob {shown}" if len(named) == 1 else f"knobs {shown}" if named else f"one of its knobs ({shown})"
    reason = f"{type(error).__name__}: {text}"[:300]
    return ModelConfigError(f"model {name!r}: the model library cannot build it with {which} ({reason}); "
                            "check the value", named[0] if len(named) == 1 else None)


def check_builds(case: ModelCase) -> ModelCase:
    """Build ``case``'s model on the meta device (no memory, no data; GPT-2-XL in about 0.15 s) so that a
    knob the model library refuses raises :class:`ModelConfigError` now. A build that fails for another
    reason (a factory that needs real tensors) is left for the run to report. Returns ``case``."""
    _meta_model(case)
    return case


def _meta_model(case: ModelCase) -> nn.Module | None:
    template = getattr(case.build_model, "__um_lab_template__", None)
    if isinstance(template, nn.Module):
        return template  # a custom model given as a module: it exists, nothing to build
    try:
        with torch.device("meta"):
            model = case.build_model()
    except UmLabError:
        raise
    except Exception:  # noqa: BLE001 - not checkable on meta; the run builds it for real and reports
        return None
    return model if isinstance(model, nn.Module) else None


def step_needs_closure(optimizer: Any) -> bool:
    """True when ``optimizer.step`` requires an argument (a closure: ``torch.optim.LBFGS``)."""
    try:
        signature = inspect.signature(optimizer.step)
    except (TypeError, ValueError, AttributeError):
        return False
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in signature.parameters.values())


def check_optimizer(case: ModelCase, optimizer: Any) -> None:
    """Refuse (:class:`~um_lab.errors.OptimizerNeedsClosure`) an optimizer whose ``step()`` needs a closure:
    a run calls ``optimizer.step()`` once per training step, without one."""
    if step_needs_closure(optimizer):
        cls = type(optimizer)
        public = getattr(torch.optim, cls.__name__, None) is cls
        raise OptimizerNeedsClosure(f"torch.optim.{cls.__name__}" if public else f"{cls.__module__}.{cls.__qualname__}",
                                    case.name)


def check_case(case: ModelCase) -> ModelCase:
    """Cheap checks of a model case before a run's folder is created; returns ``case``.

    The model is built on the meta device (:func:`check_builds`: a knob the model library refuses is a
    :class:`ModelConfigError` naming it), its optimizer made for those parameters (nothing allocated) and
    refused when its ``step()`` needs a closure (:class:`~um_lab.errors.OptimizerNeedsClosure`, e.g.
    ``torch.optim.LBFGS``). What cannot be built on meta is left for the run to report.
    """
    if not isinstance(case, ModelCase):
        raise ModelTypeError(f"a model case must be a ModelCase (get_model(...) or custom(...)), got "
                             f"{type(case).__name__}", "case")
    model = _meta_model(case)
    if model is not None and case.info.get("recompute", "none") not in ("none", 0):
        from um_lab.training import recompute_layers

        recompute = case.info["recompute"]
        recompute_layers(model, tuple(recompute) if isinstance(recompute, list) else recompute, repr(case.name))
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else \
        [nn.Parameter(torch.empty(1, device="meta"))]
    try:
        optimizer = case.make_optimizer(params)
    except UmLabError:
        raise
    except Exception:  # noqa: BLE001 - a factory that cannot take these parameters: the run reports it
        return case
    check_optimizer(case, optimizer)
    return case


#: what a family's ``**overrides`` take, as ``um-lab models`` lists it
_MORE_KNOBS: dict[Callable[..., ModelCase], str] = {
    vit: "and patch_size, num_layers, num_heads, hidden_dim, mlp_dim",
    gpt2: "and any GPT2Config field (n_layer, n_embd, n_head, vocab_size, ...)",
    bert: "and any BertConfig field (num_hidden_layers, hidden_size, num_attention_heads, vocab_size, ...)"}


def describe_models() -> dict[str, str]:
    """Zoo name -> its size knobs with defaults, e.g. ``"width=4096, depth=8, batch_size=256, ..."``."""
    out = {}
    for name, factory in ZOO.items():
        base = _ZOO_BASE.get(name, factory)
        fixed = _FIXED_BY_NAME.get(base, set())
        params = [p for p in inspect.signature(base).parameters.values() if p.name not in fixed]
        knobs = [f"{p.name}={p.default!r}" if p.default is not p.empty else
                 (_MORE_KNOBS.get(base, "more knobs") if p.kind is p.VAR_KEYWORD else p.name) for p in params]
        out[name] = ", ".join(knobs)
    return out


#: the optional library each built-in family needs (the MLP and registered models need none)
_NEEDS_MODULE: dict[Callable[..., ModelCase], str] = {
    resnet: "torchvision", vit: "torchvision", gpt2: "transformers", bert: "transformers"}
_IMPORTABLE: dict[str, bool] = {}  #: module -> whether it imports here (asked once per process)


def module_importable(module: str) -> bool:
    """True when ``module`` is installed (``importlib.util.find_spec``) and imports (a torchvision built for
    another torch does not); asked once per process."""
    if module not in _IMPORTABLE:
        import importlib
        import importlib.util

        try:
            found = importlib.util.find_spec(module) is not None and importlib.import_module(module) is not None
        except Exception:  # noqa: BLE001 - installed but broken (e.g. built for another torch): not buildable
            found = False
        _IMPORTABLE[module] = found
    return _IMPORTABLE[module]


def _missing_module(name: str) -> str | None:
    """The optional library zoo model ``name`` needs that does not import here (None: nothing missing)."""
    base = _ZOO_BASE.get(name) if name in ZOO and ZOO[name] is _ZOO_DEFAULT.get(name) else None
    module = _NEEDS_MODULE.get(base) if base is not None else None
    return None if module is None or module_importable(module) else module


def model_needs(name: str) -> str | None:
    """What zoo model ``name`` needs that this install lacks, with the command that adds it (keeping a CPU
    torch CPU), e.g. ``"needs torchvision: pip install torchvision --index-url ..."``; None when it can be
    built here."""
    module = _missing_module(name)
    return None if module is None else f"needs {module}: {install_hint(module)}"


def buildable_models() -> list[str]:
    """The zoo names this install can build, in zoo order: ResNet and ViT only where torchvision imports,
    GPT-2 and BERT only where transformers does; the MLP and registered models always."""
    return [name for name in ZOO if model_needs(name) is None]


def case_for_spec(spec: Any) -> ModelCase:
    """The :class:`ModelCase` a :class:`~um_lab.types.RunSpec` names (its batch size and model knobs); a zoo model
    whose library does not import here is refused (:class:`~um_lab.errors.MissingDependencyError`)."""
    module = _missing_module(spec.model)
    if module is not None:
        raise _missing(spec.model, module, "not installed, or built for another torch")
    kwargs = dict(spec.model_kwargs)
    if spec.batch_size is not None:
        given = kwargs.get("batch_size")
        if given is not None and given != spec.batch_size:
            raise ModelConfigError(f"batch_size={spec.batch_size!r} and model_kwargs batch_size={given!r} disagree: "
                                   "give the batch size once", "batch_size")
        kwargs["batch_size"] = spec.batch_size
    from um_lab.training import with_training

    return with_training(get_model(spec.model, **kwargs), spec.precision, spec.recompute)
