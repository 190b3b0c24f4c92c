"""Diagnostic: host -> GPU copy of a ResNet-50 batch (77 MB) into ordinary vs managed (input pool) memory."""

import json
import statistics
import time

import torch

from um_lab.cuda.session import Session


def median_ms(fn, n=30, skip=5):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[skip:]) * 1e3, 3)


x = torch.randn(128, 3, 224, 224)
xp = x.pin_memory()
res = {"native_pageable": median_ms(lambda: x.cuda()), "native_pinned": median_ms(lambda: xp.cuda())}
with Session() as lab:
    res["managed_pageable"] = median_ms(lambda: lab.inputs(x))
    res["managed_pinned"] = median_ms(lambda: lab.inputs(xp))
    keep = [lab.inputs(x)]
    res["managed_d2d_read"] = median_ms(lambda: keep[0].sum())
    keep.clear()
y = x.cuda()
res["native_d2d_read"] = median_ms(lambda: y.sum())
print(json.dumps(res))
