"""The recurrence as a PyTorch time loop, for decoding and short steps on CPU and as the CUDA
fallback of the ``fused_recurrent`` op: it updates the caller's state in place.

The loop passes over the whole [B, H, K, V] state three times per step; the chunked algorithm
touches the state once per chunk of 64 steps at the price of more setup, so it wins on longer
sequences: dispatch takes this loop up to ``STEP_LOOP_MAX_T`` steps.
"""

from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall

__all__ = ["STEP_LOOP_MAX_T", "step_loop"]

STEP_LOOP_MAX_T = 64


def _step_decay(g: Optional[Tensor], g_gamma: Optional[Tensor], t: int, dtype: torch.dtype) -> Optional[Tensor]:
    """exp(g_t), shaped to scale a [B, H, K, V] state: [B, H, K, 1], [B, H, 1, 1], [H, 1, 1] or None."""
    if g is not None:
        g_t = g[:, t].to(dtype)
        return (g_t.unsqueeze(-1) if g.dim() == 4 else g_t[..., None, None]).exp()
    if g_gamma is not None:
        return g_gamma.to(dtype).view(-1, 1, 1).exp()
    return None


@torch.no_grad()
def step_loop(call: GLACall, state: Tensor) -> Tensor:
    """o [B, T, H, V] of ``call`` (a log gate, q and k with v's heads) from ``state``, which it
    overwrites with the final state."""
    q, k, v, g, g_gamma = call.q, call.k, call.v, call.g, call.g_gamma
    dtype = call.state_dtype
    B, T, H, _ = q.shape
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # the running state: the caller's tensor itself when it has the compute dtype (it is overwritten
    # anyway), else a working copy written back at the end
    S = state if state.dtype == dtype else state.to(dtype)
    o = q.new_empty(B, T, H, v.shape[-1])
    for t in reversed(range(T)) if call.reverse else range(T):
        decay = _step_decay(g, g_gamma, t, dtype)
        if decay is not None:
            S.mul_(decay)
        S.addcmul_(k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2))
        o[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
    if S is not state:
        state.copy_(S)
    return o.mul_(call.scale).to(call.output_dtype)
