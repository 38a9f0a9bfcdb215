"""Issue 42, the CPU part: a trained stand-in on a corpus every machine has, named by a manifest.

The corpus refuses a file that differs from its manifest (by name, one line); the BPE tokenizer is
byte-identical when trained twice (also across processes); tiny training is deterministic (two runs,
one digest, the one the smoke-trained profile pins); held-out loss goes down and entropy ends below the
random initialisation's; real prompts are deterministic, of the cell lengths, and are real held-out
token sequences; and the whole chain runs: train tiny -> snapshot -> prompts -> `rollout measure`.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout_lib.core import sha256_bytes
from rollout_lib.study.arch import get_architecture
from rollout_lib.study.corpus import CorpusMismatch, load_manifest, read_split, verify_corpus

from .conftest import REPO

FULL_CORPUS = REPO / "params" / "corpora" / "transformers-5.17.0.json"
TINY_CORPUS = REPO / "params" / "corpora" / "transformers-5.17.0-generation.json"
PROFILE = REPO / "params" / "profiles" / "smoke-trained.yaml"
DRAFT = REPO / "params" / "drafts" / "rollout-runtime-v3-trained.yaml"
V2 = REPO / "params" / "rollout-runtime-v2.yaml"
TIMING_KEYS = ("train_wall_s", "train_tokens_per_s")
# CPU training is deterministic on one machine (one thread), but its float32 sums follow the vector kernels the CPU
# gets at run time (ATen's capability, MKL's code path, and something else: docs/perf-notes.md, "Stand-in
# training"), so the build's digest is a property of the CPU family as well as of the recipe. The profile pins
# b2ab933c..., what CI's machines built through stop 67 (their CPU was not recorded); the families below were seen
# to build another digest, the same one on every repeat. A recipe change moves every digest out of this table.
CPU_FAMILY_BUILDS = {
    # session 39/40: AMD EPYC, ATen AVX2
    ("AuthenticAMD", "AVX2"): "a316e13129771097ce8c1fddfa9a60c9bdf7ce742dadcdade27da1bfa9b61a9e",
    # session 44 (Xeon with AVX512-FP16/BF16), session 45 (Xeon without them), CI at stop 68: Intel, ATen AVX512
    ("GenuineIntel", "AVX512"): "3b9cc487f8c2d28d027970dee7a12ad9af2c986bb5812ed2e0348006bf21f3a6",
}


def cpu_family() -> tuple[str, str]:
    """(vendor, ATen capability): the key of CPU_FAMILY_BUILDS."""
    import torch

    from rollout_lib.measure.host import CPUINFO

    text = CPUINFO.read_text() if CPUINFO.is_file() else ""
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")),
                  "unknown")
    return vendor, torch.backends.cpu.get_cpu_capability()


def expected_build() -> tuple[str, str]:
    """The digest this CPU family builds from the profile's recipe, and where that figure comes from."""
    family = cpu_family()
    if family in CPU_FAMILY_BUILDS:
        return CPU_FAMILY_BUILDS[family], f"the build of {family} CPUs (CPU_FAMILY_BUILDS)"
    return yaml.safe_load(PROFILE.read_text())["actor"]["payload_digest"], "the profile's pin"


def rollout(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def trained_actor(tmp_path_factory):
    """The tiny actor trained once, in this process, as the smoke-trained profile says."""
    from rollout_lib.models.train_standin import plan_training, train_standin

    out = tmp_path_factory.mktemp("standin") / "tiny-actor"
    record = train_standin(plan_training("tiny", role="actor"), out)
    return out, record


# ------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [FULL_CORPUS, TINY_CORPUS])
def test_the_committed_corpora_verify_here_and_split_both_ways(path):
    manifest = load_manifest(path)
    verify_corpus(manifest)
    train, heldout = manifest.split_files("train"), manifest.split_files("heldout")
    assert train and heldout and len(train) + len(heldout) == len(manifest.files)
    assert {f.path for f in train}.isdisjoint({f.path for f in heldout})
    assert manifest.package == "transformers" and manifest.package_version == "5.17.0"


def _tampered_manifest(tmp_path: Path, index: int) -> tuple[Path, str]:
    data = json.loads(TINY_CORPUS.read_text())
    entry = data["files"][index]
    entry["sha256"] = sha256_bytes(b"not the installed bytes")
    out = tmp_path / "tampered.json"
    out.write_text(json.dumps(data))
    return out, entry["path"]


def test_a_file_that_differs_from_the_manifest_is_refused_by_name(tmp_path):
    manifest_path, changed = _tampered_manifest(tmp_path, 3)
    manifest = load_manifest(manifest_path)
    with pytest.raises(CorpusMismatch, match=rf"transformers/{changed} differs from the manifest"):
        verify_corpus(manifest)
    # the whole corpus is verified before any split is read: the held-out split refuses too
    with pytest.raises(CorpusMismatch, match=changed):
        read_split(manifest, "heldout")


def test_a_different_package_version_is_refused(tmp_path):
    data = json.loads(TINY_CORPUS.read_text()) | {"package_version": "0.0.1"}
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(CorpusMismatch, match=r"transformers 5\.17\.0 is installed, the manifest pins 0\.0\.1"):
        verify_corpus(load_manifest(tmp_path / "m.json"))


def test_models_train_refuses_a_changed_corpus_in_one_line_writing_nothing(tmp_path):
    manifest_path, changed = _tampered_manifest(tmp_path, 0)
    out = tmp_path / "never"
    result = rollout("models", "train", "--arch", "tiny", "--out", str(out), "--corpus", str(manifest_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and changed in lines[0] and "differs from the manifest" in lines[0], result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tampered.json"]


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "steps: 0; allowed: an integer >= 1"),
    (["--bpe-vocab-size", "2000"], "bpe_vocab_size: 2000 for tiny; allowed 257..1000"),
    (["--device", "tpu"], "device: 'tpu'; allowed: cpu, cuda, cuda:N"),
])
def test_models_train_bad_input_is_one_line_exit_2(tmp_path, argv, needle):
    result = rollout("models", "train", "--arch", "tiny", "--out", str(tmp_path / "x"), *argv)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"rollout models: error: {needle}"), \
        result.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------

PADDED_SHA_SNIPPET = (
    "from rollout_lib.study.bpe_tokenizer import padded_tokenizer_json as p;"
    "from rollout_lib.study.corpus import load_manifest as m;"
    "from rollout_lib.study.arch import get_architecture as a;import hashlib;"
    "print(hashlib.sha256(p(m('params/corpora/transformers-5.17.0-generation.json'), 512, a('tiny'))).hexdigest())")


def test_the_tokenizer_trains_to_identical_bytes_twice_and_in_another_process():
    from tokenizers import Tokenizer

    from rollout_lib.study import bpe_tokenizer

    manifest, arch = load_manifest(TINY_CORPUS), get_architecture("tiny")
    first = bpe_tokenizer.padded_tokenizer_json(manifest, 512, arch)
    bpe_tokenizer.train_tokenizer_json.cache_clear()
    second = bpe_tokenizer.padded_tokenizer_json(manifest, 512, arch)
    assert first == second
    other = subprocess.run([sys.executable, "-c", PADDED_SHA_SNIPPET], capture_output=True, text=True, cwd=REPO,
                           check=True).stdout.strip()
    assert other == sha256_bytes(first)
    padded = Tokenizer.from_str(first.decode())
    assert padded.get_vocab_size(with_added_tokens=True) == arch.vocab_size == 1024
    assert padded.id_to_token(arch.eos_token_id) == "<|im_end|>" and padded.id_to_token(700) == "<|pad_700|>"


def test_the_qwen3_shape_tokenizer_is_padded_to_151936_and_loads_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    from rollout_lib.study.bpe_tokenizer import padded_tokenizer_json, tokenizer_config

    arch = get_architecture("qwen3-0.6b")
    (tmp_path / "tokenizer.json").write_bytes(padded_tokenizer_json(load_manifest(FULL_CORPUS), 32768, arch))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(arch, 32768)))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True, trust_remote_code=False)
    assert len(tokenizer) == 151936 and tokenizer.eos_token_id == arch.eos_token_id == 151645
    assert tokenizer.convert_ids_to_tokens([151643, 40000, 151935]) == ["<|endoftext|>", "<|pad_40000|>",
                                                                         "<|extra_292|>"]
    ids = tokenizer("def f(x):\n    return x + 1\n", add_special_tokens=False)["input_ids"]
    assert max(ids) < 32768 and tokenizer.decode(ids) == "def f(x):\n    return x + 1\n"


def test_padding_ids_are_never_produced_and_text_round_trips():
    from tokenizers import Tokenizer

    from rollout_lib.study.bpe_tokenizer import encode_split, padded_tokenizer_json, trained_tokenizer

    manifest, arch = load_manifest(TINY_CORPUS), get_architecture("tiny")
    padded = Tokenizer.from_str(padded_tokenizer_json(manifest, 512, arch).decode())
    trained = trained_tokenizer(manifest, 512)
    texts = dict(read_split(manifest, "heldout"))
    for path, ids in encode_split(manifest, 512, "heldout"):
        assert max(ids) < 512
        assert padded.encode(texts[path], add_special_tokens=False).ids == list(ids)
        assert trained.decode(list(ids)) == texts[path]


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------

def test_tiny_training_is_deterministic_and_matches_the_profile_pin(trained_actor, tmp_path):
    out, record = trained_actor
    again = tmp_path / "again"
    result = rollout("models", "train", "--arch", "tiny", "--role", "actor", "--out", str(again),
                     "--expect", str(out / "rollout_trained.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == record["payload_digest"]
    assert "payload digest identical" in result.stderr
    second = json.loads((again / "rollout_trained.json").read_text())
    assert {k: v for k, v in second.items() if k not in TIMING_KEYS} == \
           {k: v for k, v in record.items() if k not in TIMING_KEYS}
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    expected, source = expected_build()
    assert record["payload_digest"] == expected, (
        f"a CPU rebuild ({cpu_family()}) gives {record['payload_digest']}, not {source} {expected}: a recipe change, "
        "or a CPU family not yet recorded (then add its repeatable digest to CPU_FAMILY_BUILDS)")


def test_the_faster_kernels_train_deterministically_and_the_record_names_them(trained_actor, tmp_path):
    from rollout_lib.models.train_standin import TrainKernels, plan_training, train_standin

    fast = TrainKernels(attention="sdpa", loss="chunked", optimizer="fused", fill_uninitialized=False)
    first = train_standin(plan_training("tiny", role="actor", kernels=fast), tmp_path / "a")
    second = train_standin(plan_training("tiny", role="actor", kernels=fast), tmp_path / "b")
    assert first["payload_digest"] == second["payload_digest"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first["payload_digest"] != trained_actor[1]["payload_digest"], "other kernels, other rounding"
    assert first["kernels"] == {"attention": "sdpa", "loss": "chunked", "optimizer": "fused",
                                "fill_uninitialized": False, "step": "eager", "sdpa_backend": "flash_attention",
                                "loss_chunk_tokens": 1024, "graph_warmup_steps": None}
    assert first["deterministic"]["warn_only"] is False and first["deterministic"]["fill_uninitialized_memory"] is False
    assert trained_actor[1]["deterministic"]["warn_only"] is True
    # a faster kernel is no excuse for a worse model: the same recipe reaches about the same held-out loss
    reference_loss = trained_actor[1]["final_metrics"]["heldout_loss_nats"]
    assert abs(first["final_metrics"]["heldout_loss_nats"] - reference_loss) < 0.1


def test_no_nan_fill_changes_no_result_and_the_settings_are_restored(trained_actor, tmp_path):
    import torch

    from rollout_lib.models.train_standin import TrainKernels, plan_training, train_standin

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    record = train_standin(plan_training("tiny", role="actor", kernels=TrainKernels(fill_uninitialized=False)),
                           tmp_path / "nofill")
    assert record["payload_digest"] == trained_actor[1]["payload_digest"]
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory) == before


def test_the_sdpa_choice_makes_a_nondeterministic_op_raise_instead_of_warning():
    import torch

    from rollout_lib.models.train_standin import TrainKernels, deterministic_kernels

    target = torch.zeros(4)
    with deterministic_kernels("cpu", TrainKernels()), pytest.warns(UserWarning, match="deterministic"):
        target.put_(torch.tensor([1]), torch.tensor([2.0]))  # the reference warns (and records the warning)
    with deterministic_kernels("cpu", TrainKernels(attention="sdpa")), \
            pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        target.put_(torch.tensor([1]), torch.tensor([2.0]))


def test_the_chunked_loss_is_the_full_loss_summed_in_another_order():
    import torch

    from rollout_lib.models.train_standin import chunked_cross_entropy

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)  # float32, as the loss computes
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=generator)
    full = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
    full_grads = torch.autograd.grad(full, (hidden, weight))
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=8)  # 5 chunks, the last of 5 tokens
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    assert torch.allclose(chunked, full, rtol=0, atol=1e-5)  # one token's share of the mean is ~0.1
    for got, want in zip(chunked_grads, full_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_bad_kernels_are_refused_by_name_before_any_work(tmp_path):
    from rollout_lib.models.train_standin import TrainError, TrainKernels, plan_training

    with pytest.raises(TrainError, match=r"^loss: 'tiled'; allowed: full, chunked$"):
        plan_training("tiny", kernels=TrainKernels(loss="tiled"))
    with pytest.raises(TrainError, match=r"^step: 'graph' captures a CUDA graph, not on device 'cpu'"):
        plan_training("tiny", kernels=TrainKernels(attention="sdpa", step="graph"))
    result = rollout("models", "train", "--arch", "tiny", "--out", str(tmp_path / "x"), "--optimizer", "adam8bit")
    assert result.returncode == 2 and "argument --optimizer: invalid choice: 'adam8bit'" in result.stderr
    assert "'foreach', 'fused'" in result.stderr and not (tmp_path / "x").exists()
    result = rollout("models", "train", "--arch", "tiny", "--out", str(tmp_path / "x"), "--kernels", "turbo")
    assert result.returncode == 2 and "argument --kernels: invalid choice: 'turbo'" in result.stderr
    assert "'reference', 'fast'" in result.stderr and not (tmp_path / "x").exists()


def test_a_named_kernel_set_is_what_trains_and_a_flag_overrides_its_part(tmp_path):
    """`--kernels fast` is sdpa + fused AdamW + no NaN fill (the profile's fastest deterministic set); a kernel flag
    given beside it replaces that part only; the record names what trained."""
    out = tmp_path / "fast"
    result = rollout("models", "train", "--arch", "tiny", "--steps", "2", "--kernels", "fast", "--optimizer",
                     "foreach", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "kernels fast: attention sdpa, loss full, optimizer foreach, fill-uninitialized off" in result.stderr
    kernels = json.loads((out / "rollout_trained.json").read_text())["kernels"]
    assert (kernels["attention"], kernels["optimizer"], kernels["fill_uninitialized"], kernels["loss"]) == (
        "sdpa", "foreach", False, "full")


def test_the_snapshot_is_a_normal_hf_snapshot_with_the_record(trained_actor):
    from rollout_lib.models.synthetic import payload_digest

    out, record = trained_actor
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "rollout_trained.json", "tokenizer.json", "tokenizer_config.json"]
    assert payload_digest(out) == record["payload_digest"]
    assert record["payload_digest"] != record["init_payload_digest_logit_scale_1"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1024
    assert sha256_bytes((out / "tokenizer.json").read_bytes()) == record["tokenizer_json_sha256"]


def test_held_out_loss_goes_down_and_entropy_ends_below_the_random_init(trained_actor):
    _, record = trained_actor
    curve = [point["heldout_loss_nats"] for point in record["heldout_loss_curve"]]
    assert record["heldout_loss_curve"][0]["step"] == 0 and len(curve) == 7  # 240 steps, every 40
    assert curve[-1] < curve[0] - 1.5, curve  # ln(1024) = 6.93 at init
    assert all(b < a for a, b in itertools.pairwise(curve)), curve
    init, final = record["init_metrics"], record["final_metrics"]
    assert final["mean_entropy_nats"] < init["mean_entropy_nats"] - 1.5, (init, final)
    assert final["mean_top1_probability"] > init["mean_top1_probability"]
    counts = final["top1_probability_histogram"]["counts"]
    assert sum(counts) == final["positions"] == 16 * 64 and len(counts) == 20
    assert abs(record["fingerprint"]["heldout_loss_nats"] - final["heldout_loss_nats"]) == 0
    assert len(record["fingerprint"]["positions"]) == 64


def test_the_fingerprint_check_fails_beyond_tolerance(trained_actor):
    from rollout_lib.models.train_standin import fingerprint_mismatches

    _, record = trained_actor
    assert fingerprint_mismatches(record, record) == []
    shifted = json.loads(json.dumps(record))
    shifted["fingerprint"]["heldout_loss_nats"] += 0.01
    assert any("heldout_loss_nats" in p for p in fingerprint_mismatches(record, shifted))
    nudged = json.loads(json.dumps(record))
    nudged["fingerprint"]["positions"][5]["top_logits"][2] += 0.2
    assert any("logit of id" in p for p in fingerprint_mismatches(record, nudged))
    within = json.loads(json.dumps(record))
    within["fingerprint"]["positions"][5]["top_logits"][2] += 0.01
    assert fingerprint_mismatches(record, within) == []


# ------------------------------------------------------------------------------------------
# real prompts
# ------------------------------------------------------------------------------------------

def test_real_prompts_are_deterministic_held_out_sequences_of_the_cell_lengths():
    from rollout_lib.study import real_prompts
    from rollout_lib.study.bpe_tokenizer import encode_split
    from rollout_lib.study.prereg import load
    from rollout_lib.study.workload import Workload

    study = load(PROFILE)
    work = Workload(study)
    first = {(i, n): work.prompt(i, n) for i in range(4) for n in (16, 48)}
    real_prompts.heldout_window.cache_clear()
    assert {(i, n): Workload(load(PROFILE)).prompt(i, n) for i in range(4) for n in (16, 48)} == first
    files = [ids for _, ids in encode_split(load_manifest(TINY_CORPUS), 512, "heldout")]
    for i in range(4):
        long, short = first[(i, 48)], first[(i, 16)]
        assert len(long) == 48 and len(short) == 16 and long[:16] == short
        assert max(long) < 512 < study.actor.architecture.first_special_id
        assert any(_contains(ids, long) for ids in files), f"prompt {i} is not a held-out token sequence"
    assert len({first[(i, 48)] for i in range(4)}) == 4
    seeded = Workload(load(REPO / "params" / "profiles" / "smoke.yaml"))
    assert seeded.prompt(0, 48) != first[(0, 48)]


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_the_draft_pins_the_fast_stand_ins_built_on_the_gpu_keeps_the_v2_cells_and_refuses_a_placeholder():
    from rollout_lib.study.prereg import PreregistrationError, load, loads
    from rollout_lib.study.workload import Workload

    filled = load(DRAFT)
    # the pinned digests are the ones the first fast-kernel build recorded (its records are the evidence)
    records = {name: json.loads((REPO / "outputs" / "perf" / "standins-v3-fast" / f"{name}.json").read_text())
               for name in ("qwen3-0.6b-actor", "qwen3-1.7b-teacher")}
    assert filled.actor.payload_digest == records["qwen3-0.6b-actor"]["payload_digest"]
    assert filled.teacher.payload_digest == records["qwen3-1.7b-teacher"]["payload_digest"]
    assert all(r["kernels"]["attention"] == "sdpa" and r["kernels"]["optimizer"] == "fused" for r in records.values())
    # and a second fresh GPU machine rebuilt both to the same payload digests (issue 42: bit for bit)
    for name, first in records.items():
        second = json.loads((REPO / "outputs" / "perf" / "standins-v3-fast-second-machine" / f"{name}.json")
                            .read_text())
        assert second["payload_digest"] == first["payload_digest"]
        assert second["kernels"] == first["kernels"] and second["recipe"] == first["recipe"]
        assert second["environment"]["gpu"] == first["environment"]["gpu"] == "NVIDIA H200"
        assert second["train_wall_s"] != first["train_wall_s"]  # another run, not a copy of the first record
    text = DRAFT.read_text()
    unfilled = text.replace(filled.actor.payload_digest, "TO-BE-FILLED-actor-digest-from-tools/lab/train_standins.sh")
    with pytest.raises(PreregistrationError, match=r"actor\.payload_digest: 'TO-BE-FILLED"):
        loads(unfilled)
    v2 = load(V2)
    assert Workload(filled).cell_ids() == Workload(v2).cell_ids()
    work = Workload(filled)  # the full corpus has held-out files long enough for 512-token prompts
    for i in range(4):
        long = work.prompt(i, 512)
        assert len(long) == 512 and long[:128] == work.prompt(i, 128) and max(long) < 32768
        assert long != Workload(v2).prompt(i, 512)
    assert (filled.actor.source, filled.teacher.source) == ("snapshot", "snapshot")
    assert filled.workload.prompt_source.bpe_vocab_size == 32768 and v2.workload.prompt_source is None
    assert filled.actor.logit_scale is None and filled.gates == v2.gates


# ------------------------------------------------------------------------------------------
# end to end: train tiny -> snapshot -> real prompts -> rollout measure (hf_cached, one cell, CPU)
# ------------------------------------------------------------------------------------------

def test_the_trained_tiny_profile_measures_end_to_end(trained_actor, tmp_path):
    out, record = trained_actor
    project = tmp_path / "project"
    (project / "params" / "profiles").mkdir(parents=True)
    shutil.copytree(REPO / "params" / "corpora", project / "params" / "corpora")
    profile = PROFILE.read_text()
    pinned = yaml.safe_load(profile)["actor"]["payload_digest"]
    if record["payload_digest"] != pinned:  # this CPU family's build (the pin test checks it) pinned in the copy
        profile = profile.replace(pinned, record["payload_digest"])
    (project / "params" / "profiles" / "smoke-trained.yaml").write_text(profile)
    shutil.copytree(out, project / ".cache" / "standins" / "tiny-actor")  # where the profile points
    result = rollout("measure", "--direct", "--backend", "hf_cached", "--params",
                     "params/profiles/smoke-trained.yaml", "--campaign", "smoke-trained", "--cells",
                     "p48-r8-n1-greedy", "--device", "cpu", "--output-dir", "outputs", cwd=project)
    assert result.returncode == 0, result.stderr[-2000:]
    cell = json.loads(result.stdout.strip().splitlines()[-1])
    assert cell["cell_id"] == "p48-r8-n1-greedy" and cell["status"] == "completed" and cell["valid_reps"] == 3
    raw = next((project / "outputs" / "raw" / "smoke-trained" / "hf_cached").glob("*.jsonl"))
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    header = records[0]
    assert record["payload_digest"] in json.dumps(header["measurement_identity"])
    reps = [r for r in records if r.get("record") == "repetition"]
    assert reps and all(q["prompt_tokens"] == 48 and q["generated_tokens"] == 8 for r in reps for q in r["requests"])


def test_the_draft_is_filled_with_both_digests_and_copied_beside_the_records(tmp_path, monkeypatch):
    """tools/lab/fill_standin_draft.py: both digests replace their placeholders or an earlier build's pinned ones;
    the filled draft is written where it loads (the drafts folder) and beside the records, where the report's ladder
    labels the trained rows by it; a missing record or a missing digest line writes nothing."""
    from rollout_lib.study.prereg import load
    from tools.lab import fill_standin_draft

    drafts = tmp_path / "drafts"
    drafts.mkdir()
    draft = drafts / DRAFT.name
    pinned = load(DRAFT)
    # an unfilled draft (placeholders) and a pinned one (an earlier build's digests) are both filled
    draft.write_text(DRAFT.read_text().replace(pinned.actor.payload_digest, "TO-BE-FILLED-actor-digest"))
    monkeypatch.setattr(fill_standin_draft, "DRAFT", draft)
    records = tmp_path / "standins-second-machine"
    records.mkdir()
    (records / "qwen3-0.6b-actor.json").write_text(json.dumps({"payload_digest": "a" * 64}))
    out = drafts / "rollout-runtime-v3-trained.ladder.yaml"
    assert fill_standin_draft.main(str(records), str(out)) == 2 and not out.exists()  # the teacher's is missing
    (records / "qwen3-1.7b-teacher.json").write_text(json.dumps({"payload_digest": "b" * 64}))
    assert fill_standin_draft.main(str(records), str(out)) == 0
    filled = out.read_text()
    assert "a" * 64 in filled and "b" * 64 in filled and "TO-BE-FILLED" not in filled
    assert pinned.teacher.payload_digest not in filled
    assert (records / out.name).read_text() == filled
    draft.write_text(filled)  # refilling a filled draft pins the new build's digests
    (records / "qwen3-0.6b-actor.json").write_text(json.dumps({"payload_digest": "c" * 64}))
    assert fill_standin_draft.main(str(records), str(out)) == 0
    refilled = out.read_text()
    assert "c" * 64 in refilled and "a" * 64 not in refilled and "b" * 64 in refilled
    draft.write_text(filled.replace("  payload_digest: " + "b" * 64 + "\n", ""))  # the teacher's line is gone
    assert fill_standin_draft.main(str(records), str(out)) == 2 and out.read_text() == refilled
