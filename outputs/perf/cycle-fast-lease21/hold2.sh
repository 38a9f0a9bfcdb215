#!/usr/bin/env bash
# issue 41, hold 2: exactness at full size, old vs new update side by side, the fast cycle rows (hf_cached),
# one reference cycle row in the same hold, the GPU tests of the fast path. Run detached from the repo root.
set -u
J=/tmp/job; mkdir -p $J/out/update $J/out/trace
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log() { echo "[$(date -u +%T)] $*" >> $J/out/job.log; }
step() { local name=$1; shift; log "start $name"; timeout "${T:-420}" "$@" > "$J/out/$name.log" 2>&1; log "end $name rc=$?"; }
log "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader) source: $(cat .source-commit 2>/dev/null)"
step exactness python3 tools/fast_training_exactness.py --out $J/out/exactness-p128-r256-n4.json
for cell in p128-r256-n4-stochastic p512-r512-n4-stochastic; do
  step "ref-$cell" python3 tools/profile_update.py --cell $cell --path reference --no-trace --out $J/out/update
  step "fast-$cell" python3 tools/profile_update.py --cell $cell --path fast --out /tmp/trace
done
python3 tools/trim_trace.py /tmp/trace/trace-fast-p128-r256-n4-stochastic.json $J/out/trace/trace-fast-p128-window.json.gz \
  --start-fraction 0.3 --window-ms 120 > $J/out/trace/trim-fast.log 2>&1
cp /tmp/trace/summary-* $J/out/update/ 2>/dev/null
step fast-nockpt-6144 python3 tools/profile_update.py --cell p128-r256-n4-stochastic --path fast --checkpointing off \
  --max-tokens 6144 --label -nockpt-6144 --no-trace --out $J/out/update
step fast-ckpt-768 python3 tools/profile_update.py --cell p128-r256-n4-stochastic --path fast --max-tokens 768 \
  --label -ckpt-768 --no-trace --out $J/out/update
for run in direct_gkd:p128-r256-n4-stochastic pg_k1:p128-r256-n4-stochastic direct_gkd:p512-r512-n4-stochastic \
           pg_k1:p512-r512-n4-stochastic; do
  IFS=: read -r algorithm cell <<< "$run"
  step "cycle-fast-$algorithm-$cell" python3 -m rollout_lib.cli cycle --params params/rollout-runtime-v2-cycle-fast.yaml \
    --backend hf_cached --algorithm $algorithm --cell $cell --campaign h200-cycle-fast
done
step cycle-ref-direct_gkd-p128 python3 -m rollout_lib.cli cycle --params params/rollout-runtime-v2-cycle.yaml \
  --backend hf_cached --algorithm direct_gkd --cell p128-r256-n4-stochastic --campaign h200-cycle-side-by-side
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_training.py
log "done"
touch $J/done
