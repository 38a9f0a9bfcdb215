"""tools/lab/epilogue_bench.py (issue 43: the epilogue kernels' launch configurations, GPU only): every
configuration it times computes what the module's default computes, the default is among them, and bad input is
refused in one line before anything runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture: Triton's interpreter on a CPU)
    DEVICE,
    MARKS,
    exact_values,
    interpreter_on_a_cpu,
)
from tools.lab.epilogue_bench import KERNELS, _call, configs, default_config, main


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_modules_default_configuration_is_among_those_timed(kernel):
    assert default_config(kernel) in configs(kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.skipif(bool(MARKS), reason="needs a CUDA GPU, or Triton for its CPU interpreter (not installed here)")
def test_every_configuration_computes_what_the_default_computes(kernel, rows):
    """On exact values (small integers times powers of two) the float32 sums are the same in any order, so every
    launch configuration gives the default's bits: the bench times one computation, not several. The attention
    kernel's configurations round its weights to bf16 at other points of the online softmax (slices and blocks
    move the running maximum): within 0.02 of the default's output (values of order 1)."""
    generator = torch.Generator().manual_seed(rows)
    hidden, inner, rank, splits = 64, 96, 4, 3
    heads, kv_heads, head_dim = 4, 2, 16
    if kernel in ("o_down", "o_down_slices", "o_down_splitk"):
        from rollout_lib.backends import norm_epilogue

        norm_epilogue.prepare(DEVICE)  # the slices kernel's counters
        shape = (splits, rows, hidden + 3 * rank) if kernel == "o_down_splitk" else (rows, hidden + 3 * rank)
        operands = {"both": exact_values(shape, generator, 0.25),
                    "lora_b": exact_values((rank, hidden), generator, 0.125).t(),
                    "h": exact_values((rows, hidden), generator, 1.0).bfloat16(),
                    "weight": (1 + exact_values((hidden,), generator, 0.0625)).bfloat16()}
    elif kernel.startswith("attention"):
        from rollout_lib.backends import decode_attention

        decode_attention.prepare(DEVICE)
        columns = 150 if kernel.endswith("_long") else 40
        shared = kernel.startswith("attention_shared")  # GRPO groups of 4 rows: one prompt (one pad) each
        operands = {"q": torch.randn(rows, kv_heads, heads // kv_heads, head_dim, generator=generator).bfloat16(),
                    "cache_k": torch.randn(rows, kv_heads, columns, head_dim, generator=generator).bfloat16(),
                    "cache_v": torch.randn(rows, kv_heads, columns, head_dim, generator=generator).bfloat16(),
                    "pad": (torch.arange(rows) // 4 if shared else torch.arange(rows)) % 7,
                    "write": torch.tensor([columns - 3])}
        if shared:
            operands["prefix_end"] = torch.tensor([columns // 2])
    elif kernel == "gate_up":
        operands = {"both": exact_values((rows, 2 * inner + 6 * rank), generator, 0.25),
                    "lora_b": exact_values((2 * rank, 2 * inner), generator, 0.125).t(), "inter": inner}
    else:
        features = (heads + 2 * kv_heads) * head_dim
        angle = torch.rand(rows, head_dim // 2, generator=generator) * 6.0
        operands = {"both": exact_values((rows, features + 9 * rank), generator, 0.25),
                    "lora_b": exact_values((3 * rank, features), generator, 0.125).t(),
                    "q_norm": (1 + exact_values((head_dim,), generator, 0.0625)).bfloat16(),
                    "k_norm": (1 + exact_values((head_dim,), generator, 0.0625)).bfloat16(),
                    "cos": torch.cat([angle.cos()] * 2, dim=-1).bfloat16(),
                    "sin": torch.cat([angle.sin()] * 2, dim=-1).bfloat16(),
                    "cache_k": torch.zeros(rows, kv_heads, 8, head_dim, dtype=torch.bfloat16),
                    "cache_v": torch.zeros(rows, kv_heads, 8, head_dim, dtype=torch.bfloat16),
                    "write": torch.tensor([5]), "heads": heads}
    operands = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                for name, value in operands.items()}
    want = _call(kernel, operands, default_config(kernel))
    want_caches = [operands[name].clone() for name in ("cache_k", "cache_v") if name in operands]
    for config in configs(kernel):
        got = _call(kernel, operands, config)
        if kernel == "gate_up":
            assert torch.equal(got, want), config
            continue
        if kernel.startswith("attention"):  # slices and blocks change where the weights round to bf16
            assert (got.float() - want.float()).abs().max() <= 0.02, config
            continue
        tolerance = 2 * torch.finfo(torch.bfloat16).eps  # a norm's sum of squares: float32 in each one's order
        if kernel == "qkv":  # the queries normed; k normed and v as computed, in the caches
            assert torch.allclose(got.float(), want.float(), rtol=tolerance), config
            assert torch.allclose(operands["cache_k"].float(), want_caches[0].float(), rtol=tolerance), config
            assert torch.equal(operands["cache_v"], want_caches[1]), config
            assert operands["cache_v"][:, :, 5].abs().sum() > 0 and not operands["cache_v"][:, :, 4].any()
            continue
        assert torch.equal(got[0], want[0]), config  # the residual stream after the projection
        assert torch.allclose(got[1].float(), want[1].float(), rtol=tolerance), config


def test_bad_input_is_refused_by_the_benches_shared_check_naming_its_own_option(tmp_path, monkeypatch, capsys):
    """gemm_bench.refuse_bad_input (its tests: every field, an existing --out, no GPU) with --layers named."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "x.json", "--layers", "57"])
    assert exit_info.value.code == 2
    assert "--layers: 57 is not allowed; allowed: 1 to --calls (56)" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_kernel_is_refused_by_name_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "x.json", "--kernels", "attention_long", "attention_sharedlong"])
    assert exit_info.value.code == 2
    assert "--kernels: attention_sharedlong is not allowed; allowed: o_down, " in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_shared_prompt_kernels_time_the_per_row_kernels_caches_in_groups_of_four():
    """`attention_shared_long` reads the cache `attention_long` reads (768 columns, 640 in use), its rows in groups
    of 4 sharing a 512-column prompt: the two times compare the same attention read two ways."""
    from tools.lab.epilogue_bench import ATTENTION_CACHES, SHARED_PREFIX_END, SHARED_ROWS, _operands

    arch = SimpleNamespace(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16)
    assert ATTENTION_CACHES["attention_shared_long"] == ATTENTION_CACHES["attention_long"]
    assert ATTENTION_CACHES["attention_shared"] == ATTENTION_CACHES["attention"] and SHARED_ROWS == 4
    shared = _operands("attention_shared_long", arch, 4, 16, torch.Generator().manual_seed(0))
    per_row = _operands("attention_long", arch, 4, 16, torch.Generator().manual_seed(0))
    assert shared["prefix_end"].tolist() == [SHARED_PREFIX_END["attention_shared_long"]] == [512]
    assert {name: t.shape for name, t in per_row.items()} == {name: t.shape for name, t in shared.items()
                                                              if name != "prefix_end"}
    assert shared["write"].tolist() == per_row["write"].tolist() == [639]


def test_its_operands_have_the_engines_shapes_and_b_rank_major():
    from tools.lab.epilogue_bench import _operands

    arch = SimpleNamespace(hidden_size=64, intermediate_size=96)
    generator = torch.Generator().manual_seed(0)
    o_down = _operands("o_down", arch, 4, 16, generator)
    assert tuple(o_down["both"].shape) == (16, 64 + 12) and tuple(o_down["lora_b"].shape) == (64, 4)
    assert o_down["lora_b"].stride() == (1, 64)  # rank-major: a rank term's features contiguous
    gate_up = _operands("gate_up", arch, 4, 4, generator)
    assert tuple(gate_up["both"].shape) == (4, 2 * 96 + 24) and tuple(gate_up["lora_b"].shape) == (192, 8)
    assert gate_up["lora_b"].stride() == (1, 192) and gate_up["inter"] == 96
    split = _operands("o_down_splitk", arch, 4, 16, generator, splits=8)
    assert tuple(split["both"].shape) == (8, 16, 64 + 12) and split["lora_b"].stride() == (1, 64)


def test_its_qkv_operands_are_one_decode_position_per_row_with_b_rank_major():
    from tools.lab.epilogue_bench import CACHE_LENGTH, _operands

    arch = SimpleNamespace(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16)
    qkv = _operands("qkv", arch, 4, 16, torch.Generator().manual_seed(0))
    features = (4 + 2 * 2) * 16
    assert tuple(qkv["both"].shape) == (16, features + 36) and tuple(qkv["lora_b"].shape) == (features, 12)
    assert qkv["lora_b"].stride() == (1, features)
    assert tuple(qkv["cache_k"].shape) == (16, 2, CACHE_LENGTH, 16) and tuple(qkv["cos"].shape) == (16, 16)
    assert qkv["write"].tolist() == [CACHE_LENGTH // 2] and qkv["heads"] == 4


def test_the_split_k_operands_have_the_engines_slices_of_the_o_projection():
    """GEMM_SPLIT_K "auto" on a 132-SM GPU (H100, H200) splits Qwen3-0.6B's o projection (2,048 inputs, 1,072
    outputs with the shrink's rows) into 8 slices: the partials the bench's `o_down_splitk` reads."""
    from tools.lab.epilogue_bench import o_splits

    arch = SimpleNamespace(hidden_size=1024, num_attention_heads=16, head_dim=128)
    assert o_splits(arch, 16, 132) == 8
    assert o_splits(arch, 16, 0) == 1
