"""Mixed precision and recompute as run options: checked input, the model's layers, the same numbers with
recompute, less memory in the simulator's trace, fp16's loss scale, and the spec, table and CLI that carry them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from um_lab.app import cli
from um_lab.errors import SpecError
from um_lab.models import custom, get_model
from um_lab.runs.sweep import compare
from um_lab.sim.trace import trace_step
from um_lab.training import LossScaler, apply_recompute, layer_names, recompute_layers, with_training
from um_lab.types import RunSpec, check_precision, check_recompute

GPT2_TINY = {"batch_size": 2, "seq_len": 64, "n_layer": 3, "n_embd": 64, "n_head": 2}


def _mlp(width: int = 64, depth: int = 4):
    return get_model("mlp", width=width, depth=depth, batch_size=16)


@pytest.mark.parametrize("bad", ["fp8", "FP32", None, 16])
def test_a_precision_that_is_not_one_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(SpecError, match="precision"):
        check_precision(bad)
    with pytest.raises(SpecError, match="precision"):
        RunSpec(precision=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "canonical"), [("none", "none"), ("every-layer", "every-layer"), ("3", 3), (2, 2),
                                                  ("blocks.0", ("blocks.0",)), (["a", "b"], ("a", "b"))])
def test_recompute_takes_a_name_a_count_or_layers(given: object, canonical: object) -> None:
    assert check_recompute(given) == canonical


@pytest.mark.parametrize("bad", [None, True, -1, 1.5])
def test_a_recompute_that_is_not_one_is_refused(bad: object) -> None:
    with pytest.raises(SpecError, match="recompute"):
        check_recompute(bad)


def test_the_layers_are_the_repeated_blocks_outermost_first() -> None:
    with torch.device("meta"):
        mlp = _mlp(depth=5).build_model()
        gpt2 = get_model("gpt2-small", **GPT2_TINY).build_model()
    assert layer_names(mlp) == [str(i) for i in range(5)]
    assert layer_names(gpt2) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert layer_names(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_recompute_refuses_layers_the_model_has_not() -> None:
    model = _mlp(depth=3).build_model()
    with pytest.raises(SpecError, match="not layers of .*its layers: 0, 1, 2"):
        recompute_layers(model, ("0", "nope"))
    with pytest.raises(SpecError, match="has 3 layers"):
        recompute_layers(model, 4)
    with pytest.raises(SpecError, match="no repeated layers"):
        recompute_layers(nn.Linear(3, 3), "every-layer")
    assert [n for n, _ in recompute_layers(model, 2)] == ["0", "1"]


def _loss_and_grads(case, seed: int = 0) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = case.build_model()
    loss = case.loss_fn(model, *case.batch(seed))
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("name", "kwargs"), [("mlp", {"width": 64, "depth": 4, "batch_size": 16}),
                                              ("gpt2-small", GPT2_TINY)])
def test_recompute_gives_the_same_loss_and_gradients_in_fp32(name: str, kwargs: dict) -> None:
    case = get_model(name, **kwargs)
    plain_loss, plain_grads = _loss_and_grads(case)
    loss, grads = _loss_and_grads(with_training(case, recompute="every-layer"))
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_apply_recompute_wraps_each_chosen_layer_once() -> None:
    model = _mlp(depth=3).build_model()
    assert apply_recompute(model, ["1"]) == ["1"]
    wrapped = model[1].forward
    apply_recompute(model, "every-layer")
    assert model[1].forward is wrapped and "forward" in vars(model[0]) and "forward" in vars(model[2])


def test_the_trace_keeps_fewer_activations_with_recompute_and_in_bf16() -> None:
    case = get_model("gpt2-small", batch_size=4, seq_len=256, n_layer=6, n_embd=128, n_head=4, vocab_size=256)
    plain = trace_step(case)
    recomputed = trace_step(with_training(case, recompute="every-layer"))
    bf16 = trace_step(with_training(case, precision="bf16"))
    assert recomputed.peak_bytes() < 0.8 * plain.peak_bytes()
    assert recomputed.n_ops > plain.n_ops  # the forward of every layer runs again in backward
    assert bf16.bytes_by_type()["act"] < plain.bytes_by_type()["act"]
    assert bf16.op_16bit is not None and bf16.op_16bit.any()
    assert plain.op_16bit is None or not plain.op_16bit.any()
    assert bf16.bytes_by_type(persistent_only=True)["param"] == plain.bytes_by_type(persistent_only=True)["param"]


def test_training_options_change_what_the_case_records() -> None:
    case = _mlp()
    assert with_training(case) is case
    changed = with_training(case, "bf16", ["0", "2"])
    assert changed.info["precision"] == "bf16" and changed.info["recompute"] == ["0", "2"]
    assert changed.name == case.name


def test_a_custom_model_takes_recompute_by_its_own_layer_names() -> None:
    def build() -> nn.Module:
        return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)), nn.Linear(8, 2))

    case = custom("mine", build, lambda g: (torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)),
                  lambda m, x, y: nn.functional.cross_entropy(m(x), y))
    plain_loss, _ = _loss_and_grads(case)
    loss, _ = _loss_and_grads(with_training(case, recompute=["0", "1"]))
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    with pytest.raises(SpecError, match="its layers: 0, 1, 2"):
        with_training(case, recompute=["9"]).build_model()


def test_the_loss_scaler_skips_a_step_with_an_infinite_gradient() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("cpu")
    scaler.guard(opt)
    start = scaler.value
    before = model.weight.detach().clone()
    loss = model(torch.full((2, 4), float("inf"))).sum()
    scaler.scale(loss).backward()
    scaler.unscale(opt)
    opt.step()
    scaler.update()
    assert scaler.skipped == 1 and torch.equal(model.weight, before) and scaler.value < start
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale(opt)
    opt.step()
    scaler.update()
    assert scaler.skipped == 1 and not torch.equal(model.weight, before)


def test_the_spec_round_trips_precision_and_recompute() -> None:
    spec = RunSpec(model="mlp", precision="fp16", recompute=("0", "1"))
    back = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back.precision == "fp16" and back.recompute == ("0", "1")
    assert RunSpec().precision == "fp32" and RunSpec().recompute == "none"


def test_compare_shows_training_columns_only_when_chosen(tmp_path) -> None:
    kw = {"width": 64, "depth": 3, "batch_size": 8}
    plain = compare(models={"mlp": kw}, policies=["um-default"], backend="sim", steps=1, warmup_steps=0,
                    out_dir=tmp_path / "a", progress=False)
    chosen = compare(models={"mlp": kw}, policies=["um-default"], backend="sim", steps=1, warmup_steps=0,
                     out_dir=tmp_path / "b", progress=False, precision="bf16", recompute="every-layer")
    assert "precision" not in plain.columns and "recompute" not in plain.columns
    assert chosen["precision"].tolist() == ["bf16"] and chosen["recompute"].tolist() == ["every-layer"]


def test_the_cli_runs_with_precision_and_recompute_and_lists_layers(tmp_path, capsys) -> None:
    code = cli.main(["run", "--backend", "sim", "--model", "mlp", "--model-kw", "width=64", "--model-kw", "depth=3",
                     "--batch-size", "8", "--steps", "1", "--warmup", "0", "--precision", "bf16",
                     "--recompute", "0,2", "--out", str(tmp_path)])
    assert code == cli.EXIT_OK
    spec = json.loads(next(tmp_path.rglob("spec.json")).read_text())
    assert spec["precision"] == "bf16" and spec["recompute"] == ["0", "2"]
    assert cli.main(["models", "--layers", "mlp", "--model-kw", "depth=3"]) == cli.EXIT_OK
    assert capsys.readouterr().out.count("\n  ") >= 3
    assert cli.main(["run", "--backend", "sim", "--model", "mlp", "--recompute", "nope",
                     "--out", str(tmp_path / "bad")]) == cli.EXIT_USAGE
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_on_the_cpu_autocast_keeps_in_fp32_what_cuda_autocast_keeps_in_fp32():
    """The simulator traces on CPU tensors; CUDA's autocast computes pow, softmax, layer_norm ... in fp32 where the
    CPU's leaves them in bf16, so the trace runs under CudaAutocastOnCpu and keeps the GPU's dtypes (and bytes)."""
    from um_lab.training import CudaAutocastOnCpu

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ w).pow(3).dtype == torch.bfloat16  # the CPU's own choice
        with CudaAutocastOnCpu():
            h = x @ w
            assert h.dtype == torch.bfloat16  # matmuls stay 16-bit
            assert h.pow(3).dtype == torch.float32 and torch.pow(h, 3.0).dtype == torch.float32
            assert torch.softmax(h, -1).dtype == torch.float32 and torch.tanh(h).dtype == torch.bfloat16
    with CudaAutocastOnCpu():  # outside autocast nothing changes
        assert x.to(torch.bfloat16).pow(2).dtype == torch.bfloat16
