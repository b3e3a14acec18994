"""Fused gates (``gla_inductor.gates``, ``recognize/gate.py``): the GLA ops read a gate function's
input x and apply the function themselves.

  - numerics of the ops (PyTorch path, and the Triton kernels on CUDA or under the interpreter) and
    of the gradients of x, a and bias, against float64 autograd through the explicit gate;
  - the backend fuses logsigmoid(x) / c (clamped), log(sigmoid(x)) and a * softplus(x + bias) into the
    op it rewrote, through the layout ops between them, and leaves look-alikes unfused;
  - compiled, the forward is one template kernel that reads x (no gate kernel before it).
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite
from gla_inductor.reference import naive_recurrent_gla

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP32_TOL = 1e-5

# (gate_fn, constants, parameters): the cases the ops and kernels must agree on
LOGSIG = dict(gate_fn="logsigmoid", gate_scale=1 / 16)
LOGSIG_CLAMPED = dict(gate_fn="logsigmoid", gate_scale=0.5, gate_lo=-1.5)
SOFTPLUS = dict(gate_fn="softplus", gate_lo=0.05, gate_hi=4.0)


pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def explicit_gate(x, gate_fn, gate_scale=1.0, gate_lo=None, gate_hi=None, gate_a=None, gate_bias=None):
    """The gate as a model writes it (the semantics the fused op must reproduce)."""
    if gate_fn == "logsigmoid":
        g = F.logsigmoid(x) * gate_scale
    else:
        a = gate_a.view(*gate_a.shape, *([1] * (x.dim() - 3)))
        g = F.softplus(x + gate_bias)
    if gate_lo is not None or gate_hi is not None:
        g = g.clamp(gate_lo, gate_hi)
    return g if gate_fn == "logsigmoid" else a * g


def _inputs(B, T, H, K, V, vector, gate, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(device).requires_grad_()

    x = dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, H, V),
             g=rand(*((B, T, H, K) if vector else (B, T, H)), s=3.0), initial_state=rand(B, H, K, V))
    params = dict(gate)
    if gate["gate_fn"] == "softplus":
        params["gate_a"] = (-0.2 - torch.rand(H, generator=gen)).to(device).requires_grad_()
        params["gate_bias"] = rand(*((H, K) if vector else (H,)))
    return x, params


def _check_against_float64(x, params, reverse, tol):
    o, ht = gla_inductor.chunk_gla(**x, **params, output_final_state=True, reverse=reverse)
    gen = torch.Generator().manual_seed(7)
    w, wh = torch.randn(o.shape, generator=gen).to(o.device), torch.randn(ht.shape, generator=gen).to(o.device)
    leaves = {**x, **{n: t for n, t in params.items() if isinstance(t, torch.Tensor)}}
    got = torch.autograd.grad((o * w).sum() + (ht * wh).sum(), list(leaves.values()))

    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    consts = {n: c for n, c in params.items() if not isinstance(c, torch.Tensor)}
    g64 = explicit_gate(ref["g"], **consts, gate_a=ref.get("gate_a"), gate_bias=ref.get("gate_bias"))
    o64, ht64 = naive_recurrent_gla(ref["q"], ref["k"], ref["v"], g64, initial_state=ref["initial_state"],
                                    output_final_state=True, reverse=reverse)
    want = torch.autograd.grad((o64 * w.double()).sum() + (ht64 * wh.double()).sum(), list(ref.values()))
    for name, a, b in [("o", o, o64), ("ht", ht, ht64)] + list(zip(["d" + n for n in leaves], got, want)):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("gate", [LOGSIG, LOGSIG_CLAMPED, SOFTPLUS], ids=["logsigmoid", "clamped", "softplus"])
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("reverse", [False, True])
def test_ops_match_the_explicit_gate(gate, vector, reverse):
    """The PyTorch implementation (CPU) or the kernels (CUDA)."""
    x, params = _inputs(2, 70, 2, 8, 6, vector, gate, device=DEVICE)
    _check_against_float64(x, params, reverse, 1e-4 if ON_GPU else FP32_TOL)


@pytest.mark.parametrize("gate", [LOGSIG_CLAMPED, SOFTPLUS], ids=["clamped", "softplus"])
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
def test_kernels_match_the_explicit_gate(gate, vector):
    """The Triton kernels' gate function (gla_common's _gla_gate), on CUDA or under the interpreter,
    with a partial last chunk and key/value sizes that are not powers of two."""
    triton_chunk = pytest.importorskip("gla_inductor.triton_chunk")
    import triton

    if not ON_GPU and type(triton.language.cumsum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    from gla_inductor.gates import GateFn, gate_grads, log_gate

    x, params = _inputs(2, 37, 2, 12, 10, vector, gate, seed=3, device=DEVICE)
    q, k, v, xg, h0 = (x[n].detach() for n in ("q", "k", "v", "g", "initial_state"))
    fn = GateFn(params["gate_fn"], params.get("gate_scale", 1.0), params.get("gate_lo"), params.get("gate_hi"))
    a, bias = (params.get(n) for n in ("gate_a", "gate_bias"))
    a, bias = (None if t is None else t.detach() for t in (a, bias))
    g = log_gate(xg.double(), fn, None if a is None else a.double(), None if bias is None else bias.double(),
                 torch.float64)
    o, ht = triton_chunk.chunk_fwd_triton(q, k, v, xg, None, h0, 0.3, True, False, gate=fn, gate_a=a, gate_bias=bias)
    o64, ht64 = naive_recurrent_gla(q.double(), k.double(), v.double(), g, initial_state=h0.double(), scale=0.3,
                                    output_final_state=True)
    do = torch.randn_like(o)
    dg = triton_chunk.chunk_bwd_triton(q, k, v, xg, None, h0, do, None, 0.3, False, gate=fn, gate_a=a,
                                       gate_bias=bias)[3]
    # logsigmoid: the kernels return x's gradient (GateFn.input_grad); softplus: the log gate's, fp32
    x64 = xg.double().requires_grad_()
    g64 = log_gate(x64, fn, None if a is None else a.double(), None if bias is None else bias.double(),
                   torch.float64)
    o64b, _ = naive_recurrent_gla(q.double(), k.double(), v.double(), g64, initial_state=h0.double(), scale=0.3)
    dx64, dg64 = torch.autograd.grad((o64b * do.double()).sum(), [x64, g64])
    assert dg.dtype == (xg.dtype if fn.input_grad else torch.float32)
    want_dg = dx64 if fn.input_grad else dg64
    for name, got, want in (("o", o, o64), ("ht", ht, ht64), ("dg", dg, want_dg)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"
    if not fn.input_grad:
        dx = gate_grads(dg, xg, fn, a, bias)[0]
        err = ((dx.double() - dx64).norm() / dx64.norm()).item()
        assert err <= 1e-4, f"dx: relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------
# the backend fuses gates in the graphs it rewrote
# ----------------------------------------------------------------------------------------------


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


def rewrite_then_eager(gm, example_inputs):
    rewrite(gm, example_inputs)
    return gm.forward


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
    assert (out - want_out).abs().max() <= FP32_TOL * want_out.abs().max()
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a - b).abs().max() <= FP32_TOL * b.abs().max(), f"gradient of argument {i}"


def test_mamba2_padded_gate_is_fused():
    """Mamba2's scan pads the gate a * dt along time to a chunk multiple: the fused op gets x padded
    with -inf (softplus(-inf) = 0, the padded gate's value). Training gradients match eager."""
    test_models = pytest.importorskip("test_models")
    model = test_models.mamba2().train()
    ids = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(0))
    loss = torch.compile(model, backend=rewrite_then_eager, dynamic=False)(ids, use_cache=False).logits.square().mean()
    assert counters["gla_inductor"]["fused_gates"] == test_models.LAYERS
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(model(ids, use_cache=False).logits.square().mean(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert test_models.rel_err(a, b) <= FP32_TOL, name


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
    assert (out - want).abs().max() <= FP32_TOL * want.abs().max()


def test_public_api_errors_name_the_tensor():
    x, params = _inputs(1, 4, 2, 4, 3, False, SOFTPLUS)
    with pytest.raises(ValueError, match=r"gate_bias has shape \(3,\); expected \[H\] = \[2\]"):
        gla_inductor.chunk_gla(**x, **{**params, "gate_bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="needs gate_a"):
        gla_inductor.chunk_gla(**x, gate_fn="softplus", gate_bias=params["gate_bias"])
    with pytest.raises(ValueError, match="gate_fn must be one of"):
        gla_inductor.chunk_gla(**x, gate_fn="sigmoid")
