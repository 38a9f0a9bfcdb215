#!/usr/bin/env bash
# Issue 42 on the lab H200: train both stand-ins (actor qwen3-0.6b, teacher qwen3-1.7b) with
# `rollout models train`, print their digests, fingerprints and metrics, and pack the records.
# Needs nothing beyond the GPU image (torch, transformers 5.17.0, tokenizers, safetensors, numpy): no
# extras, no vLLM. Runs detached (its own session) so a poll's 10-minute limit does not cut it, and
# writes everything under /tmp (a poll's working-tree sync deletes untracked files in the checkout).
#   start: bash tools/lab/train_standins.sh start     (one call: starts, then polls up to CALL_S)
#   poll:  bash tools/lab/train_standins.sh poll      (later calls, back to back)
# Each call prints the state and a summary, and packs $OUT/standins.tgz: the two rollout_trained.json
# records, the logs, summary.json and, once both digests exist, rollout-runtime-v3-trained.yaml (the
# draft with its digests filled in: review, then commit it under params/). The weights stay on the
# machine (/tmp/standins/out/...; 1.2 GB + 3.4 GB do not fit a transfer): a fresh machine rebuilds them.
# Env: KERNELS (default fast: the v3 recipe's kernels; reference: lease 22's); STEPS_ACTOR / STEPS_TEACHER override the recipes' steps (a smoke of this script: 8 and 4);
# REPEAT=1 trains the actor a second time with --expect on the first record (same-machine determinism);
# EXPECT_DIR=dir with earlier records (qwen3-0.6b-actor.json, qwen3-1.7b-teacher.json) checks this
# machine's rebuild against them (bit-exact, else the tolerance-checked fingerprint).
set -u
CALL_S=${CALL_S:-540}
WORK=${STANDIN_WORK:-/tmp/standins}
started=$(date +%s)
export PYTHONPATH=/tmp/site:$WORK/src
if [ "${1:-poll}" = start ]; then
  if [ -f "$WORK/state/running" ]; then
    echo "a training is already running (pid $(cat "$WORK/state/running")); poll it" >&2; exit 2
  fi
  rm -rf "$WORK/src" && mkdir -p "$WORK/state" "$WORK/logs" "$WORK/out" "$WORK/records"
  cp -r . "$WORK/src" && rm -rf "$WORK/src/.git" "$WORK"/src/.stage
  [ -n "${EXPECT_DIR:-}" ] && cp -r "$EXPECT_DIR" "$WORK/expect"
  : > "$WORK/state/jobs"
  export STEPS_ACTOR=${STEPS_ACTOR:-} STEPS_TEACHER=${STEPS_TEACHER:-} REPEAT=${REPEAT:-0} KERNELS=${KERNELS:-fast}
  setsid nohup bash -c '
    echo $$ > '"$WORK"'/state/running
    cd '"$WORK"'/src
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > '"$WORK"'/state/gpu.txt 2>&1
    train() {  # name arch role steps [extra args]
      local name=$1 arch=$2 role=$3 steps=$4; shift 4
      local args=(--kernels "${KERNELS:-fast}" --arch "$arch" --role "$role" --device cuda --out '"$WORK"'/out/"$name"
                  --record '"$WORK"'/records/"$name".json --replace)
      [ -n "$steps" ] && args+=(--steps "$steps")
      [ -f '"$WORK"'/expect/"${name%-repeat}".json ] && args+=(--expect '"$WORK"'/expect/"${name%-repeat}".json)
      echo "$name running $(date +%s)" >> '"$WORK"'/state/jobs
      python3 -m rollout_lib.cli models train "${args[@]}" "$@" > '"$WORK"'/logs/"$name".log 2>&1 < /dev/null
      echo "$name exit $? $(date +%s)" >> '"$WORK"'/state/jobs
    }
    train qwen3-0.6b-actor qwen3-0.6b actor "$STEPS_ACTOR"
    train qwen3-1.7b-teacher qwen3-1.7b teacher "$STEPS_TEACHER"
    if [ "$REPEAT" = 1 ]; then
      train qwen3-0.6b-actor-repeat qwen3-0.6b actor "$STEPS_ACTOR" --expect '"$WORK"'/records/qwen3-0.6b-actor.json
    fi
    rm -f '"$WORK"'/state/running
  ' > "$WORK/logs/driver.log" 2>&1 < /dev/null &
  sleep 2
fi
[ -d "$WORK/state" ] || { echo "no training on this machine (a fresh machine: start one)" >&2; exit 2; }
while [ -f "$WORK/state/running" ] && [ $(( $(date +%s) - started )) -lt "$CALL_S" ]; do
  sleep 5
done
echo "training: $([ -f "$WORK/state/running" ] && echo running || echo finished) ($(cat "$WORK/state/gpu.txt" 2>/dev/null))"
source tools/lab/job_states.sh
job_states "$WORK/state/jobs"
for log in "$WORK"/logs/qwen3-*.log; do [ -f "$log" ] && { echo "--- $(basename "$log")"; tail -n 4 "$log"; }; done
cd "$WORK/src"
python3 - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
summary = {}
for record_file in sorted((work / "records").glob("*.json")):
    r = json.loads(record_file.read_text())
    f, i = r["final_metrics"], r["init_metrics"]
    summary[record_file.stem] = {
        "payload_digest": r["payload_digest"], "tokenizer_json_sha256": r["tokenizer_json_sha256"],
        "trained_tokens": r["trained_tokens"], "train_wall_s": r["train_wall_s"],
        "train_tokens_per_s": r["train_tokens_per_s"], "heldout_loss_nats": f["heldout_loss_nats"],
        "init_heldout_loss_nats": i["heldout_loss_nats"], "mean_entropy_nats": f["mean_entropy_nats"],
        "init_mean_entropy_nats": i["mean_entropy_nats"], "mean_top1_probability": f["mean_top1_probability"],
        "top1_accuracy": f["top1_accuracy"], "top1_histogram_counts": f["top1_probability_histogram"]["counts"],
        "heldout_loss_curve": [(p["step"], p["heldout_loss_nats"]) for p in r["heldout_loss_curve"]],
        "nondeterminism_warnings": r["deterministic"]["nondeterminism_warnings"], "environment": r["environment"]}
    print(f"{record_file.stem}: digest {r['payload_digest']}  loss {f['heldout_loss_nats']:.4f} (init "
          f"{i['heldout_loss_nats']:.4f})  entropy {f['mean_entropy_nats']:.3f} nats (init {i['mean_entropy_nats']:.3f})"
          f"  top-1 p {f['mean_top1_probability']:.3f}  {r['trained_tokens']} tokens in {r['train_wall_s']:.0f} s")
(work / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
EOF
# the draft with both digests filled in, once both records exist (the tool refuses otherwise, writing nothing)
python3 tools/lab/fill_standin_draft.py "$WORK/records" params/drafts/rollout-runtime-v3-trained.filled.yaml \
  > /dev/null 2>&1 && mv params/drafts/rollout-runtime-v3-trained.filled.yaml "$WORK/rollout-runtime-v3-trained.yaml" \
  && echo "filled draft: rollout-runtime-v3-trained.yaml in standins.tgz (digests from this run)"
mkdir -p "$OUT"
files=(logs state records summary.json)
[ -f "$WORK/rollout-runtime-v3-trained.yaml" ] && files+=(rollout-runtime-v3-trained.yaml)
tar czf "$OUT/standins.tgz" -C "$WORK" "${files[@]}"
