"""Model zoo with synthetic batches (no downloads): what a run trains, by name.

A :class:`ModelCase` bundles a model factory, a batch factory and a loss, so every backend (real or
simulated) and every benchmark trains the same thing; the case and the factories that build one (the
families below and ``custom``) are in :mod:`um_lab.model_cases` and importable from here. This module is
the zoo that names them: its knobs checked, the cheap checks before a run, what this install can build.

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

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from um_lab.errors import ModelConfigError, ModelTypeError, OptimizerNeedsClosure, UmLabError
from um_lab.knobs import did_you_mean
from um_lab.knobs import knob_error as knob_error
from um_lab.model_cases import BERT_SIZES as BERT_SIZES
from um_lab.model_cases import GPT2_SIZES as GPT2_SIZES
from um_lab.model_cases import VIT_SIZES as VIT_SIZES
from um_lab.model_cases import Batch as Batch
from um_lab.model_cases import ModelCase as ModelCase
from um_lab.model_cases import _missing
from um_lab.model_cases import bert as bert
from um_lab.model_cases import custom as custom
from um_lab.model_cases import gpt2 as gpt2
from um_lab.model_cases import install_hint as install_hint
from um_lab.model_cases import mlp as mlp
from um_lab.model_cases import resnet as resnet
from um_lab.model_cases import vit as vit

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

    Bad knobs (unknown, wrongly typed, out of range or above :data:`~um_lab.knobs.SIZE_LIMITS`, fixed by the name
    like ``resnet50``'s depth) raise :class:`~um_lab.errors.ModelConfigError` naming the knob; nothing is built,
    except that GPT-2 / BERT config fields build the library's config and are tried on the meta device (no
    memory): a value the model library refuses
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
