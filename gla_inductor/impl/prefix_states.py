"""Prefix states (``chunk_gla(..., output_prefix_states=True)``) for the implementations that have
no kernel for them: the forward run block by block, ``interval`` steps at a time, each block from
the state the one before left, keeping the state after every whole block. The slots are the
kernels' (``kernels.chunk.prefix_slots``): [B, T // P + 1] for fixed-length sequences, slot j
holding the state after the first j * P steps; packed, [1, T // P + N], sequence n's from slot
cu_seqlens[n] // P + n on.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..contract import GLACall
from . import varlen

__all__ = ["forward", "slots"]


def slots(call: GLACall, interval: int) -> tuple[int, int]:
    """(batch, slots) of the prefix states."""
    B, T = call.q.shape[:2]
    return (B, T // interval + 1) if not call.varlen else (1, T // interval + call.num_sequences)


def forward(call: GLACall, interval: int, run: Callable[[GLACall], tuple[Tensor, Tensor]]
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final states, prefix states) of a forward call with a log gate, ``run`` (an
    implementation's forward) on every block."""
    q, v = call.q, call.v
    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    hp = q.new_zeros(*slots(call, interval), H, K, V, dtype=call.state_dtype)
    if not call.varlen:
        o, ht = _blocks(call, interval, hp, 0, run)
        return o, ht, hp
    parts = [_blocks(varlen.sequence(call, n, start, end), interval, hp, start // interval + n, run)
             for n, (start, end) in enumerate(varlen.spans(call))]
    return torch.cat([o for o, _ in parts], 1), torch.cat([ht for _, ht in parts], 0), hp


def _blocks(call: GLACall, interval: int, hp: Tensor, first: int, run) -> tuple[Tensor, Tensor]:
    """(o, final state) of a fixed-length call run in blocks, its prefix states written to
    hp[:, first:] (all batch entries at once)."""
    q, v = call.q, call.v
    B, T, H, K, V = *q.shape[:2], v.shape[2], q.shape[3], v.shape[3]
    state = call.initial_state
    state = q.new_zeros(B, H, K, V, dtype=call.state_dtype) if state is None else state.to(call.state_dtype)
    hp[:, first] = state
    outs = [v.new_empty(B, 0, H, V, dtype=call.output_dtype)]
    for j, start in enumerate(range(0, T, interval)):
        end = min(start + interval, T)
        block = varlen.time_slice(call, start, end).replace(initial_state=state, output_final_state=True)
        o, state = run(block)
        outs.append(o)
        if end - start == interval:
            hp[:, first + j + 1] = state
    return torch.cat(outs, 1), state
