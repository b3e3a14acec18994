"""Naive GLA programs as people write them, and look-alikes that are not GLA.

Each entry: a function, a factory of its inputs, and how many rewrites the backend must
make. Inputs: `make(B, T, H, K, V, dtype)` returns a tuple of tensors that require grad.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

B, T, H, K, V = 2, 9, 3, 4, 5


@dataclass
class Spelling:
    name: str
    fn: Callable
    make: Callable
    rewrites: int  # expected rewrites (0 for near misses)
    form: str = "loop"


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


def _gate(*shape, dtype):
    return F.logsigmoid(torch.randn(*shape, dtype=dtype) + 2.0)


def bthd(gate: str):
    def make(dtype=torch.float32):
        q, k = _randn(B, T, H, K, dtype=dtype), _randn(B, T, H, K, dtype=dtype)
        v = _randn(B, T, H, V, dtype=dtype)
        if gate == "vector":
            return q, k, v, _gate(B, T, H, K, dtype=dtype)
        if gate == "scalar":
            return q, k, v, _gate(B, T, H, dtype=dtype)
        if gate == "constant":
            return q, k, v, _gate(H, dtype=dtype)
        if gate == "value":
            return q, k, v, _gate(B, T, H, V, dtype=dtype)
        return q, k, v

    return make


def head_first(gate: str):
    def make(dtype=torch.float32):
        args = bthd(gate)(dtype)
        out = [a.transpose(1, 2).contiguous() if a.dim() == 4 else a for a in args[:3]]
        if len(args) > 3:
            g = args[3]
            out.append(g.transpose(1, 2).contiguous() if g.dim() >= 3 else g)
        return tuple(out)

    return make


# ---- time loops ---------------------------------------------------------------------------
def loop_broadcast_setitem(q, k, v, g):
    """FLA's naive_recurrent_gla spelling: [B,T,H,D], broadcast-multiply-sum, o[:, t] = ..."""
    b, t_len, h, d_k = q.shape
    S = q.new_zeros(b, h, d_k, v.shape[-1])
    o = torch.zeros_like(v)
    q = q * d_k**-0.5
    for t in range(t_len):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2)
    return o


def loop_matmul_stack_scalar(q, k, v, g):
    """Outer product by matmul of unsqueezed vectors, read by q @ S, list + stack."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        decay = torch.exp(g[:, t]).unsqueeze(-1).unsqueeze(-1)
        S = decay * S + k[:, t].unsqueeze(-1) @ v[:, t].unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outs, dim=1) * q.shape[-1] ** -0.5


def loop_head_first_keepdim_cat(q, k, v, g_gamma):
    """Head-first [B,H,T,D], keepdim slices k^T @ v, cat, a constant gate per head."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    decay = g_gamma.exp()[None, :, None, None]
    outs = []
    for t in range(q.shape[2]):
        k_t, v_t, q_t = k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1]
        S = S * decay + k_t.transpose(-1, -2) @ v_t
        outs.append(q_t @ S)
    return torch.cat(outs, dim=2)


def loop_einsum_state(q, k, v, g, h0):
    """einsum everywhere, initial state in, final state out, scale on the output, casts."""
    S = h0.float()
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
        S = S * torch.exp(g[:, t].float())[..., None] + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S) * 0.5)
    return torch.stack(outs, 1).to(q.dtype), S


def loop_no_gate_unbind(q, k, v):
    """Plain causal linear attention through unbind, scale on q."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    outs = []
    for q_t, k_t, v_t in zip(q.unbind(1), k.unbind(1), v.unbind(1)):
        S = S + k_t[..., :, None] * v_t[..., None, :]
        outs.append(((q_t * 0.5)[..., :, None] * S).sum(-2))
    return torch.stack(outs, dim=1)


def loop_reverse(q, k, v, g):
    """The recurrence run backwards in time."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o = torch.empty_like(v)
    for t in reversed(range(q.shape[1])):
        S = S * g[:, t].exp()[..., None] + k[:, t, ..., None] * v[:, t, ..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o


def loop_bmm_time_major(q, k, v, g):
    """[T, B*H, D] flattened heads, bmm spellings, scalar gate, time-major."""
    S = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    o = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None] + torch.bmm(k[t].unsqueeze(2), v[t].unsqueeze(1))
        o[t] = torch.bmm(q[t].unsqueeze(1), S).squeeze(1)
    return o


def make_time_major(dtype=torch.float32):
    q, k = _randn(T, B * H, K, dtype=dtype), _randn(T, B * H, K, dtype=dtype)
    return q, k, _randn(T, B * H, V, dtype=dtype), _gate(T, B * H, dtype=dtype)


def make_state(dtype=torch.float32):
    return bthd("vector")(dtype) + (_randn(B, H, K, V, dtype=dtype),)


# ---- parallel forms -----------------------------------------------------------------------
def _causal(n, device=None):
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def parallel_scalar_masked_fill(q, k, v, g):
    """Head-first, scalar gate, decay matrix masked_fill(~mask, 0)."""
    G = g.cumsum(-1)
    D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~_causal(q.shape[2]), 0)
    A = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (A * D) @ v


def parallel_scalar_einsum_where(q, k, v, g):
    """[B,T,H,D] einsum, gate [B,T,H], where(mask, D, 0)."""
    G = torch.cumsum(g, dim=1)
    diff = G[:, :, None, :] - G[:, None, :, :]  # [B, Ti, Tj, H]
    D = torch.where(_causal(q.shape[1])[None, :, :, None], diff.exp(), 0.0)
    A = torch.einsum("bihk,bjhk->bijh", q, k) * D
    return torch.einsum("bijh,bjhv->bihv", A, v)


def parallel_scalar_neg_inf(q, k, v, g):
    """masked_fill(-inf) before exp; scale on q."""
    G = g.cumsum(-1)
    n = q.shape[2]
    logD = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~_causal(n), float("-inf"))
    return ((q * 0.5) @ k.transpose(-1, -2) * logD.exp()) @ v


def parallel_scalar_float_mask(q, k, v, g):
    """A 0/1 float mask product: tril(ones)."""
    G = g.cumsum(-1)
    n = q.shape[2]
    D = (G[..., :, None] - G[..., None, :]).exp() * torch.tril(torch.ones(n, n))
    return torch.matmul(torch.matmul(q, k.transpose(2, 3)) * D, v)


def parallel_constant_gate(q, k, v, g_gamma):
    """Retention: exp((i - j) * gamma[h]) on the causal triangle."""
    n = torch.arange(q.shape[2])
    diff = (n[:, None] - n[None, :]).float()
    D = torch.exp(diff[None] * g_gamma[:, None, None]) * _causal(q.shape[2])
    return ((q @ k.transpose(-1, -2)) * D) @ v


def parallel_vector_factored(q, k, v, g):
    """Vector gate as (q * e^G) @ (k * e^-G)^T, tril."""
    G = g.cumsum(2)
    A = (q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)
    return A.tril() @ v


def parallel_vector_pairwise(q, k, v, g):
    """Vector gate, stable pairwise [T, T, K] form with -inf above the diagonal."""
    G = g.cumsum(2)
    n = q.shape[2]
    diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, Ti, Tj, K]
    diff = diff.masked_fill(~_causal(n)[:, :, None], float("-inf"))
    A = (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1)
    return A @ v


def parallel_no_gate(q, k, v):
    """Causal linear attention, no gate."""
    return ((q @ k.transpose(-1, -2)) * 0.25).tril() @ v


def parallel_prefix_sums(q, k, v):
    """Causal linear attention as prefix sums of the materialized k^T v (Hedgehog's fallback)."""
    return (q.unsqueeze(-2) * (k.unsqueeze(-2) * v.unsqueeze(-1)).cumsum(dim=2)).sum(dim=-1)


def parallel_prefix_sums_gated(q, k, v, g):
    """Vector gate on the prefix sums: e^G_t * cumsum(e^-G_s k_s^T v_s), read by einsum."""
    G = g.cumsum(2)
    S = G.exp()[..., None] * torch.cumsum(torch.einsum("bhtk,bhtv->bhtkv", k * (-G).exp(), v), dim=2)
    return torch.einsum("bhtk,bhtkv->bhtv", q, S)


# ---- near misses --------------------------------------------------------------------------
def near_delta_rule(q, k, v, g):
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        v_new = v[:, t] - (S * k[:, t, ..., None]).sum(-2)
        S = S + k[:, t, ..., None] * v_new[..., None, :]
        outs.append((q[:, t, ..., None] * S).sum(-2))
    return torch.stack(outs, 1)


def near_normalized(q, k, v):
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    z = q.new_zeros(q.shape[0], q.shape[2], q.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S + k[:, t, ..., None] * v[:, t, ..., None, :]
        z = z + k[:, t]
        num = (q[:, t, ..., None] * S).sum(-2)
        den = (q[:, t] * z).sum(-1, keepdim=True) + 1e-6
        outs.append(num / den)
    return torch.stack(outs, 1)


def near_rwkv6(q, k, v, g):
    """Exclusive read plus bonus: o_t = q_t (S_{t-1} + u k_t v_t), then the update."""
    u = 0.5
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kv = k[:, t, ..., None] * v[:, t, ..., None, :]
        outs.append((q[:, t, ..., None] * (S + u * kv)).sum(-2))
        S = S * g[:, t].exp()[..., None] + kv
    return torch.stack(outs, 1)


def near_gate_over_v(q, k, v, g):
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, :] + k[:, t, ..., None] * v[:, t, ..., None, :]
        outs.append((q[:, t, ..., None] * S).sum(-2))
    return torch.stack(outs, 1)


def near_elementwise(q, k, v, g):
    """HGRN-style h = exp(g) h + x: no outer product."""
    h = q.new_zeros(q.shape[0], q.shape[2], q.shape[3])
    outs = []
    for t in range(q.shape[1]):
        h = h * g[:, t].exp() + k[:, t] * q[:, t]
        outs.append(h)
    return torch.stack(outs, 1)


def near_non_causal(q, k, v, g):
    G = g.cumsum(-1)
    D = torch.exp(-(G[..., :, None] - G[..., None, :]).abs())
    return ((q @ k.transpose(-1, -2)) * D) @ v


def near_shifted_mask(q, k, v, g):
    G = g.cumsum(-1)
    n = q.shape[2]
    D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), 0)
    return ((q @ k.transpose(-1, -2)) * D) @ v


SPELLINGS = [
    Spelling("loop_broadcast_setitem", loop_broadcast_setitem, bthd("vector"), 1),
    Spelling("loop_matmul_stack_scalar", loop_matmul_stack_scalar, bthd("scalar"), 1),
    Spelling("loop_head_first_keepdim_cat", loop_head_first_keepdim_cat, head_first("constant"), 1),
    Spelling("loop_einsum_state", loop_einsum_state, make_state, 1),
    Spelling("loop_no_gate_unbind", loop_no_gate_unbind, bthd("none"), 1),
    Spelling("loop_reverse", loop_reverse, bthd("vector"), 1),
    Spelling("loop_bmm_time_major", loop_bmm_time_major, make_time_major, 1),
    Spelling("parallel_scalar_masked_fill", parallel_scalar_masked_fill, head_first("scalar"), 1, "parallel"),
    Spelling("parallel_scalar_einsum_where", parallel_scalar_einsum_where, bthd("scalar"), 1, "parallel"),
    Spelling("parallel_scalar_neg_inf", parallel_scalar_neg_inf, head_first("scalar"), 1, "parallel"),
    Spelling("parallel_scalar_float_mask", parallel_scalar_float_mask, head_first("scalar"), 1, "parallel"),
    Spelling("parallel_constant_gate", parallel_constant_gate, head_first("constant"), 1, "parallel"),
    Spelling("parallel_vector_factored", parallel_vector_factored, head_first("vector"), 1, "parallel"),
    Spelling("parallel_vector_pairwise", parallel_vector_pairwise, head_first("vector"), 1, "parallel"),
    Spelling("parallel_no_gate", parallel_no_gate, head_first("none"), 1, "parallel"),
    Spelling("parallel_prefix_sums", parallel_prefix_sums, head_first("none"), 1, "parallel"),
    Spelling("parallel_prefix_sums_gated", parallel_prefix_sums_gated, head_first("vector"), 1, "parallel"),
]

NEAR_MISSES = [
    Spelling("near_delta_rule", near_delta_rule, bthd("scalar"), 0),
    Spelling("near_normalized", near_normalized, bthd("none"), 0),
    Spelling("near_rwkv6", near_rwkv6, bthd("vector"), 0),
    Spelling("near_gate_over_v", near_gate_over_v, bthd("value"), 0),
    Spelling("near_elementwise", near_elementwise, bthd("vector"), 0),
    Spelling("near_non_causal", near_non_causal, head_first("scalar"), 0, "parallel"),
    Spelling("near_shifted_mask", near_shifted_mask, head_first("scalar"), 0, "parallel"),
]


def loop_fused_qkv(qkv, g):
    """q, k, v unbound from one fused projection [B, T, 3, H, D]: two integer indices."""
    q, k, v = qkv.unbind(2)
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2)
    return o


def make_fused_qkv(dtype=torch.float32):
    return _randn(B, T, 3, H, K, dtype=dtype), _gate(B, T, H, K, dtype=dtype)


SPELLINGS.append(Spelling("loop_fused_qkv", loop_fused_qkv, make_fused_qkv, 1))


def near_time_reversed_output(q, k, v, g):
    """The read of step t written to o[:, T-1-t]: not the GLA output order."""
    n = q.shape[1]
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o = torch.zeros_like(v)
    for t in range(n):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, n - 1 - t] = (q[:, t, :, :, None] * S).sum(-2)
    return o


def near_shuffled_stack(q, k, v, g):
    """Outputs stacked in an order that is not time order."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs[1:] + outs[:1], dim=1)


NEAR_MISSES += [
    Spelling("near_time_reversed_output", near_time_reversed_output, bthd("vector"), 0),
    Spelling("near_shuffled_stack", near_shuffled_stack, bthd("vector"), 0),
]


# ---- the parallel form in reverse, with its states --------------------------------------------
def parallel_reverse_states(q, k, v, g, h0):
    """The anti-causal form (triu, a reverse cumsum), the initial state's share of the output and
    the final state (at step 0, where the reverse recurrence ends): chunk_fwd(reverse=True) with
    both states."""
    G = g.flip(2).cumsum(2).flip(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).triu()
    o = A @ v + (q * G.exp()) @ h0
    S = torch.einsum("bhtk,bhtv->bhkv", k * (G[:, :, :1] - G).exp(), v) + G[:, :, 0, :, None].exp() * h0
    return o, S


def parallel_scalar_states(q, k, v, g, h0):
    """Forward, a scalar gate: q_i exp(G_i) h0 added to the output, the final state returned."""
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    o = (((q @ k.transpose(-1, -2)) * D) @ v + G.exp()[..., None] * (q @ h0)) * 0.5
    last = G[..., -1:]
    return o, (k * (last - G).exp()[..., None]).transpose(-1, -2) @ v + last.exp()[..., None] * h0


def head_first_state(gate: str):
    def make(dtype=torch.float32):
        return head_first(gate)(dtype) + (_randn(B, H, K, V, dtype=dtype),)

    return make


def near_reverse_forward_decay(q, k, v, g):
    """A triu mask on the forward decay exp(G_i - G_j): it runs against the mask's direction."""
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().triu()) @ v


SPELLINGS += [
    Spelling("parallel_reverse_states", parallel_reverse_states, head_first_state("vector"), 1, "parallel"),
    Spelling("parallel_scalar_states", parallel_scalar_states, head_first_state("scalar"), 1, "parallel"),
]
NEAR_MISSES.append(Spelling("near_reverse_forward_decay", near_reverse_forward_decay, head_first("scalar"), 0, "parallel"))


# ---- one-token decode steps ----------------------------------------------------------------
# A step reads the state from a cache (a graph input) and writes the new state back into it,
# or returns it. `cache_arg` is the position of the argument a step mutates (None: none).
@dataclass
class Decode(Spelling):
    cache_arg: Optional[int] = None
    form: str = "decode"


def decode_inputs(gate: str, flat: bool = False):
    """q, k [B, H, K], v [B, H, V], a gate, and a cache [B, H, K, V] (flat: B*H merged)."""

    def make(dtype=torch.float32):
        lead = (B * H,) if flat else (B, H)
        q, k, v = _randn(*lead, K, dtype=dtype), _randn(*lead, K, dtype=dtype), _randn(*lead, V, dtype=dtype)
        g = {"vector": lambda: _gate(*lead, K, dtype=dtype), "scalar": lambda: _gate(*lead, dtype=dtype),
             "constant": lambda: _gate(H, dtype=dtype), "value": lambda: _gate(*lead, V, dtype=dtype)}
        gates = (g[gate](),) if gate in g else ()
        return (q, k, v) + gates + (_randn(*lead, K, V, dtype=dtype),)

    return make


def decode_broadcast_copy(q, k, v, g, cache):
    """FLA's recurrent step for one token: broadcast outer product and read, cache.copy_(S)."""
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    cache.copy_(S)
    return (q[..., :, None] * S).sum(-2) * q.shape[-1] ** -0.5


def decode_matmul_setitem(q, k, v, g, cache):
    """Scalar gate, matmul outer product and read, `cache[:] = S` after the read."""
    S = torch.exp(g)[..., None, None] * cache + k.unsqueeze(-1) @ v.unsqueeze(-2)
    o = (q.unsqueeze(-2) @ S).squeeze(-2)
    cache[:] = S
    return o


def decode_einsum_returned(q, k, v, g_gamma, h):
    """A constant gate per head, einsum, the new state returned (nothing in place: trains)."""
    S = h * g_gamma.exp()[:, None, None] + torch.einsum("bhk,bhv->bhkv", k, v)
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def decode_bmm_flat(q, k, v, g, cache):
    """Heads flattened into [B*H, K], bmm, a vector gate, no gate on the read."""
    S = cache * g.exp().unsqueeze(-1) + torch.bmm(k.unsqueeze(2), v.unsqueeze(1))
    cache.copy_(S)
    return torch.bmm(q.unsqueeze(1), S).squeeze(1)


def decode_no_gate(q, k, v, cache):
    """Linear attention decode: no decay."""
    S = cache + k[..., :, None] * v[..., None, :]
    cache.copy_(S)
    return torch.einsum("bhk,bhkv->bhv", q, S)


def decode_mamba2(x, dt, A_log, Bg, Cg, cache):
    """transformers' Mamba2 decode (mamba2_selective_state_update, 5.x): a V x K state
    [B, H, P, N], dt softplus broadcast over P, B/C groups expanded over heads, the state
    copied back before the read, the read a bmm on [B*H, P, N]."""
    b, h, p = x.shape
    n, groups = Bg.shape[-1], Bg.shape[1]
    dt = F.softplus(dt[..., None].expand(-1, -1, p))[..., None]
    A = (-torch.exp(A_log.float()))[:, None, None].expand(-1, p, n)
    dA = torch.exp(dt * A)
    Bh = Bg.reshape(b, groups, 1, n).expand(b, groups, h // groups, n).contiguous().reshape(b, h, 1, n)
    dBx = (dt * Bh) * x[..., None]
    S = cache * dA + dBx
    cache.copy_(S.to(cache.dtype))
    Ch = Cg.reshape(b, groups, 1, n).expand(b, groups, h // groups, n).contiguous().reshape(b, h, n)
    out = torch.bmm(S.view(b * h, p, n), Ch.view(b * h, n, 1))
    return out.view(b, h, p) + x


def make_mamba2_decode(dtype=torch.float32):
    groups, n = 2, 4
    heads = 2 * groups
    return (_randn(B, heads, V, dtype=dtype), _randn(B, heads, dtype=dtype), _randn(heads, dtype=dtype),
            _randn(B, groups, n, dtype=dtype), _randn(B, groups, n, dtype=dtype),
            _randn(B, heads, V, n, dtype=dtype))


def decode_read_after_copy(q, k, v, g, cache):
    """The new state copied into the cache first; the output then read from the cache."""
    cache.copy_(cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, cache)


def loop_cache_writeback(q, k, v, g, cache):
    """A short multi-token step from a cache: a time loop whose final state is copied back
    before the outputs are stacked."""
    S = cache
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None] + k[:, t, ..., None] * v[:, t, ..., None, :]
        outs.append((q[:, t, ..., None] * S).sum(-2))
    cache.copy_(S)
    return torch.stack(outs, 1)


def near_decode_zero_state(q, k, v, g, cache):
    """One outer product read by q, from no state at all: left alone (not a recurrence)."""
    S = k[..., :, None] * v[..., None, :]
    return (q[..., :, None] * S).sum(-2) + cache.sum(-2)


def near_decode_delta(q, k, v, g, cache):
    """A gated delta-rule decode step: the value is corrected by what the state predicts."""
    S = cache * g.exp()[..., None, None]
    v_new = v - (S * k[..., :, None]).sum(-2)
    S = S + k[..., :, None] * v_new[..., None, :]
    cache.copy_(S)
    return (q[..., :, None] * S).sum(-2)


def near_decode_exclusive(q, k, v, g, cache):
    """The output reads the cache before the update (RWKV-style exclusive read)."""
    o = (q[..., :, None] * cache).sum(-2)
    cache.copy_(cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :])
    return o


def near_decode_reset_before_read(q, k, v, g, cache):
    """The cache is modified in place between the update and the read: moving the step to the
    read would see the modified cache."""
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    cache.mul_(0.5)
    o = (q[..., :, None] * S).sum(-2)
    cache.add_(S)
    return o


DECODES = [
    Decode("decode_broadcast_copy", decode_broadcast_copy, decode_inputs("vector"), 1, cache_arg=4),
    Decode("decode_matmul_setitem", decode_matmul_setitem, decode_inputs("scalar"), 1, cache_arg=4),
    Decode("decode_einsum_returned", decode_einsum_returned, decode_inputs("constant"), 1),
    Decode("decode_bmm_flat", decode_bmm_flat, decode_inputs("vector", flat=True), 1, cache_arg=4),
    Decode("decode_no_gate", decode_no_gate, decode_inputs("none"), 1, cache_arg=3),
    Decode("decode_mamba2", decode_mamba2, make_mamba2_decode, 1, cache_arg=5),
    Decode("decode_read_after_copy", decode_read_after_copy, decode_inputs("vector"), 1, cache_arg=4),
    Decode("loop_cache_writeback", loop_cache_writeback, lambda dtype=torch.float32: make_state(dtype), 1,
           cache_arg=4, form="loop"),
    Decode("near_decode_zero_state", near_decode_zero_state, decode_inputs("vector"), 0),
    Decode("near_decode_delta", near_decode_delta, decode_inputs("scalar"), 0, cache_arg=4),
    Decode("near_decode_exclusive", near_decode_exclusive, decode_inputs("vector"), 0, cache_arg=4),
    Decode("near_decode_reset_before_read", near_decode_reset_before_read, decode_inputs("vector"), 0, cache_arg=4),
]


# ---- chunked forms (Mamba2's SSD scan) -----------------------------------------------------
# x [B, T, H, P], dt [B, T, H] (before softplus), A [H] (negative), Bg / Cg [B, T, G, N]
# (groups broadcast over heads), h0 [B, H, P, N]: a V x K state. q = C, k = B, v = x * dt,
# g = dt * A, scale 1.
CHUNK = 4


def segment_sum(x):
    """transformers' stable segment sum: out[..., i, j] = sum_{j < s <= i} x[..., s], -inf above."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def _ssd_inputs(x, dt, A, Bg, Cg):
    """The preamble every spelling shares: softplus, groups over heads, padding into chunks."""
    heads, seq = x.shape[2], x.shape[1]
    pad = (CHUNK - seq % CHUNK) % CHUNK
    dt = F.softplus(dt)
    Bh = Bg.to(x.dtype).repeat_interleave(heads // Bg.shape[2], dim=2, output_size=heads)
    Ch = Cg.to(x.dtype).repeat_interleave(heads // Cg.shape[2], dim=2, output_size=heads)
    x, a = x * dt[..., None], A.to(x.dtype) * dt

    def chunks(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(t.shape[0], -1, CHUNK, *t.shape[2:])

    return chunks(x), chunks(a), chunks(Bh), chunks(Ch), seq


def chunked_hf_einsum(x, dt, A, Bg, Cg, h0, on_diag=None, on_final=None):
    """transformers 5.x `mamba2_chunk_scan`: segment sums, einsums, initial state, final state.
    Hooks (the near misses of tests/recognize/test_certificate_size.py): on_diag maps the
    intra-chunk term [b, c, l, h, p], on_final the final state [b, h, p, n]."""
    x, A, B_, C_, seq = _ssd_inputs(x, dt, A, Bg, Cg)
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C_, B_)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", G * L.permute(0, 2, 3, 4, 1), x)
    if on_diag is not None:
        Y_diag = on_diag(Y_diag)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bclhp->bchpn", B_ * decay_states.permute(0, -2, -1, 1)[..., None], x)
    states = torch.cat([h0[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    if on_final is not None:
        final = on_final(final)
    Y_off = torch.einsum("bclhn,bchpn->bclhp", C_, states) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (Y_diag + Y_off).contiguous().reshape(x.shape[0], -1, x.shape[3], x.shape[4])
    return y[:, :seq], final


def chunked_hf_broadcast(x, dt, A, Bg, Cg, h0):
    """transformers <= 5.0 `torch_forward`: the same scan as broadcast-multiply-sums, with a
    sum over a size-1 axis, and the state kept by the caller."""
    x, A, B_, C_, seq = _ssd_inputs(x, dt, A, Bg, Cg)
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    G = (C_[:, :, :, None, :, :] * B_[:, :, None, :, :, :]).sum(dim=-1)
    M = (G[..., None] * L.permute(0, 2, 3, 4, 1)[..., None]).sum(dim=-1)
    Y_diag = (M[..., None] * x[:, :, None]).sum(dim=3)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B_ * decay_states.permute(0, -2, -1, 1)[..., None]
    states = (B_decay[..., None, :] * x[..., None]).sum(dim=2)
    states = torch.cat([h0[:, None], states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = (decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=1)
    states, ssm_state = new_states[:, :-1], new_states[:, -1]
    C_times_states = C_[..., None, :] * states[:, :, None, ...]
    Y_off = C_times_states.sum(-1) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (Y_diag + Y_off).reshape(x.shape[0], -1, x.shape[3], x.shape[4])
    return y[:, :seq], ssm_state


def ssd_minimal(X, A, Bh, Ch, h0):
    """mamba_ssm's `ssd_minimal_discrete` (four- and three-operand einsums), rearranges written
    as reshapes; X = x * dt and A = dt * A given, T a multiple of the chunk, no final state."""
    b, seq, h, p = X.shape
    X, A, Bh, Ch = (t.reshape(b, seq // CHUNK, CHUNK, *t.shape[2:]) for t in (X, A, Bh, Ch))
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Ch, Bh, L, X)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_states, X)
    states = torch.cat([h0[:, None], states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, new_states[:, :-1], torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, seq, h, p)


def near_ssd_segsum_shifted(x, dt, A, Bg, Cg, h0):
    """A segment sum that also counts the diagonal (mask diagonal 0 before the cumsum): each
    step decays by its own gate once too often. Not GLA: the certificate fails."""
    x, A, B_, C_, seq = _ssd_inputs(x, dt, A, Bg, Cg)
    A = A.permute(0, 3, 1, 2)
    n = A.size(-1)
    S = A[..., None].expand(*A.size(), n).masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), 0)
    S = torch.cumsum(S, dim=-2).masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), -torch.inf)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", torch.einsum("bclhn,bcshn->bclsh", C_, B_) * torch.exp(S).permute(0, 2, 3, 4, 1), x)
    A_cumsum = torch.cumsum(A, dim=-1)
    states = torch.einsum("bclhn,bclhp->bchpn", B_ * torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum).permute(0, -2, -1, 1)[..., None], x)
    states = torch.cat([h0[:, None], states], dim=1)
    new_states = torch.einsum("bzch,bzhpn->bchpn", torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3), states)
    Y_off = torch.einsum("bclhn,bchpn->bclhp", C_, new_states[:, :-1]) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    return (Y_diag + Y_off).reshape(x.shape[0], -1, x.shape[3], x.shape[4])[:, :seq]


def make_ssd(dtype=torch.float32, seq=T):
    groups, n, heads = 2, 3, 4
    return (_randn(B, seq, heads, V, dtype=dtype), _randn(B, seq, heads, dtype=dtype), -torch.rand(heads, dtype=dtype),
            _randn(B, seq, groups, n, dtype=dtype), _randn(B, seq, groups, n, dtype=dtype), _randn(B, heads, V, n, dtype=dtype))


def make_ssd_minimal(dtype=torch.float32):
    heads, n, seq = 4, 3, 2 * CHUNK
    return (_randn(B, seq, heads, V, dtype=dtype), -torch.rand(B, seq, heads, dtype=dtype) * 0.5,
            _randn(B, seq, heads, n, dtype=dtype), _randn(B, seq, heads, n, dtype=dtype), _randn(B, heads, V, n, dtype=dtype))


SPELLINGS += [
    Spelling("chunked_hf_einsum", chunked_hf_einsum, make_ssd, 1, "chunked"),
    Spelling("chunked_hf_broadcast", chunked_hf_broadcast, make_ssd, 1, "chunked"),
    Spelling("chunked_ssd_minimal", ssd_minimal, make_ssd_minimal, 1, "chunked"),
]
NEAR_MISSES += [
    Spelling("near_ssd_segsum_shifted", near_ssd_segsum_shifted, make_ssd, 0, "chunked"),
]


# ---- chunk loops ------------------------------------------------------------------------------
# Head-first [B, H, T, D]; a Python loop over chunks carries the state S [B, H, K, V]: the
# output of a chunk is its intra-chunk attention under a decay mask plus the read of S.
def chunk_loop_cat(q, k, v, g):
    """FLA's naive chunk form (scalar gate, scale K^-1/2): list + cat, T = 9 over chunks of 4
    (a partial last chunk), the final state returned."""
    b, h, n, d = q.shape
    q = q * d**-0.5
    S = q.new_zeros(b, h, d, v.shape[-1])
    outs = []
    for s in range(0, n, CHUNK):
        q_i, k_i, v_i = q[:, :, s : s + CHUNK], k[:, :, s : s + CHUNK], v[:, :, s : s + CHUNK]
        G = g[:, :, s : s + CHUNK].cumsum(-1)
        c = G.shape[-1]
        D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(), 0)
        outs.append((q_i * G[..., None].exp()) @ S + (q_i @ k_i.transpose(-1, -2) * D) @ v_i)
        S = S * G[..., -1, None, None].exp() + (k_i * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ v_i
    return torch.cat(outs, dim=2), S


def chunk_loop_retention(q, k, v, log_gamma):
    """Retention by chunks (a constant decay per head, held in a buffer as a log): chunked
    views, decay tables built once, outputs written into a chunked buffer, then flattened."""
    b, h, n, d = q.shape
    qc, kc, vc = (x.reshape(b, h, n // CHUNK, CHUNK, x.shape[-1]) for x in (q, k, v))
    idx = torch.arange(CHUNK, dtype=q.dtype)
    causal = idx[:, None] >= idx[None, :]
    decay = torch.exp(log_gamma[:, None, None] * (idx[:, None] - idx[None, :])) * causal  # [H, C, C]
    q_decay = torch.exp(log_gamma[:, None] * (idx + 1))[:, :, None]  # to position i from the chunk's start
    k_decay = torch.exp(log_gamma[:, None] * (CHUNK - 1 - idx))[:, :, None]  # from j to the chunk's end
    chunk_decay = torch.exp(log_gamma * CHUNK)[:, None, None]
    o = torch.empty_like(vc)
    S = q.new_zeros(b, h, d, v.shape[-1])
    for i in range(n // CHUNK):
        q_i, k_i, v_i = qc[:, :, i], kc[:, :, i], vc[:, :, i]
        o[:, :, i] = (q_i @ k_i.transpose(-1, -2) * decay) @ v_i + (q_i * q_decay) @ S
        S = S * chunk_decay + (k_i * k_decay).transpose(-1, -2) @ v_i
    return o.reshape(b, h, n, -1)


def chunk_loop_constant_decay(q, k, v, h0):
    """A chunk loop whose decay is a Python constant (0.9 per step) and whose state starts
    from a given one; outputs stacked by chunk, then flattened."""
    b, h, n, d = q.shape
    idx = torch.arange(CHUNK, dtype=q.dtype)
    decay = (0.9 ** (idx[:, None] - idx[None, :])).tril()
    S = h0
    outs = []
    for s in range(0, n, CHUNK):
        q_i, k_i, v_i = q[:, :, s : s + CHUNK], k[:, :, s : s + CHUNK], v[:, :, s : s + CHUNK]
        outs.append((q_i @ k_i.transpose(-1, -2) * decay) @ v_i + (q_i * 0.9 ** (idx + 1)[:, None]) @ S)
        S = S * 0.9**CHUNK + (k_i * 0.9 ** (CHUNK - 1 - idx)[:, None]).transpose(-1, -2) @ v_i
    return torch.stack(outs, dim=2).reshape(b, h, n, -1)


def near_chunk_loop_delta(q, k, v, g):
    """A chunked delta rule (the value corrected by what the state predicts): the same skeleton
    as the GLA chunk loop, not GLA."""
    b, h, n, d = q.shape
    S = q.new_zeros(b, h, d, v.shape[-1])
    outs = []
    for s in range(0, n, CHUNK):
        q_i, k_i, v_i = q[:, :, s : s + CHUNK], k[:, :, s : s + CHUNK], v[:, :, s : s + CHUNK]
        G = g[:, :, s : s + CHUNK].cumsum(-1)
        c = G.shape[-1]
        D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(), 0)
        u = v_i - (k_i * G[..., None].exp()) @ S
        outs.append((q_i * G[..., None].exp()) @ S + (q_i @ k_i.transpose(-1, -2) * D) @ u)
        S = S * G[..., -1, None, None].exp() + (k_i * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)


def make_retention(dtype=torch.float32):
    q, k, v = head_first("none")(dtype)
    q, k, v = (x[:, :, : 2 * CHUNK].contiguous() for x in (q, k, v))
    return q, k, v, torch.log(1 - 2.0 ** (-2 - torch.arange(H, dtype=dtype)))


def make_constant_decay(dtype=torch.float32):
    q, k, v = make_retention(dtype)[:3]
    return q, k, v, _randn(B, H, K, V, dtype=dtype)


SPELLINGS += [
    Spelling("chunk_loop_cat", chunk_loop_cat, head_first("scalar"), 1, "chunked"),
    Spelling("chunk_loop_retention", chunk_loop_retention, make_retention, 1, "chunked"),
    Spelling("chunk_loop_constant_decay", chunk_loop_constant_decay, make_constant_decay, 1, "chunked"),
]
NEAR_MISSES += [
    Spelling("near_chunk_loop_delta", near_chunk_loop_delta, head_first("scalar"), 0, "chunked"),
]
