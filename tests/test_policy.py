"""Policies: presets, validation naming the field, JSON round trip (property-based)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from um_lab import Advice, DataType, Policy, PolicyError, get_policy, presets
from um_lab.policy import PREFERRED_LOCATIONS, PREFETCHES, PROCESSORS

advices = st.builds(
    Advice,
    preferred_location=st.sampled_from(PREFERRED_LOCATIONS),
    accessed_by=st.frozensets(st.sampled_from(PROCESSORS)),
    read_mostly=st.booleans(),
    prefetch=st.sampled_from(PREFETCHES),
)
policies = st.builds(
    Policy,
    name=st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")), min_size=1, max_size=20)
    .filter(lambda s: s.strip() == s),
    advice=st.dictionaries(st.sampled_from(list(DataType)), advices),
    description=st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")) | st.sampled_from("\n\t"),
                        max_size=40),
)


@given(policies)
def test_json_round_trip(policy):
    assert Policy.from_json(policy.to_json()) == policy
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


@given(policies, st.sampled_from(list(DataType)), st.sampled_from(["preferred_location", "prefetch"]),
       st.text(max_size=12))
def test_bad_values_are_rejected_naming_the_field(policy, dtype, field, bad):
    data = policy.to_dict()
    valid = PREFERRED_LOCATIONS if field == "preferred_location" else PREFETCHES
    if bad in valid:
        return
    data["advice"][dtype.value][field] = bad
    with pytest.raises(PolicyError) as err:
        Policy.from_dict(data)
    assert err.value.field == f"advice.{dtype.value}.{field}"


@given(st.text(min_size=1, max_size=10))
def test_unknown_data_type_is_rejected(name):
    if name in {t.value for t in DataType}:
        return
    data = presets["um-default"].to_dict()
    data["advice"][name] = {}
    with pytest.raises(PolicyError, match="unknown data type"):
        Policy.from_dict(data)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["advice"]["param"].update(accessed_by=["gpu", "tpu"]), "advice.param.accessed_by"),
        (lambda d: d["advice"]["grad"].update(accessed_by="gpu"), "advice.grad.accessed_by"),
        (lambda d: d["advice"]["act"].update(read_mostly="yes"), "advice.act.read_mostly"),
        (lambda d: d["advice"]["input"].update(colour="red"), "advice.input.colour"),
        (lambda d: d.update(name=""), "name"),
        (lambda d: d.update(evil="__import__('os')"), "evil"),
        (lambda d: d.update(um_lab_policy=99), "um_lab_policy"),
        (lambda d: d.update(advice=[1, 2]), "advice"),
    ],
)
def test_specific_rejections(mutate, field):
    data = presets["paper-3type"].to_dict()
    mutate(data)
    with pytest.raises(PolicyError) as err:
        Policy.from_dict(data)
    assert err.value.field == field


def test_not_json_is_a_policy_error_not_an_evaluation():
    with pytest.raises(PolicyError, match="not valid JSON"):
        Policy.from_json("__import__('os').system('true')")


def test_presets_exist_and_baseline_has_no_advice():
    for name in ("um-default", "gpu-first", "zero-copy-params", "offload-optimizer", "input-read-mostly",
                 "paper-3type"):
        assert get_policy(name).name == name
    assert all(a.is_default for a in presets["um-default"].advice.values())
    zc = presets["zero-copy-params"][DataType.PARAM]
    assert zc.preferred_location == "cpu" and zc.accessed_by == {"gpu"}
    with pytest.raises(PolicyError, match="valid: um-default"):
        get_policy("nope")


def test_paper_groups_view_sets_three_types_at_once():
    a = Advice(preferred_location="gpu")
    p = Policy.from_paper_groups("x", model_parameters=a)
    assert p["param"] == p["grad"] == p["optim"] == a and p["act"].is_default


def test_save_and_load(tmp_path):
    p = presets["offload-optimizer"]
    assert Policy.load(p.save(tmp_path / "p.json")) == p


def test_advice_stores_the_vocabulary_as_enums_equal_to_their_strings():
    import json

    from um_lab.policy import Advice, Location, Prefetch, Processor

    a = Advice(preferred_location="gpu", accessed_by={"gpu"}, prefetch="to-gpu-before-use")
    assert a.preferred_location is Location.GPU and a.prefetch is Prefetch.TO_GPU_BEFORE_USE
    assert a.accessed_by == frozenset({Processor.GPU}) and "gpu" in a.accessed_by
    assert a == Advice(preferred_location=Location.GPU, accessed_by={Processor.GPU},
                       prefetch=Prefetch.TO_GPU_BEFORE_USE)
    assert json.loads(json.dumps(a.to_dict())) == {"preferred_location": "gpu", "accessed_by": ["gpu"],
                                                    "read_mostly": False, "prefetch": "to-gpu-before-use"}
    with pytest.raises(PolicyError, match="preferred_location"):
        Advice(preferred_location="gpu0")
