"""The CUDA entry points route to the Triton kernels, or to the PyTorch implementation when
the kernels do not apply or are switched off. Exercised on CPU through the interpreter."""

import pytest
import torch

import gla_inductor
from gla_inductor.impl import chunked as chunked_impl
from gla_inductor.ops import dispatch
from gla_inductor.contract import GLACall

from helpers import gla_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter routing only")


def inputs(dtype=torch.float32):
    x = gla_inputs("vector", B=1, T=20, H=2, K=8, V=12, dtype=dtype, with_h0=False)
    return x["q"], x["k"], x["v"], x["g"]


def test_kernels_and_fallback_agree():
    q, k, v, g = inputs()
    o_k, ht_k = dispatch.chunk_fwd_gpu(GLACall(q, k, v, g, None, None, 0.3, True, False))
    with gla_inductor.config.patch(triton_kernels=False):
        o_t, ht_t = dispatch.chunk_fwd_gpu(GLACall(q, k, v, g, None, None, 0.3, True, False))
    ref_o, ref_ht = chunked_impl._chunk_fwd_torch(q, k, v, g, None, None, 0.3, True, False)
    assert torch.equal(o_t, ref_o) and torch.equal(ht_t, ref_ht)
    assert torch.allclose(o_k, ref_o, rtol=1e-4, atol=1e-5)
    assert torch.allclose(ht_k, ref_ht, rtol=1e-4, atol=1e-5)


def test_unsupported_dtype_falls_back():
    q, k, v, g = inputs(torch.float64)
    assert "float64" in dispatch.chunk_unsupported_reason(GLACall(q, k, v, g, None, None))
    o, _ = dispatch.chunk_fwd_gpu(GLACall(q, k, v, g, None, None, 0.3, False, False))
    assert o.dtype == torch.float64
    assert torch.equal(o, chunked_impl._chunk_fwd_torch(q, k, v, g, None, None, 0.3, False, False)[0])


def test_untrusted_gate_kinds_fall_back():
    q, k, v, g = inputs()
    gs = g[..., 0]
    assert dispatch.chunk_unsupported_reason(GLACall(q, k, v, gs, None, None)) is None
    with gla_inductor.config.patch(triton_gates=("vector",)):
        assert "scalar gates" in dispatch.chunk_unsupported_reason(GLACall(q, k, v, gs, None, None))
        o, _ = dispatch.chunk_fwd_gpu(GLACall(q, k, v, gs, None, None, 0.3, False, False))
    assert torch.equal(o, chunked_impl._chunk_fwd_torch(q, k, v, gs, None, None, 0.3, False, False)[0])
