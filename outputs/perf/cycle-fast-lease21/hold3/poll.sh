#!/usr/bin/env bash
# pack what the detached job has so far into $OUT (two tarballs) and show its log; wait up to $1 s for it to end
J=/tmp/job; end=$(( $(date +%s) + ${1:-500} ))
while [ ! -f $J/done ] && [ "$(date +%s)" -lt $end ]; do sleep 5; done
tar czf $OUT/job.tgz -C /tmp job/out 2>/dev/null
[ -d /tmp/cycles-out ] && tar czf $OUT/cycles.tgz -C /tmp --exclude='*.lock' cycles-out
cat $J/out/job.log; [ -f $J/done ] && echo JOB-DONE
