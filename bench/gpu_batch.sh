#!/usr/bin/env bash
# One device call: build the shim in place, sanity-check the runtime, GPU tests, then benchmarks.
# Usage on the GPU machine (repo root): bash bench/gpu_batch.sh [tests|bench|all] ; results under $OUT.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
python3 - <<'PY' 2>&1 | tee "$OUT/sanity.log"
import torch, json
from um_lab.cuda import driver
torch.cuda.init()
lib = driver.runtime_library()
print(json.dumps({"cudart": driver._loaded_cudart_path(), "runtime": driver.runtime_version(),
  "has_v2": hasattr(lib, "cudaMemAdvise_v2"), "free_total": torch.cuda.mem_get_info(),
  "info": str(driver.device_info(0))}))
PY
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --timeout 400 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 300 python3 bench/allocator_overhead.py --out "$OUT/allocator_overhead.json" 2>&1 | tee "$OUT/bench.log"
fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/sanity.log"
