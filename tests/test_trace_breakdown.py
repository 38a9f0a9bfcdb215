"""tools/trace_breakdown.py (issue 43's per-kernel profile of a decode step) on a hand-made trace whose
answer is known, and its refusals."""

from __future__ import annotations

import gzip
import json

import pytest

from tools.trace_breakdown import breakdown, category, main, read_trace


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _two_steps_of_two_layers():
    """Per step: per layer an RMSNorm (10 us), a GEMM (30), a LoRA shrink (5), attention (20); then the
    sampler (8). Kernels back to back except a 4 us gap before every attention kernel."""
    events, t = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}], 100.0
    for _step in range(2):
        for _layer in range(2):
            for name, dur, gap in (("triton_per_fused_add_mean_mul_pow_rsqrt_0", 10, 0), ("nvjet_sm90_tst_64x8", 30, 0),
                                   ("triton_red_fused__to_copy_mul_sum_unsqueeze_1", 5, 0),
                                   ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 20, 4)):
                t += gap
                events.append(_kernel(name, t, dur))
                t += dur
        events.append(_kernel("triton_red_fused_argmax_exponential_2", t, 8))
        t += 8
    return events


def test_a_known_trace_gives_its_known_breakdown():
    result = breakdown(_two_steps_of_two_layers(), layers=2)
    assert result["steps"] == 2 and result["kernels_per_step"] == 9
    assert result["gpu_busy_us_per_step"] == 2 * (10 + 30 + 5 + 20) + 8
    assert result["gaps_us_per_step"] == 2 * 4
    assert result["span_us_per_step"] == result["gpu_busy_us_per_step"] + result["gaps_us_per_step"]
    categories = result["categories"]
    assert {k: v["us"] for k, v in categories.items()} == {"gemm": 60, "attention": 40, "rmsnorm": 20,
                                                           "low_rank_reductions": 10, "sampling": 8}
    assert list(categories) == ["gemm", "attention", "rmsnorm", "low_rank_reductions", "sampling"]
    assert categories["attention"]["kernels"] == 2
    assert breakdown(_two_steps_of_two_layers(), layers=2, steps=4)["kernels_per_step"] == 4.5
    assert result["gaps_before_attention_us_per_step"] == 2 * 4 and result["host_waits_us_per_step"] == 0


def test_the_host_waits_between_steps_are_told_from_the_graphs_own_gaps():
    """A step's tokens read back by the host leave the GPU idle between steps: a gap over 20 us is the host's."""
    events, shifted = _two_steps_of_two_layers(), []
    first_sampler = next(e["ts"] for e in events if "argmax" in e.get("name", ""))
    for event in events:  # 75 us of idle after the first step's sampler, as a blocking read-back leaves
        shifted.append(dict(event, ts=event["ts"] + 75) if event["cat"] == "kernel" and event["ts"] > first_sampler
                       else event)
    result = breakdown(shifted, layers=2)
    assert result["host_waits_us_per_step"] == 75 / 2
    assert result["gaps_us_per_step"] == 2 * 4 + 75 / 2 and result["gaps_before_attention_us_per_step"] == 2 * 4


def test_steps_are_counted_by_read_backs_where_attention_takes_two_kernels_a_layer():
    """FA3 (lease 30) launches a split-KV kernel and its combine per layer: counted by attention kernels, a window
    of three steps read as six. With a read-back after each step's sampler, the window is cut to the whole steps
    between the first and the last read-back and counted by them; the window's partial steps at either end are
    left out."""
    events, t = [_kernel("triton_poi_partial_step_tail_0", 0.0, 7)], 10.0  # the end of a step cut by the window
    for _step in range(3):
        for _layer in range(2):
            for name, dur in (("nvjet_sm90_tss_64x8", 30), ("void flash::FlashAttnFwdSm90<split>", 12),
                              ("void flash::FlashAttnFwdCombine<128>", 3)):
                events.append(_kernel(name, t, dur))
                t += dur
        events.append(_kernel("Memcpy DtoH (Device -> Pageable)", t, 2, cat="gpu_memcpy"))
        t += 2 + 75  # the host's wait for the tokens and the next launch
    events.append(_kernel("nvjet_sm90_tss_64x8", t, 30))  # the start of a fourth step, cut by the window
    result = breakdown(events, layers=2)
    assert result["steps"] == 2 and result["steps_from"].startswith("read-backs")
    assert result["kernels_per_step"] == 7  # 6 kernels and a read-back a whole step
    assert result["categories"]["attention"]["kernels"] == 4 and result["categories"]["gemm"]["us"] == 60
    assert result["host_waits_us_per_step"] == 75
    assert breakdown(events, layers=2, steps=6)["steps_from"] == "given"
    assert breakdown([e for e in events if e["cat"] == "kernel"], layers=2)["steps"] == 6.0  # attention / layers


def test_categories_follow_the_documented_order():
    assert category("cudnn_generated_fort_native_sdpa_gemm_like", "kernel") == "attention"  # attention first
    assert category("void cublasLt::splitKreduce_kernel<32>", "kernel") == "gemm"
    assert category("triton_poi_fused_add_cat_mean_mul_neg_pow_rsqrt_2", "kernel") == "rmsnorm"
    assert category("Memset (Device)", "gpu_memset") == "memset_memcpy"
    assert category("void at::native::vectorized_elementwise_kernel", "kernel") == "other"


@pytest.mark.parametrize(("name", "expected"), [
    # the LoRA terms: the shrink's and the expand's reductions as inductor names them (lease 7 and lease 23 traces)
    ("triton_red_fused__to_copy_mul_sum_unsqueeze_6", "low_rank_reductions"),
    ("triton_per_fused__to_copy__unsafe_view_add_mul_sum_unsqueeze_7", "low_rank_reductions"),
    ("triton_per_fused_add_mul_select_slice_sum_unsqueeze_view_2", "low_rank_reductions"),
    ("triton_per_fused__to_copy_add_mul_select_slice_sum_unsqueeze_view_4", "low_rank_reductions"),
    ("gate_up_epilogue_kernel", "low_rank_reductions"),  # GATE_UP_EPILOGUE triton: the expand and the SiLU product
    ("residual_norm_epilogue_kernel", "low_rank_reductions"),  # O_EPILOGUE triton: the expand, residual and norm
    ("qkv_epilogue_kernel", "low_rank_reductions"),  # QKV_EPILOGUE triton: the expand, q/k norms, rotary, cache writes
    # a sampler kernel that multiplies and reduces is the sampler's, not a LoRA term
    ("triton_red_fused__log_softmax_exp_mul_sub_sum_3", "sampling"),
    ("counter_sample_kernel", "sampling"),  # SAMPLER triton: the whole sampler as one kernel
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_slice_split_with_sizes_view_5", "rmsnorm"),
    # float32 GEMMs (the expand as a GEMM, an old float32 head) apart from the bf16-operand ones
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x128x8_stage3_warpsize1x2x1_ffma", "gemm_float32"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>", "gemm_float32"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 4, 4, true>", "gemm_float32"),
    ("nvjet_sm90_sss_64x8_64x16_4x1_v_bz_TNT", "gemm_float32"),
    ("nvjet_sm90_tss_64x8_64x16_4x1_v_bz_TNT", "gemm"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
])
def test_the_lora_terms_and_float32_gemms_are_told_apart(name, expected):
    assert category(name, "kernel") == expected


def test_the_command_reads_a_gzipped_trace_and_writes_json(tmp_path, capsys):
    trace = tmp_path / "t.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": _two_steps_of_two_layers()}).encode()))
    out = tmp_path / "b.json"
    assert main([str(trace), "--layers", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2.0 steps (attention kernels / 2 layers): 9.0 kernels/step" in printed
    assert "gaps 8.0 us/step (before attention kernels 8.0, host waits over 20 us 0.0)" in printed
    assert json.loads(out.read_text())["gpu_busy_us_per_step"] == 138


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="not a regular file"):
        read_trace(tmp_path)
    with pytest.raises(SystemExit, match="no GPU kernels"):
        breakdown([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}])
    with pytest.raises(SystemExit, match=r"no attention kernel .*--steps"):
        breakdown([_kernel("nvjet_x", 0, 1)])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json"), "--layers", "0"])


def test_inductor_reductions_are_listed_by_launch_shape():
    """The same reduction kernel launched with two grids (two compilations' picks) is two rows, each with its
    calls per step and mean duration; kernels that are not inductor reductions are not listed."""
    events, t = [], 0.0
    for _step in range(2):
        for grid, block, dur in (([512, 1, 1], [128, 1, 1], 1.5), ([16384, 1, 1], [64, 1, 1], 10.9)):
            events.append(dict(_kernel("triton_per_fused_add_mul_select_slice_sum_0", t, dur),
                               args={"grid": grid, "block": block}))
            t += dur + 1
        events.append(dict(_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", t, 20),
                           args={"grid": [8, 1, 1], "block": [128, 1, 1]}))
        t += 21
    result = breakdown(events, layers=1)
    assert result["reduction_launches"] == [
        {"name": "triton_per_fused_add_mul_select_slice_sum_0", "grid": [16384, 1, 1], "block": [64, 1, 1],
         "calls_per_step": 1.0, "us_per_call": 10.9, "us_per_step": 10.9},
        {"name": "triton_per_fused_add_mul_select_slice_sum_0", "grid": [512, 1, 1], "block": [128, 1, 1],
         "calls_per_step": 1.0, "us_per_call": 1.5, "us_per_step": 1.5}]
    assert breakdown(_two_steps_of_two_layers(), layers=2)["reduction_launches"][0]["grid"] == []  # no args: unknown
