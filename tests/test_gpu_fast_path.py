"""hf_cached fast path on the GPU (the synthetic Qwen3-0.6B actor): CUDA graphs vs the eager path,
policy sync without recapture, sampling determinism, noise bits equal on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

from rollout_lib.backends import counter_noise, create_backend
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part2]  # docs/reliability.md: GPU suite parts

CELL = "p128-r64-n1-greedy"


def test_noise_bits_equal_on_cpu_and_cuda():
    seeds = torch.tensor([1101, 2101, 3101, 4101])
    cpu = counter_noise.uniform(seeds, 17, 151936)
    gpu = counter_noise.uniform(seeds.cuda(), torch.tensor(17, device="cuda"), 151936).cpu()
    assert torch.equal(cpu, gpu)


def test_bf16_operand_head_is_the_float32_head_in_another_order():
    """The LM head on bf16 operands with float32 accumulation and output (cuBLAS `out_dtype`) against
    the float32 GEMM of the same, exactly upcast values: both as close to the float64 sum, same argmax."""
    from rollout_lib.backends.compact_qwen3 import (
        HEAD_BF16_OPERANDS,
        _cuda_bf16_gemm_with_float32_output,
        head_operands,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(151936, 1024, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    hidden = torch.randn(16, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    assert _cuda_bf16_gemm_with_float32_output(weight.device)
    # as the mirror holds it: a float32 copy of the tied bf16 embedding -> the embedding is the operand
    mode, operands = head_operands(weight.float(), weight, torch.bfloat16, True)
    assert mode == HEAD_BF16_OPERANDS and operands.data_ptr() == weight.data_ptr()
    fast = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    float32 = torch.nn.functional.linear(hidden.float(), weight.float())
    exact = torch.nn.functional.linear(hidden.double(), weight.double())
    fast_error = (fast.double() - exact).abs().max().item()
    float32_error = (float32.double() - exact).abs().max().item()
    assert fast.dtype == torch.float32 and fast_error <= 4 * float32_error + 1e-6, (fast_error, float32_error)
    assert torch.equal(fast.argmax(-1), float32.argmax(-1))


def test_a_gemm_split_over_k_reads_the_weight_in_place():
    """GEMM_SPLIT_K (issue 43 candidate) compiled by inductor on the H200, at o_proj's shape with the shrink rows
    (4 rows, 1,072 x 2,048): one batched GEMM over strided views of x and the weight (no copy of either: every
    kernel is the GEMM or inductor's one kernel that adds the 8 partial sums and rounds), and the result is
    `mm_float32`'s float32 sums in another order."""
    from rollout_lib.backends.compact_qwen3 import _split_k_product
    from rollout_lib.models.actor import mm_float32

    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn(1072, 2048, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(4, 1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    split = torch.compile(lambda x, weight: _split_k_product(x, weight, 8).to(torch.bfloat16), fullgraph=True)
    split(x, weight)  # compiled and launched once, outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = split(x, weight)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    others = [k for k in kernels if not any(g in k.lower() for g in ("gemm", "gemv", "nvjet", "cutlass", "xmma"))]
    assert len(others) == 1 and others[0].startswith("triton_"), kernels
    one = mm_float32(x.reshape(4, 2048), weight.t()).to(torch.bfloat16).reshape(4, 1, 1072)
    exact = x.double().reshape(4, 2048) @ weight.double().t()
    assert ((got.reshape(4, 1072).double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()
    assert ((one.reshape(4, 1072).double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()


def test_an_unrolled_lora_expand_compiles_to_pointwise_kernels_only():
    """LORA_EXPAND "unrolled" compiled by inductor on the GPU at gate_up's shape (16 rows, 6,144 outputs, rank 16,
    the shrink's float32 xa given): no reduction kernel (inductor names those triton_per_ / triton_red_), so no
    launch configuration is picked by benchmarking; the reduction form of the same term compiles to one."""
    from rollout_lib.backends.compact_qwen3 import _unrolled_expand

    gen = torch.Generator(device="cuda").manual_seed(2)
    xa = torch.randn(16, 1, 16, device="cuda", generator=gen)
    lora_b = torch.randn(6144, 16, device="cuda", generator=gen) * 0.01
    base = torch.randn(16, 1, 6144, device="cuda", generator=gen).to(torch.bfloat16)
    forms = {"unrolled": lambda xa, b, base: (base.float() + _unrolled_expand(xa, b) * 2.0).to(torch.bfloat16),
             "reductions": lambda xa, b, base: (base.float() + (xa[..., None, :] * b).sum(-1) * 2.0).to(torch.bfloat16)}
    kernels, results = {}, {}
    for name, form in forms.items():
        torch._dynamo.reset()
        compiled = torch.compile(form, fullgraph=True)
        compiled(xa, lora_b, base)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            results[name] = compiled(xa, lora_b, base)
            torch.cuda.synchronize()
        kernels[name] = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels["unrolled"] and all(k.startswith("triton_poi") for k in kernels["unrolled"]), kernels
    assert any(k.startswith(("triton_per", "triton_red")) for k in kernels["reductions"]), kernels
    exact = base.double() + 2.0 * (xa.double() @ lora_b.double().t())
    for got in results.values():
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()


@pytest.fixture(scope="module")
def study():
    from rollout_lib.study.prereg import load

    from .conftest import PREREG

    return load(PREREG)


def _run(study, decode, dtype, cells, versions=2):
    workload = Workload(study)
    policies = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, versions)
    backend = create_backend("hf_cached", study, compute_dtype=dtype, decode=decode)
    backend.cold_start()
    backend.sync_policy(policies[0])
    out = {c: backend.generate(workload.requests(workload.cell(c))).results for c in cells}
    return backend, policies, out


def _reference_margins(study, reference, results) -> list[list[float]]:
    """The reference engine's own top-1 minus top-2 logit at each of its greedy tokens (teacher-forced): where a
    candidate engine may part from it (checks.conformance.greedy_divergences_beyond_ties)."""
    workload = Workload(study)
    requests = workload.requests(workload.cell(results[0].request_id.split("/")[0]))
    return [reference.teacher_forced(r.prompt_token_ids, list(x.token_ids)).top1_minus_top2
            for r, x in zip(requests, results, strict=True)]


def _parts_only_at_near_ties(study, expected, got, margins) -> None:
    from rollout_lib.checks.conformance import greedy_divergences_beyond_ties

    tie = study.tolerances.bf16_teacher_forced_tie_margin_logits
    broken = greedy_divergences_beyond_ties(expected, got, margins, tie)
    same = sum(a.token_ids == b.token_ids for a, b in zip(expected, got, strict=True))
    assert not broken, f"{same} of {len(got)} greedy requests identical; beyond the near ties: " + "; ".join(broken)


def test_graphs_equal_eager_greedy_in_float32(study):
    cells = [CELL, "p512-r64-n4-greedy"]
    eager, _, a = _run(study, "eager", "float32", cells)
    eager.teardown()
    graphs, _, b = _run(study, "graphs", "float32", cells)
    assert graphs.environment()["cuda_graphs"] is True
    graphs.teardown()
    for cell in cells:
        for x, y in zip(a[cell], b[cell], strict=True):
            assert x.token_ids == y.token_ids and x.stop_reason == y.stop_reason


def test_sync_without_recapture_and_deterministic_sampling(study):
    from rollout_lib.backends.compact_qwen3 import HEAD_BF16_OPERANDS

    backend, policies, first = _run(study, "graphs", "bfloat16", ["p128-r64-n4-stochastic"], versions=3)
    # the measured engine takes the bf16-operand head (lease 5: it silently kept the float32 GEMM, because
    # the mirror's head is a float32 copy), over the embedding itself (no second copy of the weights)
    assert backend.environment()["lm_head"] == HEAD_BF16_OPERANDS
    assert backend.engine.lm_head.data_ptr() == backend.engine.embed.data_ptr()
    graphs = {key: bucket.graph for key, bucket in backend.buckets.buckets.items()}
    workload = Workload(study)
    requests = workload.requests(workload.cell("p128-r64-n4-stochastic"))
    again = backend.generate(requests).results
    assert [r.token_ids for r in again] == [r.token_ids for r in first["p128-r64-n4-stochastic"]]
    # the noise is a function of each request's seed and step, not of its row: the same batch reversed
    # (same bucket, same kernels) gives every request the same tokens. A batch of another size runs
    # other GEMM kernels, so in bf16 it is not bitwise comparable and is not asserted.
    reversed_ids = [r.token_ids for r in backend.generate(requests[::-1]).results]
    assert reversed_ids[::-1] == [r.token_ids for r in again]
    for policy in policies[1:]:
        assert backend.sync_policy(policy) == policy.identity
        assert {k: b.graph for k, b in backend.buckets.buckets.items() if k in graphs} == graphs
    backend.teardown()


def test_streamed_identity_on_cuda_equals_the_policy_identity(study):
    from rollout_lib.models.fast_identity import policy_identity_streamed

    workload = Workload(study)
    version = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 2)[-1]
    on_device = {name: t.cuda().t().contiguous().t() for name, t in version.tensors.items()}  # strided views
    staging = torch.empty(sum(t.numel() for t in on_device.values()), pin_memory=True)
    for chunk_bytes in (1 << 16, 4 << 20):
        timings = {}
        served = policy_identity_streamed(version.base_digest, on_device, staging, timings, chunk_bytes)
        assert served == version.identity
        assert set(timings) == {"gather_s", "wait_s", "hash_s"}


def test_lora_shrink_in_the_base_gemm_compiles_and_serves_the_policy(study, monkeypatch):
    """Issue 43 candidate on the H200: the compiled bf16 engine with LoRA A inside the base GEMM (inductor
    lowers mm with a float32 output) serves each policy exactly (identity, exact three-way split) and its
    greedy tokens stay those of today's engine but for near-ties."""
    from rollout_lib.backends import compact_qwen3

    cells = ["p128-r64-n4-greedy"]
    default, _, expected = _run(study, "graphs", "bfloat16", cells)
    margins = _reference_margins(study, default, expected[cells[0]])
    default.teardown()
    monkeypatch.setattr(compact_qwen3, "LORA_SHRINK", "in_base_gemm")
    backend, policies, got = _run(study, "graphs", "bfloat16", cells, versions=2)
    try:
        assert backend.environment()["lora_shrink"] == "in_base_gemm"
        assert backend.sync_policy(policies[1]) == policies[1].identity
        _parts_only_at_near_ties(study, expected[cells[0]], got[cells[0]], margins)
    finally:
        backend.teardown()


@pytest.mark.parametrize("settings", [{"LORA_EXPAND": "gemm"}, {"LORA_EXPAND": "unrolled"},
                                      {"AUTOTUNE_ROWS": "largest"}, {"ATTENTION_BACKEND": "efficient"},
                                      {"ATTENTION_BACKEND": "flex"}, {"ATTENTION_BACKEND": "fa3"},
                                      {"PREFILL": "shared_prompts"}, {"PREFILL_STEP": "compiled_graph"},
                                      {"PREFILL": "shared_prompts", "PREFILL_STEP": "compiled_graph"},
                                      {"STEP_PIECES": "across_layers"}, {"SAMPLER": "chunked"},
                                      {"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared"},
                                      {"STEP_EDGES": "compiled"}, {"STEP_EDGES": "compiled", "READBACK": "pipelined"},
                                      {"GEMM_SPLIT_K": "auto"}, {"GEMM_SPLIT_K": "8"}, {"COMBO_KERNELS": "on"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on"},
                                      {"LORA_EXPAND": "unrolled_parts"}, {"LORA_EXPAND": "triton"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "LORA_EXPAND": "triton"},
                                      # the engine tools/lab/pick_engine.py keeps after lease 31 (with the shrink)
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "PREFILL": "shared_prompts", "PREFILL_STEP": "compiled_graph"},
                                      # after lease 32 (appended: the queues name the ones above by index)
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "PREFILL": "shared_prompts", "PREFILL_STEP": "compiled_graph",
                                       "LORA_EXPAND": "unrolled_parts", "SAMPLER": "chunked"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "LORA_EXPAND": "unrolled_parts", "SAMPLER": "chunked",
                                       "ATTENTION_PLAN": "per_step"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "LORA_EXPAND": "unrolled_parts", "SAMPLER": "chunked",
                                       "GEMM_KERNEL": "triton_skinny"},
                                      # after lease 33: the LoRA expand reductions' launch without the draw
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs"},
                                      {"REDUCTION_LAUNCH": "fewest_programs"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs",
                                       "GATE_UP_EPILOGUE": "triton"},
                                      {"GATE_UP_EPILOGUE": "triton"},
                                      # after lease 34's build: the o GEMM's epilogue, alone and with gate_up's
                                      {"O_EPILOGUE": "triton"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton"},
                                      # the down GEMM's epilogue with the next layer's norm, alone and with the
                                      # other two (one hand-written kernel in each gap between GEMMs but qkv's)
                                      {"DOWN_EPILOGUE": "triton"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton",
                                       "DOWN_EPILOGUE": "triton"},
                                      # the qkv GEMM's epilogue (q, and k/v into their caches), alone and with all
                                      {"QKV_EPILOGUE": "triton"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton",
                                       "DOWN_EPILOGUE": "triton", "QKV_EPILOGUE": "triton"},
                                      # with split-K: the o and down epilogues add the GEMMs' partials
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fewest_programs",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton",
                                       "DOWN_EPILOGUE": "triton", "QKV_EPILOGUE": "triton", "GEMM_SPLIT_K": "auto"},
                                      # after lease 34: the rule that fills the SMs, alone and under all four
                                      # epilogues (their projections' B stored rank-major)
                                      {"REDUCTION_LAUNCH": "fill_multiprocessors"},
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fill_multiprocessors",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton",
                                       "DOWN_EPILOGUE": "triton", "QKV_EPILOGUE": "triton"},
                                      # after lease 38: the o/down kernel over slices of each row
                                      {"ATTENTION_BACKEND": "fa3", "READBACK": "pipelined", "COMBO_KERNELS": "on",
                                       "SAMPLER": "chunked", "REDUCTION_LAUNCH": "fill_multiprocessors",
                                       "GATE_UP_EPILOGUE": "triton", "O_EPILOGUE": "triton",
                                       "DOWN_EPILOGUE": "triton", "QKV_EPILOGUE": "triton",
                                       "NORM_EPILOGUE_ROW": "slices"}])
def test_next_decode_candidates_compile_and_keep_the_greedy_tokens(study, monkeypatch, settings):
    """Issue 43's next candidates on the H200, each on top of the shrink in the base GEMM: the LoRA B product
    as a float32 GEMM, SDPA's memory-efficient kernel for decode attention, compiled FlexAttention, vLLM's
    FlashAttention-3 decode kernel over the static cache, one prefill per distinct prompt (n = 4 rows share
    it), the prefill compiled and captured (with the shared prompts too), one compiled piece from each layer's
    attention to the next, the sampler's vocabulary reductions in chunks, FA3 with each block of 4 rows reading
    its shared prompt once (cascaded with the rows' own columns), the step's work outside its layers compiled
    (with the pipelined read-back too), each projection's GEMM split over K. The compiled bf16 engine serves the
    synced policy and its greedy tokens stay those
    of the shrink-only engine but for near-ties."""
    import importlib.util

    from rollout_lib.backends import compact_qwen3

    if settings.get("ATTENTION_BACKEND") == "fa3" and importlib.util.find_spec("vllm") is None:
        pytest.skip("ATTENTION_BACKEND fa3 reads vLLM's FlashAttention-3 kernels: vLLM is not installed here")
    cells = ["p128-r64-n4-greedy"]
    monkeypatch.setattr(compact_qwen3, "LORA_SHRINK", "in_base_gemm")
    reference, _, expected = _run(study, "graphs", "bfloat16", cells)
    margins = _reference_margins(study, reference, expected[cells[0]])
    reference.teardown()
    for name, value in settings.items():
        monkeypatch.setattr(compact_qwen3, name, value)
    backend, policies, got = _run(study, "graphs", "bfloat16", cells, versions=2)
    try:
        env = backend.environment()
        assert all(env[{"SAMPLER": "sampler_reduction"}.get(name, name.lower())] == value
                   for name, value in settings.items()), env
        if "PREFILL_STEP" in settings:  # the prefill replayed a captured graph (of the 4 distinct prompts, if shared)
            graphs = backend.buckets.prefills
            assert graphs and all(p.graph is not None for p in graphs.values())
            assert {key[3] for key in graphs} == ({4} if "PREFILL" in settings else {None})
        assert backend.sync_policy(policies[1]) == policies[1].identity
        _parts_only_at_near_ties(study, expected[cells[0]], got[cells[0]], margins)
    finally:
        backend.teardown()


def test_one_fa3_plan_per_step_gives_every_layer_the_outputs_it_would_plan_for_itself():
    """ATTENTION_PLAN "per_step": FA3's scheduler metadata made once (`_fa3_plan`) and read by several calls over
    different k/v (the layers of a step) gives each call the output and log-sum-exp of the same call without a
    plan, bit for bit, at the decode shapes of the study (4 and 16 rows, rows of other lengths and paddings),
    in a captured CUDA graph replayed with new lengths too."""
    import importlib.util


    if importlib.util.find_spec("vllm") is None:
        pytest.skip("ATTENTION_PLAN reads vLLM's FlashAttention-3 kernels: vLLM is not installed here")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3's kernels are Hopper's")
    generator = torch.Generator(device="cuda").manual_seed(43)
    for rows, columns in ((4, 192), (16, 576), (16, 1024)):
        q = torch.randn(rows, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        layers = [(torch.randn(rows, 8, columns, 128, device="cuda", dtype=torch.bfloat16, generator=generator),
                   torch.randn(rows, 8, columns, 128, device="cuda", dtype=torch.bfloat16, generator=generator))
                  for _ in range(3)]
        pad = torch.randint(0, columns // 3, (rows,), device="cuda", generator=generator).to(torch.int32)
        used = (pad + torch.randint(1, columns - columns // 3, (rows,), device="cuda", generator=generator)
                ).to(torch.int32)

        for (out, lse), (want_out, want_lse) in zip(_fa3_layers(q, layers, used, pad, planned=True),
                                                    _fa3_layers(q, layers, used, pad, planned=False), strict=True):
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (rows, columns)
        graph = torch.cuda.CUDAGraph()
        _fa3_layers(q, layers, used, pad, planned=True)  # warmed up before capture
        with torch.cuda.graph(graph):
            captured = _fa3_layers(q, layers, used, pad, planned=True)
        used.copy_(torch.minimum(used + 7, torch.full_like(used, columns)))  # the next step's lengths
        graph.replay()
        for (out, lse), (want_out, want_lse) in zip(captured, _fa3_layers(q, layers, used, pad, planned=False),
                                                    strict=True):
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (rows, columns, "replayed")


def _fa3_layers(q, layers, used, pad, planned: bool):
    """One decode step's FA3 calls over `layers` (k, v [B, Hk, L, D] as the static cache holds them), with one plan
    for all of them (`planned`) or each planning for itself."""
    from rollout_lib.backends import compact_qwen3

    columns = layers[0][0].shape[2]
    plan = compact_qwen3._fa3_plan(1, q.shape[2], layers[0][0].shape[1], q.shape[3], columns, q.dtype, used,
                                   pad) if planned else None
    return [compact_qwen3._fa3_attention(q, k.transpose(1, 2), v.transpose(1, 2), used, pad, 0.088, plan)
            for k, v in layers]


def test_a_pipelined_readback_replays_the_same_graphs_to_the_same_results(study):
    """READBACK "pipelined" on the H200 (issue 43 candidate): the same captured graphs replayed in the same order,
    the tokens read through pinned memory one step behind, so a greedy and a seeded cell give the per-step
    readback's results bit for bit; with every row stopping early by EOS, the same results and one discarded
    step past the last stop."""
    import dataclasses

    workload = Workload(study)
    cells = ["p128-r64-n4-greedy", "p128-r64-n4-stochastic"]
    backend, _, stepped = _run(study, "graphs", "bfloat16", cells)
    try:
        backend.engine.readback = "pipelined"
        for cell in cells:
            piped = backend.generate(workload.requests(workload.cell(cell))).results
            assert [(r.token_ids, r.stop_reason, r.logprobs) for r in piped] == \
                   [(r.token_ids, r.stop_reason, r.logprobs) for r in stepped[cell]], cell
        # each row's first token from the 10th on that it had not drawn before becomes its end of sequence
        fresh = [next(i for i in range(9, len(r.token_ids)) if r.token_ids[i] not in r.token_ids[:i])
                 for r in stepped[cells[1]]]
        early = [dataclasses.replace(q, eos_token_ids=(r.token_ids[i],)) for q, r, i in
                 zip(workload.requests(workload.cell(cells[1])), stepped[cells[1]], fresh, strict=True)]
        piped = backend.generate(early)
        backend.engine.readback = "per_step"
        reference = backend.generate(early)
        assert {r.stop_reason for r in reference.results} == {"eos"} and reference.decode_steps == max(fresh)
        assert [r.token_ids for r in piped.results] == [r.token_ids for r in reference.results]
        assert piped.decode_steps == reference.decode_steps + 1
    finally:
        backend.teardown()


def test_a_profiled_cell_breaks_down_per_decode_step(tmp_path):
    """Issue 43 item 1 as the measure notebook runs it (`profile_cell`, then `breakdown_record`): a CUDA trace of
    the smoke study's tiny hf_cached engine, its whole decode steps counted by their read-backs, one attention call
    or more per layer per step, the GPU named from the trace, the record readable by the report."""
    from rollout_lib.core import write_json_atomic
    from rollout_lib.measure.runner import MEASUREMENT_POLICY_VERSION, profile_cell
    from rollout_lib.measure.step_profile import breakdown_record
    from rollout_lib.report.step_profiles import step_profile_records
    from rollout_lib.study.prereg import load

    from .conftest import SMOKE

    study = load(SMOKE)
    workload = Workload(study)
    backend = create_backend("hf_cached", study, device="cuda")
    try:
        backend.cold_start()
        backend.sync_policy(policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest,
                                            MEASUREMENT_POLICY_VERSION)[-1])
        cell = "p16-r8-n1-greedy"
        _, trace = profile_cell(backend, workload.requests(workload.cell(cell)), tmp_path / f"r-{cell}.trace.json.gz")
    finally:
        backend.teardown()
    record = breakdown_record(trace, workload.arch.num_hidden_layers, cell=cell, root=tmp_path)
    assert record["steps_from"].startswith("read-backs") and record["steps"] >= 3, record["steps_from"]
    assert record["categories"]["attention"]["kernels"] >= workload.arch.num_hidden_layers
    assert record["categories"]["gemm"]["kernels"] > 0 and record["gaps_us_per_step"] >= 0
    assert record["gpu"] == torch.cuda.get_device_name(0)
    out = tmp_path / "perf" / f"breakdown-{cell}.json"
    out.parent.mkdir()
    write_json_atomic(out, record)
    assert [path for path, _ in step_profile_records(tmp_path)] == [out]
