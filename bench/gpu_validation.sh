#!/usr/bin/env bash
# One device call after changes: the record-loss diagnostic, every GPU test (core, runner,
# telemetry), then the allocator-overhead benchmark (native vs um_lab only) as a regression check.
# Repo root on the GPU machine, $OUT set, .whl/ carried. Every stage has a timeout; the whole call
# stays under ~9 minutes. At most 8 files come back from $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c "import cupti" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/stages.log"; }
stage build
timeout 60 python3 setup.py -q build_ext --inplace >/tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
stage records
timeout 60 python3 bench/diagnostics/telemetry_records.py >"$OUT/telemetry_records.jsonl" 2>&1
grep trial "$OUT/telemetry_records.jsonl" | cut -c1-260
stage gpu-tests
timeout 330 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --timeout 150 >"$OUT/gpu_tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | tail -40
stage allocator-overhead
timeout ${ALLOC_TIMEOUT:-120} python3 bench/allocator_overhead.py --modes native um_lab \
  --out "$OUT/allocator_overhead.json" >"$OUT/allocator_overhead.log" 2>&1
tail -8 "$OUT/allocator_overhead.log"
stage done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/stages.log"
