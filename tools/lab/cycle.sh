#!/usr/bin/env bash
# Cycle runs of issue 15 on the lab H200 (hf_cached and hf_reference need only the extras; vllm needs
# vLLM installed too), each with its own timeout; raw files and seals come back as $OUT/cycles.tgz.
#   RUNS="hf_cached:pg_k1:p128-r256-n4-stochastic hf_cached:direct_gkd:p128-r256-n4-stochastic" \
#     bash tools/lab/cycle.sh
#   vllm entries carry the memory mode: vllm:pg_k1:p128-r256-n4-stochastic:sleep
# A run cut by its timeout leaves an unsealed raw file with no writer: `rollout seal FILE --reason ...`
# before publishing (the cut run is then listed, never used as complete).
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
CAMPAIGN=${CAMPAIGN:-h200-v2}
for run in ${RUNS:?RUNS: backend:algorithm:cell[:vllm-memory-mode] ...}; do
  IFS=: read -r backend algorithm cell mode <<< "$run"
  extra=()
  [ -n "${mode:-}" ] && extra=(--vllm-memory-mode "$mode")
  timeout "${RUN_TIMEOUT_S:-280}" python3 -m rollout_lib.cli cycle --backend "$backend" --algorithm "$algorithm" \
    --cell "$cell" --campaign "$CAMPAIGN" "${extra[@]}" >> "$OUT/cycles.log" 2>&1
  echo "$run -> exit $?" >> "$OUT/cycles.log"
done
tar czf "$OUT/cycles.tgz" outputs/cycles
