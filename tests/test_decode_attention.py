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


def test_the_slices_fill_the_gpu_and_keep_a_block_of_columns_each():
    from rollout_lib.backends.decode_attention import MAX_SPLITS, splits_for

    assert splits_for(32, 640, 132) == 8      # 4 rows x 8 kv heads: 256 programs (128 would leave 4 SMs idle)
    assert splits_for(128, 1024, 132) == 2    # 16 rows: 256
    assert splits_for(32, 128, 132) == 2      # two blocks of columns: no slice below one block
    assert splits_for(32, 64, 132) == 1
    assert splits_for(1, 1 << 20, 132) == MAX_SPLITS


def test_operands_that_are_not_one_decode_step_are_refused_by_name():
    from rollout_lib.backends import decode_attention

    decode_attention.prepare(DEVICE)
    q = torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 2, 8, 16, dtype=torch.float32, device=DEVICE)
    pad, write = torch.zeros(2, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"^ATTENTION_BACKEND triton: q \(2, 2, 2, 16\) torch.bfloat16 and the "
                                         r"caches \(2, 2, 8, 16\) torch.float32 .* are not one decode step's"):
        decode_attention.attend(q, cache, cache.clone(), pad, write, 0.25)
    with pytest.raises(ValueError, match=r"^splits 17 is not allowed; allowed: 1-16 or None"):
        decode_attention.Launch(splits=17)


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
