"""Loop-free chunked GLA whose chunk states are exclusive cumulative sums over the chunk axis
(``recognize/forms/cumsum_chunks.py``): the key-value product of each chunk (with its decays),
``cumsum`` over chunks, shifted by one chunk (a zero chunk concatenated in front, ``F.pad``, or
the cumsum minus the chunk itself), read by the chunk's queries next to the masked intra-chunk
attention. No gate, a constant decay per head (RetNet's gamma, from an input or a module
buffer), a scalar and a vector gate as cumulative log decays; head-first and [B, T, H, D]
layouts. Each is certified and rewritten to one op, equal to float64 eager in value and every
gradient. Look-alikes (an inclusive cumsum, a shift by two chunks, no decay between chunks)
stay code, with the first weight that differs from GLA's, expected against found."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite
from helpers import check_rewrite_exact, compile_rewritten, rel_err, rewrite_then_eager

B, H, T, C, K, V = 2, 3, 12, 4, 4, 5
N = T // C

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def chunks(x):
    """[B, H, T, D] -> [B, H, N, C, D]."""
    return x.reshape(x.shape[0], x.shape[1], -1, C, x.shape[-1])


def causal():
    return torch.tril(torch.ones(C, C, dtype=torch.bool))


def exclusive_cat(s, dim=2):
    """The states entering each chunk: a zero chunk in front, the last chunk's sum dropped."""
    first = torch.zeros_like(s.narrow(dim, 0, 1))
    return torch.cat([first, s.narrow(dim, 0, s.shape[dim] - 1)], dim)


# ---- rewritten -----------------------------------------------------------------------------------
def plain_cat(q, k, v):
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive_cat((kc.transpose(-1, -2) @ vc).cumsum(2))
    att = (qc @ kc.transpose(-1, -2)).masked_fill(~causal(), 0)
    return (att @ vc + qc @ state).reshape(v.shape)


def plain_minus_self(q, k, v):
    """einsum spelling, the exclusive sum as the inclusive one minus the chunk itself."""
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = torch.einsum("bhnck,bhncv->bhnkv", kc, vc)
    state = kv.cumsum(2) - kv
    att = torch.einsum("bhnik,bhnjk->bhnij", qc, kc) * causal()
    o = torch.einsum("bhnij,bhnjv->bhniv", att, vc) + torch.einsum("bhnik,bhnkv->bhniv", qc, state)
    return o.flatten(2, 3)


def plain_pad(q, k, v):
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = F.pad((kc.transpose(-1, -2) @ vc).cumsum(2), (0, 0, 0, 0, 1, 0))[:, :, :-1]
    return ((qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state).flatten(2, 3) * K**-0.5


def scalar_gate(q, k, v, g):
    """g [B, H, T]: cumulative log decays G, k * exp(-G) summed into the state, q * exp(G) reads it."""
    G = chunks(g.cumsum(-1)[..., None])
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive_cat(((kc * (-G).exp()).transpose(-1, -2) @ vc).cumsum(2))
    D = (G - G.transpose(-1, -2)).masked_fill(~causal(), float("-inf")).exp()
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * G.exp()) @ state).flatten(2, 3)


def vector_gate(q, k, v, g):
    """g [B, H, T, K]: the decays folded into q and k (q e^G, k e^-G)."""
    G = chunks(g.cumsum(2))
    qc, kc, vc = chunks(q) * G.exp(), chunks(k) * (-G).exp(), chunks(v)
    state = exclusive_cat((kc.transpose(-1, -2) @ vc).cumsum(2))
    return ((qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state).flatten(2, 3)


def time_major_scalar(q, k, v, g):
    """[B, T, H, D] layout, chunks [B, N, C, H, D], the state cumsum over dim 1, F.pad shift."""
    b, t, h, _ = q.shape
    qc, kc, vc = (x.view(b, -1, C, h, x.shape[-1]) for x in (q, k, v))
    G = g.cumsum(1).view(b, -1, C, h)
    kv = torch.einsum("bnchk,bnch,bnchv->bnhkv", kc, (-G).exp(), vc)
    state = F.pad(kv.cumsum(1), (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]
    D = (G[:, :, :, None] - G[:, :, None]).masked_fill(~causal()[..., None], float("-inf")).exp()
    intra = torch.einsum("bnihk,bnjhk,bnijh,bnjhv->bnihv", qc, kc, D, vc)
    inter = torch.einsum("bnihk,bnih,bnhkv->bnihv", qc, G.exp(), state)
    return (intra + inter).reshape(b, t, h, -1)


def retention_terms(q, k, v, log_gamma, cross_decay=True):
    """A constant decay per head (log_gamma [H]): gamma ** (i - j) within a chunk; keys decayed
    to the chunk's end, queries from its start; across chunks the cumsum of kv_m gamma^(-C m),
    rescaled by gamma^(C (n - 1)) (left out with cross_decay=False: a look-alike)."""
    lg = log_gamma[:, None, None, None]  # [H, 1 (chunk), 1, 1]
    i = torch.arange(C, dtype=q.dtype)
    D = torch.exp((i[:, None] - i[None, :]) * lg).masked_fill(~causal(), 0)
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = (kc * torch.exp((C - 1 - i)[:, None] * lg)).transpose(-1, -2) @ vc
    if cross_decay:
        n = torch.arange(N, dtype=q.dtype)
        kv = kv * torch.exp(-C * n[None, :] * log_gamma[:, None])[..., None, None]
        state = exclusive_cat(kv.cumsum(2)) * torch.exp(C * (n - 1)[None, :] * log_gamma[:, None])[..., None, None]
    else:
        state = exclusive_cat(kv.cumsum(2))
    o = ((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * torch.exp((i + 1)[:, None] * lg)) @ state
    return o.flatten(2, 3)


def retention(q, k, v, log_gamma):
    return retention_terms(q, k, v, log_gamma)


def retention_numbers(q, k, v, gamma=0.8):
    """The decay as Python numbers (gamma ** distance): read off one probe run, then certified."""
    i, n = torch.arange(C, dtype=q.dtype), torch.arange(N, dtype=q.dtype)
    D = gamma ** (i[:, None] - i[None, :]).clamp(min=0) * causal()
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = (kc * (gamma ** (C - 1 - i))[:, None]).transpose(-1, -2) @ vc
    state = exclusive_cat((kv * (gamma ** (-C * n))[:, None, None]).cumsum(2)) * (gamma ** (C * (n - 1)))[:, None, None]
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * (gamma ** (i + 1))[:, None]) @ state).flatten(2, 3)


def padded(q, k, v):
    """T not a multiple of the chunk: time padded with zeros, the output sliced back."""
    t = q.shape[2]
    q, k, v = (F.pad(x, (0, 0, 0, -t % C)) for x in (q, k, v))
    return plain_cat(q, k, v)[:, :, :t]


def heads_flattened(q, k, v):
    """[B * H, T, D]; the exclusive sum as a slice of the inclusive one after a zero chunk."""
    bh = q.shape[0]
    qc, kc, vc = (x.reshape(bh, -1, C, x.shape[-1]) for x in (q, k, v))
    kv = torch.einsum("znck,zncv->znkv", kc, vc)
    state = torch.cat([torch.zeros_like(kv[:, :1]), kv.cumsum(1)[:, :-1]], 1)
    att = torch.einsum("znik,znjk->znij", qc, kc).tril()
    o = torch.einsum("znij,znjv->zniv", att, vc) + torch.einsum("znik,znkv->zniv", qc, state)
    return o.reshape(bh, -1, v.shape[-1])


class ChunkwiseRetention(nn.Module):
    """The same with the log decays in a module buffer computed in __init__ (RetNet's way)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("decay", torch.log(1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))))

    def forward(self, q, k, v):
        return retention_terms(q, k, v, self.decay)


def plain_states(q, k, v, h0):
    """An initial state added to every chunk's, the final state out: h0 plus all chunks."""
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    inclusive = (kc.transpose(-1, -2) @ vc).cumsum(2)
    state = h0[:, :, None] + exclusive_cat(inclusive)
    o = (qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state
    return o.flatten(2, 3), h0 + inclusive[:, :, -1]


def scalar_gate_states(q, k, v, g, h0):
    G = chunks(g.cumsum(-1)[..., None])
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    inclusive = ((kc * (-G).exp()).transpose(-1, -2) @ vc).cumsum(2)
    state = h0[:, :, None] + exclusive_cat(inclusive)
    D = (G - G.transpose(-1, -2)).masked_fill(~causal(), float("-inf")).exp()
    o = ((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * G.exp()) @ state
    return o.flatten(2, 3), (h0 + inclusive[:, :, -1]) * G[:, :, -1, -1].exp()[..., None]


# ---- look-alikes ---------------------------------------------------------------------------------
def inclusive(q, k, v):
    """The state entering a chunk includes the chunk: its diagonal counted twice, its future read."""
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = (kc.transpose(-1, -2) @ vc).cumsum(2)
    return ((qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state).flatten(2, 3)


def shifted_by_two(q, k, v):
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    s = (kc.transpose(-1, -2) @ vc).cumsum(2)
    state = torch.cat([torch.zeros_like(s[:, :, :2]), s[:, :, :-2]], 2)
    return ((qc @ kc.transpose(-1, -2)).tril() @ vc + qc @ state).flatten(2, 3)


def chunk_local_decays(q, k, v, g):
    """Log decays summed within each chunk only: nothing decays the state between chunks."""
    G = chunks(g[..., None]).cumsum(3)
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive_cat(((kc * (G[:, :, :, -1:] - G).exp()).transpose(-1, -2) @ vc).cumsum(2))
    D = (G - G.transpose(-1, -2)).masked_fill(~causal(), float("-inf")).exp()
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * G.exp()) @ state).flatten(2, 3)


def no_cross_decay(q, k, v, log_gamma):
    return retention_terms(q, k, v, log_gamma, cross_decay=False)


def power_terms(q, k, v, g, cross_decay=True):
    """The decays as powers of a per-head gamma (g [H, 1, 1, 1], the decay itself): gamma ** (i - j)
    within a chunk, gamma ** (C n) across chunks (left out with cross_decay=False: a look-alike)."""
    i, n = torch.arange(C, dtype=q.dtype), torch.arange(N, dtype=q.dtype)
    D = (g ** (i[:, None] - i[None, :])).masked_fill(~causal(), 0)
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = (kc * g ** (C - 1 - i)[:, None]).transpose(-1, -2) @ vc
    gn = g ** (C * n)[:, None, None] if cross_decay else torch.ones_like(g)
    state = exclusive_cat((kv / gn).cumsum(2)) * gn / g**C
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * g ** (i + 1)[:, None]) @ state).flatten(2, 3)


class PowerRetention(nn.Module):
    """Retention with the decays as powers of a gamma buffer (gamma ** n, gamma in (0, 1))."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        return power_terms(q, k, v, self.gamma[:, None, None, None])


def power_input(q, k, v, gamma):
    """gamma [H] an input; the powers through the method spelling for the intra-chunk decay."""
    g = gamma[:, None, None, None]
    i = torch.arange(C, dtype=q.dtype)
    D = g.pow(i[:, None] - i[None, :]).masked_fill(~causal(), 0)
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    rest = power_terms(q, k, v, g) - (((qc @ kc.transpose(-1, -2)) * (g ** (i[:, None] - i[None, :])).masked_fill(
        ~causal(), 0)) @ vc).flatten(2, 3)
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc).flatten(2, 3) + rest


def power_no_cross_decay(q, k, v, gamma):
    return power_terms(q, k, v, gamma[:, None, None, None], cross_decay=False)


def cumprod_decay(q, k, v, gamma):
    """The decays from a cumulative product of gamma: an op the normal form does not expand."""
    p, r = (torch.cumprod(x[:, None].expand(H, T), -1)[None, :, :, None] for x in (gamma, 1 / gamma))
    pc, rc = chunks(p), chunks(r)  # gamma ** (t + 1) and gamma ** -(t + 1), [1, H, N, C, 1]
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive_cat(((kc * rc).transpose(-1, -2) @ vc).cumsum(2))
    D = (pc * rc.transpose(-1, -2)).masked_fill(~causal(), 0)
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * pc) @ state).flatten(2, 3)


def _inputs(gate=None):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, T, K, generator=gen), torch.randn(B, H, T, K, generator=gen)
    v = torch.randn(B, H, T, V, generator=gen)
    if gate == "scalar":
        return [q, k, v, F.logsigmoid(torch.randn(B, H, T, generator=gen) + 2)]
    if gate == "vector":
        return [q, k, v, F.logsigmoid(torch.randn(B, H, T, K, generator=gen) + 2)]
    if gate == "constant":
        return [q, k, v, torch.log(1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float)))]
    if gate == "time_major":
        return [x.transpose(1, 2).contiguous() for x in (q, k, v)] + [
            F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)]
    return [q, k, v]


def _naive(q, k, v, g=None, gate=None):
    """The float64 time loop of GLA on head-first inputs, to check the programs themselves."""
    q, k, v = q.double(), k.double(), v.double()
    S = q.new_zeros(B, H, K, V)
    out = []
    for t in range(q.shape[2]):
        if gate == "scalar":
            S = S * g[:, :, t].double().exp()[..., None, None]
        elif gate == "vector":
            S = S * g[:, :, t].double().exp()[..., None]
        elif gate == "constant":
            S = S * g.double().exp()[:, None, None]
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(out, 2)


REWRITTEN = [
    (plain_cat, None, "none"),
    (plain_minus_self, None, "none"),
    (plain_pad, None, "none"),
    (scalar_gate, "scalar", "scalar"),
    (vector_gate, "vector", "vector"),
    (time_major_scalar, "time_major", "scalar"),
    (retention, "constant", "constant"),
]


@pytest.mark.parametrize("fn,inputs,gate", REWRITTEN, ids=[f.__name__ for f, _, _ in REWRITTEN])
def test_exclusive_cumsum_chunks_are_rewritten(fn, inputs, gate):
    args = _inputs(inputs)
    if inputs != "time_major":  # the programs are GLA (up to their scale)
        want = _naive(*args, gate=inputs)
        got = fn(*[a.double() for a in args])
        assert rel_err(got, want * (K**-0.5 if fn is plain_pad else 1.0)) < 1e-6
    matches = check_rewrite_exact(fn, args, tol=1e-5)
    assert [(m.form, m.gate) for m in matches] == [("chunked", gate)]


def test_partial_last_chunk_and_flattened_heads():
    q, k, v = _inputs()
    short = [x[:, :, :10].contiguous() for x in (q, k, v)]
    assert rel_err(padded(*[a.double() for a in short]), _naive(*short)) < 1e-6
    assert [(m.form, m.gate) for m in check_rewrite_exact(padded, short)] == [("chunked", "none")]
    flat = [x.reshape(B * H, T, -1) for x in (q, k, v)]
    assert rel_err(heads_flattened(*[a.double() for a in flat]).view(B, H, T, V), _naive(q, k, v)) < 1e-6
    assert [(m.form, m.gate) for m in check_rewrite_exact(heads_flattened, flat)] == [("chunked", "none")]


def test_decay_from_python_numbers():
    args = _inputs()
    want = _naive(*args, torch.full((H,), 0.8).log(), gate="constant")
    assert rel_err(retention_numbers(*[a.double() for a in args]), want) < 1e-6
    matches = check_rewrite_exact(retention_numbers, args, tol=1e-5)
    assert [(m.form, m.gate) for m in matches] == [("chunked", "constant")]


@pytest.mark.parametrize("fn,inputs,gate", [(plain_states, None, "none"), (scalar_gate_states, "scalar", "scalar")],
                         ids=["plain", "scalar_gate"])
def test_initial_and_final_states(fn, inputs, gate):
    """Both outputs (and the gradient of h0) equal float64 eager: the final state is the op's."""
    args = _inputs(inputs) + [torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(1))]
    matches = check_rewrite_exact(fn, args, tol=1e-5)
    assert [(m.form, m.gate, m.options["initial_state"]) for m in matches] == [("chunked", gate, True)]


def test_buffer_decay_is_read_in_the_graph():
    """The decay buffer is a graph input: changed after compiling, the same compiled graph
    computes with the new value."""
    mod, (q, k, v), results = ChunkwiseRetention(), _inputs(), []

    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        return gm.forward

    fast = torch.compile(mod, backend=backend, fullgraph=True)
    assert rel_err(fast(q, k, v), _naive(q, k, v, mod.decay, gate="constant")) < 1e-5
    assert [(m.form, m.gate) for r in results for m in r.matches] == [("chunked", "constant")]
    with torch.no_grad():
        mod.decay.mul_(0.5)
    assert rel_err(fast(q, k, v), _naive(q, k, v, mod.decay, gate="constant")) < 1e-5
    assert len(results) == 1


LOOK_ALIKES = [
    (inclusive, None, "weighs the key at position 1 (chunk 0) by 1, expected 0: a later key of its own chunk"),
    (shifted_by_two, None, "position 4 (chunk 1) weighs the key at position 0 (chunk 0) by 0, expected 1: "
                           "chunk 0 does not reach chunk 1"),
    (chunk_local_decays, "scalar", "position 8 (chunk 2) weighs the key at position 0 (chunk 0) by 0.5, "
                                   "expected 0.25: the decay carried from chunk 0 to chunk 2 is not GLA's"),
    (no_cross_decay, "constant", "position 8 (chunk 2) weighs the key at position 0 (chunk 0) by 0.5, expected "
                                 "0.25: the decay carried from chunk 0 to chunk 2 is not GLA's"),
]


@pytest.mark.parametrize("fn,inputs,reason", LOOK_ALIKES, ids=[f.__name__ for f, _, _ in LOOK_ALIKES])
def test_look_alikes_stay_with_the_weight_that_differs(fn, inputs, reason):
    args = _inputs(inputs)
    outs, results = compile_rewritten(fn, args)
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "chunked"]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert rel_err(outs[0], fn(*[a.double() for a in args])) < 1e-5


def test_a_power_decay_is_rewritten_and_follows_gamma():
    """gamma ** n of a buffer: rewritten with the log gate log(gamma) computed in the graph, so a
    changed gamma reaches the op without a recompile; gamma is checked positive on every call."""
    mod, args = PowerRetention(), _inputs()
    assert rel_err(mod(*[a.double() for a in args]), _naive(*args, mod.gamma.log(), gate="constant")) < 1e-6
    assert [(m.form, m.gate) for m in check_rewrite_exact(mod, args)] == [("chunked", "constant")]
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        return gm.forward

    fast = torch.compile(mod, backend=backend, fullgraph=True)
    assert rel_err(fast(*args), _naive(*args, mod.gamma.log(), gate="constant")) < 1e-5
    with torch.no_grad():
        mod.gamma.pow_(2)
    assert rel_err(fast(*args), _naive(*args, mod.gamma.log(), gate="constant")) < 1e-5
    assert len(results) == 1 and len(results[0].matches) == 1
    with torch.no_grad():
        mod.gamma.neg_()  # gamma ** n is real, exp(n log gamma) is not: the guard raises
    with pytest.raises(RuntimeError, match="not positive"):
        fast(*args)


def test_a_power_decay_of_an_input_is_exact_with_its_gradient():
    """gamma an input (the Tensor.pow spelling too): every gradient, gamma's included, as float64 eager."""
    gamma = 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))
    args = _inputs() + [gamma]
    assert rel_err(power_input(*[a.double() for a in args]), _naive(*args[:3], gamma.log(), gate="constant")) < 1e-6
    assert [(m.form, m.gate) for m in check_rewrite_exact(power_input, args)] == [("chunked", "constant")]
    with pytest.raises(RuntimeError, match="not positive"):  # an input's values are not known when compiling
        compile_rewritten(power_input, args[:3] + [-gamma])


def power_chunk_loop(q, k, v, gamma):
    """A chunk loop with every decay a power of gamma [H] (the decay itself)."""
    g, i = gamma[:, None, None], torch.arange(C, dtype=q.dtype)
    decay = (g ** (i[:, None] - i[None, :])).masked_fill(~causal(), 0)
    S, outs = q.new_zeros(q.shape[0], q.shape[1], K, V), []
    for s in range(0, q.shape[2], C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append((qi @ ki.transpose(-1, -2) * decay) @ vi + (qi * g ** (i + 1)[:, None]) @ S)
        S = S * g**C + (ki * g ** (C - 1 - i)[:, None]).transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def test_a_power_decay_in_a_chunk_loop():
    """gamma an input: exact with every gradient. gamma a buffer: the loop's decay tables guarded
    (``table_gate.py``): a changed gamma reaches the op; a negative one is no gate's table, and the
    graph runs the user's loop instead (``fallback.py``), equal to eager."""
    gamma = 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))
    args = _inputs()
    assert rel_err(power_chunk_loop(*[a.double() for a in args], gamma.double()), _naive(*args, gamma.log(), gate="constant")) < 1e-6
    assert [(m.form, m.gate) for m in check_rewrite_exact(power_chunk_loop, args + [gamma])] == [("chunked", "constant")]

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("gamma", gamma.clone())

        def forward(self, q, k, v):
            return power_chunk_loop(q, k, v, self.gamma)

    mod = Module()
    counters.clear()
    fast = torch.compile(mod, backend=rewrite_then_eager, fullgraph=True)
    for change in (None, lambda x: x.pow_(2)):
        if change is not None:
            with torch.no_grad():
                change(mod.gamma)
        assert rel_err(fast(*args), _naive(*args, mod.gamma.log(), gate="constant")) < 1e-5
    assert counters["gla_inductor"]["rewrites_chunked"] == 1
    with torch.no_grad():
        mod.gamma.neg_()
        assert rel_err(fast(*args), mod(*args)) < 1e-6


def test_a_negative_gamma_buffer_is_left_alone():
    """A buffer that holds a negative gamma when compiling: gamma ** n alternates in sign, which no
    log gate gives. Not rewritten; the reason says so; the output is the code's own."""
    mod, args = PowerRetention(), _inputs()
    with torch.no_grad():
        mod.gamma[1] = -0.5
    outs, results = compile_rewritten(mod, args)
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "chunked"]
    assert len(reasons) == 1 and "is not positive everywhere" in reasons[0], reasons
    assert rel_err(outs[0], mod(*[a.double() for a in args])) < 1e-5


def test_a_power_decay_look_alike_names_the_weight():
    gamma = 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))
    args = _inputs() + [gamma]
    outs, results = compile_rewritten(power_no_cross_decay, args)
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "chunked"]
    assert len(reasons) == 1 and "is not GLA's" in reasons[0] and "chunk 0 to chunk" in reasons[0], reasons
    assert rel_err(outs[0], power_no_cross_decay(*[a.double() for a in args])) < 1e-5


def test_an_opaque_decay_is_reported():
    gamma = 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))
    args = _inputs() + [gamma]
    assert rel_err(cumprod_decay(*[a.double() for a in args]), _naive(*args[:3], gamma.log(), gate="constant")) < 1e-6
    outs, results = compile_rewritten(cumprod_decay, args)
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "chunked"]
    assert len(reasons) == 1, reasons
    assert "a chunk state is a cumulative sum over chunks" in reasons[0] and "cumprod" in reasons[0], reasons
    assert rel_err(outs[0], cumprod_decay(*[a.double() for a in args])) < 1e-5
