"""Deadlock stress for the allocation shim (run as a subprocess by the gpu tests; a watchdog exits 3).

A training thread creates a fresh managed pool per iteration (new segments), runs forward and
backward routed into it, then drops the pool (segments freed under torch's allocator lock); the
main thread meanwhile allocates and frees ordinary CUDA tensors while holding the GIL. The shim's
callbacks never take the GIL, so this must never stall. Managed memory stays under a 4 GiB cap.
"""

import json
import os
import sys
import threading
import time

import torch

from um_lab.cuda import driver
from um_lab.cuda.allocator import SegmentSource, TorchPoolAPI
from um_lab.types import DataType

iterations = int(sys.argv[1])
source = SegmentSource()
source.configure(*driver.shim_function_addresses())
source.set_cap(4 << 30, False)
allocs, free = source.addresses()
api = TorchPoolAPI()
dev = torch.cuda.current_device()
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
(model(torch.ones(8, 1024, device="cuda")).sum()).backward()  # cuBLAS warm-up outside any pool
state = {"iterations": 0, "main_ops": 0, "frees": 0}
stop = threading.Event()
failure = []


def train():
    try:
        # this thread's cuBLAS handle and workspace must be created outside any pool (DESIGN.md)
        model(torch.ones(8, 1024, device="cuda")).sum().backward()
        model.zero_grad(set_to_none=True)
        start_frees = source.stats()["free_calls"]
        for i in range(iterations):
            n = 64 + (i * 37) % 2048
            pool = api.new_pool(allocs[DataType.ACT], free)
            api.begin(dev, pool.id)
            try:
                x = torch.randn(n, 1024, device="cuda", requires_grad=True)
                with torch.autograd.set_multithreading_enabled(False):
                    model(x).sum().backward()
            finally:
                api.end(dev, pool.id)
                api.release(dev, pool.id)
            del x
            model.zero_grad(set_to_none=True)
            del pool
            state["iterations"] = i + 1
        state["frees"] = source.stats()["free_calls"] - start_frees
    except BaseException as e:  # report, don't hang
        failure.append(repr(e))
    finally:
        stop.set()


def watchdog():
    """Exit 3 if either thread makes no progress for 30 s (each is watched on its own)."""
    last = {"iterations": -1, "main_ops": -1}
    since = {k: time.time() for k in last}
    while not stop.is_set():
        time.sleep(1)
        for key in last:
            if state[key] != last[key]:
                last[key], since[key] = state[key], time.time()
            elif time.time() - since[key] > 30:
                print(json.dumps({"result": f"STALL in {key}", **state}), flush=True)
                os._exit(3)


threading.Thread(target=watchdog, daemon=True).start()
worker = threading.Thread(target=train)
t0 = time.time()
worker.start()
while not stop.is_set():
    z = torch.empty(1 << 18, device="cuda")
    del z
    if state["main_ops"] % 64 == 0:
        torch.cuda.empty_cache()
    state["main_ops"] += 1
worker.join()
torch.cuda.synchronize()
torch.cuda.empty_cache()
print(json.dumps({
    "result": "ok" if not failure else f"error: {failure[0]}",
    "iterations": state["iterations"], "main_ops": state["main_ops"], "segment_frees": state["frees"],
    "live_after": source.stats()["live_total"], "seconds": round(time.time() - t0, 1),
}), flush=True)
