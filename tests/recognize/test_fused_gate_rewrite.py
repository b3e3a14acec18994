"""Fused gates in the backend (``recognize/gate.py``): it fuses logsigmoid(x) / c (clamped),
log(sigmoid(x)) and a * softplus(x + bias) into the op it rewrote, through the layout ops between
them, and leaves look-alikes unfused; outputs and every gradient as eager's. The ops' own
numerics are tests/ops/test_fused_gate_op.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gla_inductor

from helpers import FP32_TOL, rel_err, rewrite_then_eager

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")

def parallel_gla(q, k, v, g):
    """Naive parallel GLA, head-first inside ([B, T, H, D] in and out)."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    G = g.cumsum(2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    A = (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1) * q.shape[-1] ** -0.5
    return (A @ v).transpose(1, 2)


def scalar_parallel(q, k, v, g):
    """Naive parallel GLA with a scalar gate g [B, T, H]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    G = g.transpose(1, 2).cumsum(-1)  # [B, H, T]
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    D = torch.where(causal, (G[..., :, None] - G[..., None, :]).exp(), 0.0)
    return ((q @ k.transpose(-1, -2)) * D @ v).transpose(1, 2)


def gla_logsigmoid(q, k, v, x):
    return parallel_gla(q, k, v, (F.logsigmoid(x) / 16).clamp_min(-1.0))


def gla_log_sigmoid(q, k, v, x):
    return parallel_gla(q, k, v, torch.log(torch.sigmoid(x)))


def gla_softplus_vector(q, k, v, x, A_log, dt_bias):
    return parallel_gla(q, k, v, -A_log.float().exp()[:, None] * F.softplus(x + dt_bias))


def gdn_softplus_scalar(q, k, v, x, A_log, dt_bias):
    return scalar_parallel(q, k, v, -A_log.exp() * F.softplus(x.float() + dt_bias))


def read_twice(q, k, v, x):
    g = F.logsigmoid(x)
    return parallel_gla(q, k, v, g) + g.sum()


def softplus_beta2(q, k, v, x, A_log, dt_bias):
    return scalar_parallel(q, k, v, -A_log.exp() * F.softplus(x + dt_bias, beta=2.0))


def softplus_a_over_time(q, k, v, x, A_log, dt_bias):
    """a varies over time, not per head: no fused gate's parameter."""
    a = -A_log.exp() * torch.linspace(0.5, 1.0, x.shape[1])[None, :, None]
    return scalar_parallel(q, k, v, a * F.softplus(x + dt_bias))


def _args(fn, B=2, T=9, H=2, K=4, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen).requires_grad_() for d in (K, K, V))
    scalar = fn in (gdn_softplus_scalar, softplus_beta2, softplus_a_over_time)
    x = (2 * torch.randn(*((B, T, H) if scalar else (B, T, H, K)), generator=gen)).requires_grad_()
    if fn in (gla_logsigmoid, gla_log_sigmoid, read_twice):
        return [q, k, v, x]
    A_log = torch.randn(H, generator=gen).requires_grad_()
    dt_bias = torch.randn(*((H,) if scalar else (K,)), generator=gen).requires_grad_()
    return [q, k, v, x, A_log, dt_bias]


@pytest.mark.parametrize("fn, fused", [
    (gla_logsigmoid, 1), (gla_log_sigmoid, 1), (gla_softplus_vector, 1), (gdn_softplus_scalar, 1),
    (read_twice, 0), (softplus_beta2, 0), (softplus_a_over_time, 0),
])
def test_backend_fuses_gate_functions(fn, fused):
    """Every program is rewritten; the gate is fused exactly where it is a recognized function read
    by the op alone. Outputs and the gradients of every input match eager."""
    args = _args(fn)
    out = torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert counters["gla_inductor"]["fused_gates"] == fused
    got = torch.autograd.grad(out.square().sum(), args)
    want_out = fn(*args)
    want = torch.autograd.grad(want_out.square().sum(), args)
    assert rel_err(out, want_out) <= FP32_TOL
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= FP32_TOL, f"gradient of argument {i}"




def test_fusion_can_be_switched_off():
    args = _args(gla_logsigmoid)
    with gla_inductor.config.patch(fuse_gates=False):
        torch.compile(gla_logsigmoid, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1 and counters["gla_inductor"]["fused_gates"] == 0


def test_fusion_failure_keeps_the_unfused_rewrite(monkeypatch):
    """An exception inside the pass is logged and the graph keeps the GLA rewrite, unfused."""
    import sys

    backend_module = sys.modules["gla_inductor.backend"]  # the package's `backend` is the function

    def broken(gm):
        for n in list(gm.graph.nodes):
            if n.target is torch.ops.gla_inductor.chunk_fwd.default:
                n.args = n.args[:3]  # half-done damage, then a crash
        raise RuntimeError("injected")

    monkeypatch.setattr(backend_module, "fuse_gates", broken)
    args = _args(gla_logsigmoid)
    out = torch.compile(gla_logsigmoid, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1 and counters["gla_inductor"]["failures"] == 1
    want = gla_logsigmoid(*args)
    assert rel_err(out, want) <= FP32_TOL
