"""Cut a torch.profiler chrome trace down to a time window (e.g. a few decode steps), so that a
before/after pair can be committed and opened in Perfetto; writes gzipped JSON and a kernel summary.

    python tools/lab/trim_trace.py TRACE.json OUT.json.gz --start-fraction 0.5 --window-ms 20
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--start-fraction", type=float, default=0.5, help="where the window starts in the trace")
    parser.add_argument("--window-ms", type=float, default=20.0)
    args = parser.parse_args()
    with open(args.trace) as handle:
        trace = json.load(handle)
    events = trace["traceEvents"]
    timed = [e for e in events if "ts" in e and e.get("ph") == "X"]
    first, last = min(e["ts"] for e in timed), max(e["ts"] + e.get("dur", 0) for e in timed)
    start = first + args.start_fraction * (last - first)
    end = start + args.window_ms * 1000
    kept = [e for e in events if "ts" not in e or start <= e["ts"] <= end]
    trace["traceEvents"] = kept
    with gzip.open(args.out, "wt") as handle:
        json.dump(trace, handle)
    kernels = [e for e in kept if e.get("cat") == "kernel"]
    busy = collections.Counter()
    for e in kernels:
        busy[e["name"][:100]] += e.get("dur", 0)
    print(json.dumps({"window_ms": args.window_ms, "kernels": len(kernels),
                      "kernel_busy_ms": round(sum(busy.values()) / 1000, 3),
                      "top": [[name, round(us)] for name, us in busy.most_common(8)]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
