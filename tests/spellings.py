"""Naive GLA programs as people write them, and look-alikes that are not GLA.

Each entry: a function, a factory of its inputs, and how many rewrites the backend must
make. Inputs: `make(B, T, H, K, V, dtype)` returns a tuple of tensors that require grad.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
