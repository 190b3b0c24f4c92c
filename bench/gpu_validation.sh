#!/usr/bin/env bash
# One device call after changes: core GPU tests (subset), telemetry (tests + overhead), and the
# simulator's new held-out configurations. Repo root on the GPU machine, $OUT set, .whl/ carried.
# Every stage has a timeout; the whole call stays under ~8 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c "import cupti" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)"; }
stage build
timeout 60 python3 setup.py -q build_ext --inplace >/tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
stage core
timeout 150 python3 -m pytest tests/gpu/test_cuda_session.py -q -rA -p no:cacheprovider --timeout 140 \
  -k "not bit_for_bit and not gpt2" >"$OUT/core_tests.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/core_tests.log" | tail -16
stage telemetry
mkdir -p /tmp/tel  # at most 8 files come back from $OUT: keep the telemetry stage's own files apart
OUT=/tmp/tel timeout 300 bash bench/telemetry_gpu.sh >"$OUT/telemetry_all.log" 2>&1
cp /tmp/tel/telemetry_overhead.json /tmp/tel/telemetry_gpu_tests.log /tmp/tel/telemetry_sanity.log "$OUT"/ 2>/dev/null
grep -E "status:|PASSED|FAILED|SKIPPED|passed|failed|on_over_off|ms" "$OUT/telemetry_all.log" | tail -22
stage fidelity-new
timeout 150 python3 bench/sim_fidelity.py --subset new --out "$OUT" >"$OUT/fidelity_new.log" 2>&1
tail -8 "$OUT/fidelity_new.log"
stage done
