"""The smoke-trained tiny actor's payload digest on this CPU under each kernel setting, one fresh process each.

CPU training is deterministic on one machine, but its float32 sums follow the vector kernels chosen at run time:
ATen's CPU capability (`ATEN_CPU_CAPABILITY`), MKL's code path (`MKL_CBWR`) and oneDNN's (`ONEDNN_MAX_CPU_ISA`).
The profile pins one digest, so a CPU that chooses other kernels refuses to measure `smoke-trained`. This tool
records which settings move the digest here; run on two kinds of CPU, it tells whether a setting gives one digest
on both (the candidate for an ISA-independent build and a new pin).

    python tools/lab/tiny_isa_digests.py --out outputs/perf/standin-cpu-isa/digests-<cpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from rollout_lib.measure.host import CPUINFO, cpu_model
from rollout_lib.safe_write import write_bytes_atomic

SETTINGS = {
    "as_found": {},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "aten_default+mkl_compatible": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
    "aten_avx2+mkl_avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
    # session 44 (an AVX-512 Intel Xeon gave no digest of the AMD AVX2 machine's under the settings above): MKL's
    # strict reproducibility, and oneDNN's instruction set capped (its kernels follow neither variable above)
    "aten_default+mkl_compatible_strict": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT"},
    "aten_default+mkl_compatible+onednn_sse41": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
                                                 "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "aten_avx2+mkl_avx2+onednn_avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # session 45 (CI's stop-68 machine and this session's built neither the pin nor the AMD digests): one variable
    # at a time, to tell whether the pin's unrecorded CPU was an AVX-512 one whose MKL took a narrower path
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl_avx2": {"MKL_CBWR": "AVX2"},
    "mkl_avx": {"MKL_CBWR": "AVX"},
}
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
CHILD = """
import json, sys, tempfile, time
import torch
from rollout_lib.models.train_standin import plan_training, train_standin
a = torch.ones(64, 64)  # no RNG draw before the build
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):  # MKL names its code path and CNR mode (stdout)
    a @ a
sys.stdout.flush()
start = time.perf_counter()
record = train_standin(plan_training("tiny", role="actor"), tempfile.mkdtemp() + "/tiny-actor")
print(json.dumps({"payload_digest": record["payload_digest"], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "torch": torch.__version__, "wall_s": round(time.perf_counter() - start, 2)}))
"""


def cpu_facts() -> dict:
    """The CPU's model and its vector-instruction flags, from one read of /proc/cpuinfo."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {"cpu_model": platform.processor() or "not_measured", "cpu_flags": "not_measured"}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"cpu_model": cpu_model(text) or "not_measured",
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "sse4")))}


def mkl_path(lines: list[str]) -> dict:
    """MKL's own words (MKL_VERBOSE) on the code path it dispatched to and its CNR mode (session 45: on an Intel
    Xeon, as found "...AVX-512...", MKL_CBWR=COMPATIBLE "Intel(R) Architecture processors" with CNR:COMPATIBLE)."""
    banner = next((line for line in lines if line.startswith("MKL_VERBOSE") and "architecture" in line), None)
    call = next((line for line in lines if line.startswith("MKL_VERBOSE SGEMM")), "")
    cnr = next((word.split(":", 1)[1] for word in call.split() if word.startswith("CNR:")), None)
    return {"mkl_path": banner.split("architecture", 1)[1].split(", Lnx")[0].strip() if banner else "not_measured",
            "mkl_cnr": cnr or "not_measured"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write (atomically)")
    args = parser.parse_args()
    out = Path(args.out)
    rows = {}
    for name, env in SETTINGS.items():
        child_env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES} | env
        done = subprocess.run([sys.executable, "-c", CHILD], env=child_env, capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            rows[name] = {"env": env, "status": "failed", "stderr_tail": done.stderr[-2000:]}
        else:
            lines = done.stdout.strip().splitlines()
            rows[name] = {"env": env, "status": "measured", **mkl_path(lines), **json.loads(lines[-1])}
        print(name, rows[name].get("payload_digest", rows[name]["status"]), flush=True)
    import torch

    # the libraries below the kernels too (session 45: an image's glibc or MKL is the next suspect for the rest)
    mkl = [line.strip(" -") for line in torch.__config__.show().splitlines() if "Math Kernel Library" in line]
    record = {**cpu_facts(), "python": platform.python_version(), "libc": "-".join(platform.libc_ver()),
              "torch": torch.__version__, "mkl": mkl[0] if mkl else "not_measured",
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": rows}
    write_bytes_atomic(out, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
