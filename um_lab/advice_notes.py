"""Plain-language warnings about advice combinations that are legal but work against themselves.

The policy vocabulary (:mod:`um_lab.policy`) rejects what CUDA cannot do; these notes explain what it
can do but should not, from the measured facts and the UM driver's semantics (e.g. ``read_mostly`` on
data that is written every step collapses its copies on every write: parameters read-mostly made
training steps 100-1,500x slower on the H200).
The notebook panel shows them inline next to the advice grid.
"""

from __future__ import annotations

from um_lab.policy import Advice, Policy
from um_lab.types import DATA_TYPES, DataType

#: data types a training step writes and reads again on the GPU, so a read-duplicated copy collapses on
#: every write. Input is left out: the batch copy writes it once a step, before the GPU only reads it.
WRITTEN_EVERY_STEP = frozenset({DataType.PARAM, DataType.GRAD, DataType.OPTIM, DataType.ACT})


def advice_notes(dtype: DataType | str, advice: Advice) -> list[str]:
    """Warnings for one data type's advice (empty when nothing works against itself)."""
    dtype = DataType.parse(dtype)
    notes = []
    if advice.read_mostly and dtype in WRITTEN_EVERY_STEP:
        notes.append(f"read-mostly on {dtype.value}, which training writes every step: each write collapses "
                     "the duplicated pages (on parameters the H200 measured 100-1,500x slower steps)")
    if advice.preferred_location == "cpu" and advice.prefetch == "to-gpu-before-use":
        notes.append("prefetching to the GPU overrides preferred location cpu (a prefetch migrates whatever "
                     "the preferred location): choose one of the two")
    if advice.preferred_location == "gpu" and advice.prefetch == "to-cpu-after-use":
        notes.append("pushing to the host after use fights preferred location gpu: the data crosses the host "
                     "link twice every step")
    if advice.read_mostly and advice.preferred_location == "cpu" and "gpu" in advice.accessed_by:
        notes.append("read-mostly with zero-copy: GPU reads duplicate the pages instead of reading them remotely")
    if "cpu" in advice.accessed_by and advice.preferred_location != "cpu" and dtype is not DataType.INPUT:
        notes.append(f"accessed-by cpu has no effect here: the CPU does not touch {dtype.value} during a GPU step")
    return notes


def policy_notes(policy: Policy) -> dict[str, list[str]]:
    """``{data type: warnings}`` for the types whose advice works against itself."""
    out = {}
    for dtype in DATA_TYPES:
        notes = advice_notes(dtype, policy[dtype])
        if notes:
            out[dtype.value] = notes
    return out
