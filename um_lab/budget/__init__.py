"""A layer-ahead Unified Memory scheduler: GPU-resident managed bytes kept under a budget.

- :mod:`~um_lab.budget.ledger`: residency per 2 MiB block, never above the budget (pure Python).
- :mod:`~um_lab.budget.order`: the recorded order of use (positions: phase, layer, data type, ranges).
- :mod:`~um_lab.budget.plan`: the scheduler (Belady evictions on the learned order, look-ahead prefetches)
  and the steady-state plan of a recorded order.
- :mod:`~um_lab.budget.record`: module and autograd hooks that record the order in a training step.
- :mod:`~um_lab.budget.executor`: the scheduler driven by those hooks in a live session, its moves
  issued as ``cudaMemPrefetchAsync`` on a side stream.
"""
