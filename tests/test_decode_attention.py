"""ATTENTION_BACKEND "triton" (`rollout_lib/backends/decode_attention.py`): a decode step's attention over the static
cache as one Triton kernel, split over the columns and merged by the last program. On a CUDA GPU it runs there; on
a CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton: skipped there, saying so).

The columns outside a row's range hold values far from the others (v 64 where the rest are within 2), so one column
too many or too few moves the output by far more than the bf16 rounding of the weights the kernel multiplies v
with (FlashAttention's; within 1 % of the largest |v| here)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture)
    DEVICE,
    MARKS,
    assert_parts_only_after_close_logprobs,
    interpreter_on_a_cpu,
    run_engines,
)

pytestmark = MARKS


def _operands(batch, kv_heads, group, head_dim, columns, pad, write, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads, group, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, columns, head_dim, generator=generator)
    v = torch.rand(batch, kv_heads, columns, head_dim, generator=generator) * 4 - 2
    for row, begin in enumerate(pad):  # outside the row's range: keys that would win, values far off
        outside = torch.ones(columns, dtype=torch.bool)
        outside[min(begin, write):write + 1] = False
        k[row, :, outside] = q[row, :, :1].expand(kv_heads, int(outside.sum()), head_dim) * 3
        v[row, :, outside] = 64.0
    return (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
            torch.tensor(pad), torch.tensor([write]))


@pytest.mark.parametrize(("batch", "kv_heads", "group", "head_dim", "columns", "pad", "write", "splits"), [
    (4, 8, 2, 128, 192, [0, 5, 64, 130], 150, None),     # Qwen3-0.6B's heads at 4 rows, the engine's slices
    (4, 8, 2, 128, 192, [0, 5, 64, 130], 150, 1),        # one slice: no merge
    (2, 2, 2, 64, 300, [17, 299], 260, 3),               # a slice past the row's end; a pad beyond write: one column
    (3, 1, 4, 32, 40, [0, 1, 2], 39, 16),                # more slices than column blocks: empty slices merged
])
def test_attention_is_softmax_over_each_rows_columns(batch, kv_heads, group, head_dim, columns, pad, write, splits):
    from rollout_lib.backends import decode_attention

    q, k, v, pad_t, write_t = _operands(batch, kv_heads, group, head_dim, columns, pad, write, batch + columns)
    decode_attention.prepare(DEVICE)
    on = [t.to(DEVICE) for t in (q, k, v, pad_t, write_t)]
    config = decode_attention.Launch(splits=splits)
    out = decode_attention.attend(*on, 0.125, config)
    want = decode_attention.reference(q, k, v, pad_t, write_t, 0.125)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float().cpu() - want.float()).abs().max() <= 0.02
    assert torch.equal(decode_attention.attend(*on, 0.125, config), out)  # the merge's order is fixed
    assert int(decode_attention._LOCKS[decode_attention.device_key(DEVICE)].abs().sum()) == 0  # left zero


@pytest.mark.parametrize(("columns", "pad", "write"), [
    (192, [0, 5, 64, 130], 150),    # p128-r64's cache: SHORT_CACHE, one slice of two 128-column iterations
    (255, [0, 1, 200, 254], 254),   # the last short length: a row of one column, another ending the cache
    (768, [0, 5, 300, 600], 700),   # p512-r256's: DEFAULT
])
def test_the_launch_chosen_by_the_cache_length_is_softmax_over_each_rows_columns(columns, pad, write):
    """ATTENTION_LAUNCH "by_columns": each of its launch configurations at Qwen3-0.6B's heads computes what DEFAULT
    does (the reference within the same bf16 tolerance), deterministically, its counters left at zero."""
    from rollout_lib.backends import decode_attention

    config = decode_attention.launch_for(columns)
    assert config == (decode_attention.SHORT_CACHE if columns < 256 else decode_attention.DEFAULT)
    q, k, v, pad_t, write_t = _operands(4, 8, 2, 128, columns, pad, write, columns)
    decode_attention.prepare(DEVICE)
    on = [t.to(DEVICE) for t in (q, k, v, pad_t, write_t)]
    out = decode_attention.attend(*on, 0.125, config)
    want = decode_attention.reference(q, k, v, pad_t, write_t, 0.125)
    assert (out.float().cpu() - want.float()).abs().max() <= 0.02
    assert torch.equal(decode_attention.attend(*on, 0.125, config), out)
    assert int(decode_attention._LOCKS[decode_attention.device_key(DEVICE)].abs().sum()) == 0


def _shared_operands(blocks, rows, kv_heads, group, head_dim, columns, pads, prefix_end, write, seed):
    """Blocks of `rows` rows sharing one prompt (one pad per block): (the operands, in which the prompt's columns of
    every row but a block's first are NaN, and the caches a per-row attention would read, where they are copies of
    the first row's)."""
    batch = blocks * rows
    q, k, v, pad, write_t = _operands(batch, kv_heads, group, head_dim, columns,
                                      [p for p in pads for _ in range(rows)], write, seed)
    copied_k, copied_v = k.clone(), v.clone()
    for block in range(blocks):
        first = block * rows
        for row in range(first + 1, first + rows):
            copied_k[row, :, :prefix_end] = k[first, :, :prefix_end]
            copied_v[row, :, :prefix_end] = v[first, :, :prefix_end]
            k[row, :, :prefix_end] = float("nan")  # a read of another row's prompt copy poisons the output
            v[row, :, :prefix_end] = float("nan")
    return (q, k, v, pad, write_t, torch.tensor([prefix_end])), (copied_k, copied_v)


@pytest.mark.parametrize(("blocks", "rows", "kv_heads", "group", "head_dim", "columns", "pads", "prefix_end",
                          "write", "splits"), [
    (4, 4, 8, 2, 128, 192, [0, 5, 64, 100], 128, 150, None),  # Qwen3-0.6B at 16 rows in 4 GRPO groups of 4
    (4, 4, 8, 2, 128, 192, [0, 5, 64, 100], 128, 150, 1),     # one slice: no merge
    (2, 2, 2, 2, 64, 300, [17, 59], 60, 260, 3),              # slices that hold only other rows' own columns
    (1, 3, 1, 4, 32, 50, [0], 30, 49, 16),                    # more slices than entries: empty slices merged
    (2, 8, 1, 8, 32, 40, [3, 9], 20, 20, None),               # a 64-row tile; the first decode column alone
    (2, 2, 1, 2, 32, 40, [10, 10], 10, 25, 2),                # no prompt column (pad at the prefix's end)
])
def test_attention_over_a_shared_prompt_reads_it_from_the_blocks_first_row(blocks, rows, kv_heads, group, head_dim,
                                                                           columns, pads, prefix_end, write, splits):
    """DECODE_PREFIX "shared" (`attend_shared`): each row's softmax over the block's prompt, read from the block's
    first row (the other rows' copies are NaN here), and its own columns: what `attend` and the float32 reference
    compute on caches where every row holds the prompt, within the bf16 tolerance; deterministic, counters zero."""
    from rollout_lib.backends import decode_attention

    operands, (copied_k, copied_v) = _shared_operands(blocks, rows, kv_heads, group, head_dim, columns, pads,
                                                      prefix_end, write, blocks * rows + columns)
    q, _, _, pad, write_t, _ = operands
    decode_attention.prepare(DEVICE)
    on = [t.to(DEVICE) for t in operands]
    config = decode_attention.Launch(splits=splits)
    out = decode_attention.attend_shared(*on, rows, 0.125, config)
    want = decode_attention.reference(q, copied_k, copied_v, pad, write_t, 0.125)
    per_row = decode_attention.attend(*[t.to(DEVICE) for t in (q, copied_k, copied_v, pad, write_t)], 0.125, config)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and not out.isnan().any()
    assert (out.float().cpu() - want.float()).abs().max() <= 0.02
    assert (out.float() - per_row.float()).abs().max() <= 0.02
    assert torch.equal(decode_attention.attend_shared(*on, rows, 0.125, config), out)
    assert int(decode_attention._LOCKS[decode_attention.device_key(DEVICE)].abs().sum()) == 0


def test_the_shared_kernels_long_cache_launch_is_softmax_over_each_rows_columns():
    """ATTENTION_LAUNCH "by_columns_shared": `attend_shared` over p512-r256's 768-column cache in 4 blocks of 4 rows
    (the prompt's 512 columns read from each block's first row) at SHARED_LONG_CACHE (128 columns an iteration, 4
    warps, one stage) computes what the float32 reference and the default launch do, within the bf16 tolerance,
    deterministically, its counters left at zero; under 256 columns it is by_columns' choice."""
    from rollout_lib.backends import decode_attention

    assert decode_attention.shared_launch_for(768) == decode_attention.SHARED_LONG_CACHE
    assert decode_attention.shared_launch_for(255) == decode_attention.launch_for(255) == decode_attention.SHORT_CACHE
    operands, (copied_k, copied_v) = _shared_operands(4, 4, 8, 2, 128, 768, [0, 5, 100, 300], 512, 700, 768)
    q, _, _, pad, write_t, _ = operands
    decode_attention.prepare(DEVICE)
    on = [t.to(DEVICE) for t in operands]
    out = decode_attention.attend_shared(*on, 4, 0.125, decode_attention.shared_launch_for(768))
    want = decode_attention.reference(q, copied_k, copied_v, pad, write_t, 0.125)
    default = decode_attention.attend_shared(*on, 4, 0.125, decode_attention.DEFAULT)
    assert out.shape == q.shape and not out.isnan().any()
    assert (out.float().cpu() - want.float()).abs().max() <= 0.02
    assert (out.float() - default.float()).abs().max() <= 0.02
    assert torch.equal(decode_attention.attend_shared(*on, 4, 0.125, decode_attention.SHARED_LONG_CACHE), out)
    assert int(decode_attention._LOCKS[decode_attention.device_key(DEVICE)].abs().sum()) == 0


def _zero_step(rows: int, kv_heads: int, cache_dtype=torch.bfloat16):
    """A decode step's operands of zeros on DEVICE (two query heads per kv head, head size 16, 8 cache columns): q,
    the k cache, pad and a one-element column index (write, or prefix_end); the kernel's counters prepared."""
    from rollout_lib.backends import decode_attention

    decode_attention.prepare(DEVICE)
    return (torch.zeros(rows, kv_heads, 2, 16, dtype=torch.bfloat16, device=DEVICE),
            torch.zeros(rows, kv_heads, 8, 16, dtype=cache_dtype, device=DEVICE),
            torch.zeros(rows, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE))


def test_a_shared_prompt_that_is_not_blocks_of_rows_is_refused_by_name():
    from rollout_lib.backends import decode_attention

    q, cache, pad, one = _zero_step(6, 2)
    with pytest.raises(ValueError, match=r"^DECODE_PREFIX shared: q \(6, 2, 2, 16\) .* in blocks of 4 \(bf16, "
                                         r"blocks x query heads per kv head at most 64"):
        decode_attention.attend_shared(q, cache, cache.clone(), pad, one, one, 4, 0.25)
    wide, wide_cache, wide_pad, one = _zero_step(66, 1)
    with pytest.raises(ValueError, match=r"in blocks of 33 "):  # 66 query rows: past the tile's 64
        decode_attention.attend_shared(wide, wide_cache, wide_cache.clone(), wide_pad, one, one, 33, 0.25)


def test_the_slices_fill_the_gpu_and_keep_a_block_of_columns_each():
    from rollout_lib.backends.decode_attention import MAX_SPLITS, splits_for

    assert splits_for(32, 640, 132) == 8      # 4 rows x 8 kv heads: 256 programs (128 would leave 4 SMs idle)
    assert splits_for(128, 1024, 132) == 2    # 16 rows: 256
    assert splits_for(32, 128, 132) == 2      # two blocks of columns: no slice below one block
    assert splits_for(32, 64, 132) == 1
    assert splits_for(1, 1 << 20, 132) == MAX_SPLITS


def test_operands_that_are_not_one_decode_step_are_refused_by_name():
    from rollout_lib.backends import decode_attention

    q, cache, pad, write = _zero_step(2, 2, cache_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^ATTENTION_BACKEND triton: q \(2, 2, 2, 16\) torch.bfloat16 and the "
                                         r"caches \(2, 2, 8, 16\) torch.float32 .* are not one decode step's"):
        decode_attention.attend(q, cache, cache.clone(), pad, write, 0.25)
    with pytest.raises(ValueError, match=r"^splits 17 is not allowed; allowed: 1-16 or None"):
        decode_attention.Launch(splits=17)
    # ATTENTION_DEPENDENT_LAUNCH: its prefetch covers a slice's columns as one span of the cache
    q, cache, pad, write = _zero_step(2, 2)
    strided = torch.zeros(2, 2, 8, 32, dtype=torch.bfloat16, device=DEVICE)[..., :16]
    with pytest.raises(ValueError, match=r"^ATTENTION_DEPENDENT_LAUNCH prefetch_kv: a CUDA device and caches whose "
                                         r"columns are contiguous \(a column 16 elements\); here .*, a column 32 "
                                         r"elements apart$"):
        decode_attention.attend(q, strided, strided, pad, write, 0.25, pdl=True)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"^ATTENTION_DEPENDENT_LAUNCH prefetch_kv: a CUDA device .*; here cpu"):
            decode_attention.attend(q, cache, cache.clone(), pad, write, 0.25, pdl=True)


def test_a_bf16_engine_with_the_kernel_serves_the_policy_and_its_tokens(smoke_study, snapshot_cache):
    """The kernel in the engine's decode steps (between the compiled pieces, captured in the step's graph on a
    GPU): the synced policy's identity is the default engine's; every layer of the decode steps called it (on a
    CPU: its profiler ranges; on a GPU: its kernel's launches); and the bf16 tokens and log-probabilities are the
    default engine's (SDPA) but for bf16 roundings in another order: log-probabilities close, tokens apart only
    after that."""
    from rollout_lib.study.workload import Workload

    policy, runs = run_engines(smoke_study, snapshot_cache, ({}, {"ATTENTION_BACKEND": "triton"}),
                               "rollout::decode_attention", "decode_attention_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= Workload(smoke_study).arch.num_hidden_layers
    assert_parts_only_after_close_logprobs(default, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_an_engine_launches_the_kernel_as_the_cache_length_chooses(smoke_study, snapshot_cache, monkeypatch):
    """ATTENTION_LAUNCH "by_columns" in the engine: every decode step's attention runs at `launch_for`'s choice for
    the engine's cache (recorded by a spy on it), and the tokens and log-probabilities are the fixed launch's but
    for bf16 roundings in another order (another number of columns an iteration)."""
    from rollout_lib.backends import decode_attention

    chosen = []
    launch_for = decode_attention.launch_for
    monkeypatch.setattr(decode_attention, "launch_for", lambda columns: chosen.append(columns) or launch_for(columns))
    seen = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend",  # the launch: the seventh argument (after q, the caches, pad,
                        lambda *args, **kwargs: seen.append(args[6]) or attend(*args, **kwargs))  # write, scale)
    triton = {"ATTENTION_BACKEND": "triton"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (triton, {**triton, "ATTENTION_LAUNCH": "by_columns"}),
                               "rollout::decode_attention", "decode_attention_kernel")
    (fixed_identity, fixed, _), (identity, got, used) = runs
    assert identity == fixed_identity == policy.identity and used
    # the fixed engine never asks; the other asks for its cache and launches every layer at the answer
    assert chosen and set(seen) == {decode_attention.DEFAULT} | {launch_for(columns) for columns in chosen}
    assert decode_attention.DEFAULT not in {launch_for(columns) for columns in chosen}
    assert_parts_only_after_close_logprobs(fixed, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_a_bf16_engine_reads_each_groups_prompt_once_and_serves_the_per_row_tokens(smoke_study, snapshot_cache):
    """DECODE_PREFIX "shared" with the Triton kernel in the engine: the n2 cells' decode steps call `attend_shared`
    in every layer (their rows are blocks of 2 with one prompt), and the tokens and log-probabilities are the
    per-row kernel's but for bf16 roundings in another order (the prompt's columns and the row's own in other
    loop iterations): log-probabilities close, tokens apart only after that."""
    from rollout_lib.study.workload import Workload

    triton = {"ATTENTION_BACKEND": "triton"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (triton, {**triton, "DECODE_PREFIX": "shared"}),
                               "rollout::decode_attention_shared", "shared_prefix_attention_kernel")
    (per_row_identity, per_row, none), (identity, got, used) = runs
    assert identity == per_row_identity == policy.identity
    assert none == [] and len(used) >= Workload(smoke_study).arch.num_hidden_layers
    assert_parts_only_after_close_logprobs(per_row, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_an_engine_launches_the_shared_kernel_over_a_long_cache_at_its_own_launch(smoke_study, snapshot_cache,
                                                                                   monkeypatch):
    """ATTENTION_LAUNCH "by_columns_shared" with DECODE_PREFIX "shared" in the engine: over a cache of
    SHORT_CACHE_COLUMNS or more (the smoke cells' caches, the threshold lowered to 8 columns here) each layer's
    `attend_shared` runs at SHARED_LONG_CACHE where "by_columns" runs it at DEFAULT, and the tokens and
    log-probabilities are by_columns' but for bf16 roundings in another order (another number of columns an
    iteration)."""
    from rollout_lib.backends import decode_attention

    monkeypatch.setattr(decode_attention, "SHORT_CACHE_COLUMNS", 8)
    seen = []
    attend_shared = decode_attention.attend_shared
    monkeypatch.setattr(decode_attention, "attend_shared", lambda *args: seen.append(args[-1]) or attend_shared(*args))
    base = {"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared", "ATTENTION_LAUNCH": "by_columns"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, "ATTENTION_LAUNCH": "by_columns_shared"}),
                               "rollout::decode_attention_shared", "shared_prefix_attention_kernel")
    (by_columns_identity, by_columns, before), (identity, got, used) = runs
    assert identity == by_columns_identity == policy.identity and before and used
    # the engines ran one after the other: by_columns' calls at DEFAULT, then by_columns_shared's at its own
    assert decode_attention.SHARED_LONG_CACHE in seen
    first = seen.index(decode_attention.SHARED_LONG_CACHE)
    assert first > 0 and set(seen[:first]) == {decode_attention.DEFAULT}
    assert set(seen[first:]) == {decode_attention.SHARED_LONG_CACHE}
    assert_parts_only_after_close_logprobs(by_columns, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_short_prompts_under_shared_long_decode_per_row_bit_for_bit(smoke_study, snapshot_cache):
    """DECODE_PREFIX "shared_long" with the smoke cells' prompts (16 and 48 columns, under SHARED_PROMPT_MIN_COLUMNS):
    no decode step calls `attend_shared`, and the tokens and log-probabilities are the per-row engine's bit for bit
    (both with REDUCTION_LAUNCH fewest_programs, so inductor draws no launch that could order a sum otherwise)."""
    base = {"ATTENTION_BACKEND": "triton", "REDUCTION_LAUNCH": "fewest_programs"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, "DECODE_PREFIX": "shared_long"}),
                               "rollout::decode_attention_shared", "shared_prefix_attention_kernel")
    (per_row_identity, want, none), (identity, got, shared_calls) = runs
    assert identity == per_row_identity == policy.identity
    assert none == [] and shared_calls == []
    for cell in want:
        for a, b in zip(want[cell], got[cell], strict=True):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), (cell, a.request_id)


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("oracle_rounding", [False, True])
def test_attention_from_the_qkv_projection_is_the_epilogue_then_the_attention(splits, oracle_rounding):
    """ATTENTION_BACKEND "triton_qkv": from the qkv GEMM's output the kernel writes the new k and v into the caches
    bit for bit as QKV_EPILOGUE's kernel does (the same operations), leaves every other column alone, and attends
    as that kernel's q over the caches does, but for the new column taken from registers first (float32 sums in
    another order): within a bf16 step or two of values of order 1."""
    from rollout_lib.backends import decode_attention, qkv_epilogue
    from tests.test_qkv_epilogue import EPS
    from tests.test_qkv_epilogue import _operands as projection_operands

    batch, heads, kv_heads, head_dim, rank, columns = 3, 4, 2, 32, 4, 80
    generator = torch.Generator().manual_seed(5)
    both, lora_b, (q_norm, k_norm), cos, sin = projection_operands(batch, 1, heads, kv_heads, head_dim, rank,
                                                                   generator)
    lora_b = lora_b.t().contiguous().t()  # rank-major, as the engine stores it
    cache_k = torch.randn(batch, kv_heads, columns, head_dim, generator=generator).bfloat16()
    cache_v = torch.randn(batch, kv_heads, columns, head_dim, generator=generator).bfloat16()
    pad, write = torch.tensor([0, 9, 70]), torch.tensor([66])
    decode_attention.prepare(DEVICE)
    on = {name: t.to(DEVICE) for name, t in dict(both=both, lora_b=lora_b, q_norm=q_norm, k_norm=k_norm, cos=cos,
                                                 sin=sin, pad=pad, write=write).items()}
    want_k, want_v = cache_k.clone().to(DEVICE), cache_v.clone().to(DEVICE)
    q = qkv_epilogue.launch(on["both"], on["lora_b"], on["q_norm"], on["k_norm"], on["cos"], on["sin"], want_k,
                            want_v, on["write"], heads, 1, 2.0, EPS, oracle_rounding)
    config = decode_attention.Launch(splits=splits)
    want = decode_attention.attend(q, want_k, want_v, on["pad"], on["write"], 0.17, config)
    got_k, got_v = cache_k.clone().to(DEVICE), cache_v.clone().to(DEVICE)
    got = decode_attention.attend_from_projection(on["both"], on["lora_b"], on["q_norm"], on["k_norm"], on["cos"],
                                                  on["sin"], got_k, got_v, on["pad"], on["write"], heads, 2.0, EPS,
                                                  0.17, oracle_rounding, config)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k[:, :, 66], cache_k[:, :, 66].to(DEVICE))  # the column was written
    assert got.shape == q.shape and (got.float() - want.float()).abs().max() <= 0.01
    assert int(decode_attention._LOCKS[decode_attention.device_key(DEVICE)].abs().sum()) == 0


def test_a_bf16_engine_with_the_qkv_epilogue_inside_attention_serves_the_policy_and_its_tokens(smoke_study,
                                                                                             snapshot_cache):
    """ATTENTION_BACKEND "triton_qkv" with the qkv epilogue it absorbs, against that epilogue with SDPA: the synced
    policy's identity; the decode steps' layers all called the kernel and the epilogue's op no more (its calls are
    the prefill's); tokens and log-probabilities alike but for bf16 roundings in another order."""
    from rollout_lib.study.workload import Workload

    epilogue = {"LORA_SHRINK": "in_base_gemm", "QKV_EPILOGUE": "triton"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (epilogue, {**epilogue, "ATTENTION_BACKEND": "triton_qkv"}),
                               "rollout::decode_attention_qkv", "projected_attention_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= Workload(smoke_study).arch.num_hidden_layers
    assert_parts_only_after_close_logprobs(default, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_a_weight_prefetch_table_is_refused_off_a_cuda_device():
    """WEIGHT_PREFETCH_BY attention's table asks for Hopper's bulk L2 prefetch, which Triton's CPU interpreter does
    not have: refused by name, before any launch, never silently dropped."""
    import torch

    from rollout_lib.backends import decode_attention

    decode_attention.prepare(torch.device("cpu"))
    q = torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    table = torch.tensor([[0, 16]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^WEIGHT_PREFETCH_BY attention: a CUDA device and a prefetch table on it "
                                         r"\(int64 \[regions, 2\], at least one region\); here cpu"):
        decode_attention.attend(q, cache, cache, torch.zeros(1, dtype=torch.int64),
                                torch.tensor([3], dtype=torch.int64), 0.25, weights=table)
