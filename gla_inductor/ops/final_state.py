"""Custom op ``gla_inductor::chunk_final_state``: a GLA run's final state from a zero state, or the
gradient w.r.t. its initial state, without the outputs; and the decay across the run.

What context parallelism needs from a segment before the states of the segments before it are
known (``distributed.context_parallel``): a full ``chunk_fwd`` would also compute and write o, and
a full reverse run the dual's outputs, only for a state. This op does the states walk alone
(``impl.final_state`` describes both modes; ``dispatch`` routes it). No autograd formula: its
callers bring their own backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..contract import FINAL_STATE_ARGS, GLACall
from . import dispatch
from .chunk import _first_trace

__all__ = ["FINAL_STATE_ARGS", "chunk_final_state", "final_state_call"]


def _chunk_final_state_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    do: Optional[Tensor],
    scale: float,
    reverse: bool,
    gate_fn: str = "",
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(state [B, H, K, V] in the state dtype, decay exp(sum of the log gates) [B, H, K] for a vector
    gate, [B, H] for scalar and constant gates, an empty [0] without a gate).

    Without do: the state the run of ``chunk_fwd`` with these arguments leaves from a zero state
    (reads k, v, g). With do [B, T, H, V]: scale * sum_t (q_t exp(G_t))^T do_t, G_t the log gates
    from the first processed step through t, the gradient of sum_t <do_t, o_t> w.r.t. the initial
    state (reads q, do, g). Arguments as ``chunk_fwd``'s; no packed sequences."""
    named = dict(zip(FINAL_STATE_ARGS, (q, k, v, g, g_gamma, do, scale, reverse, gate_fn, gate_scale, gate_lo,
                                         gate_hi, gate_a, gate_bias)))
    return dispatch.chunk_final_state(final_state_call(named), do)


def final_state_call(named: dict) -> GLACall:
    """The GLACall of the op's arguments by name (do aside)."""
    return GLACall.from_op_args((), {n: x for n, x in named.items() if n != "do"})


chunk_final_state = torch.library.custom_op("gla_inductor::chunk_final_state", _chunk_final_state_impl,
                                            mutates_args=())


@chunk_final_state.register_fake
def _chunk_final_state_fake(*args, **kwargs):
    _first_trace()  # registers the lowerings (the package face's hook) before Inductor sees the op
    named = dict(zip(FINAL_STATE_ARGS, args), **kwargs)
    call = final_state_call(named)
    q, v = call.q, call.v
    B, K, H, V = q.shape[0], q.shape[-1], v.shape[2], v.shape[-1]
    state = q.new_empty(B, H, K, V, dtype=call.state_dtype)
    kind = call.gate_kind
    decay_shape = (0,) if kind == "none" else (B, H, K) if kind == "vector" else (B, H)
    return state, q.new_empty(decay_shape, dtype=call.state_dtype)
