#!/usr/bin/env bash
# issue 41, hold 4: gradient checkpointing off, measured (update time and transient peak), and the fast path's
# GPU tests on main after the merges. Everything under /tmp.
set -u
J=/tmp/job; mkdir -p $J/out/update
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log() { echo "[$(date -u +%T)] $*" >> $J/out/job.log; }
step() { local name=$1; shift; log "start $name"; timeout "${T:-300}" "$@" > "$J/out/$name.log" 2>&1; log "end $name rc=$?"; }
log "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader) source: $(cat .source-commit 2>/dev/null)"
step nockpt-p128 python3 tools/profile_update.py --cell p128-r256-n4-stochastic --path fast --kernel bf16_operands \
  --checkpointing off --max-tokens 8192 --label _bf16-nockpt --no-trace --out $J/out/update
step ckpt-p128 python3 tools/profile_update.py --cell p128-r256-n4-stochastic --path fast --kernel bf16_operands \
  --checkpointing on --max-tokens 8192 --label _bf16-ckpt --no-trace --out $J/out/update
step nockpt-p512 python3 tools/profile_update.py --cell p512-r512-n4-stochastic --path fast --kernel bf16_operands \
  --checkpointing off --max-tokens 8192 --label _bf16-nockpt --no-trace --out $J/out/update
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_training.py
log "done"; touch $J/done
