"""The simulator's model of convolutions on remote activations (implicit GEMMs, cuDNN's workspace)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from um_lab.policy import get_policy
from um_lab.sim.access import link_passes
from um_lab.sim.backend import SimBackend
from um_lab.sim.conv_act import (
    ACT_REMOTE,
    RESNET50_CONVS,
    TILE_FIELDS,
    ConvShape,
    conv_case,
    conv_samples,
    fit_conv_tile,
)
from um_lab.sim.ops import CONV_1X1, CONV_IGEMM, CONV_IGEMM_1X1, READ_ONCE, conv_geometry, conv_reads, conv_workspace
from um_lab.sim.profile import load_profile
from um_lab.sim.trace import cached_trace
from um_lab.types import DATA_TYPES, DataType

ROOT = Path(__file__).parents[1]


def test_conv_geometry_counts_the_im2col_volume() -> None:
    x = torch.empty(2, 64, 56, 56, device="meta")
    same = conv_geometry(x, torch.empty(128, 64, 3, 3, device="meta"), [1, 1], [1, 1], [1, 1], 1)
    assert (same.out_pixels, same.taps, same.im2col) == (56 * 56, 9, 9.0)
    strided = conv_geometry(x, torch.empty(128, 64, 3, 3, device="meta"), [2, 2], [1, 1], [1, 1], 1)
    assert strided.out_pixels == 28 * 28 and strided.im2col == pytest.approx(9 / 4)
    assert strided.filter_bytes == 128 * 64 * 9 * 4


def test_backward_reads_the_output_gradient_in_both_kernels() -> None:
    geo = conv_geometry(torch.empty(2, 64, 8, 8, device="meta"), torch.empty(32, 64, 3, 3, device="meta"),
                        [1, 1], [1, 1], [1, 1], 1)
    both = conv_reads(True, geo, (True, True))
    assert [c for _, c, _ in both[0]] == [CONV_IGEMM, CONV_IGEMM]  # data gradient + filter gradient
    assert both[0][0][2] == 9 and both[1][0][2] == pytest.approx(9)  # im2col'd grad_y / x
    only_weight = conv_reads(True, geo, (False, True))
    assert len(only_weight[0]) == 1 and only_weight[2] == [(1.0, READ_ONCE, 1.0)]  # no data gradient
    one = conv_geometry(torch.empty(2, 64, 8, 8, device="meta"), torch.empty(32, 64, 1, 1, device="meta"),
                        [1, 1], [0, 0], [1, 1], 1)
    assert conv_reads(False, one)[1][0][1] == CONV_1X1  # a 1x1 filter is read directly, per pixel tile


def test_kxk_filter_copy_is_a_workspace_in_the_activation_pool() -> None:
    x, w = torch.empty(2, 8, 8, 8), torch.empty(16, 8, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    nbytes, (reuse, cls, _) = conv_workspace("aten.convolution", args)
    assert nbytes == 16 * 8 * 9 * 4 and cls == CONV_IGEMM and reuse == 2 * 64
    assert conv_workspace("aten.convolution", (x, torch.empty(16, 8, 1, 1), None, [1, 1], [0, 0], [1, 1],
                                               False, [0, 0], 1)) is None
    tr = cached_trace(conv_case(ConvShape(8, 16, 8, 3), batch_size=2))
    fwd = tr.op_names.index("aten.convolution")
    new = np.flatnonzero(tr.st_alloc == fwd)
    ws = [s for s in new if tr.st_nbytes[s] == nbytes]
    assert ws and tr.st_type[ws[0]] == DATA_TYPES.index(DataType.ACT) and tr.st_free[ws[0]] == fwd + 1


def test_igemm_passes_scale_with_the_tile_and_the_volume() -> None:
    p = load_profile("h200")
    reuse = np.array([p.tile_conv_igemm_kxk * 4, 8.0, p.tile_conv_igemm_1x1 * 3])
    passes = link_passes(reuse, np.array([CONV_IGEMM, CONV_IGEMM, CONV_IGEMM_1X1]), p, np.array([9.0, 2.0, 1.0]))
    assert passes.tolist() == pytest.approx([36.0, 2.0, 3.0])  # narrow outputs: one pass of the volume


def test_remote_activations_slow_a_kxk_conv_far_more_than_its_bytes() -> None:
    sim = SimBackend("h200")
    case = conv_case(ConvShape(64, 64, 28, 3), batch_size=8)
    _, local = sim.op_ms(case, get_policy("um-default"))
    _, remote = sim.op_ms(case, ACT_REMOTE)
    x_ms = 8 * 64 * 28 * 28 * 4 / (sim.profile.remote_GBps * 1e6)  # one pass over the input
    assert remote["aten.convolution"][1] > 5 * x_ms > local["aten.convolution"][1]


def test_fitted_tile_matches_the_measured_convolutions_in_geometric_mean() -> None:
    data = json.loads((ROOT / "bench" / "results" / "conv_in_step.json").read_text())
    rows = [r for r in data["rows"] if r["shape"] in {s.label for s in RESNET50_CONVS[:6]}]  # 1x1 and 3x3
    profile = load_profile("h200")
    fields, why = fit_conv_tile({**data, "rows": rows}, profile, ACT_REMOTE)
    samples = conv_samples(rows, dataclasses.replace(profile, **fields), ACT_REMOTE)
    assert len(samples) == 2 * 6
    for kind, field in TILE_FIELDS.items():
        ratios = [math.log(s["ratio"]) for s in samples if s["kind"] == kind]
        assert ratios and abs(sum(ratios) / len(ratios)) < 0.05, kind
        lo, hi = why[field]["range"]
        assert lo < fields[field] < hi





def test_transposed_and_grouped_convolutions_are_read_once():
    from um_lab.sim.ops import is_dense_conv, remote_reads

    x, w = torch.empty(2, 8, 8, 8), torch.empty(8, 1, 3, 3)
    depthwise = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8)
    transposed = (x, torch.empty(8, 4, 4, 4), None, [2, 2], [1, 1], [1, 1], True, [0, 0], 1)
    dense = (x, torch.empty(16, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert not is_dense_conv("aten.convolution", depthwise) and not is_dense_conv("aten.convolution", transposed)
    assert remote_reads("aten.convolution", depthwise) == {} and conv_workspace("aten.convolution", transposed) is None
    assert is_dense_conv("aten.convolution", dense) and remote_reads("aten.convolution", dense)[0][0][1] == CONV_IGEMM
    # cudnn_convolution's own argument order: (x, w, padding, stride, dilation, groups, ...)
    assert is_dense_conv("aten.cudnn_convolution", (x, dense[1], [1, 1], [1, 1], [1, 1], 1, False, False, True))


def test_an_op_whose_accounting_fails_becomes_a_zero_cost_op_without_accesses(monkeypatch):
    from um_lab.sim import trace as trace_module

    def broken(name, args):
        if name == "aten.convolution":
            raise ValueError("boom")
        return None

    monkeypatch.setattr(trace_module, "conv_workspace", broken)
    with pytest.warns(UserWarning, match="accounting failed"):
        tr = trace_module.trace_step(conv_case(ConvShape(4, 8, 8, 3), batch_size=2))
    i = tr.op_names.index("aten.convolution")
    assert tr.acc_ptr[i + 1] == tr.acc_ptr[i] and tr.op_flops[i] == 0  # no accesses left behind
    assert tr.acc_ptr[i + 2] > tr.acc_ptr[i + 1]  # the next op keeps only its own
    assert len(tr.op_names) == len(tr.op_phase) == tr.n_ops
