"""The layer-ahead scheduler: GPU-resident managed bytes kept under a budget by moving data ahead of use.

Pure (no torch, no CUDA; the live executor and the simulator share them, so they cannot drift):

- :mod:`~um_lab.schedule.config`: :class:`~um_lab.schedule.config.Budget`, the validated budget a run takes.
- :mod:`~um_lab.schedule.ledger`: residency per 2 MiB block, never above the budget.
- :mod:`~um_lab.schedule.order`: the recorded order of use (positions: phase, layer, data type, ranges).
- :mod:`~um_lab.schedule.plan`: Belady evictions on the learned order, look-ahead prefetches, the steady plan.
- :mod:`~um_lab.schedule.request`: which runs train under a budget and how many bytes it is.
- :mod:`~um_lab.schedule.staging`, :mod:`~um_lab.schedule.costs`: staging's sizes; the link's prices.

Live (torch and CUDA streams): :mod:`um_lab.schedule.live`.
"""
