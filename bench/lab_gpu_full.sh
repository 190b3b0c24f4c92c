#!/usr/bin/env bash
# Second lab call on the GPU machine (repo root, $OUT set, .whl/ carried; wheels as in bench/lab_gpu.sh):
# the paper experiment's ResNet-50 rows on the machine's CPU (one process per ratio, in the background),
# and meanwhile every GPU test, the cuda dashboard overhead, and notebook 04 executed on the GPU.
set -uo pipefail
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/stages.log"; }
stage wheels
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /tmp/wheels.log 2>&1 || { tail -20 /tmp/wheels.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} JUPYTER_PATH=/tmp/site/share/jupyter UM_LAB_RUNS_DIR=/tmp/um_lab_runs
timeout 60 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { cat /tmp/build.log; exit 1; }
stage paper-resnet-start
for r in ${RATIOS:-0.8 1.25 1.5 2.0}; do
  (OMP_NUM_THREADS=2 timeout ${PAPER_TIMEOUT:-540} python3 bench/paper_three_types.py --models resnet50 --ratios $r \
     --out "$OUT/paper_resnet_$r.json" > /tmp/paper_$r.log 2>&1; echo "ratio $r rc=$?" >> "$OUT/stages.log") &
done
stage gpu-tests
timeout 330 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider --timeout 150 > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
stage dashboard-overhead-cuda
for config in ${DASH_CONFIGS:-cuda cuda-small}; do
  timeout 150 python3 bench/dashboard_overhead.py --config $config --repeats 3 --out "$OUT/dashboard_overhead.json" 2>&1 \
    | grep -v WARNING
done
stage notebook-04-on-gpu
timeout 120 python3 - <<'PY' > "$OUT/notebook04_gpu.log" 2>&1
import json, sys
sys.path.insert(0, "tests")
from pathlib import Path
from test_notebooks import execute
nb = execute(Path("notebooks/04_um_basics.ipynb"), Path("/tmp"), {})
for c in nb.cells:
    if c.cell_type == "code":
        for o in c.outputs:
            text = o.get("text") or o.get("data", {}).get("text/plain", "")
            if text:
                print(str(text)[:1500])
PY
echo "notebook 04 rc=$?" | tee -a "$OUT/stages.log"; tail -30 "$OUT/notebook04_gpu.log" | cut -c1-200
stage wait-paper
wait
tail -3 /tmp/paper_*.log
stage done
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/stages.log"
