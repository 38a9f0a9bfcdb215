"""The fused-mirror training path (issue 41) against the reference trainer, on CPU with the tiny smoke
actor in float32: the same per-token log-probabilities (teacher and actor), the same loss and LoRA
gradients, the same policy after k optimizer steps (hence the same sampled tokens), micro-batches that
change nothing, and a cycle run that records which path it measured."""

from __future__ import annotations

import pytest
import torch

from rollout_lib.core import REPO_ROOT
from rollout_lib.measure.cycle import run_cycles
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.models.actor import add_lora, load_nf4_base
from rollout_lib.models.fast_training import (
    FastActorTrainer,
    batched_logprobs,
    micro_batches,
    resolve_logprob_kernel,
    score_rows,
)
from rollout_lib.models.local_snapshot import resolve_model_snapshot
from rollout_lib.models.policy import load_policy_into_peft, read_policy_from_peft
from rollout_lib.models.synthetic import ensure_snapshot, load_causal_lm
from rollout_lib.models.training import ActorTrainer, TrainedPolicy, lora_parameters, pg_k1_loss, token_logprobs
from rollout_lib.study.cycle import TrainingSpec, load, loads

from .conftest import oracle_rollout

SMOKE_CYCLE = REPO_ROOT / "params" / "profiles" / "smoke-cycle.yaml"
FAST = TrainingSpec(path="fused_mirror", max_tokens_per_micro_batch=16384, gradient_checkpointing=False,
                    logprob_kernel="torch_chunked")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    study = load(SMOKE_CYCLE)
    rollout = study.rollout
    cache = str(tmp_path_factory.mktemp("fast-snapshots"))
    backend, workload, start, requests, batch, rows = oracle_rollout(rollout, cache, "p48-r24-n2-stochastic")
    rows[1] = (rows[1][0], rows[1][1][:7])  # rows of different lengths: padding is exercised
    snapshot = resolve_model_snapshot(rollout.actor, cache_dir=cache, study_path=rollout.source_path)
    teacher_spec = rollout.teacher
    teacher_snapshot = ensure_snapshot(teacher_spec.architecture.name, teacher_spec.synthetic_seed,
                                       teacher_spec.logit_scale, expected_digest=teacher_spec.payload_digest,
                                       cache_dir=cache)
    from rollout_lib.models.actor import use_float32_lm_head

    teacher = load_causal_lm(teacher_snapshot.path, torch.float32, "cpu")
    use_float32_lm_head(teacher)
    yield {"study": study, "rollout": rollout, "backend": backend, "rows": rows, "start": start,
           "snapshot": str(snapshot.path), "teacher": teacher, "pad": workload.arch.bos_token_id,
           "teacher_snapshot": str(teacher_snapshot.path),
           "requests": requests, "rollout_lp": [torch.tensor(res.logprobs) for res in batch.results]}
    backend.teardown()


def _actor(setup):
    """A fresh NF4 + LoRA actor (float32 compute, CPU) holding the start policy."""
    spec = setup["rollout"].actor
    actor = add_lora(load_nf4_base(setup["snapshot"], spec.quantization, torch.float32, "cpu"), spec.lora)
    load_policy_into_peft(actor, setup["start"])
    return actor


def _fast(setup, actor, training=FAST):
    return FastActorTrainer(actor, setup["study"].optimizer, setup["snapshot"], training, torch.float32, "cpu")


def _loss(setup, tokens):
    def loss_for(indices, logprobs):
        return pg_k1_loss(logprobs, [setup["rollout_lp"][i][:len(logprobs[k])] for k, i in enumerate(indices)],
                          [0.5 - i % 3 for i in indices], 0.05, tokens)
    return loss_for


def test_the_mirror_shares_the_actors_lora_parameters_and_frozen_tensors(setup):
    actor = _actor(setup)
    trainer = _fast(setup, actor)
    mirror_lora = {id(p) for n, p in trainer.mirror.named_parameters() if "lora_" in n}
    assert mirror_lora == {id(p) for p in lora_parameters(actor)}
    embed = trainer.decoder.embed_tokens.weight
    assert embed is actor.get_base_model().model.embed_tokens.weight
    assert not any(p.requires_grad for n, p in trainer.mirror.named_parameters() if "lora_" not in n)


def test_scoring_on_the_fast_path_equals_the_reference_in_float32(setup):
    rows, pad = setup["rows"], setup["pad"]
    actor = _actor(setup)
    trainer = _fast(setup, actor)
    reference = token_logprobs(actor, rows, "cpu", pad, 2)
    fast = trainer.score(rows, "cpu", pad)
    teacher_reference = token_logprobs(setup["teacher"], rows, "cpu", pad, 2)
    teacher_fast = score_rows(setup["teacher"], rows, "cpu", pad, 16384, "torch_chunked")
    for got, expected in [*zip(fast, reference, strict=True), *zip(teacher_fast, teacher_reference, strict=True)]:
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert float((got - expected).abs().max()) <= 1e-5
    assert any(float((a - t).abs().max()) > 1e-3 for a, t in zip(fast, teacher_fast, strict=True)), \
        "actor and teacher differ: the comparison can fail"


def _gradients(setup, actor, compute):
    params = lora_parameters(actor)
    for param in params:
        param.requires_grad_(True)
        param.grad = None
    loss = compute()
    return float(loss), [p.grad.detach().clone() for p in params]


def test_loss_and_lora_gradients_match_the_reference_in_float32(setup):
    rows, pad = setup["rows"], setup["pad"]
    tokens = sum(len(r) for _, r in rows)
    loss_for = _loss(setup, tokens)
    actor = _actor(setup)

    def reference():
        total = []

        def on_micro_batch(indices, logprobs):
            loss = loss_for(indices, logprobs)
            total.append(loss.detach())
            return loss
        token_logprobs(actor, rows, "cpu", pad, 2, grad=True, on_micro_batch=on_micro_batch)
        return sum(total)

    ref_loss, ref_grads = _gradients(setup, actor, reference)
    trainer = _fast(setup, actor)

    def fast():
        group = list(range(len(rows)))
        loss = loss_for(group, batched_logprobs(trainer.decoder, trainer.head, rows, group, pad, "cpu",
                                                "torch_chunked"))
        loss.backward()
        return loss.detach()

    fast_loss, fast_grads = _gradients(setup, actor, fast)
    assert fast_loss == pytest.approx(ref_loss, abs=1e-5)
    flat_ref, flat_fast = torch.cat([g.flatten() for g in ref_grads]), torch.cat([g.flatten() for g in fast_grads])
    assert float(flat_ref.norm()) > 0
    cosine = float(torch.nn.functional.cosine_similarity(flat_ref, flat_fast, dim=0))
    relative = abs(float(flat_fast.norm()) - float(flat_ref.norm())) / float(flat_ref.norm())
    assert cosine >= 0.999 and relative <= 1e-3, (cosine, relative)


def test_micro_batches_follow_the_token_budget_and_change_nothing(setup):
    rows, pad = setup["rows"], setup["pad"]
    widths = [len(p) + len(r) for p, r in rows]
    assert micro_batches(rows, 10**6) == [list(range(len(rows)))]
    small = micro_batches(rows, 2 * max(widths))
    assert [i for g in small for i in g] == list(range(len(rows))) and all(len(g) <= 2 for g in small)
    assert micro_batches(rows, 1) == [[i] for i in range(len(rows))]  # a row over budget is its own group
    actor = _actor(setup)
    one = _fast(setup, actor).score(rows, "cpu", pad)
    several = _fast(setup, actor, TrainingSpec(path="fused_mirror", max_tokens_per_micro_batch=2 * max(widths),
                                               logprob_kernel="torch_chunked")).score(rows, "cpu", pad)
    for a, b in zip(one, several, strict=True):
        assert float((a - b).abs().max()) <= 1e-5


def test_k_steps_on_each_path_give_the_same_policy_and_the_same_sampled_tokens(setup):
    rows, pad = setup["rows"], setup["pad"]
    tokens = sum(len(r) for _, r in rows)
    loss_for = _loss(setup, tokens)
    reference_actor, fast_actor = _actor(setup), _actor(setup)
    reference = ActorTrainer(reference_actor, setup["study"].optimizer)
    fast = _fast(setup, fast_actor, TrainingSpec(path="fused_mirror", gradient_checkpointing=True,
                                                 logprob_kernel="torch_chunked"))
    for _ in range(3):
        ref_step = reference.step(loss_for, rows, "cpu", pad)
        fast_step = fast.step(loss_for, rows, "cpu", pad)
        assert fast_step["loss"] == pytest.approx(ref_step["loss"], abs=1e-5)
        assert fast_step["grad_norm"] == pytest.approx(ref_step["grad_norm"], rel=1e-3)
    start = setup["start"]
    policies = [TrainedPolicy(version=3, base_digest=start.base_digest, arch=start.arch, lora=start.lora,
                              live=read_policy_from_peft(actor)) for actor in (reference_actor, fast_actor)]
    assert policies[0].identity != start.identity, "three steps moved the policy"
    worst = max(float((policies[1].live[name] - tensor).abs().max()) for name, tensor in policies[0].live.items())
    moved = max(float((tensor - start.tensors[name]).abs().max()) for name, tensor in policies[0].live.items())
    assert worst <= 1e-3 * moved, (worst, moved)
    backend = setup["backend"]
    sampled = []
    for policy in policies:
        backend.sync_policy(policy)
        sampled.append([tuple(r.token_ids) for r in backend.generate(setup["requests"]).results])
    backend.sync_policy(start)
    assert sampled[0] == sampled[1]


def test_the_logprob_kernel_is_named_and_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="allowed: liger, torch_chunked"):
        resolve_logprob_kernel("triton", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"logprob_kernel liger: .*CUDA"):
        resolve_logprob_kernel("liger", torch.device("cpu"))
    assert resolve_logprob_kernel("torch_chunked", torch.device("cpu")) == "torch_chunked"


def test_a_cycle_study_names_its_training_path_and_a_run_records_it(setup, tmp_path):
    text = SMOKE_CYCLE.read_text()
    study = loads(text + "\ntraining:\n  path: fused_mirror\n  logprob_kernel: torch_chunked\n",
                  str(SMOKE_CYCLE))
    assert study.training.path == "fused_mirror" and study.training.gradient_checkpointing is False
    assert load(SMOKE_CYCLE).training.path == "reference", "a study without the section keeps the reference"
    with pytest.raises(Exception, match=r"training\.path"):
        loads(text + "\ntraining:\n  path: fastest\n", str(SMOKE_CYCLE))
    cache = str(tmp_path / "cache")
    path = run_cycles(study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "fast", run_id="t1",
                      output_dir=tmp_path, device="cpu", cache_dir=cache, cycles=2)
    records, torn = read_raw(path)
    assert not torn and [r["record"] for r in records][-1] == "teardown"
    assert records[0]["training_memory"]["path"] == "fused_mirror"
    cycles = [r for r in records if r["record"] == "cycle"]
    assert len(cycles) == 2 and all(c["sync_exact"] for c in cycles)
    assert cycles[1]["policy_identity"] == cycles[0]["next_policy_identity"]


def test_bf16_operand_logprobs_equal_the_float32_head_forward_and_backward():
    """The bf16_operands kernel's arithmetic (float32 sums of exact bf16 products; on CPU the float32
    matmul of the upcasts), chunked at 512 tokens, against autograd through the float32 head: the
    log-probabilities and the per-token backward into bf16 hidden states."""
    from rollout_lib.models.fast_training import Head, fused_logprobs

    generator = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 700, 32, 300
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.3).bfloat16()
    hidden = torch.randn(tokens, hidden_size, generator=generator).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)
    fused_input = hidden.clone().requires_grad_(True)
    fused = fused_logprobs(fused_input, Head(weight.float(), weight), targets, "bf16_operands")
    (fused * upstream).sum().backward()
    reference_input = hidden.clone().requires_grad_(True)
    logits = torch.nn.functional.linear(reference_input.float(), weight.float())
    reference = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream).sum().backward()
    assert fused.dtype == torch.float32 and float((fused - reference).abs().max()) <= 1e-5
    assert fused_input.grad.dtype == torch.bfloat16
    assert torch.allclose(fused_input.grad.float(), reference_input.grad.float(), rtol=8e-3, atol=1e-6)
    with pytest.raises(ValueError, match="not bfloat16"):
        fused_logprobs(hidden.float(), Head(weight.float(), weight), targets, "bf16_operands")


def test_a_float32_trainer_refuses_the_bf16_operand_head_before_building_its_mirror(setup):
    with pytest.raises(ValueError, match=r"compute dtype is torch\.float32, not bfloat16"):
        _fast(setup, _actor(setup), TrainingSpec(path="fused_mirror", logprob_kernel="bf16_operands"))


def test_float32_head_copies_false_needs_the_bf16_operand_kernel_and_is_named_when_refused():
    text = SMOKE_CYCLE.read_text()
    with pytest.raises(Exception, match=r"training\.float32_head_copies: false needs .*bf16_operands"):
        loads(text + "\ntraining:\n  path: fused_mirror\n  logprob_kernel: liger\n  float32_head_copies: false\n",
              str(SMOKE_CYCLE))
    study = loads(text + "\ntraining:\n  path: fused_mirror\n  logprob_kernel: bf16_operands\n"
                  "  float32_head_copies: false\n", str(SMOKE_CYCLE))
    assert study.training.float32_head_copies is False


def test_the_bf16_operand_head_adds_no_bytes_and_scores_as_the_float32_copy(setup):
    """A bf16 model whose head is its tied embedding (no float32 copy) gives the fused path the same
    operands, hence the same log-probabilities bit for bit, as the same model with the float32 copy, and
    holds vocab x hidden x 4 bytes less; its forward gives the float32 head's logits."""
    from rollout_lib.models.actor import use_bf16_operand_head, use_float32_lm_head
    from rollout_lib.models.fast_training import model_head

    def param_bytes(model):
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())

    with_copy = load_causal_lm(setup["teacher_snapshot"], torch.bfloat16, "cpu")
    use_float32_lm_head(with_copy)
    shared = load_causal_lm(setup["teacher_snapshot"], torch.bfloat16, "cpu")
    use_bf16_operand_head(shared)
    embedding = shared.get_input_embeddings().weight
    assert shared.get_output_embeddings().weight is embedding, "the head is the embedding's own Parameter"
    assert param_bytes(with_copy) - param_bytes(shared) == embedding.numel() * 4
    rows, pad = setup["rows"], setup["pad"]
    expected = score_rows(with_copy, rows, "cpu", pad, 16384, "bf16_operands")
    got = score_rows(shared, rows, "cpu", pad, 16384, "bf16_operands")
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    ids = torch.tensor([list(rows[0][0]) + list(rows[0][1])])
    with torch.no_grad():
        logits_copy, logits_shared = with_copy(input_ids=ids).logits, shared(input_ids=ids).logits
    assert logits_shared.dtype == torch.float32
    assert float((logits_copy - logits_shared).abs().max()) <= 1e-5 * float(logits_copy.abs().max())
    with pytest.raises(ValueError, match=r"bf16-operand head .*allowed: bf16_operands"):
        model_head(shared, "torch_chunked")
    with pytest.raises(ValueError, match=r"embedding is torch\.float32, not bfloat16"):
        use_bf16_operand_head(load_causal_lm(setup["teacher_snapshot"], torch.float32, "cpu"))
    with pytest.raises(ValueError, match="not its tied input embedding"):
        use_bf16_operand_head(with_copy)


def test_without_float32_head_copies_the_memory_plan_drops_exactly_the_copies():
    from rollout_lib.measure.cycle import memory_plan

    keep = load(REPO_ROOT / "params" / "rollout-runtime-v2-cycle-fast-bf16-head.yaml")
    drop = load(REPO_ROOT / "params" / "rollout-runtime-v2-cycle-fast-shared-head.yaml")
    assert keep.training.float32_head_copies and not drop.training.float32_head_copies
    vocab, actor_hidden, teacher_hidden = 151936, 1024, 2048
    for backend, saved in (("hf_cached", vocab * teacher_hidden * 4),  # hf_cached's actor is its backend's
                           ("vllm", vocab * (teacher_hidden + actor_hidden) * 4)):
        cell = "p512-r512-n4-stochastic"
        assert sum(memory_plan(keep, backend, cell).values()) - sum(memory_plan(drop, backend, cell).values()) \
            == saved
