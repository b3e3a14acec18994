"""Spellings the fuzzer once listed as gaps (issue 6), each rewritten once and exact against
float64 eager in value and in every gradient, beside a near miss of the same spelling that
must stay code:

  * the parallel form with heads flattened by reshape(B * H, ...) for bmm, with a gate over
    time (scalar, vector) and the initial and final state terms, the gate reshaped like q;
  * a time loop whose outputs are written into one-step slices, `o[:, :, t:t + 1] = o_t`;
  * a time loop whose first state is the outer product itself (`S = kv if S is None`), computed
    by bmm on flattened heads (a [B * H, K, V] state the next step views as [B, H, K, V]);
  * K or V of size 1 (time loops, a decode step, parallel forms), with near misses that are
    not GLA at those sizes either.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import HEAD_FIRST_SIZES, check_rewrite_exact, head_first_inputs

B, H, T, K, V = HEAD_FIRST_SIZES

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


# ---- parallel form, heads flattened for bmm ----------------------------------------------------
def flat(x, *rest):
    return x.reshape(B * H, *x.shape[2:], *rest)


def par_flat_scalar(q, k, v, g):
    q, k, v, g = flat(q), flat(k), flat(v), flat(g)
    G = g.cumsum(-1)
    D = (G[:, :, None] - G[:, None, :]).exp().masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0)
    return torch.bmm(torch.bmm(q, k.transpose(1, 2)) * D, v).view(B, H, T, V)


def par_flat_vector_states(q, k, v, g, h0):
    """Factored vector decay, the initial state's share and the final state, all on [B * H, ...]."""
    q, k, v, g, h0 = flat(q), flat(k), flat(v), flat(g), flat(h0)
    G = g.cumsum(1)
    A = torch.bmm(q * G.exp(), (k * (-G).exp()).transpose(1, 2)).tril()
    o = torch.bmm(A, v) + torch.bmm(q * G.exp(), h0)
    S = torch.bmm((k * (G[:, -1:] - G).exp()).transpose(1, 2), v) + G[:, -1, :, None].exp() * h0
    return o.view(B, H, T, V), S.view(B, H, K, V)


def par_flat_scalar_output_flat(q, k, v, g):
    """The output left flat, [B * H, T, V]."""
    q, k, v, g = flat(q), flat(k), flat(v), flat(g)
    G = g.cumsum(-1)
    D = (G[:, :, None] - G[:, None, :]).exp().tril()
    return torch.bmm(torch.bmm(q, k.transpose(1, 2)) * D, v)


@pytest.mark.parametrize("fn,gate,h0,options", [
    (par_flat_scalar, "scalar", False, {"initial_state": False, "final_state": False}),
    (par_flat_vector_states, "vector", True, {"initial_state": True, "final_state": True}),
    (par_flat_scalar_output_flat, "scalar", False, {"initial_state": False, "final_state": False}),
], ids=lambda x: getattr(x, "__name__", None))
def test_parallel_flattened_heads(fn, gate, h0, options):
    matches = check_rewrite_exact(fn, head_first_inputs(gate, h0))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("parallel", gate)]
    assert {k: matches[0].options[k] for k in options} == options


def near_par_flat_cumsum_over_heads(q, k, v, g):
    """The cumsum runs over the flattened heads, not over time."""
    q, k, v, g = flat(q), flat(k), flat(v), flat(g)
    G = g.cumsum(0)
    D = (G[:, :, None] - G[:, None, :]).exp().tril()
    return torch.bmm(torch.bmm(q, k.transpose(1, 2)) * D, v).view(B, H, T, V)


def near_par_flat_h0_one_step_short(q, k, v, g, h0):
    """The initial state decayed to step i - 1: the attention is GLA, the state term stays code."""
    q, k, v, g, h0 = flat(q), flat(k), flat(v), flat(g), flat(h0)
    G = g.cumsum(-1)
    D = (G[:, :, None] - G[:, None, :]).exp().tril()
    o = torch.bmm(torch.bmm(q, k.transpose(1, 2)) * D, v) + torch.bmm(q * (G - g).exp()[..., None], h0)
    return o.view(B, H, T, V)


def test_parallel_flattened_heads_near_misses():
    assert check_rewrite_exact(near_par_flat_cumsum_over_heads, head_first_inputs("scalar")) == []
    matches = check_rewrite_exact(near_par_flat_h0_one_step_short, head_first_inputs("scalar", h0=True))
    assert [m.options["initial_state"] for m in matches] == [False]


# ---- time loops -------------------------------------------------------------------------------
def loop_rows_setitem(q, k, v, g):
    S = q.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for t in range(T):
        q_t, k_t, v_t, g_t = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g[:, :, t:t + 1]
        S = S * g_t.exp().transpose(-1, -2) + k_t.transpose(-1, -2) @ v_t
        o[:, :, t:t + 1] = q_t @ S
    return o


def loop_rows_setitem_reversed(q, k, v, g, h0):
    S = h0
    o = torch.zeros_like(v)
    for t in reversed(range(T)):
        q_t, k_t, v_t = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]
        S = S * g[:, :, t:t + 1].exp()[..., None] + k_t.transpose(-1, -2) @ v_t
        o[:, :, t:t + 1] = q_t @ S
    return o, S


def loop_first_state_bmm(q, k, v, g):
    S = None
    outs = []
    for t in range(T):
        kv = torch.bmm(k[:, :, t].reshape(-1, K, 1), v[:, :, t].reshape(-1, 1, V)).view(B, H, K, V)
        S = kv if S is None else S * g[:, :, t].exp()[..., None, None] + kv
        outs.append(torch.bmm(q[:, :, t].reshape(-1, 1, K), S.reshape(-1, K, V)).view(B, H, V))
    return torch.stack(outs, dim=2)


def loop_first_state_bmm_einsum_read(q, k, v, g):
    S = None
    outs = []
    for t in range(T):
        kv = torch.bmm(k[:, :, t].reshape(-1, K, 1), v[:, :, t].reshape(-1, 1, V)).view(B, H, K, V)
        S = kv if S is None else S * g[:, :, t, :, None].exp() + kv
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


@pytest.mark.parametrize("fn,gate,h0", [
    (loop_rows_setitem, "vector", False),
    (loop_rows_setitem_reversed, "scalar", True),
    (loop_first_state_bmm, "scalar", False),
    (loop_first_state_bmm_einsum_read, "vector", False),
], ids=lambda x: getattr(x, "__name__", None))
def test_loop_spellings(fn, gate, h0):
    matches = check_rewrite_exact(fn, head_first_inputs(gate, h0))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("loop", gate)]


def near_loop_rows_buffer_too_long(q, k, v, g):
    """One row of the buffer is never written: it keeps its zeros, which the op does not make."""
    S = q.new_zeros(B, H, K, V)
    o = q.new_zeros(B, H, T + 1, V)
    for t in range(T):
        q_t, k_t, v_t, g_t = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g[:, :, t:t + 1]
        S = S * g_t.exp().transpose(-1, -2) + k_t.transpose(-1, -2) @ v_t
        o[:, :, t:t + 1] = q_t @ S
    return o


def near_loop_rows_shifted(q, k, v, g):
    """Step t written into row t + 1 (row 0 keeps its zeros): not in time order."""
    S = q.new_zeros(B, H, K, V)
    o = q.new_zeros(B, H, T + 1, V)
    for t in range(T):
        q_t, k_t, v_t, g_t = q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g[:, :, t:t + 1]
        S = S * g_t.exp().transpose(-1, -2) + k_t.transpose(-1, -2) @ v_t
        o[:, :, t + 1:t + 2] = q_t @ S
    return o


def near_loop_first_state_heads_scrambled(q, k, v, g):
    """The first state's flat [B * H] axis is viewed head-major: batch and heads trade places."""
    S = None
    outs = []
    for t in range(T):
        kv = torch.bmm(k[:, :, t].reshape(-1, K, 1), v[:, :, t].reshape(-1, 1, V))
        S = kv.view(H, B, K, V).transpose(0, 1) if S is None else S * g[:, :, t].exp()[..., None, None] + kv.view(B, H, K, V)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("fn", [near_loop_rows_buffer_too_long, near_loop_rows_shifted,
                                near_loop_first_state_heads_scrambled], ids=lambda f: f.__name__)
def test_loop_near_misses(fn):
    assert check_rewrite_exact(fn, head_first_inputs("vector" if "rows" in fn.__name__ else "scalar")) == []


# ---- K or V of size 1 ---------------------------------------------------------------------------
# k^T v is then an elementwise product, and the read and the attention contract over nothing
# (K = 1) or keep a size-1 axis (V = 1): the algebra has no variable for a size-1 axis, so the
# roles are read from the axes that are there. A vector gate over K = 1 is one number per step,
# a scalar gate. Each spelling below is rewritten at K = 1, V = 1 and K = V = 1, and is exact.
SIZE_ONE = [(1, V), (K, 1), (1, 1)]


def rewritten_gate(gate: str, k: int) -> str:
    return "scalar" if gate == "vector" and k == 1 else gate  # one key: one decay per step


def loop1_vector_states(q, k, v, g, h0):
    """Broadcast outer product and read, from an initial state, the final state returned."""
    S = h0
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None] + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2), S


def loop1_scalar_matmul(q, k, v, g):
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    o = torch.zeros_like(v)
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp() + k[:, :, t].unsqueeze(-1) @ v[:, :, t].unsqueeze(-2)
        o[:, :, t] = (q[:, :, t].unsqueeze(-2) @ S).squeeze(-2) * 0.5
    return o


def loop1_constant_einsum_reversed(q, k, v, g_gamma):
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in reversed(range(q.shape[2])):
        S = torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t]) + S * g_gamma.exp()[:, None, None]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs[::-1], dim=2)


def loop1_rows_first_state(q, k, v):
    """Row slices [B, H, 1, D], k_t^T @ v_t, q_t @ S, no gate; the first state is the update."""
    S = None
    outs = []
    for t in range(q.shape[2]):
        kv = k[:, :, t:t + 1].transpose(-1, -2) @ v[:, :, t:t + 1]
        S = kv if S is None else S + kv
        outs.append(q[:, :, t:t + 1] @ S)
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("kv", SIZE_ONE, ids=lambda kv: f"K{kv[0]}V{kv[1]}")
@pytest.mark.parametrize("fn,gate,h0", [
    (loop1_vector_states, "vector", True),
    (loop1_scalar_matmul, "scalar", False),
    (loop1_constant_einsum_reversed, "constant", False),
    (loop1_rows_first_state, "none", False),
], ids=lambda x: getattr(x, "__name__", None))
def test_loop_size_one(fn, gate, h0, kv):
    matches = check_rewrite_exact(fn, head_first_inputs(gate, h0, *kv))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("loop", rewritten_gate(gate, kv[0]))]
    assert matches[0].shapes["K"] == kv[0] and matches[0].shapes["V"] == kv[1]
    assert matches[0].options["initial_state"] == h0


def decode1_vector(q, k, v, g, h0):
    S = h0 * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, S), S


@pytest.mark.parametrize("kv", SIZE_ONE, ids=lambda kv: f"K{kv[0]}V{kv[1]}")
def test_decode_size_one(kv):
    """One token, no time axis: at K = 1 the value [B, H, V] is indexed like the state
    [B, H, 1, V], and only the cache may be the state the step decays."""
    matches = check_rewrite_exact(decode1_vector, head_first_inputs("vector", True, *kv, time=False))
    assert [(m.form, m.gate) for m in matches] == [("decode", rewritten_gate("vector", kv[0]))]


def par1_scalar_masked(q, k, v, g):
    G = g.cumsum(-1)
    n = q.shape[2]
    D = (G[..., :, None] - G[..., None, :]).exp().masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), 0)
    return ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 * D) @ v


def par1_vector_factored_states(q, k, v, g, h0):
    G = g.cumsum(-2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).tril()
    o = A @ v + (q * G.exp()) @ h0
    S = (k * (G[..., -1:, :] - G).exp()).transpose(-1, -2) @ v + G[..., -1, :, None].exp() * h0
    return o, S


def par1_vector_pairwise_einsum(q, k, v, g):
    G = g.cumsum(-2)
    n = q.shape[2]
    M = torch.ones(n, n, dtype=torch.bool).tril()
    D = torch.where(M[:, :, None], (G[..., :, None, :] - G[..., None, :, :]).exp(), 0.0)
    A = torch.einsum("bhik,bhjk,bhijk->bhij", q, k, D)
    return torch.einsum("bhij,bhjv->bhiv", A, v)


def par1_constant_reverse_broadcast(q, k, v, g_gamma):
    i = torch.arange(q.shape[2])
    D = ((i[None, :] - i[:, None]) * g_gamma[:, None, None]).exp().masked_fill(~(i[None, :] >= i[:, None]), 0)
    A = (q[..., :, None, :] * k[..., None, :, :]).sum(-1) * D
    return (A[..., :, :, None] * v[..., None, :, :]).sum(-2)


def par1_no_gate_bmm(q, k, v):
    b, h, n = q.shape[:3]
    q, k, v = q.reshape(b * h, n, -1), k.reshape(b * h, n, -1), v.reshape(b * h, n, -1)
    A = torch.bmm(q, k.transpose(1, 2)).tril()
    return torch.bmm(A, v).view(b, h, n, -1)


@pytest.mark.parametrize("kv", SIZE_ONE, ids=lambda kv: f"K{kv[0]}V{kv[1]}")
@pytest.mark.parametrize("fn,gate,h0,reverse", [
    (par1_scalar_masked, "scalar", False, False),
    (par1_vector_factored_states, "vector", True, False),
    (par1_vector_pairwise_einsum, "vector", False, False),
    (par1_constant_reverse_broadcast, "constant", False, True),
    (par1_no_gate_bmm, "none", False, False),
], ids=lambda x: getattr(x, "__name__", None))
def test_parallel_size_one(fn, gate, h0, reverse, kv):
    matches = check_rewrite_exact(fn, head_first_inputs(gate, h0, *kv))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("parallel", rewritten_gate(gate, kv[0]))]
    assert matches[0].shapes["K"] == kv[0] and matches[0].shapes["V"] == kv[1]
    options = {"reverse": reverse, "initial_state": h0, "final_state": h0}
    assert {k: matches[0].options[k] for k in options} == options


# Near misses at size 1 that are not GLA there either.
def near1_loop_exclusive(q, k, v, g):
    """The state read before its update (K = 1: q_t * S_{t-1})."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        outs.append((q[:, :, t, :, None] * S).sum(-2))
        S = S * g[:, :, t].exp()[..., None] + k[:, :, t, :, None] * v[:, :, t, None, :]
    return torch.stack(outs, dim=2)


def near1_loop_rwkv6_bonus(q, k, v, g):
    """Read S_{t-1} + 0.5 k_t v_t, then update: not GLA for T >= 3, whatever the sizes."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * (S + 0.5 * kv)).sum(-2))
        S = S * g[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, dim=2)


def near1_loop_nonlinear(q, k, v, g):
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        S = torch.tanh(S * g[:, :, t].exp()[..., None] + k[:, :, t, :, None] * v[:, :, t, None, :])
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2)


def near1_loop_delta(q, k, v, g):
    """Delta rule at V = 1: the value corrected by the state's own prediction."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        k_t = torch.nn.functional.normalize(k[:, :, t], dim=-1)
        S = S * g[:, :, t].exp()[..., None]
        v_t = v[:, :, t] - (k_t[..., :, None] * S).sum(-2)
        S = S + k_t[..., :, None] * v_t[..., None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2)


def near1_loop_gate_over_v(q, k, v, g):
    """A decay per value column at K = 1: not GLA with V = 5 (the decay must not depend on the
    value column). Each column is its own scalar recurrence, so it is GLA with K = V = 1 and the
    value axis as a third batch axis, which the op does not have (B, H > 1): left alone."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, :] + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2)


def near1_par_strict(q, k, v, g):
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().tril(-1)) @ v


def near1_par_decay_against_mask(q, k, v, g):
    """An anti-causal mask under a forward decay."""
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().triu()) @ v


def near1_par_noncausal(q, k, v, g):
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (-(G[..., :, None] - G[..., None, :]).abs()).exp()) @ v


@pytest.mark.parametrize("fn,gate,kv", [
    (near1_loop_exclusive, "vector", (1, V)),
    (near1_loop_exclusive, "vector", (1, 1)),
    (near1_loop_rwkv6_bonus, "vector", (1, 1)),
    (near1_loop_rwkv6_bonus, "vector", (K, 1)),
    (near1_loop_nonlinear, "vector", (1, 1)),
    (near1_loop_delta, "vector", (K, 1)),
    (near1_loop_gate_over_v, "value", (1, V)),
    (near1_par_strict, "scalar", (1, V)),
    (near1_par_strict, "scalar", (1, 1)),
    (near1_par_decay_against_mask, "scalar", (K, 1)),
    (near1_par_noncausal, "scalar", (1, 1)),
], ids=lambda x: getattr(x, "__name__", None) or (f"K{x[0]}V{x[1]}" if isinstance(x, tuple) else x))
def test_size_one_near_misses(fn, gate, kv):
    assert check_rewrite_exact(fn, head_first_inputs(gate, False, *kv)) == []
