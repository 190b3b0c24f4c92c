"""Mixed precision and recompute on the real cuda backend (safety cap on, small models)."""

from __future__ import annotations

import math

import pytest
import torch

from um_lab.runs.runner import run
from um_lab.types import RunSpec

pytestmark = pytest.mark.gpu

GPT2 = {"batch_size": 2, "seq_len": 128, "n_layer": 2}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_trains_with_fp32_master_weights(precision, tmp_path):
    loaded = run(RunSpec(model="gpt2-small", backend="cuda", steps=4, warmup_steps=1, model_kwargs=GPT2,
                         precision=precision), out_dir=tmp_path)
    assert loaded.complete, loaded.status
    assert loaded.spec.precision == precision and loaded.model["info"]["precision"] == precision
    records = list(loaded.records())
    assert all(math.isfinite(r.loss) and 4 < r.loss < 15 for r in records)  # unscaled: a language-model loss
    if precision == "fp16":
        assert all(r.extra["loss_scale"] > 1 for r in records)


def test_recompute_trains_to_the_same_loss_in_less_activation_memory(tmp_path):
    torch.backends.cudnn.deterministic = True
    plain, recomputed = (run(RunSpec(model="mlp", backend="cuda", steps=3, warmup_steps=1, seed=3,
                                     model_kwargs={"width": 2048, "depth": 6, "batch_size": 512}, recompute=r),
                             out_dir=tmp_path / str(r)) for r in ("none", "every-layer"))
    a, b = list(plain.records()), list(recomputed.records())
    assert [r.loss for r in a] == pytest.approx([r.loss for r in b], rel=1e-5)
    # the act pool's segments: its high-water mark (the caching allocator keeps them between steps)
    assert b[-1].live_bytes["act"] < 0.8 * a[-1].live_bytes["act"], (a[-1].live_bytes, b[-1].live_bytes)
