"""``python -m benchmarks tp-overhead`` runs its gloo path on CPU and reports every pass: the
command the GPU run uses must not first fail on a lent machine."""

import pytest

from benchmarks import __main__ as cli


def test_tp_overhead_table():
    from benchmarks import tp_overhead

    row = {"world": 2, "heads_per_rank": 8, "mode": "eager", "pass": "fwd", "dtensor_ms": 1.1, "plain_ms": 1.0,
           "ratio": 1.1, "rank_ratios": [1.1, 1.05], "dtensor_host_ms": 0.2, "plain_host_ms": 0.1}
    text = tp_overhead.table([row])
    assert "| 2 | 8 | eager | fwd | 1.100 | 1.000 | 1.100 | 1.100 1.050 | 0.200 | 0.100 |" in text


@pytest.mark.slow
def test_tp_overhead_cpu_two_processes(capsys):
    """Two gloo processes (tens of seconds: spawns, and compiles four graphs per process)."""
    assert cli.main(["tp-overhead", "--device", "cpu", "--worlds", "2", "--quick"]) == 0
    out = capsys.readouterr().out
    for mode in ("eager", "compiled"):
        for pass_ in ("fwd", "fwd+bwd"):
            assert f"| 2 | 2 | {mode} | {pass_} |" in out, out
