"""The benchmarks import, parse their arguments, and run their smallest CPU paths (seconds each):
``python -m benchmarks NAME`` must not first fail on a lent GPU machine, where time is short."""

import json
import os
import sys

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import harness
from benchmarks.registry import BENCHMARKS

NEW = ("never-slower", "pool-decode", "varlen", "cp-scaling")
CUDA_ONLY = ("kernels", "block", "decode", "compile-time")


def _parser(name):
    import argparse
    import importlib

    p = argparse.ArgumentParser(prog=name)
    p.add_argument("--quick", action="store_true")
    importlib.import_module(BENCHMARKS[name].module).add_arguments(p)
    return p


def test_every_benchmark_is_listed_and_parses_its_defaults(capsys):
    assert set(NEW) <= set(BENCHMARKS)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    listed = capsys.readouterr().out
    for name, entry in BENCHMARKS.items():
        assert name in listed
        p = _parser(name)
        if entry.tool:  # subcommands: --help must still work
            with pytest.raises(SystemExit) as e:
                p.parse_args(["--help"])
            assert e.value.code == 0
        else:
            assert p.parse_args([]).quick is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
@pytest.mark.parametrize("name", CUDA_ONLY + ("varlen", "pool-decode"))
def test_cuda_benchmarks_exit_with_a_message_without_cuda(name):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--quick"])
    assert "needs CUDA" in str(e.value.code) and name in str(e.value.code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the sections left out where no GPU is visible")
def test_never_slower_leaves_gpu_sections_out_and_requires_cuda_for_them_alone():
    with pytest.raises(SystemExit) as e:
        cli.main(["never-slower", "--section", "decode,short"])
    assert "needs CUDA" in str(e.value.code)
    with pytest.raises(SystemExit, match="unknown"):
        cli.main(["never-slower", "--section", "decod"])
    with pytest.raises(SystemExit, match="unknown"):
        cli.main(["never-slower", "--section", "cpu", "--impls", "ours,flash"])


def test_never_slower_cpu_section(tmp_path, capsys):
    """The CPU section at its tiny shapes: every case a row, the float64 check passed, the forced
    backend rewrote the time loop, ratios computed, files written with the stamp."""
    assert cli.main(["never-slower", "--section", "cpu", "--quick", "--impls", "eager,forced", "--rounds", "1",
                     "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("*.json")
    data = json.loads(js.read_text())
    assert data["meta"]["sections"] == "cpu" and data["meta"]["commit"]
    assert js.name.startswith("cpu-") and js.name.endswith("-never-slower-cpu.json")
    rows = data["rows"]
    assert [r["form"] for r in rows] == ["decode", "short", "loop"]
    for r in rows:
        assert set(r["cols"]) == {"eager", "forced"}, r
        for c in r["cols"].values():
            assert c["rel_err"] < 1e-5 and c["ms"] > 0
        assert r["forced_x"] == pytest.approx(r["cols"]["forced"]["ms"] / r["cols"]["eager"]["ms"])
    assert rows[2]["cols"]["forced"]["rewrites"] == 1
    assert "forced / best" in capsys.readouterr().out


def test_never_slower_cases_reference_matches_the_programs():
    """Each step program, run eagerly in float64, agrees with the case's reference (and updates its
    cache to the reference state), for both gates."""
    from benchmarks import never_slower_cases as cases

    for form, shape in (("decode", (2, 1, 3, 4, 5)), ("short", (2, 3, 3, 4, 5))):
        for gate in ("vector", "scalar"):
            case = cases.Case("cpu", form, gate, shape, "cpu", torch.float64)
            args = case.make_inputs()
            ref_o, ref_s = case.reference(args)
            o = case.program(*args)
            assert torch.allclose(o, ref_o) and torch.allclose(args[4].double(), ref_s, rtol=1e-6), (form, gate)


def test_pool_decode_cpu(capsys):
    assert cli.main(["pool-decode", "--device", "cpu", "--quick", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours_pool_vk" in out and "ours_batch" in out and "error" not in out


def test_varlen_cpu(capsys):
    assert cli.main(["varlen", "--device", "cpu", "--quick", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefix-states fwd (events)" in out and "packed / fixed" in out


def test_cp_scaling_tables_and_process_environment(monkeypatch):
    from benchmarks import cp_scaling

    rows = [{"world": 1, "T_per_rank": 8, "step_ms": 4.0, "steady_ms": 3.8, "comm_alone_ms": 0.0,
             "comm_in_step_ms": 0.0},
            {"world": 2, "T_per_rank": 4, "step_ms": 2.5, "steady_ms": 2.0, "comm_alone_ms": 0.1,
             "comm_in_step_ms": 0.2}]
    text = cp_scaling.cp_table(rows)
    assert rows[1]["speedup"] == pytest.approx(1.6) and rows[1]["comm_in_step_share"] == pytest.approx(0.08)
    assert rows[1]["steady_speedup"] == pytest.approx(1.9)
    assert "1.60" in text and "1.90" in text
    assert harness.PROCESS_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.mark.slow
def test_cp_scaling_cpu_one_and_two_processes(capsys, monkeypatch):
    """gloo processes on CPU (tens of seconds: each spawns and imports torch)."""
    for name in harness.PROCESS_ENV:  # run() sets them for its children; restored after the test
        monkeypatch.setenv(name, "unset")
    assert cli.main(["cp-scaling", "--device", "cpu", "--worlds", "1,2", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 128 |" in out
    assert all(os.environ[name] == value for name, value in harness.PROCESS_ENV.items())


def test_fla_warm_reports_a_child_past_its_limit(monkeypatch, tmp_path):
    """The warm-up's limit: a child that takes longer is stopped and reported, not waited for."""
    from benchmarks import fla_warm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fla_warm.sys, "executable", sys.executable)
    real_run = fla_warm.subprocess.run
    monkeypatch.setattr(fla_warm.subprocess, "run",
                        lambda cmd, **kw: real_run([sys.executable, "-c", "import time; time.sleep(30)"], **kw))
    ok, took, why = fla_warm.warm("chunk_gla", (1, 64, 2, 16, 16), budget_s=1.0)
    assert not ok and took < 10 and "limit" in why and str(tmp_path) in why
    assert fla_warm.cache_dir() == str(tmp_path)


def test_fla_autotune_results_round_trip(monkeypatch, tmp_path):
    """Saved autotune files land in a fresh cache under the same key directory; others are not copied."""
    from benchmarks import fla_warm

    cache, saved, fresh = tmp_path / "cache", tmp_path / "saved", tmp_path / "fresh"
    (cache / "abc123").mkdir(parents=True)
    (cache / "abc123" / "chunk_fwd_kernel.autotune.json").write_text('{"key": [1], "configs_timings": []}')
    (cache / "abc123" / "chunk_fwd_kernel.cubin").write_bytes(b"binary")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert fla_warm.save_autotune(str(saved)) == 1
    assert [p.name for p in saved.rglob("*") if p.is_file()] == ["chunk_fwd_kernel.autotune.json"]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert fla_warm.load_autotune(str(saved)) == 1
    assert (fresh / "abc123" / "chunk_fwd_kernel.autotune.json").read_text().startswith('{"key"')
    assert fla_warm.load_autotune(str(saved)) == 0  # already there


def test_cpu_benchmark_recognition_part(capsys):
    assert cli.main(["cpu", "--quick", "--parts", "recognition"]) == 0
    assert "recognition of a T=64 loop graph" in capsys.readouterr().out


@pytest.mark.slow
def test_models_quick_on_cpu(capsys):
    """transformers' Mamba2 at tiny shapes on CPU (minutes: it compiles every phase)."""
    pytest.importorskip("transformers")
    assert cli.main(["models", "--quick"]) == 0


def test_tune_ab_patches_find_their_text():
    """Every ablation of ``tune ab`` finds the source it replaces (a stale one would fail on the GPU)."""
    from benchmarks import tune_ab
    from gla_inductor.kernels import standalone

    for name, patches in tune_ab.PATCHES.items():
        for template, old, _ in patches:
            assert old in standalone.load_template(template), f"{name}: {old!r} not in {template}"


@pytest.mark.parametrize("gate", ["vector", "scalar", "constant", "none"])
def test_tune_ab_inputs_of_every_gate(gate):
    from benchmarks import inputs

    q, k, v, g, g_gamma = inputs.ab_inputs(1, 8, 2, 16, 16, gate, device="cpu")
    assert q.shape == (1, 8, 2, 16) and v.shape == (1, 8, 2, 16)
    assert (g is None) == (gate in ("constant", "none")) and (g_gamma is None) == (gate != "constant")
    if g_gamma is not None:
        assert g_gamma.shape == (2,) and bool((g_gamma <= 0).all())


def test_gpu_busy_time_counts_overlapping_kernels_once():
    from benchmarks.harness import busy_us

    # two streams' kernels overlapping, one nested in another, a gap, unsorted
    assert busy_us([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (5.5, 5.7)]) == 4.0
    assert busy_us([]) == 0.0
