"""Simulator speed on this (CPU) machine: one GPT-2-medium step, and an 8 policies x 4 ratios sweep.

    python bench/sim_speed.py [--steps 3] [--out bench/results]

``gpt2_medium_step_s``: the slowest over the 8 policies at ratio 1.5 of a one-step run (a fresh
simulated GPU, no warm-up; the trace is prepared once beforehand). ``sweep_8x4_s``: 8 policies x
ratios 0.5, 1.0, 1.5, 2.0 on GPT-2-medium (bs 8 x 1024), 1 warm-up + ``--steps`` steps each,
including the one-off trace; ``band_over_plain``: the cost of that sweep's uncertainty band (each run
again at both ends of the profile constants' ranges, um_lab.sim.band) over the plain sweep's
(``sweep_with_band_over_plain``: both together). Targets: <= 0.5 s, <= 60 s and <= 2.
Writes bench/results/sim_speed.json.

    python bench/sim_speed.py --corpus [--small] [--library timm|torchvision|transformers]

traces one training step (forward, backward, AdamW) of each architecture of the corpus (timm, torchvision and
transformers models as users build them, wrapped with ``um_lab.models.custom``): traced or not (and the typed
error), trace seconds and the simulator's footprint per data type. Writes bench/results/trace_corpus.json.
torchvision and timm need a torch they were built for (the CUDA build runs on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from um_lab.errors import UmLabError  # noqa: E402
from um_lab.models import ModelCase, custom, get_model  # noqa: E402
from um_lab.policy import Advice, presets  # noqa: E402
from um_lab.sim.backend import SimBackend  # noqa: E402
from um_lab.sim.band import band_ms  # noqa: E402
from um_lab.sim.placement import place  # noqa: E402
from um_lab.sim.trace import clear_trace_cache, trace_step  # noqa: E402
from um_lab.types import DATA_TYPES, RunSpec  # noqa: E402

RATIOS = (0.5, 1.0, 1.5, 2.0)
MODEL_KWARGS = {"batch_size": 8, "seq_len": 1024}


def policies() -> list:
    """The 7 presets plus parameters prefetched before use: 8 policies."""
    extra = presets["um-default"].replace("prefetch-params", param=Advice(prefetch="to-gpu-before-use"))
    return [*presets.values(), extra]


def machine() -> str:
    """A short description of this machine."""
    return (f"{platform.node()} {platform.machine()} {os.cpu_count()} cores,"
            f" Python {platform.python_version()}")


# ----------------------------------------------------------------------------------------------- the corpus
#: Architectures the way users get them, traced by ``--corpus``: timm (``timm.create_model(name,
#: pretrained=False)``; image size), torchvision (``torchvision.models.get_model(name, weights=None)``; image size)
#: and Hugging Face transformers built from configs (class, auto class, task, the real configuration, what the
#: small one changes). Real sizes: images in batches of 8, language models at their published configurations.
TIMM = {"resnet50": 224, "efficientnet_b0": 224, "convnext_tiny": 224, "vit_base_patch16_224": 224,
        "deit_small_patch16_224": 224, "swin_tiny_patch4_window7_224": 224, "regnety_016": 224,
        "mobilenetv3_large_100": 224, "densenet121": 224, "mixer_b16_224": 224, "beit_base_patch16_224": 224,
        "cait_xxs24_224": 224, "efficientformer_l1": 224, "levit_128": 224, "poolformer_s12": 224, "pvt_v2_b0": 224,
        "mobilevit_s": 256, "ghostnet_100": 224, "dla34": 224, "dpn68": 224, "rexnet_100": 224,
        "hrnet_w18_small": 224, "inception_v3": 299, "maxvit_tiny_tf_224": 224, "edgenext_small": 256,
        "dm_nfnet_f0": 256, "twins_svt_small": 224, "eva02_tiny_patch14_224": 224, "fastvit_t8": 256,
        "hiera_tiny_224": 224}
TORCHVISION = {"mobilenet_v3_large": 224, "efficientnet_b0": 224, "efficientnet_v2_s": 384, "convnext_tiny": 224,
               "densenet121": 224, "regnet_y_800mf": 224, "swin_t": 224, "swin_v2_t": 256, "maxvit_t": 224,
               "shufflenet_v2_x1_0": 224, "squeezenet1_1": 224, "googlenet": 224, "inception_v3": 299,
               "mnasnet1_0": 224, "vgg11_bn": 224, "resnext50_32x4d": 224, "alexnet": 224}
_TINY_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000)
TRANSFORMERS: dict[str, tuple[str, str, str, dict[str, Any], dict[str, Any]]] = {
    "llama-3.2-1b": ("LlamaConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True), _TINY_LM),
    "qwen2.5-0.5b": ("Qwen2Config", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True), _TINY_LM),
    "mistral-7b": ("MistralConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8), _TINY_LM),
    "gemma-2b": ("GemmaConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256), {**_TINY_LM, "head_dim": 16}),
    "phi-3-mini": ("Phi3Config", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, pad_token_id=32000, bos_token_id=1, eos_token_id=32000),
        {**_TINY_LM, "pad_token_id": 999, "bos_token_id": 1, "eos_token_id": 998}),
    "pythia-410m": ("GPTNeoXConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=50304, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        {k: v for k, v in _TINY_LM.items() if k != "num_key_value_heads"}),
    "mixtral-8x7b": ("MixtralConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2), {**_TINY_LM, "num_local_experts": 4}),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeConfig", "AutoModelForCausalLM", "causal-lm", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632),
        {**_TINY_LM, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
    "t5-base": ("T5Config", "AutoModelForSeq2SeqLM", "seq2seq", dict(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, pad_token_id=0,
        decoder_start_token_id=0),
        dict(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
             decoder_start_token_id=0)),
    "bart-base": ("BartConfig", "AutoModelForSeq2SeqLM", "seq2seq", dict(
        vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2),
        dict(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, pad_token_id=1, bos_token_id=0,
             eos_token_id=2, decoder_start_token_id=2)),
    "vit-base-patch16-224": ("ViTConfig", "AutoModelForImageClassification", "image", dict(num_labels=1000),
                             dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  image_size=32, patch_size=8, num_labels=10)),
    "deit-base-patch16-224": ("DeiTConfig", "DeiTForImageClassification", "image", dict(num_labels=1000),
                              dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   image_size=32, patch_size=8, num_labels=10)),
    "swin-tiny-patch4-window7-224": ("SwinConfig", "AutoModelForImageClassification", "image", dict(num_labels=1000),
                                     dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], image_size=32, patch_size=4,
                                          window_size=4, num_labels=10)),
}
#: real sizes: batch and sequence length (language models; encoder-decoders: source, target) or image batch
LM_BATCH, LM_SEQ, SEQ2SEQ_BATCH, SEQ2SEQ_TGT, IMAGE_BATCH = 1, 512, 4, 128, 8
LIBRARIES = ("timm", "torchvision", "transformers")


def corpus_names(library: str | None = None) -> list[str]:
    """The corpus, as ``library/name``."""
    tables = {"timm": TIMM, "torchvision": TORCHVISION, "transformers": TRANSFORMERS}
    return [f"{lib}/{name}" for lib, table in tables.items() if library in (None, lib) for name in table]


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits; a model that also returns auxiliary logits in training (GoogLeNet,
    Inception v3) adds them at 0.4, as torchvision's reference training does."""
    out = model(x)
    if isinstance(out, torch.Tensor):
        return nn.functional.cross_entropy(out, y)
    logits = [o for o in out if isinstance(o, torch.Tensor)]
    return nn.functional.cross_entropy(logits[0], y) + 0.4 * sum(nn.functional.cross_entropy(o, y) for o in logits[1:])


def _images(batch: int, size: int, classes: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda g: (torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))


def corpus_case(name: str, small: bool = False) -> tuple[ModelCase, dict[str, Any]]:
    """The corpus entry ``library/name`` as ``um_lab.models.custom(...)`` and what describes it (library, family,
    how it was built, batch). ``small``: batch 1 and, for transformers, the small configuration."""
    import importlib

    library, model = name.split("/", 1)
    mod = importlib.import_module(library)
    if library in ("timm", "torchvision"):
        size, batch, classes = (TIMM if library == "timm" else TORCHVISION)[model], 1 if small else IMAGE_BATCH, 1000
        if library == "timm":
            # num_classes: timm builds some configurations (eva02) headless, which labels would then overrun
            build = lambda: mod.create_model(model, pretrained=False, num_classes=classes)  # noqa: E731
            family = mod.models.model_entrypoint(model).__module__
            call = f"timm.create_model({model!r}, pretrained=False, num_classes={classes})"
        else:
            build = lambda: mod.models.get_model(model, weights=None)  # noqa: E731
            family = mod.models.get_model_builder(model).__module__
            call = f"torchvision.models.get_model({model!r}, weights=None)"
        info = {"library": library, "family": family, "call": call, "batch_size": batch, "image_size": size}
        return custom(name, build, _images(batch, size, classes), _classify, info=info), info
    config_cls, auto, task, real, tiny = TRANSFORMERS[model]
    config = getattr(mod, config_cls)(**(tiny if small else real))
    factory = getattr(mod, auto).from_config if auto.startswith("Auto") else getattr(mod, auto)
    build = lambda: factory(config)  # noqa: E731
    info = {"library": library, "family": config.model_type, "task": task, "call": f"transformers.{auto}"
            f"{'.from_config' if auto.startswith('Auto') else ''}({config_cls}(**{tiny if small else real}))"}
    if task == "image":
        size, batch = config.image_size, 1 if small else IMAGE_BATCH
        info.update(batch_size=batch, image_size=size)
        make = _images(batch, size, config.num_labels)
        return custom(name, build, make, lambda m, x, y: m(pixel_values=x, labels=y).loss, info=info), info
    vocab = config.vocab_size
    if task == "seq2seq":
        batch, src, tgt = (1, 32, 16) if small else (SEQ2SEQ_BATCH, LM_SEQ, SEQ2SEQ_TGT)
        info.update(batch_size=batch, seq_len=src, target_len=tgt)
        make = lambda g: (torch.randint(0, vocab, (batch, src), generator=g),  # noqa: E731
                          torch.randint(0, vocab, (batch, tgt), generator=g))
        return custom(name, build, make, lambda m, x, y: m(input_ids=x, labels=y).loss, info=info), info
    batch, seq = (1, 32) if small else (LM_BATCH, LM_SEQ)
    info.update(batch_size=batch, seq_len=seq)
    make = lambda g: (torch.randint(0, vocab, (batch, seq), generator=g),)  # noqa: E731
    return custom(name, build, make, lambda m, ids: m(input_ids=ids, labels=ids).loss, info=info), info


def trace_corpus_entry(name: str, small: bool = False) -> dict[str, Any]:
    """Trace one corpus entry: traced or not (and the typed error's message), trace seconds, and the
    simulator's prepared footprint per data type (its pools' segments after placement)."""
    row: dict[str, Any] = {"name": name}
    try:
        case, info = corpus_case(name, small)
    except ImportError as e:
        return {**row, "library": name.split("/")[0], "traced": False, "error": f"not importable: {e}"}
    row.update(info)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = trace_step(case)
    except Exception as e:  # noqa: BLE001 - recorded: a typed error (UmLabError) says why; another is a bug
        return {**row, "traced": False, "error": f"{type(e).__name__}: {e}", "typed": isinstance(e, UmLabError),
                "trace_s": round(time.perf_counter() - t0, 2)}
    trace_s = time.perf_counter() - t0
    footprint = place(trace).final.segment_bytes
    return {**row, "traced": True, "error": None, "trace_s": round(trace_s, 2), "n_ops": trace.n_ops,
            "bytes": {t.value: int(footprint.get(t.value, 0)) for t in DATA_TYPES},
            "footprint_bytes": int(sum(footprint.values())), "unknown_ops": trace.unknown_ops}


def run_corpus(out: Path, small: bool = False, library: str | None = None) -> dict:
    """Trace the corpus (or one library of it), print a table, write ``trace_corpus.json``."""
    import importlib.metadata

    rows = []
    for name in corpus_names(library):
        row = trace_corpus_entry(name, small)
        rows.append(row)
        sizes = " ".join(f"{k} {v / 2**20:9.1f}" for k, v in row.get("bytes", {}).items())
        print(f"{name:48s} {'traced' if row['traced'] else 'FAILED'} {row.get('trace_s', 0):6.2f} s  "
              f"{sizes or row['error']}", flush=True)
    per_library = {lib: {"traced": sum(r["traced"] for r in rows if r["library"] == lib),
                         "total": sum(r["library"] == lib for r in rows),
                         "families": len({r.get("family") for r in rows if r["library"] == lib and r["traced"]})}
                   for lib in LIBRARIES}
    versions: dict[str, str | None] = {"torch": torch.__version__}  # a CUDA build runs on the CPU too
    for package in LIBRARIES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    traced = [r for r in rows if r["traced"]]
    slowest = max(traced, key=lambda r: r["trace_s"]) if traced else None
    result = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sizes": "small" if small else "real",
        "versions": versions,
        "traced": len(traced), "total": len(rows), "traced_fraction": round(len(traced) / max(1, len(rows)), 4),
        "per_library": per_library,
        "slowest": {"name": slowest["name"], "trace_s": slowest["trace_s"]} if slowest else None,
        "total_trace_s": round(sum(r.get("trace_s", 0) for r in rows), 1),
        "bytes_are": "the simulator's prepared footprint per data type: each pool's segments after placement",
        "rows": rows,
    }
    print(f"\ntraced {len(traced)}/{len(rows)}: " + ", ".join(f"{lib} {v['traced']}/{v['total']}"
                                                          for lib, v in per_library.items()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace_corpus.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


#: corpus models (none in um_lab's zoo) whose memory estimate is checked against a native training step on a GPU,
#: in sets: each set's predictions are committed before a GPU measures it
ESTIMATE_SETS = {
    "2026-12-05": ("timm/efficientnet_b0", "timm/convnext_tiny", "timm/vit_base_patch16_224", "timm/densenet121",
                   "timm/swin_tiny_patch4_window7_224", "torchvision/mobilenet_v3_large", "torchvision/regnet_y_800mf",
                   "torchvision/resnext50_32x4d", "torchvision/vgg11_bn", "transformers/qwen2.5-0.5b",
                   "transformers/pythia-410m", "transformers/t5-base", "transformers/bart-base",
                   "transformers/deit-base-patch16-224"),
    "2026-12-06": ("timm/deit_small_patch16_224", "timm/regnety_016", "timm/mixer_b16_224",
                   "timm/beit_base_patch16_224", "timm/poolformer_s12", "timm/ghostnet_100", "timm/dla34",
                   "timm/inception_v3",
                   "torchvision/shufflenet_v2_x1_0", "torchvision/googlenet", "torchvision/efficientnet_v2_s",
                   "torchvision/swin_v2_t", "transformers/llama-3.2-1b", "transformers/swin-tiny-patch4-window7-224"),
}
ESTIMATE_BAR = 0.10  #: each model's estimate within 10% of the GPU's peak allocated bytes


def predict_estimates(out: Path) -> dict:
    """The simulator's memory estimate of each model of every set in :data:`ESTIMATE_SETS` not yet in
    ``estimate_vs_gpu.json`` (before any GPU measures it): the panel's estimate (each data type's own peak,
    summed: what um_lab's one-pool-per-type backend holds), the peak of everything live at once over the traced
    step, and native PyTorch's peak (that plus the GEMM workspaces: what one caching allocator holds). Rows
    already there are kept as they are."""
    from um_lab.sim.trace import cached_trace
    from um_lab.sizing import estimate_memory

    path = out / "estimate_vs_gpu.json"
    result = json.loads(path.read_text()) if path.exists() else {"rows": []}
    known = {row["name"] for row in result["rows"]}
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for predicted, names in ESTIMATE_SETS.items():
        for name in names:
            if name in known:
                continue
            case, info = corpus_case(name)
            estimate = estimate_memory(case)
            peak = cached_trace(case).peak_bytes()
            result["rows"].append({
                "name": name, "set": predicted, "predicted": now, **info, "per_type_bytes": estimate.bytes_per_type,
                "estimate_bytes": estimate.total_bytes, "estimate_method": estimate.method, "peak_live_bytes": peak,
                "native_peak_bytes": estimate.native_peak_bytes, "workspace_bytes": estimate.workspace_bytes,
                "measured_bytes": None})
            print(f"{name:44s} estimate {estimate.total_bytes / 2**30:7.2f} GiB  peak live {peak / 2**30:7.2f} GiB  "
                  f"native peak {(estimate.native_peak_bytes or 0) / 2**30:7.2f} GiB", flush=True)
    result.update(machine=result.get("machine", machine()), date=now, bar=ESTIMATE_BAR,
                  optimizer="the case's (AdamW), fp32")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


ESTIMATES_ARE = ("estimate: each data type's own peak, summed (um_lab's pools); peak_live: everything live at once "
                 "over the traced step; native_peak: peak_live plus the GEMM workspaces (cuBLAS, one per thread that "
                 "runs GEMMs): what one caching allocator holds")


def measure_estimates(out: Path, only_set: str | None = None) -> dict:
    """On a CUDA GPU: each predicted model trained natively (one warm-up step, then a step whose peak is read:
    ``torch.cuda.max_memory_allocated``, gradients zeroed in place as um_lab's session keeps them), each from no
    cuBLAS workspace; the error of each prediction against it, and per set how many are within the bar.
    ``only_set``: measure that set's rows alone (the others keep their measurement). The file is rewritten after
    every model, so a run cut short keeps what it measured."""
    path = out / "estimate_vs_gpu.json"
    result = json.loads(path.read_text())
    device = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info()
    for row in result["rows"]:
        if only_set is not None and row.get("set", "2026-12-05") != only_set:
            continue
        for key in ("skipped", "estimate_error", "peak_live_error", "native_peak_error"):
            row.pop(key, None)  # from an earlier measurement
        # each model starts with no cuBLAS workspace: the earlier models' stay allocated (empty_cache keeps them)
        # and would count in this one's peak
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        if row["estimate_bytes"] > 0.6 * free:  # never near the card's free memory
            row["measured_bytes"], row["skipped"] = None, "too large for the free memory here"
            continue
        case, _ = corpus_case(row["name"])
        torch.manual_seed(0)
        model = case.build_model().to(device)
        optimizer = case.make_optimizer(list(model.parameters()))
        batch = [t.to(device) for t in case.make_batch(torch.Generator().manual_seed(0))]
        for i in range(2):
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            optimizer.zero_grad(set_to_none=False)
            case.loss_fn(model, *batch).backward()
            optimizer.step()
        torch.cuda.synchronize()
        row["measured_bytes"] = int(torch.cuda.max_memory_allocated())
        row["measured_on"] = torch.cuda.get_device_name(0)
        for key in ("estimate", "peak_live", "native_peak"):
            if row.get(f"{key}_bytes"):
                row[f"{key}_error"] = round(row[f"{key}_bytes"] / row["measured_bytes"] - 1, 4)
        if row.get("native_peak_bytes_after_measuring"):  # an older set, re-estimated after it was measured
            row["native_peak_error_after_measuring"] = round(
                row["native_peak_bytes_after_measuring"] / row["measured_bytes"] - 1, 4)
        print(f"{row['name']:44s} measured {row['measured_bytes'] / 2**30:7.2f} GiB  estimate "
              f"{row['estimate_error']:+.1%}  peak live {row['peak_live_error']:+.1%}  native peak "
              f"{row.get('native_peak_error', float('nan')):+.1%}", flush=True)
        del model, optimizer, batch
        torch.cuda.empty_cache()
        _write_measured(path, result)
    return _write_measured(path, result)


def _write_measured(path: Path, result: dict) -> dict:
    """``result`` with the date, the device and the count within the bar per set, written to ``path``."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    within: dict[str, dict[str, int]] = {}
    for predicted in ESTIMATE_SETS:
        measured = [r for r in result["rows"] if r.get("set", "2026-12-05") == predicted and r.get("measured_bytes")]
        within[predicted] = {key: sum(abs(r[f"{key}_error"]) <= ESTIMATE_BAR for r in measured)
                             for key in ("estimate", "peak_live", "native_peak")
                             if measured and all(f"{key}_error" in r for r in measured)} | {"of": len(measured)}
    result.update(date=now, measured=now, estimates_are=ESTIMATES_ARE,
                  device=torch.cuda.get_device_name(0), torch=torch.__version__, within_bar=within)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write the JSON; returns the result dict."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--corpus", action="store_true", help="trace the corpus instead (trace_corpus.json)")
    ap.add_argument("--small", action="store_true", help="the corpus at small sizes")
    ap.add_argument("--library", choices=LIBRARIES, help="only this library's part of the corpus")
    ap.add_argument("--estimates", choices=("predict", "measure"),
                    help="memory estimates of corpus models: predict (any CPU), then measure (a CUDA GPU)")
    ap.add_argument("--estimate-set", choices=sorted(ESTIMATE_SETS), default=None,
                    help="with --estimates measure: only this set's models")
    args = ap.parse_args(argv)
    if args.corpus:
        return run_corpus(Path(args.out), args.small, args.library)
    if args.estimates:
        if args.estimates == "predict":
            return predict_estimates(Path(args.out))
        return measure_estimates(Path(args.out), args.estimate_set)
    pols = policies()
    assert len(pols) == 8

    clear_trace_cache()
    t0 = time.perf_counter()
    backend = SimBackend()
    case = get_model("gpt2-medium", **MODEL_KWARGS)
    backend.prepare(case)
    prepare_s = time.perf_counter() - t0
    rows = []
    for policy in pols:
        for ratio in RATIOS:
            spec = RunSpec(model="gpt2-medium", backend="sim", steps=args.steps, warmup_steps=1,
                           oversubscription_ratio=ratio)
            t = time.perf_counter()
            recs = list(backend.run(spec, case, policy))
            rows.append({"policy": policy.name, "ratio": ratio, "run_s": time.perf_counter() - t,
                         "step_ms": recs[-1].wall_ms, "evictions": recs[-1].evictions})
    sweep_s = time.perf_counter() - t0

    # the same sweep's uncertainty band: every run again at both ends of the profile constants' ranges
    t = time.perf_counter()
    for policy in pols:
        for ratio in RATIOS:
            spec = RunSpec(model="gpt2-medium", backend="sim", steps=args.steps, warmup_steps=1,
                           oversubscription_ratio=ratio)
            fast_ms, slow_ms = band_ms(spec, case, policy)
            row = next(r for r in rows if r["policy"] == policy.name and r["ratio"] == ratio)
            row.update(band_fast_ms=fast_ms, band_slow_ms=slow_ms)
    band_s = time.perf_counter() - t

    one_step = []
    for policy in pols:
        spec = RunSpec(model="gpt2-medium", backend="sim", steps=1, warmup_steps=0,
                       oversubscription_ratio=1.5)
        t = time.perf_counter()
        list(backend.run(spec, case, policy))
        one_step.append((time.perf_counter() - t, policy.name))
    step_s, slowest = max(one_step)

    print(f"{'policy':20s} " + " ".join(f"{'r=' + str(r):>22s}" for r in RATIOS))
    for policy in pols:
        cells = [r for r in rows if r["policy"] == policy.name]
        print(f"{policy.name:20s} " + " ".join(f"{c['step_ms']:11.1f} ms {c['run_s']:6.2f} s" for c in cells))
    print(f"\ntrace + placement (once): {prepare_s:.2f} s")
    print(f"one GPT-2-medium step (slowest policy, {slowest}, ratio 1.5): {step_s:.3f} s  (target <= 0.5 s)")
    print(f"sweep 8 policies x 4 ratios, {1 + args.steps} steps each, trace included: {sweep_s:.1f} s"
          "  (target <= 60 s)")
    print(f"uncertainty band of that sweep (2 more runs each, corner profiles prepared once): {band_s:.1f} s ="
          f" {band_s / sweep_s:.2f}x the plain sweep (target <= 2); sweep and band together"
          f" {(sweep_s + band_s) / sweep_s:.2f}x")
    result = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpt2_medium_step_s": round(step_s, 4),
        "sweep_8x4_s": round(sweep_s, 2),
        "trace_s": round(prepare_s, 2),
        "band_s": round(band_s, 2),
        "band_over_plain": round(band_s / sweep_s, 3),
        "sweep_with_band_over_plain": round((sweep_s + band_s) / sweep_s, 3),
        "steps_per_config": 1 + args.steps,
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
