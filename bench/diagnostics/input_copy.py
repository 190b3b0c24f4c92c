"""Diagnostic (GPU, issue 12): host -> GPU copies of a batch, ordinary vs managed (input pool) memory,
and the host-side copy into a pinned buffer that input staging does, by method.

    python bench/diagnostics/input_copy.py [--out input_copy.json]

Sizes: the MLP's batch (4 MiB) and ResNet-50 bs 128 (77 MB). Prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable

import torch

from um_lab.cuda.session import Session


def median_ms(fn: Callable[[], object], n: int = 30, skip: int = 5) -> float:
    """Median wall time of ``fn`` with the GPU synchronised around each call."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[skip:]) * 1e3, 3)


def measure(shape: tuple[int, ...]) -> dict[str, object]:
    """Every copy path for one float32 batch of ``shape``."""
    x = torch.randn(*shape)
    xp = x.pin_memory()
    buf = torch.empty_like(x).pin_memory()
    pageable = torch.empty_like(x)
    nbytes = x.numel() * 4
    res: dict[str, object] = {"shape": list(shape), "MB": round(nbytes / 1e6, 1), "threads": torch.get_num_threads(),
                              "native_pageable": median_ms(lambda: x.cuda()),
                              "native_pinned": median_ms(lambda: xp.cuda()),
                              "host_copy_to_pinned_torch": median_ms(lambda: buf.copy_(x)),
                              "host_copy_to_pageable_torch": median_ms(lambda: pageable.copy_(x)),
                              "host_memmove_to_pinned": median_ms(lambda: ctypes.memmove(buf.data_ptr(), x.data_ptr(),
                                                                                         nbytes))}
    with Session(evacuate_on_close=False) as lab:
        res["managed_staged"] = median_ms(lambda: lab.inputs(x))
        lab.stage_inputs, lab._staging = False, None
        res["managed_pageable"] = median_ms(lambda: lab.inputs(x))
        res["managed_pinned"] = median_ms(lambda: lab.inputs(xp))
    return res


def main() -> None:
    """Measure both sizes, print and write them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="input_copy.json")
    args = ap.parse_args()
    rows = []
    for shape in ((256, 4096), (128, 3, 224, 224)):
        rows.append(measure(shape))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
