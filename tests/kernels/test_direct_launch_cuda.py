"""The standalone kernels' direct launches (a compiled kernel called without ``JITFunction.run``)
give exactly the outputs of launches through Triton, on the GPU."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_direct_launch_matches_launch_through_triton(monkeypatch, gate):
    import gla_inductor
    from gla_inductor.kernels import standalone

    B, T, H, K, V = 8, 1024, 8, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn((B, T, H, K) if gate == "vector" else (B, T, H), device="cuda", generator=gen)) / 16
    with torch.no_grad():
        direct = [gla_inductor.chunk_gla(q, k, v, g)[0] for _ in range(3)]  # the later calls launch directly
        call = standalone.StandaloneKernel.__call__

        def via_triton(self, *args, **kwargs):
            self.compiled.clear()
            return call(self, *args, **kwargs)

        monkeypatch.setattr(standalone.StandaloneKernel, "__call__", via_triton)
        through_triton = gla_inductor.chunk_gla(q, k, v, g)[0]
    for o in direct:
        assert torch.equal(o, through_triton)
