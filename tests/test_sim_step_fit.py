"""Constants fitted on per-op training steps (um_lab.sim.step_fit) and the model pieces they feed:
host-only ops, column reductions, the read-and-write link rate, CPU attention costed as fused attention."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from um_lab.models import custom
from um_lab.policy import Advice, Policy
from um_lab.sim import step_fit
from um_lab.sim.ops import is_column_reduction
from um_lab.sim.placement import BLOCK
from um_lab.sim.profile import Profile, load_profile
from um_lab.sim.roofline import op_host_us
from um_lab.sim.trace import KIND_ATTENTION, PHASE_BWD, PHASE_FWD, trace_step
from um_lab.sim.uvm import AdviceTable, UvmModel
from um_lab.types import DataType

DETAIL = Path(__file__).parents[1] / "bench" / "results" / "step_detail.json"
FULL = np.uint32(0xFFFFFFFF)


def test_nonneg_lstsq_recovers_known_costs_and_never_goes_negative() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(10, 1000, size=(8, 3))
    truth = np.array([18.0, 9.0, 5.0])
    assert step_fit._nonneg_lstsq(x, x @ truth) == pytest.approx(truth, rel=1e-6)
    y = x @ np.array([18.0, 0.0, 5.0]) - 50 * x[:, 1]  # the best unconstrained fit is negative there
    coef = step_fit._nonneg_lstsq(x, y)
    assert (coef >= 0).all() and coef[1] == 0.0


def test_host_fit_reproduces_the_committed_tiny_batch_steps() -> None:
    """The packaged profile's host costs come from the tiny-batch steps and reproduce each within 3%."""
    detail = json.loads(DETAIL.read_text())
    fields, why = step_fit.fit_host_costs(detail)
    rows = why["host_fit_rows"]
    assert len(rows) >= 5
    for row in rows:
        assert row["fitted_ms"] == pytest.approx(row["measured_ms"], rel=0.03), row
    p = load_profile("h200")
    for name in step_fit.HOST_FIELDS:
        assert getattr(p, name) == pytest.approx(fields[name]), name
    assert p.cpu_bwd_op_us < p.cpu_op_us  # the C++ engine issues backward ops more cheaply than Python


def test_gemm_rate_fit_recovers_a_synthetic_roofline() -> None:
    peak, half = 48.0, 0.8
    ops = []
    for m, k, n in [(512, 1024, 1024), (2048, 768, 3072), (8192, 1024, 4096), (4096, 4096, 4096), (256, 512, 512)]:
        gflop = 2 * m * k * n / 1e9
        us = gflop * 1e3 * (gflop + half) / (peak * gflop)
        ops.append({"op": "aten::mm", "shapes": str([[m, k], [k, n]]), "count": 2, "self_device_ms": 2 * us / 1e3})
    detail = {"configs": [{"kind": "shapes", "policy": "um-default", "ops": ops}]}
    fields, why = step_fit.fit_gemm_rate(detail)
    assert fields["matmul_tflops"] == pytest.approx(peak, abs=0.3)
    assert fields["matmul_half_gflop"] == pytest.approx(half, rel=0.1)
    assert why["matmul_tflops"]["range"][1] <= peak
    assert step_fit.gemm_shape("aten::addmm", "[[768], [2048, 768], [768, 3072]]") == (2048, 768, 3072)
    assert step_fit.gemm_shape("aten::mm", "[[2, 3], [4, 5]]") is None  # inner sizes differ


def test_remote_elementwise_fit_reads_rates_from_act_remote_ops() -> None:
    s = [4, 512, 3072]
    nbytes = 4 * 4 * 512 * 3072

    def op(name: str, shapes: list, total_bytes: float, gbps: float) -> dict:
        return {"op": name, "shapes": str(shapes), "count": 1, "self_device_ms": total_bytes / (gbps * 1e9) * 1e3}

    ops = [op("aten::mul", [s, s], 3 * nbytes, 66.0), op("aten::add_", [s, s, []], 2 * nbytes, 66.0),
           op("aten::sum", [[2048, 3072], [], [], []], 2048 * 3072 * 4, 19.0),
           op("aten::mul", [[3, 3], [3, 3]], 1e3, 1.0)]  # too small: ignored
    detail = {"configs": [{"kind": "shapes", "policy": "act-remote", "ops": ops}]}
    fields, _ = step_fit.fit_remote_elementwise(detail)
    assert fields["remote_rw_GBps"] == pytest.approx(66.0, rel=0.01)
    assert fields["remote_colreduce_GBps"] == pytest.approx(19.0, rel=0.01)


def test_column_reduction_is_a_sum_that_keeps_the_last_dim() -> None:
    x = torch.empty(8, 16)
    assert is_column_reduction((x, [0]))
    assert not is_column_reduction((x, [1]))
    assert not is_column_reduction((x, [-1]))
    assert not is_column_reduction((x,))  # a full sum
    assert is_column_reduction((torch.empty(2, 3, 4), [0, 1]))


class _Viewy(nn.Module):
    """Linear layers with reshapes in between: host-only ops the trace must count."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).view(-1, 4, 4).transpose(1, 2).reshape(-1, 16).unsqueeze(0).squeeze(0)
        return self.b(h)


def test_trace_counts_host_only_ops_and_the_host_model_charges_them() -> None:
    case = custom("viewy", _Viewy(), (torch.randn(8, 16), torch.randint(0, 4, (8,))))
    tr = trace_step(case)
    assert tr.op_host_only is not None and len(tr.op_host_only) == tr.n_ops
    fwd = tr.op_phase == PHASE_FWD
    assert tr.op_host_only[fwd].sum() >= 4  # view, transpose, reshape, unsqueeze, squeeze (some fold)
    p = dataclasses.replace(Profile(), cpu_op_us=10.0, cpu_bwd_op_us=3.0, cpu_view_op_us=2.0, cpu_step_us=500.0,
                            cpu_cudnn_call_us=0.0, cpu_foreach_tensor_us=0.0)
    host = op_host_us(tr, p)
    timed = np.arange(tr.n_ops) > 0
    bwd = tr.op_phase == PHASE_BWD
    expect = (10.0 * (timed & ~bwd).sum() + 3.0 * (timed & bwd).sum()
              + 2.0 * tr.op_host_only[timed & ~bwd].sum() + 500.0)
    assert host.sum() == pytest.approx(expect)
    assert host[0] == 0.0 and host[1] >= 500.0  # the step's fixed cost before its first op


def test_cpu_attention_of_multihead_attention_is_costed_as_fused_attention() -> None:
    mha = nn.MultiheadAttention(64, 4, batch_first=True)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x, x, x, need_weights=False)[0].square().mean()

    tr = trace_step(custom("mha", mha, (torch.randn(2, 32, 64),), loss_fn=loss))
    att = tr.op_kind == KIND_ATTENTION
    assert att.sum() == 2  # forward and backward
    fwd_flops = 4 * 2 * 4 * 32 * 32 * 16  # 4 * batch * heads * q * k * head_dim
    assert tr.op_flops[att & (tr.op_phase == PHASE_FWD)].sum() == pytest.approx(fwd_flops)


def test_remote_read_and_write_share_the_link_unless_in_place() -> None:
    p = dataclasses.replace(Profile(), remote_GBps=50.0, remote_write_GBps=50.0, remote_rw_GBps=66.0,
                            remote_inplace_GBps=84.0)
    zero_copy = Advice(preferred_location="cpu", accessed_by=frozenset({"gpu"}))
    model = UvmModel(p, AdviceTable.from_policy(Policy("zc", {DataType.ACT: zero_copy})), 8 * BLOCK, 2)
    model.block_type[:] = 3
    b = np.array([0, 1], np.int64)
    m = np.full(2, FULL, np.uint32)
    protect = np.ones(2, bool)
    read = np.array([1e6, 0.0])
    write = np.array([0.0, 1e6])
    _, separate = model.access(b, m, np.array([0, FULL], np.uint32), read, protect, write, np.zeros(2))
    assert separate == pytest.approx(2e6 / 66e3)  # a read stream and a write stream: 66 GB/s together
    one = np.array([0], np.int64)
    _, in_place = model.access(one, m[:1], m[:1], np.array([1e6]), protect[:1], np.array([1e6]),
                               np.array([1e6]))
    assert in_place == pytest.approx(2e6 / 84e3)  # an in-place update: the in-place rate
    _, read_only = model.access(one, m[:1], np.zeros(1, np.uint32), np.array([1e6]), protect[:1])
    assert read_only == pytest.approx(1e6 / 50e3)


def test_vit_replica_has_torchvision_vit_b16_size_and_traces_like_it() -> None:
    """The ViT replica lets the simulator (and these fits) run without torchvision: same parameters as
    ViT-B/16 (86,567,656 with 1000 classes) and, where torchvision loads, the same trace op for op."""
    import importlib.util

    from um_lab.sim.replicas import vit_replica

    case = vit_replica("b16", batch_size=2, image_size=64)
    model = case.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 86_567_656 - (197 - 17) * 768  # fewer positions at 64 px: 4x4 patches + class token
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        from um_lab.models import get_model

        real = trace_step(get_model("vit-b16", batch_size=2, image_size=64))
    except (ImportError, RuntimeError) as e:  # a torchvision build that does not load with this torch
        pytest.skip(f"torchvision does not load here: {e}")
    mine = trace_step(case)
    assert mine.op_names == real.op_names
    for field in ("op_bytes", "op_flops", "op_host_only", "st_nbytes", "acc_lo", "acc_hi"):
        assert np.array_equal(getattr(mine, field), getattr(real, field)), field


def test_saturating_fit_recovers_peak_and_half_size_from_summed_kernel_times() -> None:
    """The attention and convolution fits share one grid search over whole steps' kernel sums."""
    peak, half = 40.0, 1.0
    steps = []
    for sizes in ([0.2, 0.5, 1.0], [2.0, 4.0], [8.0, 16.0, 32.0]):
        g = np.array(sizes)
        steps.append((g, float((g * 1e3 * (g + half) / (peak * g)).sum())))
    got_peak, got_half = step_fit._fit_saturating(steps, np.arange(20.0, 60.01, 0.5), np.geomspace(0.1, 10.0, 41))
    assert got_peak == pytest.approx(peak) and got_half == pytest.approx(half, rel=1e-6)
