"""Input staging's buffer logic, on the CPU (plain tensors stand in for pinned memory and the GPU)."""

from __future__ import annotations

import contextlib

import torch

from um_lab.cuda.staging import ALIGN, InputStaging


class _Event:
    """Counts records and waits, as a CUDA event would be used."""

    log: list[str] = []

    def record(self) -> None:
        _Event.log.append("record")

    def synchronize(self) -> None:
        _Event.log.append("wait")


def _staging() -> tuple[InputStaging, list[int]]:
    made: list[int] = []

    def new_buffer(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    _Event.log = []
    return InputStaging(torch.device("cpu"), new_buffer=new_buffer, new_event=_Event), made


def test_staged_copies_hold_the_values_and_later_changes_to_the_source_do_not_leak_in() -> None:
    staging, made = _staging()
    x, y = torch.randn(3, 5), torch.tensor([1, 2, 3])
    routed: list[str] = []

    @contextlib.contextmanager
    def allocate():
        routed.append("in")
        yield

    gx, gy, note = staging.copy((x, y, "note"), allocate)
    expect_x, expect_y = x.clone(), y.clone()
    x.add_(100)
    y.zero_()
    assert torch.equal(gx, expect_x) and torch.equal(gy, expect_y) and note == "note"
    assert gx.dtype == torch.float32 and gy.dtype == torch.int64 and gx.shape == (3, 5)
    assert routed == ["in"]
    assert made == [2 * ALIGN]  # each tensor starts on an aligned offset
    assert staging.staged_bytes == 2 * ALIGN


def test_the_buffer_is_reused_after_waiting_and_grows_for_a_larger_batch() -> None:
    staging, made = _staging()
    for _ in range(3):
        staging.copy((torch.ones(64),), contextlib.nullcontext)
    assert made == [ALIGN]
    assert _Event.log == ["record", "wait", "record", "wait", "record"]
    big = torch.arange(10_000, dtype=torch.float64)
    (out,) = staging.copy((big,), contextlib.nullcontext)
    assert torch.equal(out, big)
    assert len(made) == 2 and made[1] >= big.numel() * 8 and staging.capacity == made[1]


def test_non_contiguous_tensors_are_copied_directly_and_nothing_is_staged_for_them() -> None:
    staging, made = _staging()
    t = torch.randn(4, 6).t()
    (out,) = staging.copy((t,), contextlib.nullcontext)
    assert torch.equal(out, t)
    assert made == [] and _Event.log == [] and staging.staged_bytes == 0
    assert not InputStaging.stages(t) and InputStaging.stages(t.contiguous())
    assert not InputStaging.stages("text") and not InputStaging.stages(torch.empty(0).to_sparse())
