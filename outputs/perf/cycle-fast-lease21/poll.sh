#!/usr/bin/env bash
# pack what the detached job has so far into $OUT (one tarball) and show its log; wait up to $1 s for it to end
J=/tmp/job; end=$(( $(date +%s) + ${1:-500} ))
while [ ! -f $J/done ] && [ "$(date +%s)" -lt $end ]; do sleep 5; done
tar czf $OUT/job.tgz -C /tmp job/out $( [ -d outputs/cycles/raw ] && echo ) 2>/dev/null
tar czf $OUT/cycles.tgz outputs/cycles/raw/h200-cycle-fast outputs/cycles/raw/h200-cycle-side-by-side 2>/dev/null
cat $J/out/job.log; [ -f $J/done ] && echo JOB-DONE
