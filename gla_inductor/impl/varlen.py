"""Packed sequences (``GLACall.cu_seqlens``) for the implementations that take one sequence at a
time: the chunked PyTorch algorithm and the C++ step loop. A packed call is split on the host into
one call per sequence (batch 1, its own initial state), each runs as it would alone, and the
results are joined: outputs and input gradients along time, states along the sequences, a constant
gate's gradient summed.

The offsets are read with ``tolist()``: a host synchronization where they live on a GPU. These are
the CPU implementations and the CUDA fallback, not paths for CUDA graphs (the Triton kernels read
the offsets on the device).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..contract import GLACall

__all__ = ["backward", "forward", "one_sequence", "sequence", "spans", "time_slice"]


def spans(call: GLACall) -> list[tuple[int, int]]:
    """(start, end) of every packed sequence."""
    offsets = [int(x) for x in call.cu_seqlens.tolist()]
    return list(zip(offsets, offsets[1:]))


def _slice(x: Optional[Tensor], start: int, end: int) -> Optional[Tensor]:
    return None if x is None else x[:, start:end]  # time is dim 1 of q, k, v and g alike


def time_slice(call: GLACall, start: int, end: int) -> GLACall:
    """Steps start to end - 1 of every input (views), the rest of the call as it is."""
    return call.replace(q=_slice(call.q, start, end), k=_slice(call.k, start, end), v=_slice(call.v, start, end),
                        g=_slice(call.g, start, end))


def sequence(call: GLACall, n: int, start: int, end: int) -> GLACall:
    """Sequence n as a call of its own: [1, end - start] views of the inputs, its initial state."""
    h0 = call.initial_state
    return time_slice(call, start, end).replace(initial_state=None if h0 is None else h0[n:n + 1], cu_seqlens=None)


def one_sequence(call: GLACall) -> GLACall:
    """A call shaped like one of the packed sequences (the whole packed length), for the
    implementations' support checks, which read shapes only."""
    h0 = call.initial_state
    return call.replace(initial_state=None if h0 is None else h0[:1], cu_seqlens=None)


def _empty_state(call: GLACall) -> Tensor:
    q, v = call.q, call.v
    return q.new_zeros(1, v.shape[2], q.shape[-1], v.shape[-1], dtype=call.state_dtype)


def forward(call: GLACall, run: Callable[[GLACall], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(o, final states [N, H, K, V] or an empty [0]) of a packed call, ``run`` on each sequence.
    Sequences of length 0 pass their initial state through (run is not called on them)."""
    outs, states = [], []
    for n, (start, end) in enumerate(spans(call)):
        one = sequence(call, n, start, end)
        if end > start:
            o, ht = run(one)
        else:
            o = call.v.new_empty(1, 0, *call.v.shape[2:], dtype=call.output_dtype)
            ht = _empty_state(call) if one.initial_state is None else one.initial_state.to(call.state_dtype)
        outs.append(o)
        states.append(ht)
    o = torch.cat(outs, 1)
    if not call.output_final_state:
        return o, call.q.new_empty(0, dtype=call.state_dtype)
    return o, torch.cat(states, 0)


def backward(call: GLACall, do: Tensor, dht: Optional[Tensor],
             run: Callable[[GLACall, Tensor, Optional[Tensor]], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dg_gamma, dh0) of a packed call, ``run`` on each sequence, in the ops'
    convention (an empty [0] for an absent input)."""
    parts = []
    for n, (start, end) in enumerate(spans(call)):
        one = sequence(call, n, start, end)
        one_dht = None if dht is None else dht[n:n + 1]
        parts.append(run(one, do[:, start:end], one_dht) if end > start else _empty_grads(one, one_dht))
    dq, dk, dv, dg, dg_gamma, dh0 = zip(*parts)
    q = call.q
    return (
        torch.cat(dq, 1),
        torch.cat(dk, 1),
        torch.cat(dv, 1),
        q.new_empty(0) if call.g is None else torch.cat(dg, 1),
        q.new_empty(0) if call.g_gamma is None else torch.stack(dg_gamma).sum(0),
        q.new_empty(0) if call.initial_state is None else torch.cat(dh0, 0),
    )


def _empty_grads(one: GLACall, dht: Optional[Tensor]) -> tuple[Tensor, ...]:
    """The gradients of a sequence of length 0: nothing but the initial state's, which is dht."""
    q, k, v, g, g_gamma, h0 = one.q, one.k, one.v, one.g, one.g_gamma, one.initial_state
    dg = None if g is None else g.new_zeros(g.shape)
    dg_gamma = None if g_gamma is None else torch.zeros_like(g_gamma)
    dh0 = None if h0 is None else (torch.zeros_like(h0) if dht is None else dht.to(h0.dtype, copy=True))
    return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), dg, dg_gamma, dh0
