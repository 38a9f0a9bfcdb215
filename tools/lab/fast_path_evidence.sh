#!/usr/bin/env bash
# One device call for issue 12's evidence on the lab H200, from the repository root, after the
# extras are installed (`eval "$(bash .stage/extras/install-extras.sh)"`). Every step has its own
# timeout and writes under $OUT as it goes (at most 8 files come back):
#   probe.json / probe.log   before vs after in one process (tools/lab/fast_path_probe.py)
#   trace-*.json.gz          20 ms profiler windows of each variant in the first PROFILE_CELLS cells (default 2)
#   gpu-tests.log            the GPU-marked fast-path tests
#   evidence.tgz             outputs/conformance after hf_cached conformance (float32 + bf16) and the
#                            8-refresh run (merge SEALS.jsonl: the local file must be a prefix)
# BEFORE names the older compact_qwen3.py (default: the copy of commit fdebb33 under .stage/before: `git show fdebb33:rollout_lib/backends/compact_qwen3.py`).
set -u
status=0  # the probe's exit status where it failed (the other steps' are not kept), returned after everything is packed
export PYTHONPATH=/tmp/site:$PWD
BEFORE=${BEFORE:-.stage/before/compact_qwen3_fdebb33.py}
CAMPAIGN=${CAMPAIGN:-h200-v2}
STEPS=${STEPS:-probe,tests,refresh}   # conformance takes a call of its own: STEPS=conformance
rm -rf /tmp/prof  # traces of an earlier probe in this machine would be trimmed into this $OUT too
mkdir -p "$OUT" /tmp/prof
if [[ $STEPS == *probe* ]]; then
  timeout "${PROBE_TIMEOUT_S:-300}" python3 tools/lab/fast_path_probe.py --variants "${VARIANTS:-before,inductor}" --before "$BEFORE" \
    --cells "${PROBE_CELLS:-p128-r64-n1-greedy,p128-r64-n4-stochastic,p512-r256-n4-greedy}" --repetitions 3 \
    --profile /tmp/prof --profile-cells "${PROFILE_CELLS:-2}" --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1
  probe_rc=$?
  if [ "$probe_rc" -ne 0 ]; then
    # lease 47: the probe was cut after two of three variants and the job still exited 0 (the cut showed only as a
    # probe.log ending mid-load): the cut is written where the results are and becomes the job's exit status
    echo "probe: exit $probe_rc (124: stopped by PROBE_TIMEOUT_S=${PROBE_TIMEOUT_S:-300}); variants of VARIANTS not in probe.json were not measured" | tee -a "$OUT/probe.log" >&2
    status=$probe_rc
  fi
  for trace in /tmp/prof/*.json; do
    [ -e "$trace" ] && python3 tools/lab/trim_trace.py "$trace" "$OUT/trace-$(basename "$trace" .json)-20ms.json.gz" >> "$OUT/probe.log"
  done
fi
if [[ $STEPS == *tests* ]]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_fast_path.py > "$OUT/gpu-tests.log" 2>&1
fi
if [[ $STEPS == *refresh* ]]; then
  timeout 240 python3 -m rollout_lib.cli refresh --backend hf_cached \
    --out "outputs/conformance/refresh-$CAMPAIGN-hf_cached-$(date -u +%Y%m%dT%H%M%SZ).json" >> "$OUT/gpu-tests.log" 2>&1
fi
if [[ $STEPS == *conformance* ]]; then
  # h200-v1's run of the same settings took 466 s (the oracle generates too): one call on its own
  timeout "${CONFORMANCE_TIMEOUT_S:-560}" python3 -m rollout_lib.cli conformance --candidate hf_cached \
    --out "outputs/conformance/conformance-$CAMPAIGN-hf_cached-$(date -u +%Y%m%dT%H%M%SZ).json" >> "$OUT/gpu-tests.log" 2>&1
fi
tar czf "$OUT/evidence.tgz" outputs/conformance
exit "$status"
