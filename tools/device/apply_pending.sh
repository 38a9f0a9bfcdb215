#!/usr/bin/env bash
# Applies docs/pending/*.patch to the current directory (a device work copy, which has no .git) in the
# order docs/pending/README.md gives them (its `git apply docs/pending/<name>.patch` lines), so one lease
# can measure the oracle's last cell on the frozen code and then run the GPU suites on the patched code
# (tools/device/queues/oracle-then-post-freeze-gpu-suites.tsv). Writes outputs/perf/pending-applied.txt
# (each patch's sha256, in order) only once every patch applied: the suites after it start only if it
# exists, so they never run on half-patched code. Remove with docs/pending once the patches land.
set -euo pipefail
readme=docs/pending/README.md
[ -f "$readme" ] || { echo "apply_pending: $readme not found (were the patches already applied?)" >&2; exit 2; }
mapfile -t order < <(grep -oE '^ +git apply docs/pending/[A-Za-z0-9_.-]+\.patch' "$readme" | awk '{print $3}')
[ "${#order[@]}" -gt 0 ] || { echo "apply_pending: $readme names no patch" >&2; exit 2; }
marker=outputs/perf/pending-applied.txt
rm -f "$marker"
for patch in "${order[@]}"; do
  # git apply works outside a repository; GNU patch reads the same git-style diffs where git is absent
  if command -v git > /dev/null; then git apply "$patch"; else patch -p1 --forward --batch < "$patch"; fi
  echo "applied $patch"
done
mkdir -p outputs/perf
sha256sum "${order[@]}" > "$marker"
