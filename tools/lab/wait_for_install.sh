#!/usr/bin/env bash
# A queue job that waits for a package the staging calls install while the queue already runs:
#   bash tools/lab/wait_for_install.sh vllm|ray [SECONDS]
# The installing call ends with `eval "$(bash /tmp/stage/install-<name>.sh)" && touch /tmp/<name>-installed`;
# this polls that marker for up to SECONDS (default 220), then checks that the package imports. (Lease 22
# polled with `pgrep -f install-vllm.sh`, which matched the polling call's own command line: 167 s idle.)
set -u
name=${1:?vllm or ray}
case "$name" in vllm|ray) ;; *) echo "package: $name is not allowed; allowed: vllm, ray" >&2; exit 2 ;; esac
limit=${2:-220}
started=$(date +%s)
# A lease too short to stage vLLM (no part of its archive copied by the time this job runs, ~5 minutes into the
# queue) gives up at once instead of idling the GPU for SECONDS (parts: vllm_stage.tar.xz.part-*, ray.whl.part-*).
if [ ! -f "/tmp/$name-installed" ] && ! compgen -G "/tmp/stage/${name}*.part-*" > /dev/null; then
  echo "no /tmp/stage/${name}*.part-* and no /tmp/$name-installed: $name is not being staged" >&2; exit 1
fi
until [ -f "/tmp/$name-installed" ]; do
  if [ $(( $(date +%s) - started )) -ge "$limit" ]; then
    echo "no /tmp/$name-installed after ${limit} s" >&2; exit 1
  fi
  sleep 3
done
exec python3 -c "import $name; print('$name', $name.__version__, 'after', $(( $(date +%s) - started )), 's')"
