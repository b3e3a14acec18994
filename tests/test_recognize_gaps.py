"""Spellings the fuzzer once listed as gaps (issue 6), each rewritten once and exact against
float64 eager in value and in every gradient, beside a near miss of the same spelling that
must stay code:

  * the parallel form with heads flattened by reshape(B * H, ...) for bmm, with a gate over
    time (scalar, vector) and the initial and final state terms, the gate reshaped like q;
  * a time loop whose outputs are written into one-step slices, `o[:, :, t:t + 1] = o_t`;
  * a time loop whose first state is the outer product itself (`S = kv if S is None`), computed
    by bmm on flattened heads (a [B * H, K, V] state the next step views as [B, H, K, V]).
"""

import pytest
import torch
from torch._dynamo.utils import counters

# the parallel form's test sizes, inputs and float64 check, shared
from test_recognize_parallel import B, H, T, K, V, check_exact as check, inputs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


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
    matches = check(fn, inputs(gate, h0))
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
    assert check(near_par_flat_cumsum_over_heads, inputs("scalar")) == []
    matches = check(near_par_flat_h0_one_step_short, inputs("scalar", h0=True))
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
    matches = check(fn, inputs(gate, h0))
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
    assert check(fn, inputs("vector" if "rows" in fn.__name__ else "scalar")) == []
