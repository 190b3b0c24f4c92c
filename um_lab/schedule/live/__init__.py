"""The scheduler in a live session (torch hooks, CUDA streams, pinned memory).

- :mod:`~um_lab.schedule.live.record`: module and autograd hooks that record the order in a training step.
- :mod:`~um_lab.schedule.live.executor`: the plan driven by those hooks, its moves issued as
  ``cudaMemPrefetchAsync`` on a side stream by :mod:`~um_lab.schedule.live.mover`.
- :mod:`~um_lab.schedule.live.control`: what a :class:`~um_lab.cuda.session.Session` holds under a budget.
- :mod:`~um_lab.schedule.live.stage`, :mod:`~um_lab.schedule.live.pinned`: saved activations through pinned
  host memory; :mod:`~um_lab.schedule.live.tail`: how much of them stays on the GPU.
- :mod:`~um_lab.schedule.live.remote_state`, :mod:`~um_lab.schedule.live.free`: experimental moves.
"""
