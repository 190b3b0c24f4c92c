#!/usr/bin/env bash
# Telemetry on the GPU machine, one device call (repo root, $OUT set; .whl/ carried along):
# wheels -> shim -> record diagnostic -> tests/gpu/test_telemetry_gpu.py -> bench/telemetry_overhead.py.
# Logs and results under $OUT. Every stage has a timeout; all together stay under 9 minutes.
# Wheels (not committed; .whl/ is git-excluded), fetched on a machine with the internet:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl "cupti-python==13.0.*" pyelftools
set -uo pipefail
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/telemetry_stages.log"; }
VARIANTS=${VARIANTS:-}

stage wheels
if ! python3 -c "import cupti" 2>/dev/null; then
  timeout 20 python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tee "$OUT/wheels.log"
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}

stage build
timeout 40 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }

stage records
timeout 40 python3 bench/diagnostics/telemetry_records.py >"$OUT/telemetry_records.jsonl" 2>&1
tail -c 2000 "$OUT/telemetry_records.jsonl"

stage tests
timeout 90 python3 -m pytest tests/gpu/test_telemetry_gpu.py -q -rA -s -p no:cacheprovider --timeout 80 2>&1 \
  | tee "$OUT/telemetry_gpu_tests.log" | tail -40

stage bench
# shellcheck disable=SC2086
timeout ${BENCH_TIMEOUT:-300} python3 bench/telemetry_overhead.py --out "$OUT/telemetry_overhead.json" \
  ${BENCH_ARGS:-} ${VARIANTS:+--variants $VARIANTS} 2>&1 | tee "$OUT/telemetry_overhead.log"

stage done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/telemetry_stages.log"
