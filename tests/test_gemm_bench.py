"""tools/lab/gemm_bench.py (issue 43: cuBLAS against the skinny Triton GEMM, GPU only): its shapes are the engine's
GEMMs with the shrink's rows, and it refuses bad input in one line before anything runs."""

from __future__ import annotations

import pytest
import torch

from tools.lab.gemm_bench import main, projection_shapes


def test_its_shapes_are_the_engines_gemms_with_the_shrinks_rows(smoke_study, snapshot_cache):
    from rollout_lib.backends import create_backend
    from rollout_lib.study.workload import Workload

    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache, engine={"LORA_SHRINK": "in_base_gemm"})
    backend.cold_start()
    try:
        layer = backend.engine.layers[0]
        engine = {name: tuple(layer.proj[name].weight_cat.shape) for name in ("qkv", "o", "gate_up", "down")}
    finally:
        backend.teardown()
    assert projection_shapes(Workload(smoke_study).arch, smoke_study.actor.lora.rank) == engine


@pytest.mark.parametrize(("argv", "message"), [
    (["--out", "x.json", "--rows", "4", "17"], "--rows: [4, 17] is not allowed; allowed: row counts from 1 to 16"),
    (["--out", "x.json", "--calls", "0"], "--calls/--repeats: 0/20 is not allowed; allowed: integers >= 1"),
    (["--out", "x.json", "--params", "nowhere.yaml"], "--params: nowhere.yaml is not allowed; allowed: a "
                                                      "preregistration file that exists"),
])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_an_existing_out_is_refused_before_anything_runs_and_left_as_it_was(tmp_path, capsys):
    """Lease 34's sweep wrote its first projection to --out and then died refusing to rewrite it: the file is
    sealed once, at the end (progress goes to `<out>.partial.json`), and one already there is refused up front."""
    from tools.lab.gemm_bench import partial_path

    out = tmp_path / "x.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(out)])
    assert exit_info.value.code == 2
    assert f"--out: {out} exists; allowed: a new file" in capsys.readouterr().err
    assert out.read_text() == "{}" and partial_path(out) == tmp_path / "x.partial.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the tool runs instead of refusing")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.json")])
    assert "a CUDA GPU is needed" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_help_names_what_it_measures(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "cuBLAS against GEMM_KERNEL" in out and "--rows" in out


@pytest.mark.parametrize(("config", "message"), [
    ({"block_n": 48}, r"^block_n 48 is not allowed; allowed: a power of two >= 16"),
    ({"block_k": 8}, r"^block_k 8 is not allowed; allowed: a power of two >= 16"),
    ({"warps": 3}, r"^warps/stages 3/4 is not allowed; allowed: warps 1, 2, 4 or 8, stages 1-8$"),
    ({"splits": 16}, r"^splits 16 is not allowed; allowed: 1-8 or None"),
])
def test_a_launch_configuration_the_kernel_cannot_take_is_refused_by_name(config, message):
    from rollout_lib.backends import skinny_gemm

    with pytest.raises(ValueError, match=message):
        skinny_gemm.Launch(**config)




def test_the_sweep_covers_each_projections_configurations_once_with_whole_slices():
    """`--sweep`'s configurations per projection of the study's actor: every one a configuration the kernel
    takes, no repeats, each slice of K at least one iteration long, the engine's own (DEFAULT, splits_for's
    slices) among them, and a doubled slice count where splits_for leaves room for one."""
    from rollout_lib.backends import skinny_gemm
    from rollout_lib.study.prereg import load
    from rollout_lib.study.workload import Workload
    from tools.lab.gemm_bench import DEFAULT_PARAMS, sweep_configs

    study = load(DEFAULT_PARAMS)
    for name, (features, inner) in projection_shapes(Workload(study).arch, study.actor.lora.rank).items():
        configs = sweep_configs(features, inner, 132)
        assert len(configs) == len(set(configs)) and 27 <= len(configs) <= 54, (name, len(configs))
        assert all(config.splits * config.block_k <= inner for config in configs)
        engine = skinny_gemm.Launch(splits=skinny_gemm.splits_for(features, inner, 132))
        assert engine in configs, name
        doubled = min(2 * engine.splits, skinny_gemm.MAX_SPLITS)
        assert (doubled == engine.splits or doubled * engine.block_k > inner
                or skinny_gemm.Launch(splits=doubled) in configs), name


def test_more_distinct_weights_than_calls_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "x.json", "--calls", "8", "--weights", "28"])
    assert exit_info.value.code == 2
    assert "--weights: 28 is not allowed; allowed: 1 to --calls (8)" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_fastest_is_among_the_configurations_that_ran():
    from tools.lab.gemm_bench import fastest

    timed = [{"block_n": 32, "us": 6.5}, {"block_n": 64, "us": "not_measured", "not_run": "shared memory"},
             {"block_n": 128, "us": 5.9}]
    assert fastest(timed) == {"block_n": 128, "us": 5.9}
    assert fastest([{"block_n": 64, "us": "not_measured", "not_run": "shared memory"}]) == "not_measured"


def test_a_configuration_the_gpu_cannot_hold_is_recorded_not_run_and_the_sweep_goes_on(monkeypatch):
    errors = pytest.importorskip("triton.runtime.errors", reason="needs Triton (its OutOfResources); not installed")
    from tools.lab import gemm_bench

    def out_of_shared_memory(fn, calls, repeats):
        raise errors.OutOfResources(294912, 232448, "shared memory")

    monkeypatch.setattr(gemm_bench, "time_in_graph", out_of_shared_memory)
    record = gemm_bench.time_config(lambda index: None, 56, 20)
    assert record["us"] == "not_measured" and "294912" in record["not_run"] and "shared memory" in record["not_run"]
    monkeypatch.setattr(gemm_bench, "time_in_graph", lambda fn, calls, repeats: 6.0e-6)
    assert gemm_bench.time_config(lambda index: None, 56, 20) == {"us": pytest.approx(6.0)}


def test_the_cold_reading_is_the_flush_and_call_graph_less_the_flush_alone(monkeypatch):
    """`time_cold`: each call of the timed graph flushes first, then calls; the flush's own time is taken off (a
    call whose loads come from HBM, as between a decode step's layers)."""
    from tools.lab import gemm_bench

    order = []

    def timed(fn, calls, repeats):
        order.clear()
        fn(7)
        return 40e-6 if order == ["flush", ("call", 7)] else 36e-6 if order == ["flush"] else float("nan")

    monkeypatch.setattr(gemm_bench, "time_in_graph", timed)
    seconds = gemm_bench.time_cold(lambda index: order.append(("call", index)), lambda: order.append("flush"), 56,
                                   20)
    assert seconds == pytest.approx(4e-6)
