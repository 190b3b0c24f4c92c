#!/usr/bin/env bash
# The lab on the GPU machine, one device call (repo root, $OUT set, .whl/ carried along): the paper
# experiment's ResNet-50 rows on the machine's CPU (one process per ratio, in the background), and
# meanwhile every GPU test, the cuda dashboard overhead, notebook 04 and the quick start executed on the
# GPU. Every stage has a timeout; together they stay under 9 minutes. Set RATIOS="" to skip the paper rows.
# Wheels (not committed; .whl/ is git-excluded), fetched on a machine with PyPI, for Python 3.12:
#   plotly ipywidgets widgetsnbextension jupyterlab_widgets comm traitlets anywidget psygnal ipython
#   ipython_pygments_lexers decorator jedi parso matplotlib_inline pexpect ptyprocess prompt_toolkit wcwidth
#   stack_data executing asttokens pure_eval ipykernel jupyter_client jupyter_core pyzmq tornado
#   nest_asyncio debugpy platformdirs nbclient nbformat fastjsonschema jsonschema jsonschema_specifications
#   referencing rpds_py "cupti-python==13.0.*" pyelftools
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ...)
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
for r in ${RATIOS-0.8 1.25 1.5 2.0}; do
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
stage quickstart-on-gpu
timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/quickstart_gpu.log" | tail -15
import json, sys
sys.path.insert(0, "tests")
from pathlib import Path
import nbformat
from test_notebooks import execute
nb = execute(Path("notebooks/01_quickstart.ipynb"), Path("/tmp"), {"PACE_S": 0.0, "STEPS": 10})
texts = [o.get("text", "") or json.dumps(o.get("data", {}).get("text/plain", ""))
         for c in nb.cells if c.cell_type == "code" for o in c.outputs]
print("\n".join(t[:300] for t in texts if t)[:6000])
nbformat.write(nb, "/tmp/quickstart_gpu_executed.ipynb")
PY
stage wait-paper
wait
for f in /tmp/paper_*.log; do tail -n 3 "$f"; done
stage done
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/stages.log"
