#!/usr/bin/env bash
# The benchmark suite on a CUDA GPU machine, from the repository root:
#
#   bash bench/gpu.sh SUITE [SUITE ...]        # results and logs under $OUT (default bench/out)
#
# SUITE (docs/benchmarks.md says what each measures and which committed file each result replaces):
#   tests        every GPU test (python -m pytest -q -m gpu)
#   allocator    allocator overhead, native and um_lab alternating in each process -> allocator_overhead.json
#   telemetry    the telemetry GPU tests, then the telemetry overhead                -> telemetry_overhead.json
#   dashboard    the live dashboard's overhead inside a Jupyter kernel (cuda configs) -> dashboard_overhead.json
#   budget       the budget table's rows (BUDGET_MODELS, default all three), FSDP2 beside them, merged with the
#                committed predictions                                               -> budget.json
#   planner      the memory planner in fp32 and bf16 at ratios 1.5, 2, 3 against every peer in the same run
#                (PLANNER_MODELS, default all three; one model per call where time needs it; GPT-2-XL's
#                everything-fits run holds 53 GB of managed memory: an H200, not an 80 GB card) -> budget.json, planner
#   primitives   UM primitives, the GEMM tile grid, prefetch by call size
#                                              -> uvm_primitives.json, gemm_tiles.json, uvm_call_size.json
#   calibration  the simulator's other GPU inputs: per-op steps, 16-bit tensor-core rates, convolutions in a step,
#                the models' GEMM shapes, the scheduler's timed moves -> step_detail.json, tensor_core_rates.json,
#                conv_in_step.json, gemm_shapes/, scheduler_moves.json
#   paper        the paper experiment (simulator; one process per model)         -> paper_three_types.json
#   fidelity     the simulator against the GPU, the newest held-out set, the corpus memory estimates
#                -> sim_fidelity.json, sim_fidelity_heldout/measured.json, sim_fidelity_corpus/measured.json
#                   (with machine_calibrated_predictions.json), estimate_vs_gpu.json
#   all          all of the above, in that order
#
# Every suite builds the C shim in place first and reads the GPU's state (sanity.log). Every stage has a timeout
# (STAGE_TIMEOUT scales them: 2 doubles each). Nothing here oversubscribes the card: each benchmark keeps its managed
# memory under its own safety cap. CUPTI telemetry (the telemetry suite, the budget rows with a CUPTI column) needs
# cupti-python: when it is not importable, the wheels in .whl/ are installed into /tmp/site (the dashboard suite's
# Jupyter packages too, where the machine lacks them, and torchao for the planner's checkpointing + CPUOffloadOptimizer
# peer). Fetch them on a machine with PyPI, for the GPU machine's Python, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     "cupti-python==13.0.*" pyelftools torchao
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
t0=$SECONDS
stage() { echo "== $1 (t=$((SECONDS - t0)) s)" | tee -a "$OUT/stages.log"; }
limit() { python3 -c "print(int($1 * ${STAGE_TIMEOUT:-1}))"; }  # a stage's timeout in seconds
run() {  # run NAME SECONDS CMD...: the command's output to $OUT/NAME.log (its tail shown), killed at the limit
  local name=$1 secs; secs=$(limit "$2"); shift 2
  timeout -s KILL "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/stages.log"
  grep -v Warning "$OUT/$name.log" | tail -n 12
  return $rc
}

if [ $# -eq 0 ]; then
  sed -n '2,/^set -uo/p' "$self" | sed '$d'
  exit 2
fi
suites=("$@")
[ "${suites[*]}" = all ] && suites=(tests allocator telemetry dashboard budget planner primitives calibration paper fidelity)
for s in "${suites[@]}"; do
  case $s in
    tests|allocator|telemetry|dashboard|budget|planner|primitives|calibration|paper|fidelity) ;;
    *) echo "unknown suite: $s (see: bash bench/gpu.sh)" >&2; exit 2 ;;
  esac
done

stage setup
if ! python3 -c "import cupti, torchao" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >"$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} JUPYTER_PATH=/tmp/site/share/jupyter UM_LAB_RUNS_DIR=/tmp/um_lab_runs
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
python3 - <<'PY' 2>&1 | tee "$OUT/sanity.log"
import json, torch
from um_lab.cuda import driver
torch.cuda.init()
print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "runtime": driver.runtime_version(), "free_total": torch.cuda.mem_get_info()}))
PY

suite_tests() {
  stage tests
  run gpu_tests 2400 python3 -m pytest -q -m gpu -rfE -p no:cacheprovider
}

suite_allocator() {  # each model's blocks sized so that a pair's spread stays far below the 1% bar
  stage allocator
  mkdir -p "$OUT/allocator"
  local fixed
  for fixed in "" "--fixed-batch"; do
    run "allocator_mlp${fixed:+_fixed}" 300 python3 bench/allocator_overhead.py --models mlp --alternate 6 --repeats 2 \
      --steps 60 --warmup 5 --cpus auto $fixed --out "$OUT/allocator/mlp${fixed:+_fixed}.json"
    run "allocator_resnet50${fixed:+_fixed}" 400 python3 bench/allocator_overhead.py --models resnet50 --alternate 6 \
      --repeats 3 --steps 10 --warmup 3 --cpus auto $fixed --out "$OUT/allocator/resnet50${fixed:+_fixed}.json"
    run "allocator_gpt2-medium${fixed:+_fixed}" 600 python3 bench/allocator_overhead.py --models gpt2-medium \
      --alternate 4 --repeats 2 --steps 6 --warmup 2 --cpus auto $fixed \
      --out "$OUT/allocator/gpt2-medium${fixed:+_fixed}.json"
  done
  python3 - "$OUT" <<'PY'  # one file: every model in both batch modes, each row naming its run
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
merged, rows = None, []
for model in ("mlp", "resnet50", "gpt2-medium"):
    for suffix in ("", "_fixed"):
        path = out / "allocator" / f"{model}{suffix}.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        merged = merged or {k: run[k] for k in ("device", "date", "versions", "method") if k in run}
        for row in run["rows"]:
            n = len(row["per_process_over_native"])
            row.update(batch="copied once" if suffix else "copied every step",
                       blocks=f"{row['pairs'] // n} pairs x {n} processes, {run['steps']} steps "
                              f"(+{run['warmup']} warm-up) per block",
                       source=f"allocator/{path.name}")
            rows.append(row)
if merged:
    merged.update(bar="um_lab / native <= 1.01 for every model and both batch modes", rows=rows,
                  bar_met={m: all(r["um_lab_over_native"] <= 1.01 for r in rows if r["model"] == m)
                           for m in dict.fromkeys(r["model"] for r in rows)})
    (out / "allocator_overhead.json").write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {out / 'allocator_overhead.json'}: {len(rows)} rows")
PY
}

suite_telemetry() {
  stage telemetry
  run telemetry_tests 600 python3 -m pytest tests/gpu/test_telemetry_gpu.py -q -rfE -p no:cacheprovider
  run telemetry_overhead 900 python3 bench/telemetry_overhead.py --out "$OUT/telemetry_overhead.json"
}

dashboard_args() {  # short steps are noisier: more, shorter runs, interleaved
  case $1 in cuda-small) echo "--repeats 8 --steps 200" ;; *) echo "--repeats 3" ;; esac
}

suite_dashboard() {  # the simulator's row (config sim) is measured on a CPU machine: python bench/dashboard_overhead.py
  stage dashboard
  local config
  for config in cuda cuda-small; do
    run "dashboard_$config" 600 python3 bench/dashboard_overhead.py --config $config $(dashboard_args $config) \
      --out "$OUT/dashboard_overhead.json"
  done
}

budget_runs() {  # the runs behind bench/results/budget.json, one model at a time
  case $1 in
    gpt2-large)
      run budget_gpt2-large 900 python3 bench/budget.py --models gpt2-large --ratios 1.5 2 3 --steps 8 --stage on \
        --no-sim --out "$OUT/budget/gpt2-large.json"
      run budget_gpt2-large_cupti 600 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 6 --stage on \
        --telemetry --no-sim --out "$OUT/budget/gpt2-large_cupti.json" ;;
    gpt2-xl)
      run budget_gpt2-xl 1800 python3 bench/budget.py --models gpt2-xl --ratios 1.5 2 3 --steps 9 --stage on \
        --no-sim --out "$OUT/budget/gpt2-xl.json" ;;
    resnet50)  # FSDP2 beside the rows (--fsdp2), partial staging and full staging in turn
      run budget_resnet50 900 python3 bench/budget.py --models resnet50 --ratios 1.32 1.5 --steps 12 --stage on \
        --partial-stage on off --repeats 2 --fsdp2 --no-sim --out "$OUT/budget/resnet50.json"
      run budget_resnet50_2-3 600 python3 bench/budget.py --models resnet50 --ratios 2 3 --steps 10 --stage on \
        --partial-stage on off --fsdp2 --no-sim --out "$OUT/budget/resnet50_2-3.json"
      run budget_resnet50_cupti 300 python3 bench/budget.py --models resnet50 --ratios 1.32 --steps 8 --stage on \
        --partial-stage on --telemetry --no-sim --out "$OUT/budget/resnet50_cupti.json" ;;
    *) echo "unknown budget model: $1 (gpt2-large, gpt2-xl, resnet50)" >&2; return 2 ;;
  esac
}

suite_budget() {  # predictions first: python bench/budget.py --predict ... on a CPU, committed before this runs
  stage budget
  mkdir -p "$OUT/budget"
  local model
  for model in ${BUDGET_MODELS:-gpt2-large gpt2-xl resnet50}; do
    budget_runs "$model"
  done
  compgen -G "$OUT/budget/*.json" >/dev/null || return 1
  python3 bench/budget_table.py "$OUT"/budget/*.json --predicted bench/results/budget_predicted.json \
    --note "bash bench/gpu.sh budget" --out "$OUT/budget.json" | tee "$OUT/budget_table.md" | tail -n 30
}

suite_planner() {  # predictions first: python bench/budget.py --predict --recompute auto, committed before this runs
  stage planner
  mkdir -p "$OUT/planner"
  local model precision
  for model in ${PLANNER_MODELS:-gpt2-large gpt2-xl resnet50}; do
    for precision in fp32 bf16; do
      run "planner_${model}_$precision" 1500 python3 bench/budget.py --models "$model" --ratios 1.5 2 3 --steps 8 \
        --recompute auto --machine-calibrate --precision "$precision" --peers --peer-steps 4 --no-sim \
        --max-managed-fraction 0.7 --out "$OUT/planner/${model}_$precision.json"
    done
  done
  compgen -G "$OUT/planner/*.json" >/dev/null || return 1
  cp bench/results/budget.json "$OUT/budget.json"
  python3 bench/budget_table.py "$OUT"/planner/*.json --planner --predicted bench/results/budget_predicted.json \
    --out "$OUT/budget.json" | tail -n 30
}

suite_primitives() {
  stage primitives
  run uvm_primitives 900 python3 bench/uvm_primitives.py --out "$OUT/uvm_primitives.json"
  run gemm_tiles 900 python3 bench/uvm_primitives.py --sections gemm_tiles --out "$OUT/gemm_tiles.json"
  run uvm_call_size 600 python3 bench/uvm_primitives.py --sections call_size --out "$OUT/uvm_call_size.json"
}

suite_calibration() {
  stage calibration
  run step_detail 1200 python3 bench/step_detail.py --out "$OUT/step_detail.json"
  run tensor_core_rates 300 python3 bench/gemm_shapes.py --tensor-cores --out "$OUT/tensor_core_rates.json"
  run conv_in_step 900 python3 bench/conv_in_step.py --out "$OUT/conv_in_step.json"
  mkdir -p "$OUT/gemm_shapes"
  local spec
  for spec in "bert-large batch_size=8 seq_len=512" "gpt2-large batch_size=2 seq_len=1024" \
      "gpt2-xl batch_size=1 seq_len=1024" "vit-h14 batch_size=8" "vit-l16 batch_size=16" \
      "vit-l16 batch_size=8 image_size=384" "vit-l32 batch_size=16"; do
    local name; name=$(echo "$spec" | sed 's/=//g; s/ /_/g')
    # shellcheck disable=SC2086
    run "gemm_shapes_$name" 300 python3 bench/gemm_shapes.py --model $spec --out "$OUT/gemm_shapes/$name.json"
  done
  run scheduler_moves 1200 python3 bench/budget.py --models gpt2-large resnet50 --ratios 2 1.5 --steps 5 --time-moves \
    --no-sim --out "$OUT/scheduler_moves.json"
}

suite_paper() {  # the simulator only (CPU); here because torchvision's ResNet-50 loads on the GPU machine
  stage paper
  local model
  for model in gpt2-medium bert-large resnet50; do
    run "paper_$model" 2400 env OMP_NUM_THREADS=2 python3 bench/paper_three_types.py --models $model --merge \
      --out "$OUT/paper_three_types.json"
  done
}

suite_fidelity() {  # the held-out set's predictions are committed first (bench/sim_fidelity.py --simulate-only)
  stage fidelity
  run sim_fidelity 1800 python3 bench/sim_fidelity.py --out "$OUT"
  run sim_fidelity_heldout 1200 python3 bench/sim_fidelity.py --subset new --out "$OUT/sim_fidelity_heldout"
  run sim_fidelity_corpus 900 python3 bench/sim_fidelity.py --subset corpus --machine-calibrate \
    --out "$OUT/sim_fidelity_corpus"
  mkdir -p "$OUT/estimates" && cp bench/results/estimate_vs_gpu.json "$OUT/estimates/"
  run estimate_vs_gpu 600 python3 bench/sim_speed.py --estimates measure --out "$OUT/estimates"
}

status=0
for s in "${suites[@]}"; do
  "suite_$s" || status=1
done
stage done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/stages.log"
exit $status
