#!/usr/bin/env bash
# Telemetry on the GPU machine, one device call (repo root, $OUT set; .whl/ carried along):
# wheels -> shim -> CUPTI sanity -> tests/gpu/test_telemetry_gpu.py -> bench/telemetry_overhead.py.
# Logs and results under $OUT. Every stage has a timeout; all of them together stay under 5 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/telemetry_stages.log"; }

stage wheels
if ! python3 -c "import cupti" 2>/dev/null; then
  timeout 20 python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tee "$OUT/wheels.log"
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}

stage build
timeout 40 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }

stage sanity
timeout 25 python3 - <<'PY' 2>&1 | tee "$OUT/telemetry_sanity.log"
import importlib.metadata as md, json, sys, torch
torch.cuda.init()
v = {"python": sys.version.split()[0], "torch": torch.__version__}
for d in ("cupti-python", "nvidia-cuda-cupti", "cuda-bindings", "nvidia-ml-py", "pyelftools"):
    try:
        v[d] = md.version(d)
    except md.PackageNotFoundError:
        v[d] = None
print(json.dumps(v))
from um_lab.cuda.telemetry import Telemetry
tel = Telemetry()
print("status:", tel.start(torch.cuda.current_device()))
from um_lab.cuda import driver
buf = driver.malloc_managed(8 << 20)  # not an um_lab segment: shows up as unattributed
driver.managed_array(buf.ptr, 8 << 20).fill(1.0); torch.cuda.synchronize()
st = tel.collect([])
print("collect:", None if st is None else json.dumps(st.extra, default=str)[:800])
del buf
tel.close()
PY

stage tests
timeout 75 python3 -m pytest tests/gpu/test_telemetry_gpu.py -q -rA -s -p no:cacheprovider --timeout 70 2>&1 \
  | tee "$OUT/telemetry_gpu_tests.log"

stage bench
timeout 140 python3 bench/telemetry_overhead.py --out "$OUT/telemetry_overhead.json" 2>&1 | tee "$OUT/telemetry_overhead.log"

stage done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/telemetry_stages.log"
