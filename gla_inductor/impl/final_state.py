"""The final state of a GLA run from a zero state, without its outputs, in PyTorch: the
``chunk_final_state`` op's implementation on CPU and wherever the kernels do not apply.

Two modes, for a call whose gate is a log gate (``GLACall.with_log_gate``):

  forward (do None)   S = sum_t exp(G_T - G_t) k_t v_t^T, the state a run leaves, where G_t sums
                      the log gates from the first processed step through t: reads k, v, g;
  dual (do given)     dS = scale * sum_t (q_t * exp(G_t))^T do_t, the gradient of sum_t <do_t, o_t>
                      w.r.t. the run's initial state: reads q, do, g.

Both also give the decay across the whole run, exp(G_T) ([B, H, K] for a vector gate, [B, H] for
scalar and constant gates). The work is the chunked algorithm's state recurrence alone: per chunk
of ``BT`` steps one [K, BT] x [BT, V] product, no outputs, no intra-chunk scores.

Each decay is exp of a sum of log gates over a span inside one chunk, or a product of the chunks'
decays (``fold``): never a difference of long sums (NOTE:[GLA chunk stability]).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall, repeat_groups

__all__ = ["BT", "final_state", "fold"]

BT = 64


def fold(states: Tensor, decays: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The state after walking P pieces in order from zero, S <- a_p * S + states_p, and the decay
    across all of them: states [N, P, H, K, V], decays [N, P, H, K] or [N, P, H] (None: no gate;
    the decay is then an empty [0]). As sum_p (prod_{p' > p} a_p') states_p: a reverse cumulative
    product, one product and one sum, rather than P dependent steps."""
    if decays is None:
        return states.sum(1), states.new_empty(0)
    after = decays.flip(1).cumprod(1).flip(1)  # prod_{p' >= p} a_p'
    weights = torch.cat([after[:, 1:], torch.ones_like(after[:, :1])], 1)  # prod_{p' > p}
    weights = weights.unsqueeze(-1) if decays.dim() == 4 else weights[..., None, None]
    return (weights * states).sum(1), after[:, 0].contiguous()  # the op's decay is contiguous


def _log_gate(call: GLACall, B: int, T: int, H: int) -> Optional[Tensor]:
    """[B, T, H, Kg] log gates (Kg = K for a vector gate, else 1), None without a gate."""
    if call.g is not None:
        return call.g if call.g.dim() == 4 else call.g.unsqueeze(-1)
    if call.g_gamma is not None:
        return call.g_gamma.view(1, 1, H, 1).expand(B, T, H, 1)
    return None


def _chunks(x: Tensor, NT: int, dtype: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, H, NT, BT, D] in dtype, zero-padded (zero keys and log gates are inert)."""
    B, T, H, D = x.shape
    out = x.new_zeros(B, H, NT * BT, D, dtype=dtype)
    out[:, :, :T] = x.transpose(1, 2)
    return out.view(B, H, NT, BT, D)


@torch.no_grad()
def final_state(call: GLACall, do: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(state [B, H, K, V], decay) of ``call`` (a log gate, no packed sequences): the forward mode,
    or the dual one with output gradients do. In the state dtype (fp32, fp64 for fp64 inputs)."""
    dual = do is not None
    dtype = call.state_dtype
    v = do if dual else call.v
    B, T, H, V = v.shape
    x = repeat_groups(call.q if dual else call.k, H)
    K = x.shape[-1]
    lg = _log_gate(call, B, T, H)
    vector = lg is not None and call.g is not None and call.g.dim() == 4
    if T == 0:
        decay = x.new_empty(0, dtype=dtype) if lg is None else x.new_ones(B, H, *(K,) * vector, dtype=dtype)
        return x.new_zeros(B, H, K, V, dtype=dtype), decay
    # walk the pieces forward in the array: the forward mode in processing order, the dual against it
    if call.reverse != dual:
        x, v, lg = (None if t is None else t.flip(1) for t in (x, v, lg))
    NT = -(-T // BT)
    xc, vc = _chunks(x, NT, dtype), _chunks(v, NT, dtype)
    if dual:
        xc = xc * call.scale
    if lg is None:
        return fold(torch.einsum("bhnck,bhncv->bnhkv", xc, vc), None)
    lc = _chunks(lg, NT, dtype)
    # the decay from step j to the piece's end in walk order: the steps after j (forward mode:
    # S <- a_t S + k_t v_t^T), or j and those after it (dual: dS <- a_t (dS + q_t do_t^T))
    after = lc.flip(3).cumsum(3).flip(3)
    span = after if dual else torch.cat([after[:, :, :, 1:], torch.zeros_like(after[:, :, :, :1])], 3)
    update = torch.einsum("bhnck,bhncv->bnhkv", xc * span.exp(), vc)
    decays = after[:, :, :, 0].exp().transpose(1, 2)  # [B, NT, H, Kg]
    return fold(update, decays if vector else decays[..., 0])
