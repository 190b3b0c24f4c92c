"""Link passes over a GEMM's remote weight by layout and shape (um_lab.sim.gemm_passes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from um_lab.sim.access import link_passes
from um_lab.sim.gemm_passes import fit_gemm_passes, grid_rows, law_passes, passes_nn, passes_nt
from um_lab.sim.ops import GEMM_A, GEMM_XW, GEMM_XW_BIAS, GEMM_XWT, GEMM_XWT_BIAS, remote_reads
from um_lab.sim.profile import load_profile

ROOT = Path(__file__).parents[1]
GRID = ROOT / "bench" / "results" / "gemm_tiles.json"


def test_the_packaged_constants_are_the_fit_on_the_grid() -> None:
    h200 = load_profile("h200")
    fields, why = fit_gemm_passes(json.loads(GRID.read_text()), h200.remote_GBps)
    for name, value in fields.items():
        assert getattr(h200, name) == pytest.approx(value), name
    lo, hi = why["gemm_nt_passes"]["range"]
    assert lo < h200.gemm_nt_passes < hi


def test_the_fit_follows_the_grid_within_its_scatter() -> None:
    h200 = load_profile("h200")
    rows = grid_rows(json.loads(GRID.read_text()), h200.remote_GBps)
    assert len(rows) == 160
    errors = []
    for r in rows:
        m, k, n, b = (np.array([v]) for v in (r["M"], r["K"], r["N"], r["bias"]))
        model = passes_nt(m, n, b, h200) if r["layout"] == "nt" else passes_nn(m, k, n, b, h200)
        errors.append(abs(np.log(model[0] / r["passes"])))
    assert np.mean(errors) < 0.25
    assert np.median(errors) < 0.25


def test_linear_forward_and_backward_read_the_weight_in_their_layouts() -> None:
    x = torch.empty(2048, 768, device="meta")
    w = torch.empty(3072, 768, device="meta")  # nn.Linear weight [out, in]
    bias = torch.empty(3072, device="meta")
    fwd = remote_reads("aten.addmm", (bias, x, w.t()))
    assert fwd[1] == [(3072.0, GEMM_A, 1.0)]
    assert fwd[2] == [(2048.0, GEMM_XWT_BIAS, 1.0, 768.0, 3072.0)]
    gy = torch.empty(2048, 3072, device="meta")
    assert remote_reads("aten.mm", (gy, w))[1] == [(2048.0, GEMM_XW, 1.0, 3072.0, 768.0)]
    conv1d_w = torch.empty(768, 3072, device="meta")  # GPT-2's Conv1D weight [in, out]: x @ W
    assert remote_reads("aten.addmm", (bias, x, conv1d_w))[2][0][1] == GEMM_XW_BIAS
    assert remote_reads("aten.mm", (gy, conv1d_w.t()))[1][0][1] == GEMM_XWT


def test_passes_grow_with_rows_and_few_rows_shrink_the_tile() -> None:
    p = load_profile("h200")
    no = np.array([False, False])
    assert np.all(np.diff(passes_nt(np.array([2048.0, 8192.0]), np.array([768.0, 768.0]), no, p)) > 0)
    assert np.all(np.diff(passes_nn(np.array([2048.0, 8192.0]), np.array([3072.0] * 2), np.array([768.0] * 2),
                                    no, p)) > 0)
    # below the grid, x @ W^T keeps enough thread blocks: a wider W gets fewer passes, never over M / 32
    few = passes_nt(np.array([256.0, 256.0]), np.array([4096.0, 8192.0]), no, p)
    assert few[0] == pytest.approx(8.0) and few[1] == pytest.approx(p.gemm_small_m_ctas * 128 / 8192)
    assert passes_nt(np.array([64.0]), np.array([64.0]), np.array([False]), p)[0] == pytest.approx(2.0)


def test_link_passes_needs_the_gemm_shape_and_uses_it() -> None:
    p = load_profile("h200")
    reuse, cls = np.array([8192.0]), np.array([GEMM_XWT])
    with pytest.raises(ValueError, match="K and N"):
        link_passes(reuse, cls, p)
    narrow = link_passes(reuse, cls, p, None, np.array([768.0]), np.array([768.0]))
    wide = link_passes(reuse, cls, p, None, np.array([768.0]), np.array([50257.0]))
    assert wide[0] < narrow[0]


def test_gemm_shapes_lists_a_models_weight_gemms_from_its_trace():
    """bench/gemm_shapes.py's shape list (the CPU half of the per-shape measurement): GPT-2's Conv1D forward
    is x @ W with a fused bias, its input gradient x @ W^T without one; counts per step by layer."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from gemm_shapes import weight_gemms

    from um_lab.models import get_model
    from um_lab.sim.trace import trace_step

    case = get_model("gpt2-small", batch_size=2, seq_len=16, n_layer=2, n_embd=64, n_head=2, vocab_size=100)
    rows = weight_gemms(trace_step(case))
    shapes = {(r["layout"], r["bias"], r["M"], r["K"], r["N"]): r["count"] for r in rows}
    assert shapes[("nn", True, 32, 64, 192)] == 2  # c_attn forward, one per layer
    assert shapes[("nt", False, 32, 192, 64)] == 2  # its input gradient
    assert ("nt", False, 32, 64, 100) in shapes  # the tied head: x @ wte^T
    passes = law_passes(rows, load_profile("h200"))
    assert len(passes) == len(rows) and all(p >= 1.0 for p in passes)


def test_measured_shapes_replace_the_law_at_those_shapes_only(tmp_path):
    """Profile.gemm_shape_passes (from bench/gemm_shapes.py results) wins over the power law at its exact
    shapes; an empty table is left out of the profile's dict, so existing digests stay valid."""
    from um_lab.sim.gemm_passes import load_gemm_shapes
    from um_lab.sim.profile import Profile, profile_sha256

    base = load_profile("h200").replace(gemm_shape_passes=())
    assert "gemm_shape_passes" not in base.to_dict()
    report = {"passes_at_GBps": base.remote_GBps, "rows": [
        {"layout": "nt", "bias": True, "M": 6304, "K": 1024, "N": 1024, "passes": 162.6},
        {"layout": "nt", "bias": True, "M": 6304, "K": 1024, "N": 1024, "passes": 160.0},
        {"layout": "nn", "bias": False, "M": 6304, "K": 1024, "N": 4096, "passes": None}]}
    (tmp_path / "shapes.json").write_text(json.dumps(report))
    table = load_gemm_shapes([tmp_path / "shapes.json"])
    assert table == (("nt", 1, 6304, 1024, 1024, 161.3),)
    measured = base.replace(gemm_shape_passes=table)
    assert profile_sha256(measured) != profile_sha256(base)
    again = Profile.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert again.gemm_shape_passes == table
    reuse = np.array([6304.0, 6304.0, 6304.0])
    reread = np.array([GEMM_XWT_BIAS, GEMM_XWT, GEMM_XWT_BIAS])
    k, n = np.array([1024.0, 1024.0, 1024.0]), np.array([1024.0, 1024.0, 4096.0])
    law = link_passes(reuse, reread, base, gemm_k=k, gemm_n=n)
    got = link_passes(reuse, reread, measured, gemm_k=k, gemm_n=n)
    assert got[0] == pytest.approx(161.3) and got[0] != law[0]
    assert got[1] == law[1] and got[2] == law[2]  # no bias / another N: the law
    with pytest.raises(ValueError, match="gemm_shape_passes rows"):
        Profile.from_dict({**base.to_dict(), "gemm_shape_passes": [["tn", 1, 8, 8, 8, 2.0]]})


def test_the_law_factor_scales_unmeasured_shapes_and_its_band_spans_the_models_timed(tmp_path):
    """Profile.gemm_law_factor multiplies the law's passes at shapes the table lacks (never the table's own);
    law_spread gives its band: measured over law link bytes, one value per model; the packaged profile
    records that band, so a zero-copy step's band widens on the slow side."""
    from um_lab.sim.band import corner_profiles, profile_ranges
    from um_lab.sim.gemm_passes import law_spread

    base = load_profile("h200")
    assert base.gemm_law_factor == 1.0 and base.gemm_shape_passes
    layout, bias, m, k, n, measured = max(base.gemm_shape_passes, key=lambda row: row[2])  # far from the clip
    cls = (GEMM_XWT_BIAS if bias else GEMM_XWT) if layout == "nt" else (GEMM_XW_BIAS if bias else GEMM_XW)
    reuse, reread = np.array([float(m), float(m) + 1]), np.array([cls, cls])
    kk, nn = np.array([float(k), float(k)]), np.array([float(n), float(n)])
    one = link_passes(reuse, reread, base, gemm_k=kk, gemm_n=nn)
    two = link_passes(reuse, reread, base.replace(gemm_law_factor=2.0), gemm_k=kk, gemm_n=nn)
    assert one[0] == two[0] == pytest.approx(measured) and two[1] == pytest.approx(2 * one[1])
    tiny = np.array([8.0, 8.0])  # the law's clip holds after the factor: never below one pass, nor above M / 32
    low = link_passes(tiny, reread, base.replace(gemm_law_factor=0.5), gemm_k=kk, gemm_n=nn)
    high = link_passes(np.array([64.0, 64.0]), reread, base.replace(gemm_law_factor=50.0), gemm_k=kk, gemm_n=nn)
    assert (low >= 1.0).all() and (high <= 2.0).all()
    rows = [{"layout": "nt", "bias": False, "M": 8, "K": 4, "N": 4, "count": 2, "weight_bytes": 64,
             "model_passes": 10.0, "passes": 15.0},
            {"layout": "nn", "bias": False, "M": 8, "K": 4, "N": 4, "count": 1, "weight_bytes": 64,
             "model_passes": 10.0, "passes": None}]
    (tmp_path / "a.json").write_text(json.dumps({"model": "a", "kwargs": {}, "rows": rows}))
    rows2 = [dict(rows[0], passes=5.0)]
    (tmp_path / "b.json").write_text(json.dumps({"model": "b", "kwargs": {"batch_size": 2}, "rows": rows2}))
    spread = law_spread([tmp_path / "a.json", tmp_path / "b.json"])
    assert spread["per_model"] == {"a": 1.5, "b batch_size=2": 0.5} and spread["range"] == [0.5, 1.5]
    with pytest.raises(ValueError, match="no timed GEMM shapes"):
        law_spread([])
    lo, hi = profile_ranges("h200")["gemm_law_factor"]
    assert lo < 1.0 < hi
    fast, slow = corner_profiles("h200")
    assert fast.gemm_law_factor == lo and slow.gemm_law_factor == hi
