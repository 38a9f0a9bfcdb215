"""The adversarial suite (issue 40 item 7): bad inputs and faults, table-driven, through the `rollout` CLI.

Every case runs one command in a subprocess against its own copy of a small published campaign
(`pub`, smoke profile, fake backend) and asserts four things:

1. the exit code;
2. the message: one line, matched by a regular expression (stderr's last line on a refusal,
   stdout's last line on success);
3. a time bound (the subprocess timeout; a hang fails the case, it never stalls CI);
4. no committed evidence changed: `git status` of outputs/ and params/ is the same before and after
   (cases never point at the real outputs/ tree except to read it), plus the case's own check of
   its copy (the previous good aggregate kept, no partial or lock files, what was excluded and why).

Classes: laundering (after-the-fact seals, the seal manifest's hash chain), readers (FIFOs, devices,
symlinks, sizes), numbers (records checked before the frozen calculator), atomic (full disk,
read-only folder, debris, nothing written on refusal), seal-targets, children (a parent killed by
SIGKILL), input-validation (the CLI's refusals, made before any file exists
here). `python tools/reliability_table.py` renders CASES into docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollout_lib.measure.rawfile import seal_abandoned, seal_file
from rollout_lib.study.prereg import load

from .conftest import REPO, SMOKE

CELLS = ["p16-r24-n2-greedy", "p48-r24-n1-stochastic"]
CAMPAIGN = "pub"


# ------------------------------------------------------------------------------------------
# The campaign every case copies
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A published campaign `pub` (two backends, two cells each, one conformance evidence file)."""
    from rollout_lib.measure.identity import write_evidence
    from rollout_lib.measure.runner import run, validate_parameters

    from .fakes import FakeBackend

    root = tmp_path_factory.mktemp("adversarial-base")
    params = root / "smoke.yaml"
    params.write_text(SMOKE.read_text())
    study = load(params)
    out = root / "outputs"
    for backend in ("hf_reference", "hf_cached"):
        spec, _, workload = validate_parameters(backend=backend, params=str(params), campaign=CAMPAIGN, cells=CELLS,
                                                output_dir=str(out), run_id="r1")
        list(run(spec, study, workload, backend_factory=lambda: FakeBackend(study)))
    write_evidence(out / "conformance" / f"conformance-{CAMPAIGN}-hf_cached-r1.json",
                   {"kind": "local_conformance", "backend": "hf_cached",
                    "verdict": {"passed": True, "checks": {"greedy": True}, "max_abs_logprob_diff": 0.001}},
                   study=study, model_digests={})
    done = _cli("publish", "--params", str(params), "--campaign", CAMPAIGN, "--output-dir", str(out))
    assert done.returncode == 0, done.stderr
    return root


@dataclass
class Ctx:
    root: Path

    @property
    def out(self) -> Path:
        return self.root / "outputs"

    @property
    def params(self) -> Path:
        return self.root / "smoke.yaml"

    @property
    def aggregate(self) -> Path:
        return self.out / "aggregate" / f"{CAMPAIGN}.json"

    def raw(self, backend: str = "hf_cached", run_id: str = "r1") -> Path:
        return self.out / "raw" / CAMPAIGN / backend / f"{run_id}.jsonl"

    @property
    def seals(self) -> Path:
        return self.out / "raw" / CAMPAIGN / "SEALS.jsonl"

    @property
    def evidence(self) -> Path:
        return self.out / "conformance" / f"conformance-{CAMPAIGN}-hf_cached-r1.json"

    def publish_args(self, *extra: str) -> list[str]:
        return ["publish", "--params", str(self.params), "--campaign", CAMPAIGN, "--output-dir", str(self.out), *extra]

    def check_args(self) -> list[str]:
        return ["check", "--params", str(self.params), "--campaign", CAMPAIGN, "--output-dir", str(self.out)]

    def stored(self) -> dict:
        return json.loads(self.aggregate.read_bytes())


def _cli(*argv: str, timeout: float = 60, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom rollout_lib.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=dict(os.environ, TQDM_DISABLE="1"))


# ------------------------------------------------------------------------------------------
# Building blocks of the cases
# ------------------------------------------------------------------------------------------

def _fabricate(c: Ctx, run_id: str = "r9", edit: Callable[[list[dict]], None] | None = None,
               backend: str = "hf_cached") -> Path:
    """A raw file in the tree that no run wrote: a genuine one's records, edited (by default the
    measured times divided by ten: a backend that looks ten times faster)."""
    records = [json.loads(line) for line in c.raw(backend).read_text().splitlines()]
    records[0]["run_id"] = run_id
    if edit is None:
        for record in records:
            if record.get("record") == "repetition" and record.get("wall_s"):
                record["wall_s"] = record["wall_s"] / 10
    else:
        edit(records)
    path = c.raw(backend, run_id)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _set_first_rep(field_path: str, value) -> Callable[[list[dict]], None]:
    """Edit the first measured repetition: `field_path` is dotted (memory.torch.peak_reserved_bytes)."""
    def edit(records: list[dict]) -> None:
        rep = next(r for r in records if r.get("record") == "repetition" and not r.get("warmup"))
        *parents, last = field_path.split(".")
        target = rep
        for name in parents:
            target = target.setdefault(name, {})
        if value is _DELETE:
            target.pop(last, None)
        else:
            target[last] = value
    return edit


_DELETE = object()


def _bad_number(field_path: str, value, text: str | None = None) -> Callable[[Ctx], None]:
    """A fabricated raw file whose first measured repetition has `field_path` = value, sealed as an
    abandoned run (as `rollout seal` would): publish must exclude it, naming record, field and value."""
    def mutate(c: Ctx) -> None:
        path = _fabricate(c, edit=_set_first_rep(field_path, value))
        if text is not None:  # a literal JSON text (NaN, 1e400) json.dumps cannot write
            path.write_text(path.read_text().replace(json.dumps("__MARK__"), text))
        seal_abandoned(path, reason="adversarial: fabricated record")
    return mutate


def _excluded(run_id: str, *needles: str) -> Callable[[Ctx], None]:
    def post(c: Ctx) -> None:
        entry = next(r for r in c.stored()["raw_files"] if r["run_id"] == run_id)
        assert entry["accepted"] is False, entry
        for needle in needles:
            assert needle in entry["excluded_reason"], (needle, entry["excluded_reason"])
    return post


def _same_cells(c: Ctx) -> None:
    """The cells, gates and selection equal those of the base campaign (the fabricated file moved nothing)."""
    base = json.loads((c.root.parent / "base-aggregate-here.json").read_bytes())
    now = c.stored()
    for key in ("cells", "gates", "selection"):
        assert now[key] == base[key], key


def _and(*posts: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    def post(c: Ctx) -> None:
        for one in posts:
            one(c)
    return post


def _aggregate_kept(c: Ctx) -> None:
    assert c.aggregate.read_bytes() == (c.root.parent / "base-aggregate.json").read_bytes()
    assert sorted(p.name for p in c.aggregate.parent.iterdir()) == [c.aggregate.name], "debris in aggregate/"


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)


def _symlink(path: Path, target: str | Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(target)


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as handle:
        handle.truncate(size)


def _fault(errno_name: str, on: str = "mkstemp") -> str:
    """Python run before the CLI: the file system refuses creating output files with `errno_name`."""
    return textwrap.dedent(f"""
        import errno, os, tempfile
        def _refuse(*a, **k):
            raise OSError(errno.{errno_name}, os.strerror(errno.{errno_name}), str(a[0]) if a else None)
        if {on!r} == "mkstemp":
            _real = tempfile.mkstemp
            def _mkstemp(*a, **k):
                if str(k.get("dir", "")).endswith("aggregate"):
                    _refuse(k.get("dir"))
                return _real(*a, **k)
            tempfile.mkstemp = _mkstemp
        else:
            _write = os.write
            def _w(fd, data):
                if os.readlink(f"/proc/self/fd/{{fd}}").endswith("SEALS.jsonl"):
                    _refuse("SEALS.jsonl")
                return _write(fd, data)
            os.write = _w
    """)


# A guard for cases whose command must be refused before any work: building a model snapshot (1.2 GB
# for the GPU study) fails at once instead of filling the repository's .cache while the case times out.
NO_MODEL_BUILD = textwrap.dedent("""
    import rollout_lib.core
    def _no_build(*a, **k):
        raise SystemExit("adversarial guard: a model snapshot build started before the refusal")
    rollout_lib.core.build_directory_once = _no_build
""")


def _edit_manifest(edit: Callable[[list[bytes]], list[bytes]]) -> Callable[[Ctx], None]:
    def mutate(c: Ctx) -> None:
        lines = c.seals.read_bytes().splitlines(keepends=True)
        c.seals.write_bytes(b"".join(edit(lines)))
    return mutate


def _forge_seal_line(c: Ctx, path: Path, **extra) -> bytes:
    import hashlib

    from rollout_lib.core import canonical_json

    entry = {"record": "seal", "path": path.relative_to(c.seals.parent).as_posix(),
             "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size,
             "ended": "teardown", "utc": "2026-12-04T00:00:00.000+00:00", "host": "vm", "pid": 1} | extra
    return (canonical_json(entry) + "\n").encode()


def _fabricated_sealed_as_teardown_between(c: Ctx) -> None:
    path = _fabricate(c)
    lines = c.seals.read_bytes().splitlines(keepends=True)
    lines.insert(2, _forge_seal_line(c, path, chain_version=1, previous_line_sha256="0" * 64))
    c.seals.write_bytes(b"".join(lines))


def _fabricated_appended_unchained(c: Ctx) -> None:
    path = _fabricate(c)
    with open(c.seals, "ab") as handle:
        handle.write(_forge_seal_line(c, path))


def _fabricated_evidence(c: Ctx) -> Path:
    report = json.loads(c.evidence.read_text())
    report["verdict"] = {"passed": True, "checks": {"greedy": True}, "max_abs_logprob_diff": 0.0}
    path = c.evidence.with_name(f"conformance-{CAMPAIGN}-hf_cached-r9.json")
    path.write_text(json.dumps(report))
    return path


def _legacy_manifest_then_edit(c: Ctx) -> None:
    """A manifest from before the chain (its lines without chain fields), then one chained seal (which
    writes the anchor), then a legacy line edited: the anchor names it."""
    lines = [json.loads(line) for line in c.seals.read_text().splitlines()]
    legacy = [{k: v for k, v in e.items() if k not in ("chain_version", "previous_line_sha256")}
              for e in lines if e["record"] == "seal"]
    c.seals.write_text("".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in legacy))
    seal_file(_fabricate(c), c.seals.parent, ended="teardown")
    text = c.seals.read_text().splitlines(keepends=True)
    text[0] = text[0].replace('"ended":"teardown"', '"ended":"complete"')
    c.seals.write_text("".join(text))


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    cls: str
    input: str                      # what was tried, in words (docs/reliability.md)
    outcome: str                    # what happens, in words
    argv: Callable[[Ctx], list[str]]
    code: int
    message: str                    # regex on the one-line message
    mutate: Callable[[Ctx], None] | None = None
    post: Callable[[Ctx], None] | None = None
    seconds: float = 30
    prelude: str = ""
    marks: tuple = field(default_factory=tuple)


def _publish(c: Ctx) -> list[str]:
    return c.publish_args()


def _check(c: Ctx) -> list[str]:
    return c.check_args()


WROTE = r"^wrote .*pub\.json sha256 [0-9a-f]{64}$"
REFUSED = r"^rollout publish: FAILED: "

CASES: list[Case] = [
    # ---- laundering: after-the-fact evidence and the seal manifest's chain -----------------------------
    Case("atf-raw-excluded", "laundering", "a fabricated raw file (10x faster) sealed with `seal --after-the-fact`",
         "published, but listed under sealed_after_the_fact and excluded from every gate; cells unchanged",
         _publish, 0, WROTE,
         mutate=lambda c: _cli("seal", "--after-the-fact", "--reason", "found it", str(_fabricate(c))),
         post=_and(_excluded("r9", "sealed after the fact", "not named by SHA-256"), _same_cells,
                   lambda c: c.stored()["sealed_after_the_fact"][0]["allowlisted"] is False or pytest.fail())),
    Case("atf-evidence-excluded", "laundering", "fabricated conformance evidence sealed after the fact",
         "published; the evidence file is not accepted and the gate reads the genuine one",
         _publish, 0, WROTE,
         mutate=lambda c: _cli("seal", "--after-the-fact", "--reason", "found it", str(_fabricated_evidence(c))),
         post=lambda c: next(e for e in c.stored()["evidence_files"] if e["path"].endswith("r9.json"))["accepted"]
         is False or pytest.fail()),
    Case("atf-seal-says-so", "laundering", "`rollout seal --after-the-fact` on a fabricated raw file",
         "sealed, and the command says the file is marked and cannot decide a gate unless allowlisted",
         lambda c: ["seal", "--after-the-fact", "--reason", "an old file", str(_fabricate(c))], 0,
         r"\(after_the_fact\) \(sealed after the fact: listed in the aggregate; counts toward a gate only if"),
    Case("atf-blank-reason", "laundering", "`seal --after-the-fact` with a blank reason",
         "refused before sealing: the reason is required", lambda c: ["seal", "--after-the-fact", "--reason", "  ",
                                                                     str(_fabricate(c))],
         2, r"^rollout seal: error: reason: must say why"),
    Case("atf-atf-aggregate-row", "laundering", "an after-the-fact seal: what the aggregate records",
         "file, sha256, sealed_at, reason, allowlisted false, allowlist_reason null; the allowlist bound by hash",
         _publish, 0, WROTE,
         mutate=lambda c: _cli("seal", "--after-the-fact", "--reason", "found it", str(_fabricate(c))),
         post=lambda c: (set(c.stored()["sealed_after_the_fact"][0]) == {
             "file", "sha256", "sealed_at", "reason", "allowlisted", "allowlist_reason"}
             and c.stored()["evidence_allowlist"]["status"] == "bound") or pytest.fail(str(c.stored().keys()))),
    Case("chain-edited-line", "laundering", "a seal line edited (ended teardown -> complete)",
         "refused: the next line's chain link names the edited line", _publish, 1,
         REFUSED + r".*SEALS\.jsonl: line 3: its previous_line_sha256 .* does not match line 2",
         mutate=_edit_manifest(lambda ls: [ls[0], ls[1].replace(b'"teardown"', b'"complete"'), *ls[2:]]),
         post=_aggregate_kept),
    Case("chain-inserted-line", "laundering", "a forged seal line inserted for a fabricated raw file",
         "refused: the inserted line is named", _publish, 1, REFUSED + r".*SEALS\.jsonl: line 3: ",
         mutate=_fabricated_sealed_as_teardown_between, post=_aggregate_kept),
    Case("chain-reordered", "laundering", "two seal lines swapped", "refused: the chain names the line",
         _publish, 1, REFUSED + r".*SEALS\.jsonl: line 2: its previous_line_sha256",
         mutate=_edit_manifest(lambda ls: [ls[0], ls[2], ls[1], *ls[3:]]), post=_aggregate_kept),
    Case("chain-removed-line", "laundering", "a seal line removed from the middle",
         "refused: the chain names where", _publish, 1, REFUSED + r".*SEALS\.jsonl: line 2: its previous_line",
         mutate=_edit_manifest(lambda ls: [ls[0], *ls[2:]]),
         post=_aggregate_kept),
    Case("chain-unchained-append", "laundering", "a seal line without chain fields appended by hand",
         "refused: an unchained line after the chain started", _publish, 1,
         REFUSED + r".*line \d+ has chain_version None after the chain started",
         mutate=_fabricated_appended_unchained, post=_aggregate_kept),
    Case("chain-anchor-edited", "laundering", "a legacy (pre-chain) manifest line edited after the chain was anchored",
         "refused: the anchor names the legacy line", _publish, 1,
         REFUSED + r".*SEALS\.jsonl: line 1: does not match the chain anchor",
         mutate=_legacy_manifest_then_edit),
    Case("atf-edited-after-seal", "laundering", "a raw file edited after its after-the-fact seal",
         "refused: sealed vs found SHA-256", _publish, 1, REFUSED + r".*r9\.jsonl: sealed with sha256 .* found ",
         mutate=lambda c: (_cli("seal", "--after-the-fact", "--reason", "x-reason", str(_fabricate(c))),
                           c.raw(run_id="r9").write_text(c.raw(run_id="r9").read_text() + "{}\n"))),
    Case("atf-hand-seal-json-elsewhere", "laundering", "after-the-fact seal of an evidence file outside conformance/",
         "refused before a SEALS file is written", lambda c: ["seal", "--after-the-fact", "--reason", "because",
                                                             str(_copy_to(c.evidence, c.root / "x.json"))],
         2, r"^rollout seal: error: .*x\.json: not inside a raw tree",
         post=lambda c: not (c.root / "SEALS.jsonl").exists() or pytest.fail("SEALS.jsonl written")),

    # ---- readers -----------------------------------------------------------------------------------
    Case("fifo-raw", "readers", "a FIFO named like a raw file in a backend folder", "refused at once: not a regular "
         "file", _publish, 1, REFUSED + r".*x\.jsonl: not a regular file", seconds=20,
         mutate=lambda c: _fifo(c.raw(run_id="x")), post=_aggregate_kept),
    Case("devzero-raw", "readers", "a symlink to /dev/zero as a raw file", "refused at once", _publish, 1,
         REFUSED + r".*z\.jsonl: not a regular file", seconds=20,
         mutate=lambda c: _symlink(c.raw(run_id="z"), "/dev/zero"), post=_aggregate_kept),
    Case("symlink-out-raw", "readers", "a sealed raw file replaced by a symlink to a copy outside the tree",
         "refused: resolves outside the tree", _publish, 1, REFUSED + r".*r1\.jsonl: resolves to .* outside ",
         mutate=lambda c: _symlink(c.raw(), _copy_to(c.raw(), c.root / "outside.jsonl")), post=_aggregate_kept),
    Case("fifo-sealed-raw", "readers", "a sealed raw file replaced by a FIFO", "refused at once", _publish, 1,
         REFUSED + r".*r1\.jsonl: is a FIFO, not a regular file", seconds=20,
         mutate=lambda c: _fifo(c.raw()), post=_aggregate_kept),
    Case("huge-raw", "readers", "a sealed raw file replaced by a 100 MiB sparse file", "refused by size before "
         "reading", _publish, 1, REFUSED + r".*r1\.jsonl: 104857600 bytes, over the raw limit of \d+ bytes",
         seconds=20, mutate=lambda c: _sparse(c.raw(), 100 << 20), post=_aggregate_kept),
    Case("devzero-aggregate", "readers", "the aggregate replaced by a symlink to /dev/zero", "refused at once",
         _check, 1, r"^rollout check: FAILED: .*pub\.json: resolves to /dev/zero, outside ", seconds=20,
         mutate=lambda c: _symlink(c.aggregate, "/dev/zero")),
    Case("fifo-aggregate", "readers", "the aggregate replaced by a FIFO", "refused at once", _check, 1,
         r"^rollout check: FAILED: .*pub\.json: is a FIFO", seconds=20, mutate=lambda c: _fifo(c.aggregate)),
    Case("huge-aggregate", "readers", "a 1 GiB sparse aggregate", "refused by size before reading", _check, 1,
         r"^rollout check: FAILED: .*pub\.json: 1073741824 bytes, over the aggregate limit", seconds=20,
         mutate=lambda c: _sparse(c.aggregate, 1 << 30)),
    Case("sparse-prereg", "readers", "a 3 GiB sparse preregistration", "refused by size before reading (fstat)",
         lambda c: ["publish", "--params", str(c.root / "big.yaml"), "--campaign", CAMPAIGN, "--output-dir",
                    str(c.out)], 2,
         r"^rollout publish: error: .*big\.yaml: 3221225472 bytes, over the preregistration limit",
         seconds=15, mutate=lambda c: _sparse(c.root / "big.yaml", 3 << 30), post=_aggregate_kept),
    Case("devzero-prereg", "readers", "/dev/zero as the preregistration", "refused: a character device",
         lambda c: ["prereg", "/dev/zero"], 2, r"^rollout prereg: error: .*character device", seconds=15),
    Case("fifo-prereg", "readers", "a FIFO as the preregistration", "refused at once: a FIFO",
         lambda c: ["prereg", str(c.root / "p.yaml")], 2, r"^rollout prereg: error: .*p\.yaml: is a FIFO",
         seconds=15, mutate=lambda c: _fifo(c.root / "p.yaml")),
    Case("fifo-manifest", "readers", "SEALS.jsonl replaced by a FIFO", "refused at once", _publish, 1,
         REFUSED + r".*SEALS\.jsonl: is a FIFO", seconds=20, mutate=lambda c: _fifo(c.seals), post=_aggregate_kept),
    Case("devzero-manifest", "readers", "SEALS.jsonl a symlink to /dev/zero", "refused at once", _publish, 1,
         REFUSED + r".*SEALS\.jsonl: is a character device", seconds=20,
         mutate=lambda c: _symlink(c.seals, "/dev/zero"), post=_aggregate_kept),
    Case("fifo-evidence", "readers", "a FIFO named like conformance evidence", "refused at once", _publish, 1,
         REFUSED + r".*conformance-pub-x\.json: not a regular file", seconds=20,
         mutate=lambda c: _fifo(c.evidence.with_name("conformance-pub-x.json")), post=_aggregate_kept),
    Case("symlink-out-evidence", "readers", "sealed evidence replaced by a symlink leaving the tree",
         "refused: outside the tree", _publish, 1, REFUSED + r".*hf_cached-r1\.json: resolves to .* outside ",
         mutate=lambda c: _symlink(c.evidence, _copy_to(c.evidence, c.root / "e.json")), post=_aggregate_kept),
    Case("nested-json-raw", "readers", "a raw line nested 100000 deep, sealed as abandoned",
         "refused with the line named (no RecursionError traceback)",
         lambda c: ["seal", "--reason", "deep", str(_write(c.raw(run_id="deep"), '{"a":' * 100000 + "1"
                                                           + "}" * 100000 + "\n"))],
         2, r"^rollout seal: error: .*deep\.jsonl: line 1 is not JSON \(RecursionError"),
    Case("fifo-beside-aggregate", "readers", "check with a FIFO beside the aggregate in its folder",
         "check reads only the aggregate: passes", _check, 0, r"^OK: .* re-derives byte for byte$",
         mutate=lambda c: (_cli(*c.publish_args()), _fifo(c.aggregate.with_name("other.json")))),

    # ---- numbers -----------------------------------------------------------------------------------
    *[Case(f"number-{name}", "numbers", f"a sealed raw record with {what}",
           "published; the file is excluded, record number, field and value named", _publish, 0, WROTE,
           mutate=_bad_number(path, value, text), post=_and(_excluded("r9", *needles), _same_cells))
      for name, what, path, value, text, needles in [
          ("wall-negative", "wall_s = -1", "wall_s", -1.0, None, ("wall_s = -1.0", "> 0")),
          ("wall-zero", "wall_s = 0", "wall_s", 0, None, ("wall_s = 0",)),
          ("wall-tiny", "wall_s = 1e-300", "wall_s", 1e-300, None, ("wall_s = 1e-300",)),
          ("wall-nan", "wall_s = NaN", "wall_s", "__MARK__", "NaN", ("wall_s = nan", "finite")),
          ("wall-inf", "wall_s = 1e400 (Infinity)", "wall_s", "__MARK__", "1e400", ("wall_s = inf",)),
          ("wall-string", 'wall_s = "1.0"', "wall_s", "1.0", None, ("wall_s = '1.0'",)),
          ("tokens-negative", "generated_tokens = -5", "generated_tokens", -5, None, ("generated_tokens = -5",)),
          ("tokens-fraction", "generated_tokens = 2.5", "generated_tokens", 2.5, None, ("generated_tokens = 2.5",)),
          ("tokens-bool", "generated_tokens = true", "generated_tokens", True, None, ("generated_tokens = True",)),
          ("phase-negative", "decode_s seconds = -0.1", "phases.decode_s.seconds", -0.1, None,
           ("phases.decode_s.seconds = -0.1",)),
          ("memory-negative", "peak_reserved_bytes = -1", "memory.torch.peak_reserved_bytes", -1, None,
           ("memory.torch.peak_reserved_bytes = -1",)),
          ("memory-fraction", "NVML peak_process_tree_bytes = 1.5", "nvml_repetition.peak_process_tree_bytes", 1.5,
           None, ("peak_process_tree_bytes = 1.5",)),
          ("warmup-missing", "no warmup field", "warmup", _DELETE, None, ("warmup = None", "true or false")),
          ("attempt-string", 'attempt = "0"', "attempt", "0", None, ("attempt = '0'",)),
      ]],

    # ---- atomic outputs and debris -------------------------------------------------------------------
    Case("enospc-publish", "atomic", "publish on a full disk", "one line, exit 2; the previous aggregate kept, no "
         "temp file", _publish, 2, r"^rollout publish: error: No space left on device.*previous outputs are unchanged",
         prelude=_fault("ENOSPC"), post=_aggregate_kept),
    Case("erofs-publish", "atomic", "publish into a read-only output folder", "one line, exit 2; nothing changed",
         _publish, 2, r"^rollout publish: error: Read-only file system.*read-only", prelude=_fault("EROFS"),
         post=_aggregate_kept),
    Case("eacces-publish", "atomic", "publish without write permission", "one line, exit 2; nothing changed",
         _publish, 2, r"^rollout publish: error: Permission denied.*no permission", prelude=_fault("EACCES"),
         post=_aggregate_kept),
    Case("enospc-seal", "atomic", "sealing on a full disk", "one line, exit 2; the manifest unchanged",
         lambda c: ["seal", "--reason", "lease ended", str(_unsealed(c))], 2,
         r"^rollout seal: error: No space left on device", prelude=_fault("ENOSPC", on="write"),
         post=lambda c: c.seals.read_bytes() == (c.root.parent / "base-seals.jsonl").read_bytes() or pytest.fail()),
    Case("no-lock-debris", "atomic", "a good publish", "the aggregate folder holds the aggregate only (the lock "
         "lives in <output-dir>/.locks)", _publish, 0, WROTE,
         post=lambda c: sorted(p.name for p in c.aggregate.parent.iterdir()) == ["pub.json"] or pytest.fail()),
    Case("no-raw-publish", "atomic", "publish of a campaign without raw files", "refused, exit 2; nothing written",
         lambda c: ["publish", "--params", str(c.params), "--campaign", "empty", "--output-dir", str(c.out)], 2,
         r"^rollout publish: error: campaign: 'empty' has no raw files",
         post=lambda c: not (c.out / "aggregate" / "empty.json").exists() or pytest.fail()),
    Case("no-raw-cycle-publish", "atomic", "cycle-publish of a campaign without raw files", "refused, exit 2",
         lambda c: ["cycle-publish", "--campaign", "empty", "--output-dir", str(c.out)], 2,
         r"^rollout cycle-publish: error: campaign: 'empty' has no raw files",
         post=lambda c: not (c.out / "cycles").exists() or pytest.fail()),
    Case("tampered-keeps-aggregate", "atomic", "publish after a raw file was tampered with",
         "refused; the previous aggregate kept, no partial file", _publish, 1,
         REFUSED + r".*r1\.jsonl: sealed with sha256", post=_aggregate_kept,
         mutate=lambda c: c.raw().write_text(c.raw().read_text().replace('"valid":true', '"valid":false', 1))),
    Case("check-missing", "atomic", "check without an aggregate", "refused: publish first", _check, 1,
         r"^rollout check: FAILED: .*does not exist: publish first", mutate=lambda c: c.aggregate.unlink()),
    Case("republish-same-bytes", "atomic", "publish twice", "the same bytes (derived, re-derivable)", _publish, 0,
         WROTE, post=lambda c: c.aggregate.read_bytes() == (c.root.parent / "base-aggregate-here.json").read_bytes()
         or pytest.fail("publish is not deterministic")),

    # ---- seal targets --------------------------------------------------------------------------------
    Case("seal-outside-tree", "seal-targets", "sealing a raw file outside any raw tree",
         "refused; no SEALS file written beside it",
         lambda c: ["seal", "--reason", "why not", str(_copy_to(c.raw(), c.root / "loose.jsonl"))], 2,
         r"^rollout seal: error: .*loose\.jsonl: not inside a raw tree",
         post=lambda c: not (c.root / "SEALS.jsonl").exists() or pytest.fail()),
    Case("seal-shallow", "seal-targets", "a raw file one folder too shallow (raw/<campaign>/x.jsonl)", "refused",
         lambda c: ["seal", "--reason", "why not", str(_copy_to(c.raw(), c.seals.parent / "x.jsonl"))], 2,
         r"not inside a raw tree"),
    Case("seal-symlink", "seal-targets", "sealing a symlink inside a raw tree", "refused: a symlink",
         lambda c: ["seal", "--reason", "why not", str(_link(c.raw(run_id="ln"), c.raw()))], 2,
         r"^rollout seal: error: .*ln\.jsonl: a symlink"),
    Case("seal-fifo", "seal-targets", "sealing a FIFO inside a raw tree", "refused at once", lambda c: [
        "seal", "--reason", "why not", str(_made_fifo(c.raw(run_id="f")))], 2,
         r"^rollout seal: error: .*f\.jsonl: not a regular file", seconds=15),
    Case("seal-directory", "seal-targets", "sealing a directory named x.jsonl", "refused", lambda c: [
        "seal", "--reason", "why not", str(_made_dir(c.raw(run_id="d")))], 2,
         r"^rollout seal: error: .*d\.jsonl: not a regular file"),
    Case("seal-suffix", "seal-targets", "sealing a .txt file", "refused: neither raw nor evidence", lambda c: [
        "seal", "--reason", "why not", str(_write(c.raw().with_suffix(".txt"), "x\n"))], 2,
         r"neither a raw file \(\.jsonl\) nor an evidence file"),
    Case("seal-missing", "seal-targets", "sealing a file that does not exist", "refused",
         lambda c: ["seal", "--reason", "why not", str(c.raw(run_id="nope"))], 2, r"nope\.jsonl: missing"),
    Case("seal-twice", "seal-targets", "sealing an already sealed raw file", "refused: already sealed",
         lambda c: ["seal", "--reason", "again", str(c.raw())], 2, r"^rollout seal: error: .*r1\.jsonl is already "
         "sealed"),
    Case("seal-second-target-bad", "seal-targets", "two targets, the second outside a raw tree",
         "refused before the first is sealed", lambda c: ["seal", "--reason", "both", str(_unsealed(c)),
                                                          str(_copy_to(c.raw(), c.root / "y.jsonl"))], 2,
         r"y\.jsonl: not inside a raw tree",
         post=lambda c: c.seals.read_bytes() == (c.root.parent / "base-seals.jsonl").read_bytes() or pytest.fail()),

    # ---- input validation (the CLI branch implements these refusals) --------------------------------
    Case("run-id-long", "input-validation", "a 300-character run id", "refused: at most 64 characters",
         lambda c: ["measure", "--direct", "--backend", "hf_cached", "--params", str(c.params), "--campaign", "v",
                    "--output-dir", str(c.out), "--device", "cpu", "--cells", CELLS[0], "--run-id", "a" * 300], 2,
         r"^rollout measure: error: .*run.id.*64", seconds=30),
    Case("run-id-charset", "input-validation", "a run id with '/' and '..'", "refused: charset named",
         lambda c: ["measure", "--direct", "--backend", "hf_cached", "--params", str(c.params), "--campaign", "v",
                    "--output-dir", str(c.out), "--device", "cpu", "--cells", CELLS[0], "--run-id", "../x"], 2,
         r"^rollout measure: error: .*run.id", seconds=30),
    Case("campaign-charset", "input-validation", "a campaign name with '/'", "refused: charset named",
         lambda c: ["publish", "--params", str(c.params), "--campaign", "a/../../b", "--output-dir", str(c.out)], 2,
         r"^rollout publish: error: campaign"),
    Case("campaign-unknown", "input-validation", "publish of an unknown campaign", "refused: no raw files",
         lambda c: ["publish", "--params", str(c.params), "--campaign", "nosuch", "--output-dir", str(c.out)], 2,
         r"^rollout publish: error: campaign: 'nosuch'"),
    Case("campaign-long", "input-validation", "a 300-character campaign name", "refused: at most 64 characters",
         lambda c: ["publish", "--params", str(c.params), "--campaign", "c" * 300, "--output-dir", str(c.out)], 2,
         r"^rollout publish: error: campaign"),
    Case("gpu-campaign-on-cpu", "input-validation", "a GPU-preregistered campaign measured on a CPU machine",
         "refused up front; nothing written", lambda c: [
             "measure", "--direct", "--backend", "hf_reference", "--campaign", "gpu-on-cpu", "--output-dir",
             str(c.out), "--cells", "p128-r64-n1-greedy"], 2, r"^rollout measure: error: .*(GPU|gpu|CUDA|cuda)",
         seconds=20, prelude=NO_MODEL_BUILD,
         post=lambda c: not (c.out / "raw" / "gpu-on-cpu").exists() or pytest.fail("wrote into the output tree")),
    Case("papermill-type", "input-validation", "a measure-notebook parameter of the wrong type (cells = 5)",
         "one line naming the parameter", lambda c: [
             "-m", "papermill", str(REPO / "notebooks" / "measure.ipynb"), str(c.root / "m.ipynb"), "-p", "backend",
             "hf_cached", "-p", "cells", "5", "-p", "params", str(c.params), "-p", "output_dir", str(c.out)], 1,
         r"^ParameterError: cells: expected list", seconds=90),
]


def _copy_to(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    return dst


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _link(path: Path, target: Path) -> Path:
    _symlink(path, target)
    return path


def _made_fifo(path: Path) -> Path:
    _fifo(path)
    return path


def _made_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _unsealed(c: Ctx) -> Path:
    """A finished-looking raw file no seal names (its writer 'died')."""
    return _fabricate(c, run_id="r8", edit=lambda records: None)


# ------------------------------------------------------------------------------------------
# Children: a parent killed by SIGKILL (their own runner: the command is the parent)
# ------------------------------------------------------------------------------------------

CHILD_CASES = [
    ("child-managed-server", "children", "the parent of a managed server (backends/server.py) killed by SIGKILL",
     "the server is gone and its port closed within 10 s (the reaper)", "managed-server-reaper"),
    ("child-bound", "children", "the parent of a bound child (lifetime.popen_bound) killed by SIGKILL",
     "the child and its own child are gone, port closed within 10 s", "bound-child"),
]


# ------------------------------------------------------------------------------------------
# The runner
# ------------------------------------------------------------------------------------------

def _committed_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored=no", "--", "outputs", "params"], cwd=REPO,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def committed_before() -> str:
    return _committed_state()


def _param(case: Case):
    return pytest.param(case, id=case.id, marks=case.marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_adversarial(case: Case, base: Path, committed_before: str, tmp_path: Path) -> None:
    root = tmp_path / "case"
    shutil.copytree(base, root, symlinks=True)
    shutil.copy(base / "outputs" / "aggregate" / f"{CAMPAIGN}.json", tmp_path / "base-aggregate.json")
    # the same aggregate as publish writes it for this copy (input paths outside the repository are absolute)
    (tmp_path / "base-aggregate-here.json").write_text(
        (tmp_path / "base-aggregate.json").read_text().replace(str(base), str(root)))
    shutil.copy(base / "outputs" / "raw" / CAMPAIGN / "SEALS.jsonl", tmp_path / "base-seals.jsonl")
    c = Ctx(root)
    if case.mutate is not None:
        case.mutate(c)
    argv = case.argv(c)
    started = time.monotonic()
    if argv[0] == "-m":  # a tool other than rollout (papermill)
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO,
                              timeout=case.seconds)
    else:
        done = _cli(*argv, timeout=case.seconds, prelude=case.prelude)
    elapsed = time.monotonic() - started
    assert elapsed < case.seconds
    stream = done.stdout if case.code == 0 else done.stderr
    lines = [line for line in stream.strip().splitlines() if line.strip()]
    assert done.returncode == case.code, (done.returncode, done.stderr[-3000:])
    if argv[0] != "-m":  # papermill's own CLI prints the notebook's traceback; the cause is its last line
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines, "no message"
    if case.code != 0 and argv[0] != "-m":
        assert sum(line.startswith("rollout ") for line in lines) == 1, done.stderr[-3000:]
    assert re.search(case.message, lines[-1]), (case.message, lines[-1])
    if case.post is not None:
        case.post(c)
    assert _committed_state() == committed_before, "committed evidence changed"


@pytest.mark.parametrize("how", [pytest.param(h, id=i) for i, _, _, _, h in CHILD_CASES])
def test_adversarial_children(how: str, tmp_path: Path, committed_before: str) -> None:
    from .test_lifetime import test_a_server_dies_with_its_parent_killed_by_sigkill as kill_parent

    started = time.monotonic()
    kill_parent(how, tmp_path)
    assert time.monotonic() - started < 60
    assert _committed_state() == committed_before, "committed evidence changed"


def all_cases() -> list[tuple[str, str, str, str]]:
    """(id, class, input, outcome) of every case, children included: what docs/reliability.md lists."""
    return [(c.id, c.cls, c.input, c.outcome) for c in CASES] + [(i, k, t, o) for i, k, t, o, _ in CHILD_CASES]


def test_the_suite_is_large_enough_and_documented() -> None:
    cases = all_cases()
    assert len(cases) >= 60 and len({c[0] for c in cases}) == len(cases)
    sys.path.insert(0, str(REPO))
    from tools.reliability_table import render_classes

    doc = (REPO / "docs" / "reliability.md").read_text()
    assert render_classes(cases) in doc, "docs/reliability.md is stale: run python tools/reliability_table.py --write"

