"""Fused gates at the ops (``gla_inductor.gates``): chunk_gla reads a gate function's input x and
applies the function itself (logsigmoid(x) / c, clamped; a * softplus(x + bias)). The ops'
numerics (the PyTorch path on CPU, the kernels on CUDA) and the Triton kernels' gate function (on
CUDA or under the interpreter), with the gradients of x, a and bias, against float64 autograd
through the explicit gate; errors that name the tensor. The backend's fusion of gates in the
graphs it rewrote is tests/recognize/test_fused_gate_rewrite.py.
"""

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.reference import naive_recurrent_gla
from gla_inductor.contract import GLACall

from helpers import FP32_TOL, rel_norm_err

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

# (gate_fn, constants, parameters): the cases the ops and kernels must agree on
LOGSIG = dict(gate_fn="logsigmoid", gate_scale=1 / 16)
LOGSIG_CLAMPED = dict(gate_fn="logsigmoid", gate_scale=0.5, gate_lo=-1.5)
SOFTPLUS = dict(gate_fn="softplus", gate_lo=0.05, gate_hi=4.0)


pytestmark = pytest.mark.usefixtures("one_thread")


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
        err = rel_norm_err(a, b)
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
    pytest.importorskip("triton")
    from gla_inductor.kernels import chunk as kchunk
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
    o, ht = kchunk.forward(GLACall(q, k, v, xg, None, h0, 0.3, True, False, gate=fn, gate_a=a, gate_bias=bias))
    o64, ht64 = naive_recurrent_gla(q.double(), k.double(), v.double(), g, initial_state=h0.double(), scale=0.3,
                                    output_final_state=True)
    do = torch.randn_like(o)
    dg = kchunk.backward(GLACall(q, k, v, xg, None, h0, 0.3, reverse=False, gate=fn, gate_a=a, gate_bias=bias), do, None)[3]
    # logsigmoid: the kernels return x's gradient (GateFn.input_grad); softplus: the log gate's, fp32
    x64 = xg.double().requires_grad_()
    g64 = log_gate(x64, fn, None if a is None else a.double(), None if bias is None else bias.double(),
                   torch.float64)
    o64b, _ = naive_recurrent_gla(q.double(), k.double(), v.double(), g64, initial_state=h0.double(), scale=0.3)
    dx64, dg64 = torch.autograd.grad((o64b * do.double()).sum(), [x64, g64])
    assert dg.dtype == (xg.dtype if fn.input_grad else torch.float32)
    want_dg = dx64 if fn.input_grad else dg64
    for name, got, want in (("o", o, o64), ("ht", ht, ht64), ("dg", dg, want_dg)):
        err = rel_norm_err(got, want)
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"
    if not fn.input_grad:
        dx = gate_grads(dg, xg, fn, a, bias)[0]
        err = rel_norm_err(dx, dx64)
        assert err <= 1e-4, f"dx: relative error {err:.2e}"




def test_public_api_errors_name_the_tensor():
    x, params = _inputs(1, 4, 2, 4, 3, False, SOFTPLUS)
    with pytest.raises(ValueError, match=r"gate_bias has shape \(3,\); expected \[H\] = \[2\]"):
        gla_inductor.chunk_gla(**x, **{**params, "gate_bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="needs gate_a"):
        gla_inductor.chunk_gla(**x, gate_fn="softplus", gate_bias=params["gate_bias"])
    with pytest.raises(ValueError, match="gate_fn must be one of"):
        gla_inductor.chunk_gla(**x, gate_fn="sigmoid")
