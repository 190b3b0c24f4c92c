"""Tracer: classification, no allocation, op accounting, caching, unknown ops."""

from __future__ import annotations

import resource
import warnings

import numpy as np
import pytest
import torch

from um_lab.models import ModelCase, get_model
from um_lab.sim.trace import PHASES, TYPE_INDEX, cached_trace, trace_step
from um_lab.types import DataType


def small_mlp(width: int = 256, depth: int = 2, batch_size: int = 32) -> ModelCase:
    return get_model("mlp", width=width, depth=depth, batch_size=batch_size)


def test_mlp_storages_are_classified_like_the_real_backend() -> None:
    width, depth, batch = 256, 2, 32
    trace = trace_step(small_mlp(width, depth, batch))
    by_type = trace.bytes_by_type(persistent_only=True)
    n_params = depth * (width * width + width) + width * 10 + 10
    assert by_type["param"] == 4 * n_params
    assert by_type["grad"] == 4 * n_params
    # AdamW: exp_avg and exp_avg_sq per parameter plus a 4-byte step counter each
    assert by_type["optim"] == 2 * 4 * n_params + 4 * (2 * depth + 2)
    inputs = trace.st_type == TYPE_INDEX[DataType.INPUT]
    assert trace.st_nbytes[inputs].sum() == batch * width * 4 + batch * 8
    # everything allocated in forward/backward is act; in the optimizer step, optim
    transient = ~trace.st_persistent & ~inputs
    assert set(trace.st_type[transient].tolist()) <= {TYPE_INDEX[DataType.ACT], TYPE_INDEX[DataType.OPTIM]}
    alloc_phase = trace.op_phase[np.clip(trace.st_alloc[transient], 0, trace.n_ops - 1)]
    is_optim = trace.st_type[transient] == TYPE_INDEX[DataType.OPTIM]
    assert np.all((alloc_phase == PHASES.index("opt")) == is_optim)


def test_trace_records_ops_flops_and_phases() -> None:
    width, batch = 256, 32
    trace = trace_step(small_mlp(width, 2, batch))
    assert trace.op_names[0] == "um_lab.input_h2d"
    assert set(np.unique(trace.op_phase).tolist()) == {0, 1, 2}
    mm = [i for i, n in enumerate(trace.op_names) if n == "aten.addmm"]
    assert mm, "forward linears are addmm"
    assert trace.op_flops[mm[0]] == pytest.approx(2 * batch * width * width)
    assert trace.op_kind[mm[0]] == 1
    # backward of 3 linears: grad-input mm for 2 of them and grad-weight mm for all 3
    assert trace.op_names.count("aten.mm") == 5
    # every access lies inside its storage
    assert np.all(trace.acc_hi <= trace.st_nbytes[trace.acc_storage])
    assert np.all(trace.acc_lo >= 0)
    # frees come after allocations
    assert np.all(trace.st_free >= trace.st_alloc)


def test_gpt2_trace_uses_fused_attention_and_allocates_nothing() -> None:
    case = get_model("gpt2-small", batch_size=1, seq_len=64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace = trace_step(case)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    # 124M parameters: real tensors for params + grads + Adam state would take ~2 GB
    assert grown_mib < 700
    assert trace.bytes_by_type(persistent_only=True)["param"] > 400e6
    assert "aten._scaled_dot_product_efficient_attention" in trace.op_names
    assert "aten.native_dropout" in trace.op_names
    assert "aten.bmm" not in trace.op_names  # no unfused attention


def test_cached_trace_reuses_and_distinguishes_configs() -> None:
    a = cached_trace(small_mlp(128, 1, 8))
    b = cached_trace(small_mlp(128, 1, 8))
    c = cached_trace(small_mlp(128, 1, 16))
    assert a is b
    assert c is not a and c.key != a.key


class _Weird(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(self.lin(x), dim=1)  # cumsum: not in the known op lists
        return torch.cumsum(y, dim=0)


def test_unknown_ops_warn_once_and_are_accounted() -> None:
    case = ModelCase(
        "weird", _Weird, lambda g: (torch.randn(4, 16, generator=g),),
        lambda m, x: m(x).sum(), info={"v": 1},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = trace_step(case)
    cumsum_warnings = [w for w in caught if "aten.cumsum" in str(w.message)]
    assert len(cumsum_warnings) == 1
    assert "aten.cumsum" in trace.unknown_ops
    i = trace.op_names.index("aten.cumsum")
    assert trace.op_bytes[i] > 0


@pytest.mark.slow
def test_gpt2_xl_step_traces_without_memory() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace = trace_step(get_model("gpt2-xl", batch_size=2, seq_len=1024))
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    params = trace.bytes_by_type(persistent_only=True)["param"]
    assert 1.5e9 * 4 < params < 1.65e9 * 4  # ~1.56 B parameters, fp32
    assert grown_gib < 2.0  # a real step would need > 25 GB
    assert trace.op_names.count("aten._scaled_dot_product_efficient_attention") == 48


def test_models_that_use_trunc_normal_init_build_on_fake_tensors():
    """torch 2.13's trunc_normal_ asks a data-dependent question; the tracer's initialisers do not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from um_lab.sim.ops import data_free_init

    original = torch.nn.init.trunc_normal_
    with FakeTensorMode(), data_free_init():
        w = torch.empty(16, 8)
        out = torch.nn.init.trunc_normal_(w, std=0.02)
    assert out is w and torch.nn.init.trunc_normal_ is original  # restored on exit


class _Attention(torch.nn.Module):
    """One attention with an additive mask laid out as given (T5's position bias is a permuted view)."""

    def __init__(self, mask_transposed: bool) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.mask_transposed = mask_transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        bias = torch.zeros(n, n, 2, device=x.device).permute(2, 0, 1) if self.mask_transposed \
            else torch.zeros(2, n, n, device=x.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0), dropout_p=0.1)
        return out.sum()


@pytest.mark.parametrize("mask_transposed", [False, True])
def test_attention_takes_the_kernel_cuda_would(mask_transposed: bool) -> None:
    """A mask whose last dimension is not dense makes CUDA run the math path, which keeps the attention
    matrices for the backward; the trace must count them."""
    case = ModelCase(f"attn-{mask_transposed}", lambda: _Attention(mask_transposed),
                     lambda g: (torch.randn(4, 128, 32, generator=g),), lambda m, x: m(x), info={})
    trace = trace_step(case)
    fused = "aten._scaled_dot_product_efficient_attention" in trace.op_names
    assert fused is not mask_transposed
    assert ("aten._safe_softmax" in trace.op_names) is mask_transposed
    matrix = 4 * 2 * 128 * 128 * 4  # one fp32 attention matrix
    if mask_transposed:
        assert trace.peak_bytes() > 2 * matrix  # softmax output and dropout output live into the backward
    else:
        assert trace.peak_bytes() < 2 * matrix
