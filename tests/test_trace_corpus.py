"""Trace any model: a constructor that computes with tensors, data-dependent ops, the typed error for an op
that cannot be traced, and the corpus (timm, torchvision, transformers) at small sizes and in its results."""

from __future__ import annotations

import json
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from um_lab.errors import ModelConfigError, UmLabError
from um_lab.models import custom
from um_lab.sim.trace import SMALL_REAL_NUMEL, TraceError, build_outside_fake, case_key, trace_step
from um_lab.types import DATA_TYPES

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from sim_speed import corpus_case, corpus_names  # noqa: E402

RESULT = ROOT / "bench" / "results" / "trace_corpus.json"


class DropPathRates(nn.Module):
    """As timm's models do: per-block rates from ``torch.linspace(...).tolist()`` in the constructor."""

    def __init__(self, depth: int = 4, width: int = 32) -> None:
        super().__init__()
        self.rates = torch.linspace(0, 0.1, depth).tolist()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in self.rates)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, rate in zip(self.blocks, self.rates, strict=True):
            x = x + nn.functional.dropout(block(x).relu(), rate, self.training)
        return self.head(x)


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def test_a_constructor_that_computes_with_a_tensor_now_traces():
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    with FakeTensorMode(), pytest.raises(DataDependentOutputException):  # why building under fake mode failed
        DropPathRates()
    for model in (DropPathRates, DropPathRates()):  # a factory, or a module (traced from a deep copy)
        trace = trace_step(custom("drop-path", model, batch))
        by_type = trace.bytes_by_type()
        assert all(by_type[t.value] > 0 for t in DATA_TYPES), by_type
        params = 4 * (32 * 32 + 32) + 32 * 10 + 10
        assert trace.bytes_by_type(persistent_only=True)["param"] == 4 * params
    assert case_key(custom("drop-path", DropPathRates, batch)) != case_key(custom("drop-path", lambda: DropPathRates(5),
                                                                                    batch))


def test_a_constructor_keeps_small_tensors_real_and_large_ones_on_meta():
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4096, 1024)  # 4 M weights: meta; 1024 biases: real
            self.register_buffer("index", torch.arange(49).view(7, 7))

    model = build_outside_fake(custom("wide", Wide, batch))
    assert model.fc.weight.is_meta and model.fc.weight.shape == (1024, 4096)
    assert not model.fc.bias.is_meta and model.fc.bias.numel() <= SMALL_REAL_NUMEL
    assert model.index.tolist()[1][0] == 7  # a small tensor keeps its values


def test_a_constructor_that_reads_a_large_tensor_is_a_typed_error_naming_the_op_and_module():
    class ReadsLarge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(1024, 1024)
            self.scale = float(self.fc.weight.detach().abs().max())

    with pytest.raises(TraceError) as caught:
        trace_step(custom("reads-large", ReadsLarge, batch))
    error = caught.value
    assert error.op == "aten._local_scalar_dense" and error.phase == "build" and error.module == "ReadsLarge"
    assert "ReadsLarge" in str(error) and "'reads-large'" in str(error)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value: not traceable
            return x * 2
        return x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 32), Gate())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class LayerDrop(nn.Module):
    """Skips each layer with probability ``p`` in training, as BART's and Whisper's encoders do."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:  # a random draw read as a Python bool
                continue
            x = torch.relu(layer(x))
        return self.head(x)


def test_a_step_that_reads_a_random_draw_traces_and_repeats():
    """LayerDrop reads one random value per layer: the trace draws it for real (seeded, so two traces agree)
    and follows the branch it picks; a layer always dropped is not in the trace."""
    kept = trace_step(custom("layerdrop-0", lambda: LayerDrop(0.0), batch))
    dropped = trace_step(custom("layerdrop-1", lambda: LayerDrop(1.0), batch))
    some = [trace_step(custom("layerdrop-half", lambda: LayerDrop(0.5), batch)).op_names for _ in range(2)]
    gemms = [sum(name in ("aten.addmm", "aten.mm") for name in t.op_names) for t in (kept, dropped)]
    assert gemms[0] > gemms[1] >= 1  # the head's GEMMs remain when every layer is dropped
    assert some[0] == some[1]  # seeded: the same draws every trace
    assert len(dropped.op_names) <= len(some[0]) <= len(kept.op_names)


class Draws(nn.Module):
    """Reads draws with arguments: a uniform in [0.9, 1), a normal near 10, a certain Bernoulli."""

    read: list[tuple[float, float, float]] = []  #: what every step read, in order

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, n = torch.empty([]).uniform_(0.9), torch.empty([]).normal_(10.0, 0.001)
        Draws.read.append((u.item(), n.item(), torch.empty([]).bernoulli_(1.0).item()))
        return self.fc(x)


class Overwritten(nn.Module):
    """A draw overwritten in place by a value of the batch: its old value must not be read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.rand([])
        gate.copy_(x.sum())
        return self.fc(x) * 2 if gate > 0 else self.fc(x)


def test_random_draws_follow_their_arguments_and_the_trace_seed_and_leave_the_callers_rng_alone():
    state = torch.random.get_rng_state()
    Draws.read.clear()
    trace_step(custom("draws", Draws, batch), seed=0)
    (u0, n0, b0) = Draws.read[-1]
    trace_step(custom("draws", Draws, batch), seed=1)
    (u1, n1, b1) = Draws.read[-1]
    assert torch.equal(state, torch.random.get_rng_state())
    assert 0.9 <= u0 < 1 and 0.9 <= u1 < 1 and u0 != u1  # the seed moves the draws
    assert abs(n0 - 10) < 0.01 and abs(n1 - 10) < 0.01 and b0 == b1 == 1.0


def test_a_draw_overwritten_by_batch_values_is_not_read_as_its_old_value():
    with pytest.raises(TraceError) as caught:
        trace_step(custom("overwritten", Overwritten, batch))
    assert caught.value.op == "aten._local_scalar_dense"


def test_an_op_that_cannot_be_traced_raises_the_typed_error_naming_the_op_and_module():
    with pytest.raises(TraceError) as caught:
        trace_step(custom("branchy", Branchy, batch))
    error = caught.value
    assert isinstance(error, ModelConfigError) and isinstance(error, UmLabError)
    assert error.op == "aten._local_scalar_dense" and error.module == "body.1 (Gate)" and error.phase == "forward"
    text = str(error)
    assert "'branchy'" in text and "aten._local_scalar_dense" in text and "body.1 (Gate)" in text
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is TraceError and str(again) == text and again.module == error.module
    # Dask's workers pickle an exception with its traceback and context (tblib): it must carry none of
    # torch's op objects, which do not pickle
    assert error.__context__ is None and error.__cause__ is None


def test_data_dependent_ops_of_a_training_step_are_sized_as_if_every_element_were_selected():
    class Masks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            keep = y != -100  # a label mask
            rows, cols = torch.where(h > 0)
            picked = h[keep]  # boolean-mask indexing
            return picked.sum() + h[rows, cols].sum() + torch.masked_select(h, h > 0).mean() + y.unique().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generic accounting for ops outside the tracer's lists
        trace = trace_step(custom("masks", Masks, batch, loss_fn=lambda m, x, y: m(x, y)))
    for op in ("aten.nonzero", "aten.index", "aten.masked_select"):
        assert op in trace.op_names, op
    i = trace.op_names.index("aten.masked_select")
    written = trace.acc_storage[trace.acc_ptr[i]:trace.acc_ptr[i + 1]][trace.acc_write[trace.acc_ptr[i]:
                                                                                    trace.acc_ptr[i + 1]] == 1]
    assert trace.st_nbytes[written].max() == 4 * 32 * 4  # every element of the 4 x 32 fp32 activation


def test_a_mixture_of_experts_looping_over_routed_tokens_names_the_experts_module():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        num_local_experts=4)
    config._experts_implementation = "eager"  # the loop over experts hit (the default grouped_mm traces)
    case = custom("moe-loop", lambda: transformers.AutoModelForCausalLM.from_config(config),
                  lambda g: (torch.randint(0, 100, (1, 16), generator=g),),
                  lambda m, ids: m(input_ids=ids, labels=ids).loss)
    with pytest.raises(TraceError) as caught:
        trace_step(case)
    assert caught.value.module == "model.layers.0.mlp.experts (MixtralExperts)"


def small_subset(library: str) -> list[str]:
    """Every transformers entry; for the vision libraries, models whose constructors need tensor values
    (drop-path rates, relative-position indices) or whose training output has auxiliary logits."""
    picks = {"timm": ("convnext_tiny", "swin_tiny_patch4_window7_224", "efficientnet_b0", "eva02_tiny_patch14_224"),
             "torchvision": ("swin_t", "googlenet", "efficientnet_b0")}
    return [n for n in corpus_names(library) if library == "transformers" or n.split("/", 1)[1] in picks[library]]


def needs(module: str) -> None:
    """Skip unless ``module`` imports: not installed, or built for another torch (torchvision on the CPU torch
    fails with ``operator torchvision::nms does not exist``); their corpus is traced where they import."""
    try:
        pytest.importorskip(module)
    except pytest.skip.Exception:
        raise
    except Exception as e:  # noqa: BLE001 - installed but not importable with this torch
        pytest.skip(f"{module} is installed but does not import with this torch: {type(e).__name__}: {e}")


def trace_small(name: str) -> None:
    case, info = corpus_case(name, small=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = trace_step(case)
    by_type = trace.bytes_by_type()
    assert all(by_type[t.value] > 0 for t in DATA_TYPES), (name, by_type)
    assert info["library"] == name.split("/")[0] and info["family"]


@pytest.mark.parametrize("name", small_subset("transformers"))
def test_transformers_models_trace_at_small_sizes(name):
    needs("transformers")
    trace_small(name)


@pytest.mark.parametrize("name", small_subset("torchvision"))
def test_torchvision_models_trace_at_small_sizes(name):
    needs("torchvision")
    trace_small(name)


@pytest.mark.parametrize("name", small_subset("timm"))
def test_timm_models_trace_at_small_sizes(name):
    needs("timm")
    trace_small(name)


def test_the_corpus_results_cover_three_libraries_and_trace_at_least_95_percent():
    result = json.loads(RESULT.read_text())
    rows = result["rows"]
    assert result["date"] and result["machine"] and result["sizes"] == "real"
    assert len(rows) >= 40 and len({r["name"] for r in rows}) == len(rows)
    traced = [r for r in rows if r["traced"]]
    assert len(traced) >= 0.95 * len(rows)
    libraries = ("timm", "torchvision", "transformers")
    families = {lib: {r["family"] for r in rows if r["library"] == lib} for lib in libraries}
    assert len(families["timm"]) >= 20
    assert sum(r["library"] == "torchvision" for r in rows) >= 10
    assert sum(r["library"] == "transformers" for r in rows) >= 10
    assert {"llama", "t5", "mixtral", "vit"} <= families["transformers"]
    for row in traced:
        assert row["trace_s"] > 0 and all(row["bytes"][t.value] > 0 for t in DATA_TYPES), row["name"]
    for row in rows:
        assert row["traced"] or row["error"], row["name"]
    assert set(corpus_names()) == {r["name"] for r in rows}  # the results are of the corpus as defined


def test_a_profiler_holding_the_callers_frames_does_not_change_the_trace():
    """A sampling profiler (a Dask worker's) holds the calling thread's frames for a moment, so a tensor a
    returning function held dies later: the trace runs in a thread of its own and records the same frees."""
    import hashlib
    import threading
    import time

    import numpy as np

    from um_lab.models import get_model

    case = get_model("gpt2-small", n_layer=2, n_embd=64, n_head=2, batch_size=2, seq_len=32)

    def digest(trace) -> str:
        return hashlib.sha1(np.concatenate([trace.st_alloc, trace.st_free, trace.st_nbytes]).tobytes()).hexdigest()

    alone = digest(trace_step(case))
    caller, stop = threading.get_ident(), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            frame = sys._current_frames().get(caller)  # what a sampling profiler does
            time.sleep(0.0005)
            del frame

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        sampled = [digest(trace_step(case)) for _ in range(3)]
    finally:
        stop.set()
        sampler.join()
    assert sampled == [alone] * 3
