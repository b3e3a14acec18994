"""The parallel form inside a block, as models write it: q/k/v/g are projections viewed as heads
(the recognizer reads them through the view, with merged axes), and the GLA output is read twice
(by a norm's statistics through a cast, and by the product with them). Both found by the H100 block
benchmark: the first crashed the match (caught: the graph stayed naive), the second replaced only the
cast read and left the naive [B, H, T, T, K] product alive for the other."""

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.backend import _listeners
from gla_inductor.reference import naive_recurrent_gla

from helpers import rel_norm_err

pytestmark = pytest.mark.compat  # run again on the newest torch and triton (.ci/run)


def naive_gla(q, k, v, g):
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))  # [B, H, T, D]
    G = g.cumsum(2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    A = (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1) * q.shape[-1] ** -0.5
    return (A @ v).transpose(1, 2)


def block(x, wq, wk, wv, wg, attn=naive_gla):
    B, T, _ = x.shape
    H, K = 2, 8
    q, k, v = (F.linear(x, w).view(B, T, H, K) for w in (wq, wk, wv))
    g = F.logsigmoid(F.linear(x, wg).view(B, T, H, K))
    o = attn(q, k, v, g)
    return o * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + 1e-6)


def reference_attn(q, k, v, g):
    return naive_recurrent_gla(q, k, v, g)[0]


def test_block_with_projections_and_a_twice_read_output():
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 12, 16, generator=gen)] + [torch.randn(16, 16, generator=gen) / 4 for _ in range(4)]
    graphs = []
    _listeners.append(lambda gm, result: graphs.append((gm.code, len(result.matches))))
    try:
        torch._dynamo.reset()
        out = torch.compile(block, backend=gla_inductor.backend, fullgraph=True)(*args)
    finally:
        _listeners.pop()
    (code, rewrites), = graphs
    assert rewrites == 1
    assert "masked_fill" not in code and "chunk_fwd" in code  # nothing of the naive form is left
    want = block(*(a.double() for a in args), attn=reference_attn)
    assert rel_norm_err(out, want) < 1e-5
