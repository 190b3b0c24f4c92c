"""The memory planner's choice on the real cuda backend: a convolutional model whose plan fits its budget (cuDNN's
workspaces counted) trains with the scheduler idle, every byte its pools hold within B. ResNet-50 at batch 64 is
where the profile's workspace share was measured: this checks the planner, the run and the idle scheduler together."""

from __future__ import annotations

import pytest

from um_lab.runs.runner import run
from um_lab.types import RunSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_planned_convnet_that_fits_its_budget_lets_the_scheduler_idle(precision, tmp_path):
    pytest.importorskip("torchvision")
    loaded = run(RunSpec(model="resnet50", backend="cuda", steps=5, warmup_steps=1, model_kwargs={"batch_size": 64},
                         precision=precision, recompute="auto", budget="0.7x"), out_dir=tmp_path)
    assert loaded.complete, loaded.status
    plan = loaded.model["plan"]
    assert plan["crossing_bytes"] == 0 and plan["recompute"] not in ("none", "every-layer"), plan["recompute"]
    budgets = [r.extra["budget"] for r in loaded.records()]
    later = budgets[2:]  # the first steps learn the order and plan
    assert later and all(b.get("idle") for b in later), [(b.get("idle"), b.get("held_bytes")) for b in budgets]
    assert all(b["held_bytes"] <= plan["budget_bytes"] for b in later), (plan["budget_bytes"], later)
