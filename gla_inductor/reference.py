"""Naive GLA definitions, written for reading and used as float64 test oracles.

Layout is [B, T, H, D]. Per (batch, head) the state S_t is a [K, V] matrix:

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

g is a per-step LOG gate: vector [B, T, H, K], scalar [B, T, H] (one decay for all K),
or constant g_gamma [H] (the same decay at every step). ``reverse=True`` runs the
recurrence from t = T-1 down to 0. q and k may have fewer heads than v, [B, T, G, K] with G
dividing H (grouped heads, GQA-style): head h reads q/k head h // (H // G), as
``q.repeat_interleave(H // G, dim=2)`` would give it (the repeat is differentiable, so gradients
come back summed over each group).

Both functions compute in float64 when any input is float64 and in float32 otherwise,
and return o and the final state in that compute dtype. They are differentiable, so
autograd through them gives the reference gradients.
"""

from typing import Optional

import torch
from torch import Tensor


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _repeat_groups(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q and k repeated to v's heads where they are grouped."""
    G, H = q.shape[2], v.shape[2]
    if G == H:
        return q, k
    if k.shape[2] != G or G == 0 or H % G:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need a head count dividing v's {H}")
    return q.repeat_interleave(H // G, dim=2), k.repeat_interleave(H // G, dim=2)


def _log_gate(q: Tensor, g: Optional[Tensor], g_gamma: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """Every gate kind written as a per-step, per-key log gate [B, T, H, K]."""
    B, T, H, K = q.shape
    if g is not None and g_gamma is not None:
        raise ValueError("pass at most one of g and g_gamma")
    if g_gamma is not None:
        return g_gamma.to(dtype).view(1, 1, H, 1).expand(B, T, H, K)
    if g is None:
        return q.new_zeros(B, T, H, K, dtype=dtype)
    if g.dim() == 3:
        return g.to(dtype).unsqueeze(-1).expand(B, T, H, K)
    return g.to(dtype)


def naive_recurrent_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    *,
    g_gamma: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """The recurrence as a plain time loop.

    Returns (o [B, T, H, V], final state [B, H, K, V] or None).
    """
    q, k = _repeat_groups(q, k, v)
    dtype = _compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    gk = _log_gate(q, g, g_gamma, dtype)

    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dtype)
    o = [None] * T
    for t in reversed(range(T)) if reverse else range(T):
        S = gk[:, t].exp().unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        o[t] = scale * (q[:, t].unsqueeze(-1) * S).sum(-2)
    o = torch.stack(o, dim=1) if T > 0 else q.new_zeros(B, 0, H, V)
    return o, (S if output_final_state else None)


def naive_parallel_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    *,
    g_gamma: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """The same map in closed form, with G = cumsum(g) over time:

        o_i = scale * sum_{j <= i} (q_i * exp(G_i - G_j)) . k_j  v_j  +  scale * (q_i * exp(G_i)) S_0

    The decay is the [T, T, K] pairwise tensor exp(G_i - G_j), masked above the diagonal before
    exponentiating (there G_i - G_j > 0 for decaying gates and could overflow). O(T^2 K) memory:
    for cross-checking the loop on small T only.
    """
    if reverse:
        # the reverse recurrence is the forward one on the time-flipped sequence
        g = g.flip(1) if g is not None else None
        o, ht = naive_parallel_gla(
            q.flip(1), k.flip(1), v.flip(1), g, g_gamma=g_gamma, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
        )
        return o.flip(1), ht

    q, k = _repeat_groups(q, k, v)
    dtype = _compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    G = _log_gate(q, g, g_gamma, dtype).cumsum(1)  # [B, T, H, K]

    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = G.unsqueeze(2) - G.unsqueeze(1)  # [B, T(i), T(j), H, K]
    decay = diff.masked_fill(~causal[:, :, None, None], float("-inf")).exp()
    A = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, decay)
    o = scale * torch.einsum("bhij,bjhv->bihv", A, v)
    if initial_state is not None:
        o = o + scale * torch.einsum("bthk,bhkv->bthv", q * G.exp(), initial_state.to(dtype))

    if not output_final_state:
        return o, None
    if T == 0:
        G_last = q.new_zeros(B, 1, H, K)
    else:
        G_last = G[:, -1:]
    ht = torch.einsum("bthk,bthv->bhkv", k * (G_last - G).exp(), v)
    if initial_state is not None:
        ht = ht + G_last[:, 0].exp().unsqueeze(-1) * initial_state.to(dtype)
    return o, ht
