"""CPU tests of the model zoo, user models, memory estimates and the size chooser."""

from __future__ import annotations

import importlib.util
import math
import pickle

import pytest
import torch
from torch import nn

from um_lab.errors import OversubscriptionRefused
from um_lab.models import (
    ZOO,
    ModelCase,
    case_for_spec,
    custom,
    describe_models,
    get_model,
    gpt2,
    install_hint,
    mlp,
    register,
    resnet,
)
from um_lab.sizing import SizeRefused, check_fits, estimate_memory, size_for_ratio
from um_lab.types import RunSpec

TINY_GPT2 = {"batch_size": 2, "seq_len": 16, "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 97}
TINY_BERT = {"batch_size": 2, "seq_len": 16, "num_hidden_layers": 1, "hidden_size": 32,
             "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 97}
HAVE_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def train_one_step(case: ModelCase) -> float:
    model = case.build_model()
    optimizer = case.make_optimizer(list(model.parameters()))
    loss = case.loss_fn(model, *case.batch(0))
    loss.backward()
    optimizer.step()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return float(loss.detach())


def test_zoo_names_and_unknown_names():
    for name in ("mlp", "resnet18", "resnet50", "resnet152", "vit-b16", "gpt2-small", "gpt2-medium",
                 "gpt2-large", "gpt2-xl", "bert-base", "bert-large"):
        assert name in ZOO
    assert set(describe_models()) == set(ZOO)
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'; valid: mlp, resnet18, .*bert-large"):
        get_model("gpt5")
    with pytest.raises(ValueError, match=r"model 'mlp'.*colour.*its knobs: width=4096, depth=8"):
        get_model("mlp", colour=1)


def test_mlp_trains_and_batches_are_deterministic():
    case = get_model("mlp", width=8, depth=2, batch_size=3)
    x, y = case.batch(5)
    assert x.shape == (3, 8) and y.shape == (3,) and y.dtype == torch.int64
    assert torch.equal(case.batch(5)[0], x) and not torch.equal(case.batch(6)[0], x)
    assert math.isfinite(train_one_step(case))
    assert case.info == {"width": 8, "depth": 2, "batch_size": 3, "classes": 10}
    with pytest.raises(ValueError, match="width must be a positive integer"):
        mlp(width=0)


def test_existing_signatures_still_work():
    assert mlp().info["width"] == 4096  # built lazily: nothing allocated here
    case = gpt2("small", 2, 32)
    assert case.name == "gpt2-small" and case.info["seq_len"] == 32 and case.info["n_layer"] == 12
    assert resnet(50).name == "resnet50"
    with pytest.raises(ValueError, match="ResNet depth must be one of"):
        resnet(42)


def test_gpt2_and_bert_from_configs_with_overrides():
    case = get_model("gpt2-small", **TINY_GPT2)
    (ids,) = case.batch()
    assert ids.shape == (2, 16) and int(ids.max()) < 97
    loss = train_one_step(case)
    assert abs(loss - math.log(97)) < 1.0  # random init: about uniform over the vocabulary
    assert get_model("gpt2-xl").info["n_layer"] == 48 and get_model("gpt2-xl").info["n_embd"] == 1600
    assert math.isfinite(train_one_step(get_model("bert-base", **TINY_BERT)))
    assert get_model("bert-large").info["num_hidden_layers"] == 24
    with pytest.raises(ValueError, match=r"unknown GPT2Config field\(s\) \['n_layers'\]"):
        get_model("gpt2-small", n_layers=2)
    with pytest.raises(ValueError, match="GPT-2 size must be one of small, medium, large, xl"):
        gpt2("huge")


def test_torchvision_models_build_or_explain_what_is_missing():
    resnet_case = get_model("resnet18", batch_size=2, image_size=32, classes=10)
    vit_case = get_model("vit-b16", batch_size=2, image_size=32, classes=10, num_layers=1, hidden_dim=32,
                         num_heads=2, mlp_dim=64)
    assert resnet_case.batch()[0].shape == (2, 3, 32, 32)
    if HAVE_TORCHVISION:
        assert math.isfinite(train_one_step(resnet_case))
        assert math.isfinite(train_one_step(vit_case))
    else:
        for case in (resnet_case, vit_case):
            with pytest.raises(ImportError, match=r"needs torchvision") as caught:
                case.build_model()
            assert install_hint("torchvision") in str(caught.value)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        get_model("vit-b16", image_size=30)
    with pytest.raises(ValueError, match=r"unknown ViT knob\(s\) \['depth'\]"):
        get_model("vit-b16", depth=3)


def test_case_for_spec_applies_batch_size_and_knobs():
    case = case_for_spec(RunSpec(model="mlp", batch_size=7, model_kwargs={"width": 8, "depth": 1}))
    assert case.batch()[0].shape == (7, 8)


# ------------------------------------------------------------------------------------ user models


def test_custom_model_instance_is_copied_per_build():
    net = nn.Sequential(nn.Linear(4, 3))
    case = custom("mine", net, lambda g: (torch.randn(5, 4, generator=g),
                                          torch.randint(0, 3, (5,), generator=g)))
    a, b = case.build_model(), case.build_model()
    assert a is not net and a is not b
    assert torch.equal(a[0].weight, net[0].weight)
    assert math.isfinite(train_one_step(case)) and case.info["custom"] is True


def test_custom_batch_forms_loss_and_optimizer():
    fixed = (torch.ones(2, 4),)
    sgd_made = []

    def make_sgd(params):
        sgd_made.append(True)
        return torch.optim.SGD(params, lr=0.1)

    case = custom("mean", lambda: nn.Linear(4, 1), fixed, loss_fn=lambda m, x: m(x).mean(),
                  make_optimizer=make_sgd)
    assert case.batch()[0] is fixed[0]
    train_one_step(case)
    assert sgd_made == [True]
    no_arg = custom("noarg", nn.Linear(4, 2), lambda: torch.zeros(3, 4), loss_fn=lambda m, x: m(x).sum())
    assert no_arg.batch()[0].shape == (3, 4)
    with pytest.raises(TypeError, match="nn.Module or a factory"):
        custom("bad", 42, fixed)


def test_register_puts_a_case_in_the_zoo():
    def factory(batch_size=2):
        batch = (torch.zeros(batch_size, 4), torch.zeros(batch_size, dtype=torch.long))
        return custom("test-linear", nn.Linear(4, 2), batch)

    register("test-linear", factory)
    try:
        assert get_model("test-linear", batch_size=3).batch()[0].shape == (3, 4)
        with pytest.raises(ValueError, match="already in the zoo"):
            register("test-linear", mlp)
    finally:
        ZOO.pop("test-linear")


# ------------------------------------------------------------------------------ memory estimates


def mlp_param_bytes(width: int, depth: int, classes: int = 10) -> int:
    return 4 * (depth * (width * width + width) + width * classes + classes)


def test_analytic_estimate_of_mlp_is_exact_for_state():
    est = estimate_memory("mlp", width=64, depth=3, batch_size=16, use_sim_trace=False)
    params = mlp_param_bytes(64, 3)
    assert est.method == "analytic"
    assert est.bytes_per_type["param"] == params and est.bytes_per_type["grad"] == params
    assert est.bytes_per_type["optim"] == 2 * params  # AdamW: exp_avg and exp_avg_sq
    assert est.bytes_per_type["input"] == 16 * 64 * 4 + 16 * 8
    act = est.bytes_per_type["act"]
    # GELU inputs and outputs of 3 layers are saved: at least 5 tensors of batch x width floats
    assert act >= 5 * 16 * 64 * 4
    double = estimate_memory("mlp", width=64, depth=3, batch_size=32, use_sim_trace=False)
    assert double.bytes_per_type["act"] == pytest.approx(2 * act, rel=0.05)
    assert est.total_bytes == sum(est.bytes_per_type.values())
    assert "param" in est.describe() and "analytic" in est.describe()


def test_native_peak_is_the_traced_peak_plus_one_gemm_workspace_per_thread_that_runs_gemms():
    """A native step's peak: everything live at once over the traced step, plus the cuBLAS workspace of the
    forward's thread and of autograd's backward thread (both run GEMMs in an MLP); the profile sets its size."""
    from um_lab.sim.profile import HOPPER_GEMM_WORKSPACE_BYTES, load_profile
    from um_lab.sim.trace import cached_trace

    est = estimate_memory("mlp", width=64, depth=3, batch_size=16)
    peak = cached_trace(get_model("mlp", width=64, depth=3, batch_size=16)).peak_bytes()
    assert est.workspace_bytes == 2 * HOPPER_GEMM_WORKSPACE_BYTES
    assert est.native_peak_bytes == peak + 2 * HOPPER_GEMM_WORKSPACE_BYTES
    assert peak < est.total_bytes  # each type's own peak, summed, is at least the peak of all at once
    none = load_profile("h200").replace(gemm_workspace_bytes=0)
    assert estimate_memory("mlp", width=64, depth=3, batch_size=16, profile=none).native_peak_bytes == peak
    assert est.to_dict()["native_peak_bytes"] == est.native_peak_bytes
    assert estimate_memory("mlp", width=64, depth=3, batch_size=16, use_sim_trace=False).native_peak_bytes is None
    from um_lab.errors import ProfileError

    with pytest.raises(ProfileError):  # a profile that is not there is an error, not a quiet analytic estimate
        estimate_memory("mlp", width=64, depth=3, batch_size=16, profile="no-such-card")


def test_the_gemm_workspace_keeps_a_profile_digest_at_its_default_and_is_checked():
    from um_lab.errors import ProfileError
    from um_lab.sim.profile import Profile, load_profile, profile_sha256

    base = load_profile("h200")
    assert "gemm_workspace_bytes" not in base.to_dict()  # the default: digests of older profiles hold
    smaller = base.replace(gemm_workspace_bytes=4 << 20)
    assert smaller.to_dict()["gemm_workspace_bytes"] == 4 << 20 and profile_sha256(smaller) != profile_sha256(base)
    for bad in (-1, 1.5, float("nan"), "32MiB"):
        with pytest.raises(ProfileError, match="gemm_workspace_bytes"):
            Profile.from_dict({**base.to_dict(), "gemm_workspace_bytes": bad})


def test_analytic_estimate_of_a_large_model_allocates_nothing():
    est = estimate_memory("gpt2-medium", batch_size=1, seq_len=64, use_sim_trace=False)
    n_params = est.bytes_per_type["param"] / 4
    assert 3.4e8 < n_params < 3.7e8  # GPT-2 medium: ~355 M parameters (tied head counted once)
    assert est.bytes_per_type["optim"] == 2 * est.bytes_per_type["grad"]


def test_sim_trace_estimate_when_available_agrees_on_state():
    analytic = estimate_memory("mlp", width=32, depth=2, batch_size=8, use_sim_trace=False)
    est = estimate_memory("mlp", width=32, depth=2, batch_size=8)
    if importlib.util.find_spec("um_lab.sim.trace") is not None:
        assert est.method == "sim-trace"
        assert est.bytes_per_type["param"] == analytic.bytes_per_type["param"]
        assert est.bytes_per_type["grad"] == analytic.bytes_per_type["grad"]
        assert est.bytes_per_type["optim"] >= analytic.bytes_per_type["optim"]  # + step temporaries
        assert est.bytes_per_type["act"] > 0
    else:
        assert est == analytic


def test_estimate_of_a_custom_optimizer_counts_its_state():
    batch = (torch.zeros(2, 10), torch.zeros(2, dtype=torch.long))
    case = custom("sgd-net", lambda: nn.Linear(10, 10), batch,
                  make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    est = estimate_memory(case, use_sim_trace=False)
    assert est.bytes_per_type["optim"] == est.bytes_per_type["param"]  # one momentum buffer


def test_size_for_ratio_reaches_the_target_with_the_smallest_size():
    capacity = 64 * 2**20
    sized = size_for_ratio("mlp", capacity, 1.5, width=256, depth=2, use_sim_trace=False)
    assert sized.ratio >= 1.5
    below = estimate_memory("mlp", width=256, depth=2, batch_size=sized.knobs["batch_size"] - 1,
                            use_sim_trace=False)
    assert below.ratio(capacity) < 1.5
    assert sized.case.batch()[0].shape[0] == sized.knobs["batch_size"]
    wide = size_for_ratio("mlp", capacity, 0.5, knob="width", depth=2, batch_size=8, use_sim_trace=False)
    assert wide.ratio >= 0.5 and wide.knobs["width"] > 64
    with pytest.raises(ValueError, match="still below"):
        size_for_ratio("mlp", capacity, 100.0, width=8, depth=1, max_value=16, use_sim_trace=False)


def test_check_fits_refuses_above_the_cap_with_the_estimate():
    est = estimate_memory("mlp", width=64, depth=2, batch_size=4, use_sim_trace=False)
    assert check_fits(est, est.total_bytes) is est and check_fits(est, None) is est
    with pytest.raises(SizeRefused) as info:
        check_fits(est, est.total_bytes - 1)
    assert isinstance(info.value, OversubscriptionRefused)
    text = str(info.value)
    assert "does not fit under the safety cap" in text and "param" in text and "Nothing was allocated" in text
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == text
