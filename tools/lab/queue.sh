#!/usr/bin/env bash
# A queue of device jobs that outlives the 10-minute command limit: started detached (its own process
# session) on the warm machine, polled by back-to-back calls (the machine stays warm 30 s after each),
# so the GPU stays busy between calls and a job longer than one call (conformance: ~9 min) finishes.
#   start: QUEUE=tools/lab/queues/lease.tsv bash tools/lab/queue.sh start
#   poll:  bash tools/lab/queue.sh poll
# Each call waits until the queue ends or ~CALL_S seconds pass, prints each job's state, and packs
# $OUT/queue.tgz: the job logs and the evidence directories the jobs write (outputs/conformance,
# outputs/perf, outputs/cycles, outputs/raw, outputs/campaigns). Merge seal manifests as for the
# campaign (the local SEALS.jsonl must be a prefix of the returned one).
# Queue file: one job per line, `name<TAB>timeout_s<TAB>command` (run by bash from the work copy;
# `#` lines are comments). A job that exceeds its timeout is killed and the queue goes on. Jobs see
# QUEUE_ENDS_AT (epoch seconds, LEASE_S after the start) and JOB_DEADLINE_S (seconds this job may
# plan for: the lease's remainder or its own timeout less JOB_MARGIN_S, whichever is less), so a
# campaign run passes `--deadline-s $JOB_DEADLINE_S` and starts no unit that the lease cuts off, and
# QUEUE_LEASE_S (LEASE_S: the most any job of this lease can get), which it passes as `--lease-s` so a
# later job with little time left does not cut a cell that a whole lease could hold. A job
# reached with less than MIN_JOB_S of the lease left is skipped (recorded), not started: lease 7's
# last job began after the lease's end and left a header-only raw file behind.
set -u
CALL_S=${CALL_S:-540}
WORK=${QUEUE_WORK:-/tmp/rq}
started=$(date +%s)
export PYTHONPATH=/tmp/site:$WORK/src VLLM_USE_FLASHINFER_SAMPLER=0
if [ "${1:-poll}" = start ]; then
  queue=${QUEUE:?QUEUE: a queue file (name, timeout_s, command; tab-separated)}
  [ -f "$queue" ] || { echo "queue file not found: $queue" >&2; exit 2; }
  if [ -f "$WORK/state/running" ]; then
    echo "a queue is already running (pid $(cat "$WORK/state/running")); poll it" >&2; exit 2
  fi
  source tools/lab/work_copy.sh
  work_copy "$WORK"  # a second start on the same machine keeps the outputs of the first
  mkdir -p "$WORK/state" "$WORK/logs"
  cp "$queue" "$WORK/state/queue.tsv"
  # when the lease's last poll must have packed everything: the loop below derives each job's
  # JOB_DEADLINE_S from it and skips a job it reaches too late (LEASE_S: seconds from this start;
  # default for a start ~1 min into a 30-minute lease, leaving the last poll ~2 minutes)
  export QUEUE_LEASE_S=${LEASE_S:-1560}
  export QUEUE_ENDS_AT=$(( started + QUEUE_LEASE_S ))
  echo "$QUEUE_ENDS_AT" > "$WORK/state/ends_at"
  setsid nohup bash -c '
    echo $$ > '"$WORK"'/state/running
    cd '"$WORK"'/src
    # the host beside the logs (CPU model, launch cost): the eager paths are host-bound
    timeout 120 python3 tools/lab/host_facts.py > '"$WORK"'/state/host.json 2> '"$WORK"'/logs/host_facts.log
    while IFS=$'"'"'\t'"'"' read -r name timeout_s command; do
      case "$name" in ""|\#*) continue ;; esac
      left=$(( QUEUE_ENDS_AT - $(date +%s) ))
      if [ "$left" -lt "${MIN_JOB_S:-60}" ]; then
        echo "$name skipped $(date +%s) $left" >> '"$WORK"'/state/jobs; continue
      fi
      own=$(( timeout_s - ${JOB_MARGIN_S:-60} ))
      export JOB_DEADLINE_S=$(( left < own ? left : own ))
      echo "$name running $(date +%s)" >> '"$WORK"'/state/jobs
      timeout --kill-after=20 "$timeout_s" bash -c "$command" > '"$WORK"'/logs/"$name".log 2>&1 < /dev/null
      echo "$name exit $? $(date +%s)" >> '"$WORK"'/state/jobs
      # a job killed by its timeout may leave its engine server behind (it holds GPU memory and a
      # port): recorded, then removed, so the next job starts on a clean GPU
      if pgrep -f "vllm[.]entrypoints" > /dev/null; then
        echo "$name left a vLLM server running: killed $(date +%s)" >> '"$WORK"'/state/leftovers
        pkill -9 -f "vllm[.]entrypoints"; sleep 3
      fi
    done < '"$WORK"'/state/queue.tsv
    rm -f '"$WORK"'/state/running
  ' > "$WORK/logs/queue.log" 2>&1 < /dev/null &
  sleep 2
fi
[ -d "$WORK/state" ] || { echo "no queue on this machine (a fresh machine: start one)" >&2; exit 2; }
while [ -f "$WORK/state/running" ] && [ $(( $(date +%s) - started )) -lt "$CALL_S" ]; do
  sleep 5
done
echo "queue: $([ -f "$WORK/state/running" ] && echo running || echo finished)"
source tools/lab/job_states.sh
job_states "$WORK/state/jobs"
cd "$WORK/src"
dirs=()
for d in outputs/conformance outputs/perf outputs/cycles outputs/raw outputs/campaigns; do [ -d "$d" ] && dirs+=("$d"); done
mkdir -p "$OUT"
[ -f "$WORK/state/leftovers" ] && cat "$WORK/state/leftovers"
tar czf "$OUT/queue.tgz" -C "$WORK" logs state -C "$WORK/src" "${dirs[@]}"
