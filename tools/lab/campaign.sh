#!/usr/bin/env bash
# The campaign over a lease, in back-to-back device calls (the machine stays warm 30 s after a call).
#   start: BACKEND=hf_reference DEADLINE_S=1300 bash tools/lab/campaign.sh start
#          copies the tree to /tmp/rr/src without .git (the carried .source-commit binds the commit),
#          starts the detached driver, polls until ~540 s into the call, then packs what exists
#   poll:  bash tools/lab/campaign.sh poll   (in the next calls: status until the driver ends
#          or ~540 s pass, then pack)
# Each call leaves $OUT/campaign.tgz (outputs/raw/<campaign> + outputs/campaigns/<campaign>): untar it,
# copy the new raw files and SEALS.jsonl (the local one must be its prefix), publish, check, commit.
set -u
CAMPAIGN=${CAMPAIGN:-h200-v2}
BACKEND=${BACKEND:-hf_reference}
GPUS=${GPUS:-1}
CALL_S=${CALL_S:-540}
started=$(date +%s)
export PYTHONPATH=/tmp/site
if [ "${1:-poll}" = start ]; then
  source tools/lab/work_copy.sh
  work_copy /tmp/rr  # a second start on the same machine keeps what the first measured
  cd /tmp/rr/src
  python3 -m rollout_lib.cli campaign run --campaign "$CAMPAIGN" --backend "$BACKEND" --gpus "$GPUS" \
    --deadline-s "${DEADLINE_S:?DEADLINE_S: seconds of device time the driver may use}" --detach
  sleep 5  # the detached driver writes its state first: polling before that reads "no driver"
else
  cd /tmp/rr/src
fi
while [ $(( $(date +%s) - started )) -lt "$CALL_S" ]; do
  python3 -m rollout_lib.cli campaign status --campaign "$CAMPAIGN" --backend "$BACKEND" 2>/dev/null | grep -q running || break
  sleep 10
done
python3 -m rollout_lib.cli campaign status --campaign "$CAMPAIGN" --backend "$BACKEND" | tail -15
tar czf "$OUT/campaign.tgz" "outputs/raw/$CAMPAIGN" "outputs/campaigns/$CAMPAIGN"
