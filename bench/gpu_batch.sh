#!/usr/bin/env bash
# One device call: build the shim in place, sanity-check the runtime, GPU tests, then benchmarks.
# Usage on the GPU machine (repo root): bash bench/gpu_batch.sh WHAT; results under $OUT. WHAT is
# tests | bench | all | alternate | populate | moves | waits | sample | predicted | staging | free | gaps | native |
# staged | stagedprof | hostwritten | optimtemp | nextstaged | devact | devact2 | remote | remote2 | cupti | partial | partial2 | rounds | rounds2 | rounds3 | rounds4 | rounds5 | free2 | predictresnet | xlprofile | copies | copies2 | final20 | diag21 | rows21 | resnet21 | final21 | fsdp21 | final.
# alternate: issue 12's allocator table with native and um_lab in turn inside each process;
# populate: the same pairs against um_lab+populate (Session(populate_segments=True)), MLP first;
# moves: issue 13's GPT-2-large budget rows, one call per range and batched, every move timed (side stream, host);
# waits: GPT-2-large at ratio 2 with and without Session(budget_gpu_waits=True);
# sample: every thread's Python stack sampled in one GPT-2-medium budget step (where the host time goes);
# predicted: the rows of bench/results/budget_predicted_session12.json still not measured after session 13
# (GPT-2-XL at 1.5 and 3; GPT-2-large at 3; ResNet-50 at 1.5), default session (host advice), CUPTI off; each
# model's rows are written as they complete;
# staging: the staging GPU tests (bit for bit, CUPTI under B) on the current code, then the staging probe;
# free: Session(budget_discard_free=True) (hung on ResNet-50 in session 14): its GPU tests, then ResNet-50 at
# ratio 2 off and on, killed (SIGKILL) if it hangs, every thread's stack dumped first;
# gaps: issue 12's kernel gaps and host costs (MLP, both batch modes);
# staged: staging with the intermediate-results pool fixed in the ledger (session 15; run then as 'pinned', every
# row refused by the pool leak since fixed): the staging GPU tests, the pool probe, then ResNet-50 (off and on,
# same process), GPT-2-large at 2 and 3 and GPT-2-XL at 2 with staging (carry .whl for CUPTI);
# final: session 15's last call: the core GPU tests (sessions, runner, telemetry) on the calling-thread default,
# then the staging GPU tests, the pool probe and ResNet-50 / GPT-2-large at ratio 2 with staging;
# native: issue 12's whole table on the current default (backward on the caller): every model, both batch
# modes, native and um_lab alternating in each process (MLP in 60-step blocks: its 10-step pairs are noisy).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/um_lab_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -d .whl ] && ! python3 -c "import cupti" 2>/dev/null; then  # cupti-python, carried (.whl): CUPTI tests and rows
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 setup.py -q build_ext --inplace >/tmp/um_lab_build.log 2>&1 || { cat /tmp/um_lab_build.log; exit 1; }
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
if [[ $what == alternate ]]; then  # ~9 min in all (estimate): split it over two calls if need be
  for fixed in "" "--fixed-batch"; do
    timeout 200 python3 bench/allocator_overhead.py --models mlp resnet50 --alternate 6 --repeats 3 --steps 10 \
      --warmup 3 --cpus auto $fixed --out "$OUT/alternating_small${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/alternate.log"
    timeout 200 python3 bench/allocator_overhead.py --models gpt2-medium --alternate 4 --repeats 2 --steps 6 \
      --warmup 2 --cpus auto $fixed --out "$OUT/alternating_gpt2${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/alternate.log"
  done
fi
if [[ $what == populate ]]; then  # ~6 min: MLP blocks of 60 steps (its pairs are noisy), then the others
  for fixed in "" "--fixed-batch"; do
    timeout 90 python3 bench/allocator_overhead.py --models mlp --alternate 6 --repeats 2 --steps 60 --warmup 5 \
      --cpus auto --modes native um_lab+populate $fixed --out "$OUT/populate_mlp${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/populate.log"
  done
  timeout 150 python3 bench/allocator_overhead.py --models resnet50 gpt2-medium --alternate 4 --repeats 1 --steps 6 \
    --warmup 2 --cpus auto --modes native um_lab+populate --fixed-batch --out "$OUT/populate_others_fixed.json" 2>&1 | tee -a "$OUT/populate.log"
fi
if [[ $what == sample ]]; then  # ~2 min: B = half of GPT-2-medium bs 2's simulated footprint (13.85 GiB)
  timeout 150 python3 bench/budget_profile.py --model gpt2-medium --batch-size 2 --budget-gib 6.9 --steps 4 --sample \
    --out-dir "$OUT/sample" 2>&1 | tail -c 8000 | tee "$OUT/sample.log"
fi
if [[ $what == waits ]]; then  # ~4 min: compute waiting for prefetches on the GPU against the host waiting
  timeout 400 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 5 --gpu-waits off on --time-moves --no-sim \
    --out "$OUT/budget_waits.json" 2>&1 | tee "$OUT/waits.log"
fi
if [[ $what == moves ]]; then
  timeout 540 python3 bench/budget.py --models gpt2-large --ratios 2 1.5 --steps 5 --batch-calls off on --time-moves --no-sim \
    --out "$OUT/budget_moves.json" 2>&1 | tee "$OUT/moves.log"
fi
if [[ $what == predicted ]]; then  # ~9 min (session 13: a GPT-2-XL row took ~2 min with its fit run): two calls
  timeout 300 python3 bench/budget.py --models gpt2-xl --ratios 1.5 3 --steps 4 --time-moves --no-sim \
    --out "$OUT/budget_gpt2xl.json" 2>&1 | tee "$OUT/predicted.log"
  timeout 150 python3 bench/budget.py --models gpt2-large --ratios 3 --steps 5 --time-moves --no-sim \
    --out "$OUT/budget_gpt2l_r3.json" 2>&1 | tee -a "$OUT/predicted.log"
  timeout 90 python3 bench/budget.py --models resnet50 --ratios 1.5 --steps 5 --time-moves --no-sim \
    --out "$OUT/budget_resnet50_r15.json" 2>&1 | tee -a "$OUT/predicted.log"
fi
if [[ $what == staging ]]; then  # ~1.5 min
  timeout 90 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k staged 2>&1 | tee "$OUT/staging_tests.log"
  timeout 60 python3 bench/diagnostics/staging_probe.py --out "$OUT/staging_probe.json" 2>&1 | tee -a "$OUT/staging_tests.log"
fi
if [[ $what == free ]]; then  # ~3 min
  timeout -s KILL 100 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k free 2>&1 | tail -20 | tee "$OUT/free_tests.log"
  timeout -s KILL 200 python3 -c "
import faulthandler, sys, runpy
faulthandler.dump_traceback_later(170, exit=True)
sys.argv = ['bench/budget.py', '--models', 'resnet50', '--ratios', '2', '--steps', '5', '--discard-free', 'off', 'on',
            '--time-moves', '--no-sim', '--out', '$OUT/budget_free_resnet50.json']
runpy.run_path('bench/budget.py', run_name='__main__')
" 2>&1 | tail -60 | tee "$OUT/free.log"
fi
if [[ $what == staged ]]; then  # ~7-9 min
  timeout -s KILL 90 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k staged 2>&1 | tail -30 | tee "$OUT/staged_tests.log"
  timeout -s KILL 90 python3 bench/diagnostics/staged_pool.py --models resnet50 --out "$OUT/staged_pool.json" 2>&1 | tee "$OUT/staged_pool.log"
  timeout -s KILL 80 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage off on --time-moves --no-sim \
    --out "$OUT/budget_staged_resnet50.json" 2>&1 | tee "$OUT/staged.log"
  timeout -s KILL 200 python3 bench/budget.py --models gpt2-large --ratios 2 3 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_staged_gpt2l.json" 2>&1 | tee -a "$OUT/staged.log"
  timeout -s KILL 170 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 4 --stage on --time-moves --no-sim \
    --out "$OUT/budget_staged_gpt2xl.json" 2>&1 | tee -a "$OUT/staged.log"
fi
if [[ $what == stagedprof ]]; then  # ~5 min: session 16: the staging GPU tests, then where a staged step's time goes
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k staged 2>&1 | tail -30 | tee "$OUT/staged_tests.log"
  for spec in "gpt2-large 19.48 0" "gpt2-large 19.48 2048" "gpt2-xl 24.85 0"; do set -- $spec
    timeout -s KILL 150 python3 bench/budget_profile.py --model $1 --budget-gib $2 --stage --steps 5 --sample --profile-too \
      --window-mib $3 --out-dir /tmp/prof_$1_$3 2>&1 | tail -c 1500
    cp /tmp/prof_$1_$3/summary.json "$OUT/profile_staged_$1_w$3.json"
  done
fi
if [[ $what == hostwritten ]]; then  # ~8 min: session 16: the ledger's host-written pools (GPU writes land on the host)
  timeout -s KILL 150 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "device_speed or staged_activations_train" 2>&1 | tail -30 | tee "$OUT/tests.log"
  timeout -s KILL 130 python3 bench/budget.py --models gpt2-large --ratios 2 3 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_gpt2l.json" 2>&1 | tee "$OUT/rows.log"
  timeout -s KILL 50 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage on --time-moves --no-sim \
    --out "$OUT/budget_resnet50.json" 2>&1 | tee -a "$OUT/rows.log"
  timeout -s KILL 110 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_gpt2xl.json" 2>&1 | tee -a "$OUT/rows.log"
  timeout -s KILL 90 python3 bench/budget_profile.py --model gpt2-large --budget-gib 19.48 --stage --steps 5 --sample \
    --profile-too --out-dir /tmp/prof 2>&1 | tail -c 1500
  cp /tmp/prof/summary.json "$OUT/profile_gpt2l.json"
fi
if [[ $what == optimtemp ]]; then  # ~5 min: session 16 call 3: optimizer temporaries in the resident pool, window B/10
  timeout -s KILL 120 python3 bench/budget.py --models gpt2-large --ratios 2 3 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 100 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "device_speed or staged_activations_train" 2>&1 | tail -8 | tee "$OUT/tests.log"
  timeout -s KILL 100 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  timeout -s KILL 45 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage on --time-moves --no-sim \
    --out "$OUT/budget_resnet50.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == nextstaged ]]; then  # ~9 min, at most 8 files back: what session 16 left for layer-ahead-staged
  timeout -s KILL 60 python3 bench/diagnostics/copy_interference.py --out "$OUT/copy_interference.json" 2>&1 | tail -12
  timeout -s KILL 200 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "staged or device_speed or layer_ahead_staged" 2>&1 | tail -12 | tee "$OUT/tests.log"
  timeout -s KILL 170 python3 bench/budget.py --models gpt2-large --ratios 2 3 1.5 --steps 7 --stage on --time-moves \
    --no-sim --out "$OUT/budget_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 170 python3 bench/budget.py --models gpt2-xl --ratios 1.5 3 --steps 6 --stage on --time-moves \
    --no-sim --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == devact ]]; then  # <= 9.5 min, 6 files: session 17 call 2, the intermediate pool in device memory
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "device_memory or staged or device_speed" 2>&1 | tail -12 | tee "$OUT/tests.log"
  timeout -s KILL 250 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 7 --stage on --device-act off on \
    --fsdp2 --time-moves --no-sim --out "$OUT/budget_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 120 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 6 --stage on --time-moves \
    --no-sim --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  timeout -s KILL 75 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage on --device-act off on \
    --time-moves --no-sim --out "$OUT/budget_resnet50.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == devact2 ]]; then  # <= 6.5 min: session 17 call 3, the other ratios with device activations (default)
  timeout -s KILL 200 python3 bench/budget.py --models gpt2-large --ratios 3 1.5 --steps 7 --stage on --time-moves \
    --no-sim --out "$OUT/budget_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 170 python3 bench/budget.py --models gpt2-xl --ratios 3 1.5 --steps 6 --stage on --time-moves \
    --no-sim --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == remote ]]; then  # <= 9.5 min, 5 files: session 18 call 1, optimizer state left in host memory
  timeout -s KILL 150 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "host_memory or budget_run_stays" 2>&1 | tail -12 | tee "$OUT/tests.log"
  timeout -s KILL 270 python3 bench/budget.py --models gpt2-xl --ratios 2 3 --steps 5 --stage on --remote-optim on off \
    --time-moves --no-sim --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 150 python3 bench/budget.py --models gpt2-large --ratios 3 --steps 6 --stage on --remote-optim on off \
    --time-moves --no-sim --out "$OUT/budget_gpt2l.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == remote2 ]]; then  # <= 9.5 min, 6 files: session 18 call 2, ResNet-50's ratios and the FSDP2 peers
  timeout -s KILL 150 python3 bench/budget.py --models resnet50 --ratios 1.5 2 3 --steps 7 --stage on --time-moves \
    --no-sim --fsdp2 --out "$OUT/budget_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 330 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 8 --stage on --time-moves --no-sim \
    --fsdp2 --out "$OUT/budget_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  timeout -s KILL 60 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "host_memory_keeps_cupti" 2>&1 | tail -8 | tee "$OUT/tests.log"
fi
if [[ $what == cupti ]]; then  # <= 9 min, 5 files: session 18 call 3, CUPTI residency on the real models' budget rows
  timeout -s KILL 270 python3 bench/budget.py --models gpt2-xl --ratios 3 --steps 5 --stage on --telemetry --no-sim \
    --fsdp2 --out "$OUT/budget_cupti_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 150 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 5 --stage on --telemetry --no-sim \
    --out "$OUT/budget_cupti_gpt2l.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  timeout -s KILL 60 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage on --telemetry --no-sim \
    --out "$OUT/budget_cupti_resnet50.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == partial ]]; then  # ~2 min, 3 files: session 18 call 4, partial staging on ResNet-50 beside FSDP2
  timeout -s KILL 170 python3 bench/budget.py --models resnet50 --ratios 1.5 2 --steps 7 --stage on --partial-stage on off \
    --time-moves --no-sim --fsdp2 --out "$OUT/budget_partial_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
fi
if [[ $what == partial2 ]]; then  # ~9 min, 4 files (written in session 18; superseded by rounds, never run): partial staging, GPT-2
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k partial 2>&1 \
    | tail -8 | tee "$OUT/tests.log"
  timeout -s KILL 230 python3 bench/budget.py --models gpt2-large --ratios 1.5 2 --steps 6 --stage on --partial-stage on off \
    --time-moves --no-sim --out "$OUT/budget_partial_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 180 python3 bench/budget.py --models gpt2-xl --ratios 1.5 --steps 6 --stage on --partial-stage on off \
    --time-moves --no-sim --out "$OUT/budget_partial_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == rounds ]]; then  # ~8 min, 5 files: session 19 call 1, partial staging in rounds (ResNet-50 beside FSDP2, GPT-2-large)
  timeout -s KILL 150 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k partial 2>&1 \
    | tail -8 | tee "$OUT/tests.log"
  timeout -s KILL 150 python3 bench/budget.py --models resnet50 --ratios 1.5 2 3 --steps 10 --stage on --partial-stage on off \
    --time-moves --no-sim --fsdp2 --out "$OUT/budget_rounds_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 250 python3 bench/budget.py --models gpt2-large --ratios 1.5 2 --steps 10 --stage on --partial-stage on off \
    --time-moves --no-sim --out "$OUT/budget_rounds_gpt2l.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == rounds2 ]]; then  # ~8 min, 3 files: session 19 call 2, GPT-2-XL with partial staging in rounds beside FSDP2
  timeout -s KILL 520 python3 bench/budget.py --models gpt2-xl --ratios 1.5 2 3 --steps 10 --stage on --partial-stage on \
    --time-moves --no-sim --fsdp2 --out "$OUT/budget_rounds_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
fi
if [[ $what == rounds3 ]]; then  # ~9 min, 6 files: session 19 call 2, ResNet-50 at FSDP2's peak (1.32) and 1.5, GPT-2-XL 1.5 and 2
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k partial 2>&1 \
    | tail -60 | tee "$OUT/tests.log"
  timeout -s KILL 150 python3 bench/budget.py --models resnet50 --ratios 1.32 1.5 --steps 16 --stage on --partial-stage on off \
    --time-moves --no-sim --fsdp2 --out "$OUT/budget_rounds3_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 290 python3 bench/budget.py --models gpt2-xl --ratios 1.5 2 --steps 10 --stage on --partial-stage on \
    --time-moves --no-sim --out "$OUT/budget_rounds3_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == rounds4 ]]; then  # ~6 min, 5 files: session 19 call 3, the pinned link, then GPT-2-XL at 1.5 partial on/off and at 2
  timeout -s KILL 60 python3 bench/diagnostics/staging_probe.py --out "$OUT/staging_probe.json" 2>&1 | tail -20 | tee "$OUT/rows.log"
  timeout -s KILL 420 python3 bench/budget.py --models gpt2-xl --ratios 1.5 2 --steps 9 --stage on --partial-stage on off \
    --no-sim --out "$OUT/budget_rounds4_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == rounds5 ]]; then  # ~6.5 min, 4 files: session 19 call 4, ResNet-50 at 1.32 / 1.5 / 2 beside FSDP2 again, GPT-2-XL at 1.5
  timeout -s KILL 170 python3 bench/budget.py --models resnet50 --ratios 1.32 1.5 2 --steps 14 --stage on --partial-stage on off \
    --no-sim --fsdp2 --out "$OUT/budget_rounds5_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 230 python3 bench/budget.py --models gpt2-xl --ratios 1.5 --steps 8 --stage on --partial-stage on off \
    --no-sim --out "$OUT/budget_rounds5_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == free2 ]]; then  # <= 4 min, 3 files: session 19 call 5, budget_discard_free's first GPU run since session 14's fix
  timeout -s KILL 100 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k free 2>&1 | tail -30 | tee "$OUT/free_tests.log"
  timeout -s KILL 120 python3 -c "
import faulthandler, sys, runpy
faulthandler.dump_traceback_later(100, exit=True)
sys.argv = ['bench/budget.py', '--models', 'resnet50', '--ratios', '2', '--steps', '5', '--discard-free', 'off', 'on',
            '--no-sim', '--out', '$OUT/budget_free_resnet50.json']
runpy.run_path('bench/budget.py', run_name='__main__')
" 2>&1 | grep -v Warning | tail -60 | tee "$OUT/free.log"
fi
if [[ $what == predictresnet ]]; then  # ~2 min, 1-2 files (written in session 19, not run): the simulator's ResNet-50 rows,
  # on the GPU machine's CPU (torchvision loads only there); commit the file before any call that measures them
  timeout -s KILL 300 python3 bench/budget.py --predict --models resnet50 --ratios 1.32 1.5 2 3 --stage on \
    --partial-stage on off --out "$OUT/budget_predicted_resnet50.json" 2>&1 | grep -v Warning | tee "$OUT/predict.log"
fi
if [[ $what == xlprofile ]]; then  # ~4 min, 7 files: session 20 call 1, where GPT-2-XL's step time goes at 1.5 and 2 (one
  # profiled step each, the step before it stack-sampled), the simulator's ResNet-50 rows on the CPU meanwhile
  (timeout -s KILL 280 python3 bench/budget.py --predict --models resnet50 --ratios 1.32 1.5 2 3 --stage on \
    --partial-stage on off --out "$OUT/budget_predicted_resnet50.json" 2>&1 | grep -v Warning > "$OUT/predict.log") &
  for r in 2 1.5; do
    gib=$(python3 -c "print(53366226944 / $r / 2**30)")
    timeout -s KILL 150 python3 bench/budget_profile.py --model gpt2-xl --budget-gib "$gib" --stage --steps 7 --sample \
      --profile-too --out-dir "$OUT/xl$r" 2>&1 | grep -v Warning | tail -40 | tee -a "$OUT/profile.log"
  done
  wait
fi
if [[ $what == copies ]]; then  # ~8 min, 6 files: session 20 call 2, optimizer chunks joined (B/64) and remote state copied:
  # GPU tests, then GPT-2-XL at 2 and 3 with the copies on and off (same process); the simulator's ResNet-50 rows meanwhile
  (timeout -s KILL 280 python3 bench/budget.py --predict --models resnet50 --ratios 1.32 1.5 2 3 --stage on \
    --partial-stage on off --out "$OUT/budget_predicted_resnet50.json" 2>&1 | grep -v Warning > "$OUT/predict.log") &
  timeout -s KILL 170 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider \
    -k "remote or stays_under_b_and_trains_like" 2>&1 | tail -30 | tee "$OUT/tests.log"
  timeout -s KILL 330 python3 bench/budget.py --models gpt2-xl --ratios 2 3 --steps 9 --stage on --remote-copies on off \
    --no-sim --out "$OUT/budget_copies_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  wait
fi
if [[ $what == copies2 ]]; then  # ~9 min, 6 files: session 20 call 3, the copy slots (announced, weighed): GPU tests, ResNet-50
  # beside FSDP2 twice in turn (partial staging at 1.32 and 1.5, full at 1.32), then GPT-2-XL at 2 with the copies on and off
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA --tb=short -p no:cacheprovider \
    -k "remote or left_in_host" 2>&1 | tail -60 | tee "$OUT/tests.log"
  timeout -s KILL 200 python3 bench/budget.py --models resnet50 --ratios 1.32 1.5 --steps 12 --stage on \
    --partial-stage on off --repeats 2 --fsdp2 --no-sim --out "$OUT/budget_copies2_resnet50.json" 2>&1 \
    | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 200 python3 bench/budget.py --models gpt2-xl --ratios 2 --steps 9 --stage on --remote-copies on off \
    --no-sim --out "$OUT/budget_copies2_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == final20 ]]; then  # ~8 min, 4 files: session 20 call 4, the rows the final code had not run: GPT-2-large at 1.5 / 2
  # / 3 and GPT-2-XL at 3 and 1.5 (staging, the copies weighed as the session does)
  timeout -s KILL 230 python3 bench/budget.py --models gpt2-large --ratios 3 2 1.5 --steps 8 --stage on \
    --no-sim --out "$OUT/budget_final20_gpt2l.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 230 python3 bench/budget.py --models gpt2-xl --ratios 3 1.5 --steps 8 --stage on \
    --no-sim --out "$OUT/budget_final20_gpt2xl.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == diag21 ]]; then  # ~8 min, 5 files: session 21 call 1, where ResNet-50's partial-staging step goes at 1.32 (one
  # step stack-sampled, the next profiled), then GPT-2-XL at 2 and 3 in place with the intermediate pool's state per step
  timeout -s KILL 150 python3 bench/budget_profile.py --model resnet50 --budget-gib 5.2513 --stage --partial --steps 10 \
    --sample --profile-too --out-dir "$OUT/resnet" 2>&1 | grep -v Warning | tail -60 | tee "$OUT/profile.log"
  rm -f "$OUT/resnet/trace.json.gz"
  timeout -s KILL 330 python3 bench/budget.py --models gpt2-xl --ratios 2 3 --steps 9 --stage on \
    --no-sim --out "$OUT/budget_diag21_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
fi
if [[ $what == rows21 ]]; then  # ~8 min, 6 files: session 21 call 2, the copies back started at forward's end: the staging
  # GPU tests, GPT-2-XL at 2 and 3 twice in turn and GPT-2-large at 1.5 / 2 / 3 (staging, in place); ResNet-50's
  # predictions on the CPU meanwhile (measured in the next call, after they are committed)
  (timeout -s KILL 400 python3 bench/budget.py --predict --models resnet50 --ratios 1.32 1.5 --stage on \
    --partial-stage on off --out "$OUT/budget_predicted_resnet50.json" 2>&1 | grep -v Warning > "$OUT/predict.log") &
  timeout -s KILL 120 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA --tb=short -p no:cacheprovider \
    -k "staged or partial" 2>&1 | tail -40 | tee "$OUT/tests.log"
  timeout -s KILL 290 python3 bench/budget.py --models gpt2-xl --ratios 2 3 --steps 9 --stage on --repeats 2 \
    --no-sim --out "$OUT/budget_rows21_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 170 python3 bench/budget.py --models gpt2-large --ratios 1.5 2 3 --steps 8 --stage on \
    --no-sim --out "$OUT/budget_rows21_gpt2l.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  wait
fi
if [[ $what == resnet21 ]]; then  # ~8 min, 5 files: session 21 call 3, ResNet-50 beside FSDP2 twice in turn (partial staging and
  # full at 1.32 and 1.5; copies back from forward's end), then ResNet-50 and GPT-2-large with CUPTI on (the budget
  # at each step's end)
  timeout -s KILL 330 python3 bench/budget.py --models resnet50 --ratios 1.32 1.5 --steps 12 --stage on \
    --partial-stage on off --repeats 2 --fsdp2 --no-sim --out "$OUT/budget_resnet21.json" 2>&1 \
    | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 80 python3 bench/budget.py --models resnet50 --ratios 1.32 --steps 8 --stage on \
    --partial-stage on --telemetry --no-sim --out "$OUT/budget_cupti21_resnet50.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
  timeout -s KILL 130 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 6 --stage on \
    --telemetry --no-sim --out "$OUT/budget_cupti21_gpt2l.json" 2>&1 | grep -v Warning | tee -a "$OUT/rows.log"
fi
if [[ $what == final21 ]]; then  # ~7 min, 6 files: session 21 call 4, the budget GPU tests on the final code, then the rows it had
  # not run: GPT-2-XL at 1.5 and 3, ResNet-50 at 2 and 3 (partial and full staging) beside FSDP2
  timeout -s KILL 200 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA --tb=short -p no:cacheprovider 2>&1 \
    | tail -45 | tee "$OUT/tests.log"
  timeout -s KILL 210 python3 bench/budget.py --models gpt2-xl --ratios 1.5 3 --steps 9 --stage on \
    --no-sim --out "$OUT/budget_final21_gpt2xl.json" 2>&1 | grep -v Warning | tee "$OUT/rows.log"
  timeout -s KILL 170 python3 bench/budget.py --models resnet50 --ratios 2 3 --steps 10 --stage on \
    --partial-stage on off --fsdp2 --no-sim --out "$OUT/budget_final21_resnet50.json" 2>&1 | grep -v Warning \
    | tee -a "$OUT/rows.log"
fi
if [[ $what == fsdp21 ]]; then  # ~4 min, 3 files: session 21 call 5, ResNet-50 at 1.32 with partial staging beside FSDP2, two more
  # repeats in turn (the call's remaining device time)
  timeout -s KILL 250 python3 bench/budget.py --models resnet50 --ratios 1.32 --steps 12 --stage on \
    --partial-stage on --repeats 2 --fsdp2 --no-sim --out "$OUT/budget_fsdp21_resnet50.json" 2>&1 | grep -v Warning \
    | tee "$OUT/rows.log"
fi
if [[ $what == final ]]; then  # <= 9 min
  timeout -s KILL 180 python3 -m pytest tests/gpu/test_cuda_session.py tests/gpu/test_runner_gpu.py tests/gpu/test_telemetry_gpu.py \
    -q -rA -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/final_core_tests.log"
  timeout -s KILL 80 python3 -m pytest tests/gpu/test_budget_gpu.py -q -rA -p no:cacheprovider -k staged 2>&1 | tail -30 | tee "$OUT/final_tests.log"
  timeout -s KILL 80 python3 bench/diagnostics/staged_pool.py --models resnet50 --out "$OUT/staged_pool.json" 2>&1 | tee "$OUT/final.log"
  timeout -s KILL 60 python3 bench/budget.py --models resnet50 --ratios 2 --steps 6 --stage on --time-moves --no-sim \
    --out "$OUT/budget_final_resnet50.json" 2>&1 | tee -a "$OUT/final.log"
  timeout -s KILL 140 python3 bench/budget.py --models gpt2-large --ratios 2 --steps 5 --stage on --time-moves --no-sim \
    --out "$OUT/budget_final_gpt2l.json" 2>&1 | tee -a "$OUT/final.log"
fi
if [[ $what == native ]]; then  # ~9 min (session 15: GPT-2-medium's second process needs more than 100 s)
  for fixed in "" "--fixed-batch"; do
    timeout -s KILL 100 python3 bench/allocator_overhead.py --models mlp --alternate 6 --repeats 2 --steps 60 --warmup 5 \
      --cpus auto $fixed --out "$OUT/native_mlp${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/native.log"
    timeout -s KILL 120 python3 bench/allocator_overhead.py --models resnet50 --alternate 6 --repeats 3 --steps 10 \
      --warmup 3 --cpus auto $fixed --out "$OUT/native_resnet50${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/native.log"
    timeout -s KILL 170 python3 bench/allocator_overhead.py --models gpt2-medium --alternate 4 --repeats 2 --steps 6 \
      --warmup 2 --cpus auto $fixed --out "$OUT/native_gpt2${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/native.log"
  done
fi
if [[ $what == gaps ]]; then  # ~2 min
  for fixed in "" "--fixed-batch"; do
    timeout -s KILL 100 python3 bench/diagnostics/kernel_gaps.py --model mlp --blocks 6 --steps 30 --processes 2 $fixed \
      --out "$OUT/kernel_gaps_mlp${fixed:+_fixed}.json" 2>&1 | tee -a "$OUT/gaps.log"
  done
  timeout -s KILL 80 python3 bench/diagnostics/step_host_costs.py --out "$OUT/step_host_costs.json" 2>&1 | tee -a "$OUT/gaps.log"
fi
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$OUT/sanity.log"
