"""Environment identity: source commit, packages, GPU, driver, models, preregistration.

Every raw file's header and every evidence report carries this identity; a resumed run must share
its measurement-relevant part (see `runner.identity_key`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_lib.core import REPO_ROOT, write_json_atomic
from rollout_lib.measure.host import host_identity
from rollout_lib.measure.rawfile import seal_file

if TYPE_CHECKING:
    from rollout_lib.study.prereg import Preregistration

# Packages whose versions are part of the evidence identity ("absent" when not installed).
IDENTITY_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "vllm", "safetensors", "numpy")


def write_evidence(path: str | Path, report: dict[str, Any], *, study: Preregistration,
                   model_digests: dict[str, str]) -> str:
    """An evidence report bound to its environment identity, written once (never overwritten) and
    sealed in `SEALS.jsonl` beside it; returns its SHA-256."""
    environment = environment_identity(model_digests=model_digests, preregistration_sha256=study.sha256,
                                       preregistration_measurement_sha256=study.measurement_sha256)
    report = dict(report, environment=environment,
                  preregistration={"sha256": study.sha256, "measurement_sha256": study.measurement_sha256,
                                   "calculator_pin": study.calculator.sha256})
    digest = write_json_atomic(path, report)
    seal_file(path, Path(path).parent, ended="complete")
    return digest


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


SOURCE_STAMP = REPO_ROOT / ".source-commit"


def write_source_stamp(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Record commit + dirty flag in `.source-commit` for a copied tree without .git (the GPU machine
    receives the working tree only; `make source-stamp` writes this file and device calls carry it)."""
    identity = git_identity(repo, use_stamp=False)
    SOURCE_STAMP.write_text(json.dumps(identity, sort_keys=True) + "\n")
    return identity


def git_identity(repo: Path = REPO_ROOT, use_stamp: bool = True) -> dict[str, Any]:
    """Source commit and dirty flag from git; else from `.source-commit` (a tree copied without a
    usable git checkout, as on the GPU machine); `not_measured` when neither is available."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True, timeout=10).stdout
        return {"source_commit": commit, "source_dirty": bool(status.strip()), "status": "measured"}
    except (OSError, subprocess.SubprocessError):
        pass
    if use_stamp and SOURCE_STAMP.exists():
        stamp = json.loads(SOURCE_STAMP.read_text())
        return {"source_commit": stamp.get("source_commit"), "source_dirty": stamp.get("source_dirty"),
                "status": "measured", "from": ".source-commit (tree copied without a git checkout)"}
    return {"source_commit": None, "source_dirty": None, "status": "not_measured"}


def gpu_identity() -> dict[str, Any]:
    """GPU name, driver and CUDA runtime version; `not_applicable` on a CPU-only machine."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return {"status": "not_measured"}
    if not torch.cuda.is_available():
        return {"status": "not_applicable", "reason": "no CUDA device", "cuda_runtime": torch.version.cuda}
    info: dict[str, Any] = {
        "status": "measured",
        "name": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "cuda_runtime": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or refused: say so instead of guessing
        info["driver"] = None
        info["driver_status"] = f"not_measured: {type(exc).__name__}"
    return info


def environment_identity(*, model_digests: dict[str, str] | None = None,
                         preregistration_sha256: str | None = None,
                         preregistration_measurement_sha256: str | None = None) -> dict[str, Any]:
    """Everything a raw file is bound to: source, packages, GPU, driver, models, preregistration."""
    extra = ({"preregistration_measurement_sha256": preregistration_measurement_sha256}
             if preregistration_measurement_sha256 else {})
    return extra | {
        "source": git_identity(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "host": host_identity(),  # recorded, not part of identity_key: a cell continues on another host
        "packages": {name: package_version(name) for name in IDENTITY_PACKAGES},
        "gpu": gpu_identity(),
        "model_digests": dict(sorted((model_digests or {}).items())),
        "preregistration_sha256": preregistration_sha256,
    }


def gpu_key(environment: dict[str, Any]) -> dict[str, Any]:
    """The GPU a campaign is bound to: model and driver (`not_applicable` on a CPU)."""
    gpu = environment.get("gpu", {})
    return {k: gpu.get(k) for k in ("status", "name", "driver")}


def identity_key(environment: dict[str, Any], code_sha256: str | None = None) -> dict[str, Any]:
    """The measurement identity: what a resumed run or a continued cell must share with earlier
    segments. GPU model and driver, Python and packages, model digests, the preregistration's
    measurement hash (the text with the calculator pin reading `pending`: a calculator repin
    changes no measurement) and the digest of the measurement code. Not the source commit (it is
    recorded beside it): a commit that touches only the report, the docs or another backend
    leaves a half-measured cell continuable.
    """
    return {"python": environment.get("python"), "packages": environment.get("packages"),
            "gpu": {k: environment.get("gpu", {}).get(k) for k in ("name", "driver", "cuda_runtime", "status")},
            "model_digests": environment.get("model_digests"),
            "preregistration": environment.get("preregistration_measurement_sha256",
                                               environment.get("preregistration_sha256")),
            "measurement_code_sha256": code_sha256}


def identity_sha256(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _module_file(module: str) -> Path | None:
    base = REPO_ROOT / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rollout_lib")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollout_lib"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}")}
    return found


def measurement_code(modules: tuple[str, ...]) -> dict[str, Any]:
    """The source files a measurement imports (transitively, statically: every import statement,
    including those inside functions) and one SHA-256 over their paths and bytes."""
    seen: set[str] = set()
    stack = list(modules)
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        stack += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
        path = _module_file(module)
        if path is not None:
            stack += sorted(_imported_modules(path) - seen)
    files = {}
    for module in sorted(seen):
        path = _module_file(module)
        if path is not None:
            files[path.relative_to(REPO_ROOT).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"entry_modules": list(modules), "files": files, "sha256": digest}
