"""REDUCTION_LAUNCH (`rollout_lib/backends/reduction_launch.py`): the hook on inductor's first-run pick of a
persistent reduction's launch configuration. On a CPU: the pick, the hook's scope (the rule only inside a compiled
piece's call, only for persistent reductions, inductor's own benchmark otherwise) and the engine setting's
refusals. On a GPU: an engine under each rule made its picks through the hook, the largest XBLOCK each time, or the
largest that still gave every SM a program."""

from __future__ import annotations

import types

import pytest

from rollout_lib.backends import reduction_launch


def _config(xblock):
    return types.SimpleNamespace(kwargs={"XBLOCK": xblock, "R0_BLOCK": 16})


def _autotuner(heuristic, xblocks, name="triton_per_fused_sum_0"):
    launchers = [types.SimpleNamespace(config=_config(x)) for x in xblocks]
    return types.SimpleNamespace(heuristic_type=heuristic, launchers=launchers, fn=types.SimpleNamespace(
        __name__=name, arg_names=["in_ptr0", "out_ptr0", "xnumel", "r0_numel"]))


@pytest.fixture
def hooked(monkeypatch):
    """The hook installed over a stand-in for inductor's benchmark (which records that it ran and keeps the first
    launcher, as a benchmark that found XBLOCK 1 fastest would), restored afterwards."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    benchmarked = []

    def benchmark(self, *args, **kwargs):
        benchmarked.append(self.fn.__name__)
        self.launchers = self.launchers[:1]

    monkeypatch.setattr(CachingAutotuner, "autotune_to_one_config", benchmark)
    monkeypatch.setattr(reduction_launch, "PICKS", {})
    reduction_launch.install()
    reduction_launch.install()  # idempotent: wraps once
    assert CachingAutotuner.autotune_to_one_config.__wrapped__ is benchmark
    return CachingAutotuner.autotune_to_one_config, benchmarked


def test_fewest_programs_is_the_largest_xblock_and_the_first_of_equals():
    configs = [_config(1), _config(128), _config(8), _config(128), _config(32)]
    assert reduction_launch.fewest_programs(configs) is configs[1]


@pytest.mark.parametrize(("xnumel", "want"), [
    (4096, 8),         # 4 rows of 1,024 features: XBLOCK 32 gives 128 programs, short of 132 SMs; 8 gives 512
    (4 * 4096, 32),    # 4 rows of qkv's 4,096: XBLOCK 128 gives 128 programs; 32 gives 512
    (16 * 4096, 128),  # 16 rows: 512 programs at XBLOCK 128
    (100, 1),          # fewer elements than SMs: the smallest XBLOCK, the most programs
    (132, 1),          # exactly one program per SM at XBLOCK 1
])
def test_fill_multiprocessors_is_the_largest_xblock_that_still_gives_every_sm_a_program(xnumel, want):
    configs = [_config(1), _config(8), _config(32), _config(128), _config(8)]
    picked = reduction_launch.fill_multiprocessors(configs, xnumel, 132)
    assert picked.kwargs["XBLOCK"] == want
    if want == 8:
        assert picked is configs[1]  # the first of equals


def test_fill_multiprocessors_picks_by_the_first_calls_xnumel_through_the_hook(hooked, monkeypatch):
    from torch._inductor.runtime.hints import HeuristicType

    pick, benchmarked = hooked
    monkeypatch.setattr(reduction_launch, "_multiprocessors", lambda: 132)
    four_rows = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 8, 32, 128])
    no_xnumel = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 8, 32], name="triton_per_fused_other_1")
    no_xnumel.fn.arg_names = ["in_ptr0", "out_ptr0"]

    def piece():
        pick(four_rows, "in", "out", 4 * 4096, 16)
        pick(no_xnumel, "in", "out")

    reduction_launch.with_rule(piece, "fill_multiprocessors")()
    assert [launcher.config.kwargs["XBLOCK"] for launcher in four_rows.launchers] == [32]
    assert [launcher.config.kwargs["XBLOCK"] for launcher in no_xnumel.launchers] == [32]  # the fewest programs
    assert benchmarked == []
    assert reduction_launch.PICKS == {"triton_per_fused_sum_0": (32, (1, 8, 32, 128), 16384),
                                      "triton_per_fused_other_1": (32, (1, 8, 32), None)}


def test_the_rule_picks_inside_a_compiled_pieces_call_only_and_only_persistent_reductions(hooked):
    from torch._inductor.runtime.hints import HeuristicType

    pick, benchmarked = hooked
    persistent = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 8, 32, 128])
    looped = _autotuner(HeuristicType.REDUCTION, [1, 8, 64], name="triton_red_fused_log_softmax_1")
    outside = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 8, 32], name="triton_per_fused_other_2")

    def piece(*autotuners):  # what a compiled piece's first call does: inductor picks for each kernel it runs
        for autotuner in autotuners:
            pick(autotuner)
        return "out"

    combo = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 8], name="triton_per_fused_combo_3")
    for launcher, block in zip(combo.launchers, (1, 8), strict=True):  # blocks per sub-kernel: no one XBLOCK
        launcher.config.kwargs = {"XBLOCK_0": block, "XBLOCK_1": 8}
    assert reduction_launch.with_rule(piece, "fewest_programs")(persistent, looped, combo) == "out"
    pick(outside)  # after the call: inductor's own benchmark again
    assert [launcher.config.kwargs["XBLOCK"] for launcher in persistent.launchers] == [128]
    assert [launcher.config.kwargs["XBLOCK"] for launcher in looped.launchers] == [1]
    assert [launcher.config.kwargs["XBLOCK"] for launcher in outside.launchers] == [1]
    assert benchmarked == ["triton_red_fused_log_softmax_1", "triton_per_fused_combo_3", "triton_per_fused_other_2"]
    assert reduction_launch.PICKS == {"triton_per_fused_sum_0": (128, (1, 8, 32, 128), None)}


def test_the_rule_ends_with_the_call_when_the_call_raises(hooked):
    from torch._inductor.runtime.hints import HeuristicType

    pick, benchmarked = hooked

    def failing_piece():
        raise RuntimeError("inductor failed")

    with pytest.raises(RuntimeError, match="inductor failed"):
        reduction_launch.with_rule(failing_piece, "fewest_programs")()
    later = _autotuner(HeuristicType.PERSISTENT_REDUCTION, [1, 128])
    pick(later)
    assert benchmarked == ["triton_per_fused_sum_0"] and len(later.launchers) == 1
    assert later.launchers[0].config.kwargs["XBLOCK"] == 1


def test_benchmarked_leaves_the_piece_and_the_options_alone_and_a_bad_rule_is_refused():
    def piece():
        return None

    assert reduction_launch.with_rule(piece, "benchmarked") is piece
    assert reduction_launch.compile_options("benchmarked") == {}
    assert reduction_launch.compile_options("fewest_programs") == {"autotune_local_cache": False,
                                                                  "autotune_remote_cache": False}
    with pytest.raises(ValueError, match=r"^REDUCTION_LAUNCH 'fastest' is not allowed; allowed: benchmarked, "
                                         r"fewest_programs, fill_multiprocessors$"):
        reduction_launch.with_rule(piece, "fastest")


def test_the_engine_setting_is_checked_by_name_and_refused_where_torch_lacks_the_hooked_method(monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from rollout_lib.backends import compact_qwen3

    assert compact_qwen3.check_engine_settings({"REDUCTION_LAUNCH": "fewest_programs"}) == {
        "REDUCTION_LAUNCH": "fewest_programs"}
    with pytest.raises(ValueError, match=r"^REDUCTION_LAUNCH 'xblock1' is not allowed; allowed: benchmarked, "
                                         r"fewest_programs, fill_multiprocessors$"):
        compact_qwen3.check_engine_settings({"REDUCTION_LAUNCH": "xblock1"})
    monkeypatch.delattr(CachingAutotuner, "autotune_to_one_config")
    with pytest.raises(ValueError, match=r"^REDUCTION_LAUNCH fewest_programs needs CachingAutotuner"):
        reduction_launch.install()


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["fewest_programs", "fill_multiprocessors"])
def test_a_bf16_engine_under_the_rule_picks_the_largest_xblock_for_its_persistent_reductions(smoke_study,
                                                                                          snapshot_cache, rule):
    """The engine's compiled pieces ran their persistent reductions' first calls under the rule (the LoRA expand
    reductions among them), each at the largest XBLOCK inductor generated, or the largest that gave every SM a
    program at its first call's xnumel; the environment names the setting."""
    import torch

    from rollout_lib.backends import create_backend
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.workload import Workload

    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[-1]
    torch._dynamo.reset()
    reduction_launch.PICKS.clear()
    backend = create_backend("hf_cached", smoke_study, device="cuda", compute_dtype="bfloat16", decode="graphs",
                             step_compile="inductor", cache_dir=snapshot_cache,
                             engine={"REDUCTION_LAUNCH": rule})
    backend.cold_start()
    try:
        backend.sync_policy(policy)
        backend.generate(workload.requests(workload.cell("p16-r24-n2-stochastic")))
        assert backend.environment()["reduction_launch"] == rule
        assert backend.environment()["inductor_options"]["autotune_local_cache"] is False
    finally:
        backend.teardown()
    assert any("sum" in name for name in reduction_launch.PICKS), reduction_launch.PICKS
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    for picked, among, xnumel in reduction_launch.PICKS.values():
        if rule == "fewest_programs":
            assert picked == max(among), reduction_launch.PICKS
        else:
            assert xnumel is not None, reduction_launch.PICKS  # inductor's kernels name their xnumel
            filling = [block for block in among if -(-xnumel // block) >= multiprocessors]
            assert picked == (max(filling) if filling else min(among)), reduction_launch.PICKS
