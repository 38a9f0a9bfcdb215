"""The stand-in's text corpus: files every machine already has, named by a manifest (path + SHA-256).

Which text. No machine can download anything, and the CPU machines run Python 3.11 while the GPU
machine runs Python 3.12, so the standard library differs between them (no way to check which of its
files are byte-identical without both interpreters side by side). The project pins the *same*
`transformers==5.17.0` on both (requirements/cpu.txt, requirements/gpu.txt, and the GPU image per
/work/shared/device/README.md): a pure-Python wheel whose installed `.py` files are the wheel's bytes,
whatever the interpreter. So the corpus is a fixed list of that package's source files (Apache-2.0
licensed text, read in place, never copied into this repository), each pinned by SHA-256 in a
manifest committed under `params/corpora/`. The full corpus is every `*.py` outside
`transformers/models/` (about 6.6 MB, ~1.7M tokens at 32k BPE: a few epochs make the ~5M training
tokens of the recipe); the tiny corpus (`generation/`, about 1 MB) serves CPU tests.

Guards. Before any byte is used, the installed package version must equal the manifest's and every
file must exist with the pinned size and SHA-256; the first file that differs is refused by name in
one line (`CorpusMismatch`). Nothing falls back to "whatever is installed".

Split. A file is held out when SHA-256("heldout/" + its path) mod `heldout_modulus` is 0: fixed by
the path alone, so it does not move when another file changes, and it is the same on every machine.

Regenerate a manifest (after a deliberate version change only):
    python -m rollout_lib.study.corpus build --name transformers-5.17.0 --package transformers \
        --exclude models/ --heldout-modulus 10 --out params/corpora/transformers-5.17.0.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from rollout_lib.core import find_project_root, sha256_bytes
from rollout_lib.safe_read import UnsafeInput, read_bytes

MANIFEST_SCHEMA = "rollout-corpus/v1"
MANIFEST_LIMIT_BYTES = 4 << 20  # the full manifest is 46 KB
CORPORA_DIR = Path("params") / "corpora"
Split = Literal["train", "heldout"]


class CorpusError(ValueError):
    """The manifest is malformed or names a package that is not installed; the message names the field."""


class CorpusMismatch(CorpusError):
    """An installed file (or the package version) differs from the manifest: one line naming the first one."""


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the package directory, '/'-separated
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    name: str
    package: str
    package_version: str
    license: str
    selection: str
    heldout_modulus: int
    files: tuple[CorpusFile, ...]
    manifest_sha256: str  # SHA-256 of the manifest file's bytes: names the corpus in every record

    def split_files(self, split: Split) -> tuple[CorpusFile, ...]:
        return tuple(f for f in self.files if is_heldout(f.path, self.heldout_modulus) == (split == "heldout"))

    def total_bytes(self, split: Split | None = None) -> int:
        files = self.files if split is None else self.split_files(split)
        return sum(f.size_bytes for f in files)


def is_heldout(path: str, modulus: int) -> bool:
    """The deterministic split: by a hash of the path, about one file in `modulus` is held out."""
    return int(hashlib.sha256(f"heldout/{path}".encode()).hexdigest()[:16], 16) % modulus == 0


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"corpus.package: {package!r} is not installed here (the corpus is read in place)")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_manifest_path(path: str | Path) -> Path:
    """As written if absolute or existing from the working directory, else relative to the project root
    found from the working directory (DESIGN decision 16: never from where the package is installed)."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    root = find_project_root()
    return root / candidate if root is not None else candidate


def load_manifest(path: str | Path) -> Manifest:
    """Parse and check a manifest's fields (not the installed files: `verify_corpus` does that)."""
    file = resolve_manifest_path(path)
    if not file.exists():
        raise CorpusError(f"corpus manifest: {path} does not exist (paths resolve from the working directory, "
                          "then the project root)")
    try:  # a regular file, size-checked before a byte is read
        raw = read_bytes(file, kind="corpus manifest", limit=MANIFEST_LIMIT_BYTES)
    except UnsafeInput as err:
        raise CorpusError(f"corpus manifest: {err}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise CorpusError(f"corpus manifest {path}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
        raise CorpusError(f"corpus manifest {path}: schema must be {MANIFEST_SCHEMA!r}")
    for key in ("name", "package", "package_version", "license", "selection"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise CorpusError(f"corpus manifest {path}: {key} must be a non-empty string")
    modulus = data.get("heldout_modulus")
    if not isinstance(modulus, int) or isinstance(modulus, bool) or modulus < 2:
        raise CorpusError(f"corpus manifest {path}: heldout_modulus must be an integer >= 2")
    files = []
    for index, entry in enumerate(data.get("files") or []):
        ok = (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("sha256"), str)
              and len(entry["sha256"]) == 64 and isinstance(entry.get("size_bytes"), int)
              and not entry["path"].startswith("/") and ".." not in entry["path"].split("/"))
        if not ok:
            raise CorpusError(f"corpus manifest {path}: files[{index}] needs a relative path (no '..'), a 64-hex "
                              "sha256 and an integer size_bytes")
        files.append(CorpusFile(entry["path"], entry["sha256"], entry["size_bytes"]))
    if [f.path for f in files] != sorted({f.path for f in files}):
        raise CorpusError(f"corpus manifest {path}: files must be sorted by path and unique")
    manifest = Manifest(name=data["name"], package=data["package"], package_version=data["package_version"],
                        license=data["license"], selection=data["selection"], heldout_modulus=modulus,
                        files=tuple(files), manifest_sha256=sha256_bytes(raw))
    if not manifest.split_files("train") or not manifest.split_files("heldout"):
        raise CorpusError(f"corpus manifest {path}: both the train and the held-out split need at least one file")
    return manifest


def verify_corpus(manifest: Manifest) -> Path:
    """The package directory, after checking the installed version and every file; CorpusMismatch names
    the first file (in manifest order) that is missing or whose size or SHA-256 differs."""
    root = package_dir(manifest.package)
    installed = importlib.metadata.version(manifest.package)
    if installed != manifest.package_version:
        raise CorpusMismatch(f"corpus {manifest.name}: {manifest.package} {installed} is installed, the manifest "
                             f"pins {manifest.package_version}")
    for entry in manifest.files:
        _read_verified(root, manifest, entry)
    return root


def _read_verified(root: Path, manifest: Manifest, entry: CorpusFile) -> bytes:
    file = root / entry.path
    if not file.exists():
        raise CorpusMismatch(f"corpus {manifest.name}: {manifest.package}/{entry.path} is missing here")
    try:  # a regular file no larger than pinned, checked before a byte is read
        data = read_bytes(file, kind="corpus file", limit=entry.size_bytes)
    except UnsafeInput as err:
        raise CorpusMismatch(f"corpus {manifest.name}: {manifest.package}/{entry.path} differs from the manifest "
                             f"({err})") from None
    if len(data) != entry.size_bytes or sha256_bytes(data) != entry.sha256:
        raise CorpusMismatch(f"corpus {manifest.name}: {manifest.package}/{entry.path} differs from the manifest "
                             f"(sha256 {sha256_bytes(data)[:16]}..., pinned {entry.sha256[:16]}...); refusing it")
    return data


def read_split(manifest: Manifest, split: Split) -> tuple[tuple[str, str], ...]:
    """(path, text) of the split's files in path order. The whole corpus is verified first, so a
    differing file is refused even when it sits in the other split."""
    return _read_split_cached(manifest, split)


@cache
def _read_split_cached(manifest: Manifest, split: Split) -> tuple[tuple[str, str], ...]:
    root = verify_corpus(manifest)
    return tuple((f.path, _read_verified(root, manifest, f).decode("utf-8")) for f in manifest.split_files(split))


def build_manifest(name: str, package: str, exclude: tuple[str, ...], include: tuple[str, ...],
                   heldout_modulus: int, license_name: str) -> dict:
    """The manifest of every `*.py` under the package directory (optionally only under `include`
    prefixes), minus the `exclude` prefixes, from the files installed here."""
    root = package_dir(package)
    files = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if "__pycache__" in rel or any(rel.startswith(p) for p in exclude):
            continue
        if include and not any(rel.startswith(p) for p in include):
            continue
        data = file.read_bytes()
        files.append({"path": rel, "sha256": sha256_bytes(data), "size_bytes": len(data)})
    rule = "every *.py file of the package" + (f" under {', '.join(include)}" if include else "")
    rule += (f" except under {', '.join(exclude)}" if exclude else "") + ", sorted by path"
    return {"schema": MANIFEST_SCHEMA, "name": name, "package": package,
            "package_version": importlib.metadata.version(package), "license": license_name, "selection": rule,
            "heldout_modulus": heldout_modulus, "files": files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_lib.study.corpus",
                                     description="Write a corpus manifest from the files installed here.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build")
    build.add_argument("--name", required=True)
    build.add_argument("--package", required=True)
    build.add_argument("--include", action="append", default=[])
    build.add_argument("--exclude", action="append", default=[])
    build.add_argument("--heldout-modulus", type=int, default=10)
    build.add_argument("--license", default="Apache-2.0")
    build.add_argument("--out", required=True)
    verify = sub.add_parser("verify")
    verify.add_argument("manifest")
    args = parser.parse_args(argv)
    if args.command == "verify":
        manifest = load_manifest(args.manifest)
        verify_corpus(manifest)
        print(f"corpus {manifest.name}: {len(manifest.files)} files, {manifest.total_bytes()} bytes verified "
              f"(train {manifest.total_bytes('train')}, held-out {manifest.total_bytes('heldout')})")
        return 0
    data = build_manifest(args.name, args.package, tuple(args.exclude), tuple(args.include), args.heldout_modulus,
                          args.license)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)
    load_manifest(out)  # both splits non-empty
    print(f"{out}: {len(data['files'])} files, {sum(f['size_bytes'] for f in data['files'])} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
