"""rollout_lib/measure/step_profile.py and `rollout profile-breakdown` (issue 43's per-kernel profile of a
decode step) on hand-made traces whose answer is known, and their refusals."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from rollout_lib.cli import main
from rollout_lib.measure.step_profile import (
    RECORD_KIND,
    StepProfileError,
    breakdown,
    breakdown_record,
    category,
    column_us,
    read_trace,
    trace_gpu,
)
from rollout_lib.safe_read import UnsafeInput


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
    assert result["gpu_active_us_per_step"] == result["gpu_busy_us_per_step"]  # one stream: nothing overlaps
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


H100 = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}]


def _write_trace(path, events, devices=H100):
    path.write_bytes(gzip.compress(json.dumps({"deviceProperties": devices, "traceEvents": events}).encode()))
    return path


def test_the_command_reads_a_gzipped_trace_and_writes_its_record(tmp_path, capsys):
    trace = _write_trace(tmp_path / "run1-p128-r64-n1-greedy.trace.json.gz", _two_steps_of_two_layers())
    out = tmp_path / "b.json"
    assert main(["profile-breakdown", str(trace), "--layers", "2", "--label", "engine U", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(NVIDIA H100 80GB HBM3, cell p128-r64-n1-greedy, 2 layers)" in printed
    assert "2.0 steps (attention kernels / 2 layers): 9.0 kernels/step" in printed
    assert "gaps 8.0 us/step (before attention kernels 8.0, host waits over 20 us 0.0)" in printed
    record = json.loads(out.read_text())
    assert record["kind"] == RECORD_KIND and record["label"] == "engine U" and record["gpu"] == "NVIDIA H100 80GB HBM3"
    assert record["gpu_busy_us_per_step"] == 138 and record["cell"] == "p128-r64-n1-greedy"
    assert record["trace"]["sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
    assert record["trace"]["bytes"] == trace.stat().st_size
    # evidence is never overwritten
    assert main(["profile-breakdown", str(trace), "--layers", "2", "--json", str(out)]) == 2
    assert "exists; evidence is never overwritten" in capsys.readouterr().err


def test_the_layers_default_to_the_studys_actor(tmp_path, capsys):
    """The smoke profile's tiny actor has 2 layers: its trace's steps are counted by them without --layers."""
    trace = _write_trace(tmp_path / "t.json.gz", _two_steps_of_two_layers(), devices=[])
    assert main(["profile-breakdown", str(trace), "--params", "params/profiles/smoke.yaml"]) == 0
    printed = capsys.readouterr().out
    assert "(not_measured, cell not_measured, 2 layers)" in printed and "2.0 steps (attention kernels / 2" in printed


def test_a_plain_trace_and_a_bare_event_list_read_as_the_gzipped_one(tmp_path):
    events = _two_steps_of_two_layers()
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(events))
    record = breakdown_record(plain, 2, cell="p512-r256-n4-greedy")
    assert record["gpu_busy_us_per_step"] == 138 and record["cell"] == "p512-r256-n4-greedy"
    assert record["gpu"] == "not_measured" and record["label"] == "not_measured"


def test_the_report_columns_sum_every_category_once():
    record = breakdown(_two_steps_of_two_layers(), layers=2)
    record["categories"]["kv_cache_write"] = {"kernels": 1, "us": 3.0, "share_of_busy": 0.0}
    record["categories"]["gemm_float32"] = {"kernels": 1, "us": 2.0, "share_of_busy": 0.0}
    columns = column_us(record)
    assert columns == {"GEMMs": 62.0, "attention": 40.0, "norms": 20.0, "LoRA terms and epilogues": 10.0,
                       "sampling": 8.0, "L2 prefetch (side stream)": 0.0, "other": 3.0}
    assert sum(columns.values()) == sum(v["us"] for v in record["categories"].values())


def test_refusals_name_the_problem(tmp_path, capsys):
    with pytest.raises(UnsafeInput, match="is a directory, not a regular file"):
        read_trace(tmp_path)
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises((UnsafeInput, FileNotFoundError)):
        read_trace(tmp_path / "link.json")
    (tmp_path / "junk.json.gz").write_bytes(b"\x1f\x8bnot gzip at all")
    with pytest.raises(StepProfileError, match="not a readable gzip file"):
        read_trace(tmp_path / "junk.json.gz")
    (tmp_path / "object.json").write_text('{"events": []}')
    with pytest.raises(StepProfileError, match="no traceEvents list"):
        read_trace(tmp_path / "object.json")
    with pytest.raises(StepProfileError, match="no GPU kernels"):
        breakdown([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}])
    with pytest.raises(StepProfileError, match=r"no attention kernel .*--steps"):
        breakdown([_kernel("nvjet_x", 0, 1)])
    with pytest.raises(StepProfileError, match="'nvjet_x' has no numeric ts/dur"):
        breakdown([_kernel("nvjet_x", "soon", 1)])
    trace = _write_trace(tmp_path / "t.json.gz", _two_steps_of_two_layers())
    for args, message in ((["--layers", "0"], "layers: 0 is not allowed; allowed: an integer >= 1"),
                          (["--steps", "-1"], "steps: -1.0 is not allowed; allowed: a number > 0"),
                          (["--cell", "p128"], "cell: 'p128' is not allowed; allowed: a cell id such as"),
                          (["--label", "a\nb"], "label: 'a\\nb'... is not allowed; allowed: printable text")):
        out = tmp_path / "never.json"
        code = main(["profile-breakdown", str(trace), "--layers", "2", *args, "--json", str(out)])  # the last wins
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert not out.exists()  # refused before anything was written
    assert main(["profile-breakdown", str(tmp_path / "missing.json.gz"), "--layers", "2"]) == 2
    assert "trace file does not exist" in capsys.readouterr().err


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


def test_a_side_stream_kernel_counts_in_busy_time_but_not_in_active_time():
    """WEIGHT_PREFETCH's kernel runs on its own stream beside the attention: the busy sum counts it, the active
    time (the span less its gaps) does not count the overlap twice."""
    events = _two_steps_of_two_layers()
    attention = [e for e in events if "sdpa" in e["name"]]
    events += [_kernel("l2_prefetch_kernel", e["ts"] - 2, 15) for e in attention]  # from the gap into the attention
    result = breakdown(events, layers=2)
    plain = breakdown(_two_steps_of_two_layers(), layers=2)
    assert result["gpu_busy_us_per_step"] == plain["gpu_busy_us_per_step"] + 2 * 15
    assert result["categories"]["weight_prefetch"] == {"kernels": 2, "us": 30, "share_of_busy": round(30 / 168, 4)}
    assert result["gaps_us_per_step"] == 2 * 2  # the prefetch fills half of each 4 us gap before attention
    assert result["gpu_active_us_per_step"] == plain["gpu_active_us_per_step"] + 2 * 2
    assert column_us(result)["L2 prefetch (side stream)"] == 30


def test_the_trace_start_is_its_base_time_plus_its_first_event(tmp_path):
    """Kineto's `baseTimeNanoseconds` is shared by traces of one machine; each event's ts counts us after it."""
    trace = tmp_path / "t.json"
    events = _two_steps_of_two_layers()  # the first event at ts 0 (a CPU op), kernels from 100 us
    trace.write_text(json.dumps({"baseTimeNanoseconds": 1790857026000000000, "traceEvents": events}))
    assert breakdown_record(trace, 2)["trace"]["started_utc"] == "2026-10-01T12:17:06Z"
    for event in events:
        event["ts"] += 5798079789342.5  # lease 46's first U trace
    trace.write_text(json.dumps({"baseTimeNanoseconds": 1790857026000000000, "traceEvents": events}))
    assert breakdown_record(trace, 2)["trace"]["started_utc"] == "2026-12-07T14:51:45Z"
    trace.write_text(json.dumps({"baseTimeNanoseconds": "soon", "traceEvents": events}))
    assert breakdown_record(trace, 2)["trace"]["started_utc"] == "not_measured"


def test_odd_but_plausible_traces_are_read_or_refused_by_name():
    """A GPU event without its duration is refused (never read as 0 us); kernels of zero duration leave the shares
    not_measured; a launch shape that is not a list of integers is unknown; device properties that are not a list
    name no GPU."""
    no_duration = {"ph": "X", "cat": "kernel", "name": "nvjet_y", "ts": 5}
    with pytest.raises(StepProfileError, match="'nvjet_y' has no numeric ts/dur"):
        breakdown([no_duration], layers=1, steps=1)
    with pytest.raises(StepProfileError, match=r"has ts 5\.0, dur inf"):
        breakdown([dict(no_duration, dur="inf")], layers=1, steps=1)
    instant = breakdown([_kernel("nvjet_y", 5, 0), _kernel("flash_fwd", 6, 0)], layers=1)
    assert instant["categories"]["gemm"]["share_of_busy"] == "not_measured"
    assert instant["gpu_busy_us_per_step"] == 0 and instant["gaps_us_per_step"] == 1
    odd = [dict(_kernel("triton_per_fused_mul_sum_0", 0, 2), args={"grid": 512, "block": [64, "x"]}),
           dict(_kernel("flash_fwd", 3, 2), args=["not", "a", "mapping"])]
    (launch,) = breakdown(odd, layers=1)["reduction_launches"]
    assert launch["grid"] == [] and launch["block"] == []
    assert trace_gpu({"deviceProperties": 3}) == "not_measured"
    assert trace_gpu({"deviceProperties": [{"name": "NVIDIA H200"}, "junk"]}) == "NVIDIA H200"
