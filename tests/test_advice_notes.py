"""Warnings about advice that works against itself: the cases that should warn do, the presets do not."""

import pytest

from um_lab.advice_notes import advice_notes, policy_notes
from um_lab.policy import Advice, Policy, presets


@pytest.mark.parametrize("dtype, advice, words", [
    ("act", Advice(read_mostly=True), "collapses"),
    ("optim", Advice(read_mostly=True), "collapses"),
    ("param", Advice("cpu", frozenset({"gpu"}), prefetch="to-gpu-before-use"), "overrides preferred location cpu"),
    ("grad", Advice("gpu", prefetch="to-cpu-after-use"), "twice every step"),
    ("input", Advice("cpu", frozenset({"gpu"}), read_mostly=True), "instead of reading them remotely"),
    ("param", Advice(accessed_by=frozenset({"cpu"})), "no effect"),
])
def test_combinations_that_work_against_themselves_are_explained(dtype, advice, words):
    notes = advice_notes(dtype, advice)
    assert notes and any(words in n for n in notes), notes


def test_sound_advice_and_every_preset_give_no_notes():
    assert advice_notes("input", Advice(read_mostly=True, prefetch="to-gpu-before-use")) == []
    assert advice_notes("param", Advice("cpu", frozenset({"gpu"}))) == []
    assert {name: policy_notes(p) for name, p in presets.items()} == {name: {} for name in presets}
    mixed = Policy("x", {"act": Advice(read_mostly=True)})
    assert list(policy_notes(mixed)) == ["act"]
