"""This machine's measurement identity for one backend, computed as a measuring process computes it
(`rollout_lib.measure.runner.run`: environment identity, the digest of the source files the backend's
measurement imports, `identity_key`), printed as one JSON object.

The campaign driver runs it in a short-lived subprocess on the first GPU it schedules on: the driver
itself never initializes CUDA (its workers own the GPUs), and without its own identity the plan can
only take the newest raw file's for it, which was wrong on a machine where vLLM was not staged
(lease 10's oracle ran with `packages.vllm` 0.26.0, the earlier leases without).

    python -m rollout_lib.campaign.identity_probe --params params/rollout-runtime-v2.yaml --backend hf_reference
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def measurement_identity(study: Any, backend_name: str) -> dict[str, Any]:
    """`{"measurement_identity": key, "measurement_identity_sha256": sha}` for `backend_name` here.

    The same steps as the frozen runner's header (it cannot call this: its bytes are the oracle's
    measurement identity while the oracle's campaign runs)."""
    from rollout_lib.backends import get_backend_class
    from rollout_lib.measure.identity import environment_identity, identity_key, identity_sha256, measurement_code

    environment = environment_identity(
        model_digests={"actor": study.actor.payload_digest, "teacher": study.teacher.payload_digest},
        preregistration_sha256=study.sha256, preregistration_measurement_sha256=study.measurement_sha256)
    code = measurement_code(("rollout_lib.measure.runner", get_backend_class(backend_name).__module__))
    key = identity_key(environment, code["sha256"])
    return {"measurement_identity": key, "measurement_identity_sha256": identity_sha256(key)}


def probe(params_path: str, backend: str, gpu: str | None = None, timeout_s: float = 300) -> dict[str, Any]:
    """{"sha256", "key", "source"}: the measurement identity a worker on this machine will have, from this
    module in a subprocess (on `gpu` via CUDA_VISIBLE_DEVICES, else the caller's; it exits before any
    worker starts, so the caller never holds a CUDA context); sha256 None and why if it fails."""
    from rollout_lib.core import REPO_ROOT

    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
    # the child runs in the package's tree (to import it): every data path it is given is absolute
    command = [sys.executable, "-m", "rollout_lib.campaign.identity_probe", "--params", os.path.abspath(params_path),
               "--backend", backend]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"sha256": None, "source": f"identity probe exited {done.returncode}: {tail}"}
        found = json.loads(done.stdout)
        return {"sha256": found["measurement_identity_sha256"], "key": found["measurement_identity"],
                "source": "this machine's (identity probe)"}
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        return {"sha256": None, "source": f"identity probe failed: {type(exc).__name__}: {exc}"}


def identity_differences(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """`key: theirs -> mine` for each leaf of two measurement identities that differs (`absent` where one
    lacks it)."""
    def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, sub in value.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}

    a = {k.rstrip("."): v for k, v in leaves(theirs).items()}
    b = {k.rstrip("."): v for k, v in leaves(mine).items()}
    return [f"{key}: {a.get(key, 'absent')} -> {b.get(key, 'absent')}" for key in sorted(set(a) | set(b))
            if a.get(key, "absent") != b.get(key, "absent")]


def main(argv: list[str] | None = None) -> int:
    from rollout_lib.study.prereg import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", required=True)
    parser.add_argument("--backend", required=True)
    args = parser.parse_args(argv)
    print(json.dumps(measurement_identity(load(args.params), args.backend), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
