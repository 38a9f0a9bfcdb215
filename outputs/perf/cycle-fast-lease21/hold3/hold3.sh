#!/usr/bin/env bash
# issue 41, hold 3: the bf16-operand head (new preregistration, campaign h200-cycle-fast-bf16-head), exactness
# with it, update side by side (reference / liger head / bf16-operand head), the reference cycle row beside
# them, the GPU tests. Everything is written under /tmp (a poll's working-tree sync removes untracked files).
set -u
J=/tmp/job; mkdir -p $J/out/update; C=/tmp/cycles-out
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log() { echo "[$(date -u +%T)] $*" >> $J/out/job.log; }
step() { local name=$1; shift; log "start $name"; timeout "${T:-420}" "$@" > "$J/out/$name.log" 2>&1; log "end $name rc=$?"; }
log "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader) source: $(cat .source-commit 2>/dev/null)"
for run in direct_gkd:p128-r256-n4-stochastic pg_k1:p128-r256-n4-stochastic direct_gkd:p512-r512-n4-stochastic \
           pg_k1:p512-r512-n4-stochastic; do
  IFS=: read -r algorithm cell <<< "$run"
  step "cycle-b-$algorithm-$cell" python3 -m rollout_lib.cli cycle --params params/rollout-runtime-v2-cycle-fast-bf16-head.yaml \
    --backend hf_cached --algorithm $algorithm --cell $cell --campaign h200-cycle-fast-bf16-head --output-dir $C
done
step cycle-ref-direct_gkd-p128 python3 -m rollout_lib.cli cycle --params params/rollout-runtime-v2-cycle.yaml \
  --backend hf_cached --algorithm direct_gkd --cell p128-r256-n4-stochastic --campaign h200-cycle-side-by-side --output-dir $C
step exactness python3 tools/fast_training_exactness.py --kernel bf16_operands --out $J/out/exactness-bf16-head-p128.json
for label in reference:--path=reference fast-liger:--kernel=liger fast-bf16:--kernel=bf16_operands; do
  IFS=: read -r name flag <<< "$label"
  path=fast; [ "$name" = reference ] && path=reference
  step "update-$name-p512" python3 tools/profile_update.py --cell p512-r512-n4-stochastic --path $path $flag \
    --label "_$name" --no-trace --repeats 3 --out $J/out/update
done
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_training.py
log "done"
touch $J/done
