"""The GLA block of ``python -m benchmarks block`` (projections, a ``logsigmoid(x) / 16`` gate, GLA in
the pairwise parallel form, RMS norm, output gate), tiny and on CPU: the backend rewrites its GLA
once, fuses the gate into the op, and the compiled block matches eager."""

import torch


def test_benchmark_block_is_rewritten_and_matches_eager():
    from torch._dynamo.utils import counters

    import gla_inductor
    from benchmarks.block import make
    from benchmarks.inputs import naive_pairwise_vector

    block, x, _ = make(naive_pairwise_vector, (2, 24, 2, 16, 16), "cpu", torch.float32)
    torch._dynamo.reset()
    counters.clear()
    try:
        got = torch.compile(block, backend=gla_inductor.backend)(x)
        assert counters["gla_inductor"]["rewrites"] == 1
        assert counters["gla_inductor"]["fused_gates"] == 1
    finally:
        torch._dynamo.reset()
        counters.clear()
    want = block(x)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
