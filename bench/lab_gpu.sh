#!/usr/bin/env bash
# The notebook lab on the GPU machine, one device call (repo root, $OUT set, .whl/ carried along):
# wheels -> shim -> GPU tests of the lab -> dashboard overhead (cuda, in a kernel) -> quick start executed
# on the GPU with nbclient. Every stage has a timeout; together they stay under 9 minutes.
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
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/lab_gpu_stages.log"; }

stage wheels
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export JUPYTER_PATH=/tmp/site/share/jupyter UM_LAB_RUNS_DIR=/tmp/um_lab_runs

stage build
timeout 60 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/lab_gpu_stages.log"

stage tests
timeout 200 python3 -m pytest tests/gpu/test_lab_gpu.py tests/test_lab_widgets.py -q -rA -s -p no:cacheprovider \
  --timeout 180 2>&1 | tee "$OUT/lab_gpu_tests.log" | tail -25

stage dashboard-overhead-cuda
timeout 200 python3 bench/dashboard_overhead.py --config cuda --repeats ${REPEATS:-3} \
  --out "$OUT/dashboard_overhead.json" 2>&1 | tee "$OUT/dashboard_overhead_cuda.log" | grep -v WARNING

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
stage done
nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/lab_gpu_stages.log"
