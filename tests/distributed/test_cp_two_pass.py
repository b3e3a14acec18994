"""The pieces of the eager two-pass context-parallel Function, without a process group, in float64:
the entering state's gradient and the leaving state from the states-only passes, and the backward
scan as the transpose of the forward scan."""

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.contract import GLACall
from gla_inductor.distributed.context_parallel import _final_state, _Segments, _scan, _scan_back
from gla_inductor.gates import GateFn, log_gate

B, T, H, G, K, V = 2, 37, 4, 2, 8, 6


def _inputs(gate: str, seed: int = 0) -> tuple[dict, GateFn]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t = dict(q=randn(B, T, G, K), k=randn(B, T, G, K), v=randn(B, T, H, V), initial_state=randn(B, H, K, V))
    fn = GateFn()
    if gate == "vector":
        t["g"] = F.logsigmoid(randn(B, T, H, K) + 2)
    elif gate == "scalar":
        t["g"] = F.logsigmoid(randn(B, T, H) + 2)
    elif gate == "gamma":
        t["g_gamma"] = -randn(H).abs() / 4
    elif gate == "softplus":
        t.update(g=randn(B, T, H, K), gate_a=-randn(H).abs() / 4, gate_bias=randn(H, K))
        fn = GateFn("softplus")
    return t, fn


def _log_gates(t: dict, fn: GateFn) -> torch.Tensor:
    """[B, T, H, K] log gates (zeros without a gate)."""
    if "g" in t:
        lg = log_gate(t["g"], fn, t.get("gate_a"), t.get("gate_bias"), torch.float64)
        return lg if lg.dim() == 4 else lg.unsqueeze(-1).expand(B, T, H, K)
    if "g_gamma" in t:
        return t["g_gamma"].view(1, 1, H, 1).expand(B, T, H, K)
    return torch.zeros(B, T, H, K, dtype=torch.float64)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", ["vector", "scalar", "gamma", "none", "softplus"])
def test_states_only_passes(gate, reverse):
    """The dual pass: scale * sum_t (q_t exp(G_t))^T do_t with G_t inclusive, which is also autograd's
    gradient of chunk_gla's o w.r.t. its initial state; the forward pass: chunk_gla's final state
    from zero; both: the decay exp(sum of the log gates), shaped to broadcast against the states."""
    t, fn = _inputs(gate)
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scale = 0.3
    call = GLACall(t["q"], t["k"], t["v"], t.get("g"), t.get("g_gamma"), t["initial_state"], scale=scale,
                   reverse=reverse, gate=fn, gate_a=t.get("gate_a"), gate_bias=t.get("gate_bias"))
    got, decay = _final_state(call, do)

    lg = _log_gates(t, fn)
    G_incl = lg.flip(1).cumsum(1).flip(1) if reverse else lg.cumsum(1)
    q = t["q"].repeat_interleave(H // G, dim=2)
    want = scale * torch.einsum("bthk,bthv->bhkv", q * G_incl.exp(), do)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-10 * want.abs().max()

    h0 = t["initial_state"].clone().requires_grad_()
    kwargs = dict(g=t.get("g"), g_gamma=t.get("g_gamma"), gate_a=t.get("gate_a"), gate_bias=t.get("gate_bias"),
                  gate_fn=fn.name or None)
    o, _ = gla_inductor.chunk_gla(t["q"], t["k"], t["v"], initial_state=h0, scale=scale, reverse=reverse, **kwargs)
    (autograd,) = torch.autograd.grad((o * do).sum(), h0)
    assert (got - autograd).abs().max() <= 1e-10 * autograd.abs().max()

    leaving, decay_fwd = _final_state(call)
    _, ht = gla_inductor.chunk_gla(t["q"], t["k"], t["v"], scale=scale, reverse=reverse, output_final_state=True,
                                   **kwargs)
    assert (leaving - ht).abs().max() <= 1e-10 * ht.abs().max()
    if gate == "none":
        assert decay is None and decay_fwd is None
        return
    D = lg.sum(1).exp()  # [B, H, K]: every gate kind broadcast over K above
    for d in (decay, decay_fwd):
        d = d.expand(B, H, K)
        assert torch.allclose(d, D, rtol=1e-12, atol=0)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("decay", ["vector", "per_head", "none"])
def test_scan_back_is_the_scans_transpose(layout, reverse, decay):
    """With L = sum over segments of <c_j, state entering j> + <w, final state>, _scan_back's
    leaving-state gradient of segment j is dL/dS_j (the leaving state is exp(D_j) h_j + S_j) and its
    last value dL/dh0; c_j plays the entering state's gradient from o."""
    world = 3
    n = 1 if layout == "contiguous" else 2
    gen = torch.Generator().manual_seed(2)
    S_all = torch.randn(world, n * B, H, K, V, generator=gen, dtype=torch.float64, requires_grad=True)
    D_all = {"vector": torch.rand(world, n * B, H, K, generator=gen, dtype=torch.float64),
             "per_head": torch.rand(world, n * B, H, 1, generator=gen, dtype=torch.float64),
             "none": None}[decay]
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(world, n * B, H, K, V, generator=gen, dtype=torch.float64)
    w = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    loss = 0
    for rank in range(world):
        entering, ht = _scan(S_all, D_all, h0, _Segments.of(layout, rank, world), reverse)
        eager, ht_eager = _scan(S_all, D_all, h0, _Segments.of(layout, rank, world), reverse, traced=False)
        assert torch.equal(eager, entering) and torch.equal(ht_eager, ht)
        loss = loss + (entering * c[rank]).sum()
    loss = loss + (ht * w).sum()
    dS, dh0 = torch.autograd.grad(loss, (S_all, h0))

    for rank in range(world):
        leaving, initial = _scan_back(c, w, D_all, _Segments.of(layout, rank, world), reverse)
        assert torch.allclose(leaving, dS[rank], rtol=1e-12, atol=1e-12)
        assert torch.allclose(initial, dh0, rtol=1e-12, atol=1e-12)
