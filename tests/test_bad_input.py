"""Bad input, table-driven: every case is something an outside reviewer tried. Each one must end in a
clear refusal that names the field or file (and what is allowed, or the expected and found hashes),
and must lose nothing: evidence bytes stay as they were.

`tools/reliability_table.py` renders CASES as the reliability table of docs/evidence.md; a test keeps them equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_lib.core import sha256_file
from rollout_lib.evidence.publish import (
    CalculatorHashMismatch,
    EvidenceRefused,
    PublishCheckFailed,
    aggregate_path,
    check,
    publish,
)
from rollout_lib.measure.rawfile import FileLock, RawFileError, RawSealed, RawWriter, WriterBusy, read_raw
from rollout_lib.measure.runner import ParameterError, RawIdentityDrift, _same_run, run, validate_parameters
from rollout_lib.study.prereg import PreregistrationError, load

from .conftest import REPO, SMOKE
from .test_runner import _OOMOnceBackend

CELLS = ["p16-r24-n2-greedy", "p48-r24-n1-stochastic"]


@dataclass
class Ctx:
    tmp: Path
    study: object
    out: Path
    params: Path
    calc: Path

    def raw(self, backend: str = "hf_cached", run_id: str = "r1") -> Path:
        return self.out / "raw" / "pub" / backend / f"{run_id}.jsonl"

    def snapshot(self) -> dict[str, str]:
        """SHA-256 of every evidence file: what 'nothing lost' compares."""
        return {str(p.relative_to(self.out)): sha256_file(p) for p in sorted(self.out.rglob("*"))
                if p.is_file() and not p.name.endswith(".lock")}

    def prereg(self, old: str, new: str) -> Path:
        text = SMOKE.read_text()
        assert old in text, old
        path = self.tmp / "bad.yaml"
        path.write_text(text.replace(old, new, 1))
        return path


@pytest.fixture()
def ctx(tmp_path, scratch_calculator):
    calc = scratch_calculator
    params = tmp_path / "smoke.yaml"
    params.write_text(SMOKE.read_text())
    study = load(params)
    out = tmp_path / "outputs"
    for backend in ("hf_reference", "hf_cached"):
        spec, _, workload = validate_parameters(backend=backend, params=str(params), campaign="pub", cells=CELLS,
                                                output_dir=str(out), run_id="r1")
        list(run(spec, study, workload, backend_factory=lambda: _OOMOnceBackend(study)))
    publish(study, "pub", out)
    return Ctx(tmp_path, study, out, params, calc)


def cli(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, TQDM_DISABLE="1"))


def refused_one_line(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit `code`; the error is one line, the last one on stderr (progress lines may precede it)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, out.stderr
    assert lines and "Traceback" not in out.stderr, out.stderr
    error = lines[-1]
    assert error.startswith("rollout ") and sum(line.startswith("rollout ") for line in lines) == 1, out.stderr
    for needle in needles:
        assert needle in error, (needle, error)


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------

def prereg_refused(old: str, new: str, *needles: str) -> Callable[[Ctx], None]:
    def check_case(c: Ctx) -> None:
        path = c.prereg(old, new)
        with pytest.raises(PreregistrationError) as info:
            load(path)
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))
        assert len(str(info.value)) < 1000
    return check_case


def alias_bomb(c: Ctx) -> None:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = c.tmp / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    with pytest.raises(PreregistrationError, match=r"YAML aliases \(\*a0\) are not allowed") as info:
        load(path)
    assert time.perf_counter() - started < 2 and len(str(info.value)) < 500


def binary_file(c: Ctx) -> None:
    path = c.tmp / "binary.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + bytes(range(256)))
    with pytest.raises(PreregistrationError, match=r"not UTF-8 text \(byte \d+"):
        load(path)


def nul_bytes(c: Ctx) -> None:
    path = c.tmp / "nul.yaml"
    path.write_text(SMOKE.read_text() + "\x00\x00")
    with pytest.raises(PreregistrationError, match="NUL bytes"):
        load(path)


def directory_as_prereg(c: Ctx) -> None:
    refused_one_line(cli("prereg", str(c.tmp)), 2, "is a directory, not a preregistration file")


def duplicate_nested_key(c: Ctx) -> None:
    prereg_refused("    ignore_eos: false\n", "    ignore_eos: false\n    ignore_eos: true\n",
                   "workload.stop_rule.ignore_eos: duplicate key (lines")(c)


def publish_with_invalid_params(c: Ctx) -> None:
    bad = c.prereg("measured_repetitions: 3", "measured_repetitions: .nan")
    before = c.snapshot()
    refused_one_line(cli("publish", "--campaign", "pub", "--params", str(bad), "--output-dir", str(c.out)), 2,
                     "protocol.measured_repetitions: expected an integer")
    assert c.snapshot() == before


def unknown_backend(c: Ctx) -> None:
    with pytest.raises(ParameterError, match="backend: unknown backend 'hf_fast'; known backends: hf_cached"):
        validate_parameters(backend="hf_fast", params=str(c.params), campaign="pub", output_dir=str(c.out))


def unknown_cell(c: Ctx) -> None:
    with pytest.raises(ParameterError, match="cells: unknown cell id 'p16-r9-n1-greedy'; valid cell ids: p16-r8"):
        validate_parameters(backend="hf_cached", params=str(c.params), campaign="pub", cells=["p16-r9-n1-greedy"],
                            output_dir=str(c.out))


def campaign_escapes(c: Ctx) -> None:
    before = sorted(p for p in c.tmp.rglob("*"))
    out = cli("measure", "--backend", "hf_cached", "--params", str(c.params), "--campaign", "../x",
              "--output-dir", str(c.out))
    refused_one_line(out, 2, "campaign: '../x' must match")
    assert sorted(p for p in c.tmp.rglob("*")) == before, "nothing may be written for a refused campaign"


def run_id_escapes(c: Ctx) -> None:
    with pytest.raises(ParameterError, match=r"run_id: '\.\./\.\./r' must match"):
        validate_parameters(backend="hf_cached", params=str(c.params), campaign="pub", run_id="../../r",
                            output_dir=str(c.out))


def bad_device(c: Ctx) -> None:
    with pytest.raises(ParameterError, match="device: 'gpu' is not allowed; allowed: '' \\(auto\\), 'cpu'"):
        validate_parameters(backend="hf_cached", params=str(c.params), campaign="pub", device="gpu",
                            output_dir=str(c.out))


def engine_flag_takeover(c: Ctx) -> None:
    """`--backend-option extra_server_args=[...]` naming a flag the backend owns (`--host 0.0.0.0` would
    bind every interface: vLLM's argparse keeps the last value) is refused before any raw file exists."""
    out = cli("cycle", "--params", str(REPO / "params" / "profiles" / "smoke-cycle.yaml"), "--campaign", "pub",
              "--backend", "vllm", "--algorithm", "pg_k1", "--cell", "p16-r24-n2-stochastic",
              "--vllm-memory-mode", "small_kv", "--output-dir", str(c.out),
              "--backend-option", 'extra_server_args=["--host", "0.0.0.0"]')
    refused_one_line(out, 2, "extra_server_args '--host' is not allowed", "bound to 127.0.0.1")
    assert not (c.out / "cycles").exists()


def campaign_other_identity(c: Ctx) -> None:
    """A campaign job told to continue cut cells under a known measurement identity (`--expect-identity`),
    on a machine whose identity is another one: it would measure them afresh and split them again."""
    before = c.snapshot()
    out = cli("campaign", "run", "--params", str(c.params), "--campaign", "pub", "--backend", "hf_cached",
              "--output-dir", str(c.out), "--deadline-s", "60", "--expect-identity", "00000000")
    refused_one_line(out, 2, "expect-identity: 00000000 required, this machine's measurement identity is",
                     "nothing was started")
    assert c.snapshot() == before and not (c.out / "campaigns").exists()


def campaign_lease_below_deadline(c: Ctx) -> None:
    """`--lease-s` shorter than the job's own `--deadline-s`: a job's deadline lies within one lease."""
    before = c.snapshot()
    out = cli("campaign", "plan", "--params", str(c.params), "--campaign", "pub", "--backend", "hf_cached",
              "--output-dir", str(c.out), "--deadline-s", "600", "--lease-s", "300")
    refused_one_line(out, 2, "lease-s: 300.0 is not allowed; at least --deadline-s (600.0)")
    assert c.snapshot() == before and not (c.out / "campaigns").exists()


def measure_warmup_estimates_not_seconds(c: Ctx) -> None:
    """A campaign worker's `--warmup-estimates-json` that is not {cell id: seconds}: refused by name before
    any raw file exists."""
    before = c.snapshot()
    common = ("measure", "--direct", "--backend", "hf_cached", "--params", str(c.params), "--campaign", "pub",
              "--output-dir", str(c.out), "--device", "cpu", "--deadline-unix", "9e9")
    out = cli(*common, "--warmup-estimates-json", '{"p16-r8-n1-greedy": "long"}')
    refused_one_line(out, 2, "warmup-estimates-json: expected an object of cell id -> seconds per warmup")
    out = cli(*common, "--warmup-estimates-json", "{not json")
    refused_one_line(out, 2, "warmup-estimates-json: not JSON")
    assert c.snapshot() == before


def params_is_directory(c: Ctx) -> None:
    with pytest.raises(ParameterError, match=r"params: .* is not a file"):
        validate_parameters(backend="hf_cached", params=str(c.tmp), campaign="pub", output_dir=str(c.out))


def resume_sealed_run(c: Ctx) -> None:
    before = c.snapshot()
    spec, study, workload = validate_parameters(backend="hf_cached", params=str(c.params), campaign="pub",
                                                cells=CELLS, output_dir=str(c.out), run_id="r1")
    with pytest.raises(RawSealed, match=r"is sealed .*use a new run id"):
        list(run(spec, study, workload, backend_factory=lambda: _OOMOnceBackend(study)))
    assert c.snapshot() == before


def second_writer(c: Ctx) -> None:
    target = c.out / "raw" / "pub" / "hf_cached" / "live.jsonl"
    holder = FileLock(target, what="raw-file").acquire()
    try:
        with pytest.raises(WriterBusy, match=rf"being written by pid {os.getpid()} on host \S+ \(since"):
            RawWriter(target).open({"record": "header"})
    finally:
        holder.release()


def resume_corrupted_raw(c: Ctx) -> None:
    path = c.out / "raw" / "pub" / "hf_cached" / "broken.jsonl"
    lines = c.raw().read_bytes().splitlines(keepends=True)
    data = b"".join(lines[:3]) + b'{"record": "repetition", GARBAGE\n' + b"".join(lines[4:8])
    path.write_bytes(data)
    with pytest.raises(RawFileError, match=r"broken\.jsonl: line 4 is not JSON .*only a torn last line"):
        RawWriter(path).open(read_raw(c.raw())[0][0])
    assert path.read_bytes() == data
    refused_one_line(cli("missing", "--campaign", "pub", "--params", str(c.params), "--output-dir", str(c.out)), 1,
                     "broken.jsonl: no seal")


def resume_other_environment(c: Ctx) -> None:
    records, _ = read_raw(c.raw())
    header = records[0]
    path = c.out / "raw" / "pub" / "hf_cached" / "drift.jsonl"
    old = json.loads(json.dumps(header))
    old["environment"]["gpu"] = {"status": "measured", "name": "NVIDIA GeForce RTX 4080", "driver": "596.49"}
    path.write_text(json.dumps(old) + "\n")
    with pytest.raises(RawIdentityDrift, match="RTX 4080"):
        RawWriter(path).open(header, same_run=_same_run)
    assert path.read_text() == json.dumps(old) + "\n"


def concurrent_writers(c: Ctx) -> None:
    cmd = [sys.executable, "-m", "rollout_lib.cli", "measure", "--direct", "--backend", "hf_reference",
           "--params", str(SMOKE), "--campaign", "conc", "--run-id", "conc", "--output-dir", str(c.out),
           "--cells", "p16-r8-n1-greedy,p16-r8-n1-stochastic", "--device", "cpu"]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    raw = c.out / "raw" / "conc" / "hf_reference" / "conc.jsonl"
    from rollout_lib.measure.rawfile import live_holder

    deadline = time.time() + 120
    while time.time() < deadline and live_holder(raw) is None:
        time.sleep(0.05)
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    refused_one_line(second, 2, f"being written by pid {first.pid} on host", "a second raw-file writer is refused")
    records, torn = read_raw(raw)
    completes = [r["cell_id"] for r in records if r["record"] == "cell_complete"]
    assert sorted(completes) == ["p16-r8-n1-greedy", "p16-r8-n1-stochastic"] and torn == b""


def flipped_raw_byte(c: Ctx) -> None:
    data = bytearray(c.raw().read_bytes())
    index = data.index(b'"wall_s":') + len(b'"wall_s":') + 2
    data[index] = ord("7") if data[index] != ord("7") else ord("3")
    c.raw().write_bytes(bytes(data))
    aggregate = aggregate_path(c.out, "pub").read_bytes()
    for action in (publish, check):
        with pytest.raises(EvidenceRefused, match=r"hf_cached/r1\.jsonl: sealed with sha256 [0-9a-f]{64}, found "):
            action(c.study, "pub", c.out)
    assert aggregate_path(c.out, "pub").read_bytes() == aggregate


def deleted_raw(c: Ctx) -> None:
    c.raw("hf_reference").unlink()
    with pytest.raises(EvidenceRefused, match=r"hf_reference/r1\.jsonl: sealed with sha256 [0-9a-f]{64} but missing"):
        publish(c.study, "pub", c.out)


def fabricated_repetition(c: Ctx) -> None:
    records, _ = read_raw(c.raw())
    fake = next(r for r in records if r["record"] == "repetition" and not r["warmup"]) | {"wall_s": 0.001}
    with open(c.raw(), "a") as handle:
        handle.write(json.dumps(fake) + "\n")
    with pytest.raises(EvidenceRefused, match=r"hf_cached/r1\.jsonl: sealed with sha256"):
        publish(c.study, "pub", c.out)


def unsealed_raw(c: Ctx) -> None:
    shutil.copy(c.raw(), c.raw(run_id="r2"))
    with pytest.raises(EvidenceRefused, match=r"hf_cached/r2\.jsonl: no seal in .*SEALS\.jsonl and no live writer"):
        publish(c.study, "pub", c.out)


def in_progress_raw(c: Ctx) -> None:
    live = c.raw(run_id="r3")
    shutil.copy(c.raw(), live)
    with FileLock(live, what="raw-file"):
        publish(c.study, "pub", c.out)
    aggregate = json.loads(aggregate_path(c.out, "pub").read_text())
    entry = next(f for f in aggregate["raw_files"] if f["run_id"] == "r3")
    assert not entry["accepted"] and entry["excluded_reason"].startswith("in progress: being written by pid")
    assert all(cell["raw_file"].endswith("/r1.jsonl") for cell in aggregate["cells"])


def header_campaign_mismatch(c: Ctx) -> None:
    from rollout_lib.measure.rawfile import seal_file

    records, _ = read_raw(c.raw())
    moved = c.raw(run_id="r4")
    moved.write_text("\n".join(json.dumps(r | ({"campaign": "other"} if r["record"] == "header" else {}))
                               for r in records) + "\n")
    seal_file(moved, c.out / "raw" / "pub", ended="teardown")
    with pytest.raises(EvidenceRefused, match=r"hf_cached/r4\.jsonl: header campaign is 'other', its place says 'pub'"):
        publish(c.study, "pub", c.out)


def edited_hash_in_aggregate(c: Ctx) -> None:
    path = aggregate_path(c.out, "pub")
    actual = sha256_file(c.raw())
    path.write_text(path.read_text().replace(actual, "f" * 64))
    with pytest.raises(PublishCheckFailed, match=r"hf_cached/r1\.jsonl: .*records sha256 f{64}, the file and its seal "
                                                 r"have [0-9a-f]{64}: the aggregate was edited"):
        check(c.study, "pub", c.out)


def truncated_aggregate(c: Ctx) -> None:
    path = aggregate_path(c.out, "pub")
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(PublishCheckFailed, match=r"aggregate/pub\.json is not valid JSON .*truncated or edited"):
        check(c.study, "pub", c.out)


def reformatted_aggregate(c: Ctx) -> None:
    path = aggregate_path(c.out, "pub")
    path.write_text(json.dumps(json.loads(path.read_text()), indent=2))
    with pytest.raises(PublishCheckFailed, match=r"same content .* not its canonical bytes \(it was reformatted\)"):
        check(c.study, "pub", c.out)


def changed_calculator(c: Ctx) -> None:
    c.calc.write_text(c.calc.read_text() + "\n# one more line\n")
    with pytest.raises(CalculatorHashMismatch, match=r"has sha256 [0-9a-f]{64}; the preregistration pins"):
        publish(c.study, "pub", c.out)


def tampered_seal_manifest(c: Ctx) -> None:
    manifest = c.out / "raw" / "pub" / "SEALS.jsonl"
    manifest.write_text(manifest.read_text().replace('"record":"seal"', '"record":"seal",GARBAGE', 1))
    with pytest.raises(EvidenceRefused, match=r"SEALS\.jsonl: line \d+ is not JSON"):
        publish(c.study, "pub", c.out)


def resealed_with_other_hash(c: Ctx) -> None:
    manifest = c.out / "raw" / "pub" / "SEALS.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    first = next(json.loads(line) for line in lines if b'"record":"seal"' in line)
    chained = first | {"sha256": "e" * 64, "previous_line_sha256": hashlib.sha256(lines[-1]).hexdigest()}
    with open(manifest, "a") as handle:  # a well-chained second seal: the chain holds, the hashes clash
        handle.write(json.dumps(chained) + "\n")
    with pytest.raises(EvidenceRefused, match="is sealed twice with different hashes"):
        publish(c.study, "pub", c.out)


def concurrent_publish(c: Ctx) -> None:
    before = aggregate_path(c.out, "pub").read_bytes()
    from rollout_lib.evidence.publish import publish_lock_target

    with FileLock(publish_lock_target(c.out, "publish-pub"), what="publish"), \
            pytest.raises(WriterBusy, match=rf"being written by pid {os.getpid()}"):
        publish(c.study, "pub", c.out)
    assert aggregate_path(c.out, "pub").read_bytes() == before


def tampered_evidence_json(c: Ctx) -> None:
    from rollout_lib.measure.identity import write_evidence

    path = c.out / "conformance" / "conformance-x.json"
    write_evidence(path, {"kind": "local_conformance", "verdict": {"passed": True}}, study=c.study,
                   model_digests={})
    publish(c.study, "pub", c.out)
    path.write_text(path.read_text().replace('"passed":true', '"passed":false'))
    with pytest.raises(EvidenceRefused, match=r"conformance-x\.json: sealed with sha256 .*the evidence file changed"):
        check(c.study, "pub", c.out)


def evidence_overwrite(c: Ctx) -> None:
    from rollout_lib.measure.identity import write_evidence

    path = c.out / "conformance" / "once.json"
    write_evidence(path, {"kind": "x"}, study=c.study, model_digests={})
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="never rewritten"):
        write_evidence(path, {"kind": "y"}, study=c.study, model_digests={})
    assert path.read_bytes() == before


def measure_notebook_never_reused(c: Ctx) -> None:
    from rollout_lib.cli import measure_notebook_path

    paths = {measure_notebook_path(c.out, "pub", "hf_cached", "r1") for _ in range(50)}
    assert len(paths) == 50 and all(p.parent == c.out / "runs" / "pub" for p in paths)


def seal_with_live_writer(c: Ctx) -> None:
    live = c.raw(run_id="r5")
    shutil.copy(c.raw(), live)
    with FileLock(live, what="raw-file"):
        out = cli("seal", str(live), "--reason", "test")
    refused_one_line(out, 2, "being written by pid")


def nan_in_raw_evidence(c: Ctx) -> None:
    from rollout_lib.core import CanonicalJSONError, canonical_json

    with pytest.raises(CanonicalJSONError, match=r"wall_s: nan is not allowed in evidence JSON"):
        canonical_json({"wall_s": float("nan")})


@dataclass(frozen=True)
class Case:
    id: str
    input: str
    outcome: str
    run: Callable[[Ctx], None]


CASES = [
    Case("prereg-nan-tolerance", "preregistration: `.nan` tolerance", "refused: key path + 'expected a finite number'",
         prereg_refused("nf4_sampled_logprob_abs: 0.01", "nf4_sampled_logprob_abs: .nan",
                        "tolerances.nf4_sampled_logprob_abs", "finite")),
    Case("prereg-nan-gate", "preregistration: `.nan` gate threshold", "refused: `gates[0].threshold` must be finite",
         prereg_refused("threshold: 2.0", "threshold: .nan", "gates[0].threshold", "finite")),
    Case("prereg-inf-scale", "preregistration: `.inf` logit scale", "refused: `actor.logit_scale` must be finite",
         prereg_refused("logit_scale: ", "logit_scale: .inf #", "actor.logit_scale", "finite")),
    Case("prereg-huge-budget", "preregistration: a 10^30-byte budget", "refused: implausibly large",
         prereg_refused("budget_bytes: 17179869184", "budget_bytes: 1000000000000000000000000000000",
                        "memory.budget_bytes", "implausibly large")),
    Case("prereg-budget-max", "preregistration: a 2 TiB budget", "refused: above the maximum (1 TiB)",
         prereg_refused("budget_bytes: 17179869184", "budget_bytes: 2199023255552", "memory.budget_bytes",
                        "above the maximum")),
    Case("prereg-calculator-escape", "preregistration: `calculator.path: rollout_lib/../../../etc/passwd.py`",
         "refused: outside the repository",
         prereg_refused("path: rollout_lib/calculator.py", "path: rollout_lib/../../../etc/passwd.py",
                        "calculator.path", "outside the repository")),
    Case("prereg-calculator-absolute", "preregistration: absolute calculator path", "refused: relative path needed",
         prereg_refused("path: rollout_lib/calculator.py", "path: /etc/passwd", "calculator.path",
                        "a relative path to a .py file inside the repository")),
    Case("prereg-alias-bomb", "preregistration: an 8 KB YAML alias bomb",
         "refused before expansion (aliases not allowed), short message", alias_bomb),
    Case("prereg-binary", "preregistration: a binary, non-UTF-8 file", "refused: 'not UTF-8 text (byte N)'",
         binary_file),
    Case("prereg-nul", "preregistration: text with NUL bytes", "refused: binary file", nul_bytes),
    Case("prereg-directory", "preregistration: a directory", "refused: 'is a directory' (exit 2, one line)",
         directory_as_prereg),
    Case("prereg-duplicate-key", "preregistration: a duplicate nested key",
         "refused: full key path + both line numbers", duplicate_nested_key),
    Case("prereg-unknown-key", "preregistration: an unknown key", "refused: key path + allowed keys",
         prereg_refused("  oom_downshift: none", "  oom_downshift: none\n  oom_dowshift: none",
                        "memory.oom_dowshift: unknown key; allowed keys here")),
    Case("publish-invalid-params", "`rollout publish --params` with an invalid file",
         "exit 2, one line naming the key; nothing written", publish_with_invalid_params),
    Case("measure-unknown-backend", "measure: unknown backend", "refused: the known backends listed", unknown_backend),
    Case("measure-unknown-cell", "measure: unknown cell id", "refused: the valid cell ids listed", unknown_cell),
    Case("measure-campaign-escape", "measure: `--campaign ../x`", "refused before anything is written",
         campaign_escapes),
    Case("measure-run-id-escape", "measure: `--run-id ../../r`", "refused: the allowed pattern", run_id_escapes),
    Case("measure-bad-device", "measure: `--device gpu`", "refused: the allowed devices", bad_device),
    Case("engine-flag-takeover", "vLLM engine option `extra_server_args=[\"--host\", \"0.0.0.0\"]`",
         "refused: the backend's own flags named (127.0.0.1 only, no remote code); no raw file", engine_flag_takeover),
    Case("campaign-other-identity", "`campaign run --expect-identity` on a machine whose measurement identity "
         "is another one", "refused before any worker starts: both identities named (exit 2)",
         campaign_other_identity),
    Case("campaign-lease-below-deadline", "`campaign plan --lease-s` shorter than `--deadline-s`",
         "refused: both named (exit 2); nothing written", campaign_lease_below_deadline),
    Case("measure-warmup-estimates-not-seconds", "a campaign worker's `--warmup-estimates-json` not {cell: "
         "seconds}", "refused: the flag and the expected shape named (exit 2); nothing written",
         measure_warmup_estimates_not_seconds),
    Case("measure-params-directory", "measure: a directory as `params`", "refused: not a file", params_is_directory),
    Case("raw-resume-sealed", "resume a run that ended (sealed)", "refused: 'use a new run id'; file untouched",
         resume_sealed_run),
    Case("raw-second-writer", "a second writer on a live raw file", "refused at once with holder pid, host, start",
         second_writer),
    Case("raw-concurrent-measure", "two concurrent `measure` runs with one run id",
         "the second exits 2 naming the first's pid; each cell recorded once", concurrent_writers),
    Case("raw-resume-corrupted", "resume a raw file damaged mid-file", "refused: file and line named; untouched",
         resume_corrupted_raw),
    Case("raw-resume-other-env", "resume from another GPU", "refused: the differing identity shown; untouched",
         resume_other_environment),
    Case("raw-seal-live-writer", "`rollout seal` on a file with a live writer", "refused: holder named",
         seal_with_live_writer),
    Case("publish-flipped-byte", "publish/check after one flipped byte in a sealed raw file",
         "refused: file, sealed and found SHA-256; aggregate untouched", flipped_raw_byte),
    Case("publish-deleted-raw", "publish after deleting a sealed raw file", "refused: 'sealed ... but missing'",
         deleted_raw),
    Case("publish-fabricated-rep", "publish after appending a fabricated repetition",
         "refused: the seal no longer matches", fabricated_repetition),
    Case("publish-unsealed", "publish with a raw file that has no seal and no writer",
         "refused: not the output of a run that ended", unsealed_raw),
    Case("publish-in-progress", "publish while a raw file is still being written",
         "published without it, listed as 'in progress'", in_progress_raw),
    Case("publish-header-campaign", "a sealed raw file whose header names another campaign",
         "refused: header vs place", header_campaign_mismatch),
    Case("publish-concurrent", "two publishes of one campaign at once", "the second refused; aggregate untouched",
         concurrent_publish),
    Case("seal-manifest-damaged", "a damaged seal manifest", "refused: manifest and line named",
         tampered_seal_manifest),
    Case("seal-manifest-resealed", "a second seal of one file with another hash", "refused: both hashes shown",
         resealed_with_other_hash),
    Case("evidence-tampered", "an edited conformance evidence file", "refused: sealed vs found SHA-256",
         tampered_evidence_json),
    Case("evidence-overwrite", "writing an evidence file twice", "refused: evidence is never rewritten",
         evidence_overwrite),
    Case("check-edited-hash", "check after editing a raw hash inside the aggregate",
         "blames the aggregate, not the raw file", edited_hash_in_aggregate),
    Case("check-truncated", "check on a truncated aggregate", "refused: file named, 'not valid JSON'",
         truncated_aggregate),
    Case("check-reformatted", "check on a reformatted (pretty-printed) aggregate",
         "refused: 'same content, not canonical bytes'", reformatted_aggregate),
    Case("check-calculator-changed", "a calculator file that differs from the pin",
         "refused: found and pinned SHA-256", changed_calculator),
    Case("notebook-never-reused", "`rollout measure` twice with one run id",
         "a new executed notebook per call; none replaced", measure_notebook_never_reused),
    Case("evidence-nan", "a NaN about to be written as evidence", "refused: field named", nan_in_raw_evidence),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, ctx: Ctx):
    case.run(ctx)


def test_the_suite_is_large_enough_and_ids_unique():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


def test_reliability_table_is_the_suite():
    sys.path.insert(0, str(REPO / "tools"))
    from reliability_table import TABLE_FILE, render

    assert render(CASES) in TABLE_FILE.read_text(), (
        f"{TABLE_FILE.relative_to(REPO)}: reliability table is stale: run `python tools/reliability_table.py --write`")


def test_publish_refuses_nothing_on_untouched_evidence(ctx):
    check(ctx.study, "pub", ctx.out)
    with pytest.raises(RawSealed):
        RawWriter(ctx.raw()).open({"record": "header"})


def test_conformance_candidate_options_are_refused_by_name(tmp_path):
    out = cli("conformance", "--params", str(SMOKE), "--out", str(tmp_path / "c.json"), "--device", "cpu",
              "--candidate-option", "lora_add=bf16")
    refused_one_line(out, 2, "lora_add 'bf16' is not allowed", "float32_once", "bf16_like_nf4_oracle")
    out = cli("conformance", "--params", str(SMOKE), "--out", str(tmp_path / "c.json"), "--candidate", "vllm",
              "--candidate-option", "lora_add=bf16_like_nf4_oracle")
    refused_one_line(out, 2, "--candidate-option: only with --candidate hf_cached")
    assert not (tmp_path / "c.json").exists()
