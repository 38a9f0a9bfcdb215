#!/usr/bin/env bash
# A queue job that waits for vLLM's install by the staging call: that call ends with
# `eval "$(bash /tmp/stage/install-vllm.sh)" && touch /tmp/vllm-installed`; this polls the marker for up
# to ${1:-220} seconds, then checks that vllm imports. (Lease 22 polled with `pgrep -f install-vllm.sh`,
# which matched the polling call's own command line: the job waited out its loop, 167 s of GPU idle.)
set -u
limit=${1:-220}
started=$(date +%s)
until [ -f /tmp/vllm-installed ]; do
  if [ $(( $(date +%s) - started )) -ge "$limit" ]; then
    echo "no /tmp/vllm-installed after ${limit} s" >&2; exit 1
  fi
  sleep 3
done
exec python3 -c 'import vllm; print("vllm", vllm.__version__, "after", '"$(( $(date +%s) - started ))"', "s")'
