"""Host launcher of the states-only pass: the final state of a GLA run from a zero state (or, in
the dual mode, the gradient w.r.t. its initial state) and the decay across it, no outputs.

It is gla_chunk_segsum, the first launch of a scan walked in segments: P programs per (value tile,
batch * head) each walk NT / P chunks from a zero state, one dot per chunk (the states walk's
work), and write the state their segment leaves and the decay across it; ``impl.final_state.fold``
then combines the P segments (a product and a sum over [N, P, H, K, V]). Reads k, v and g (dual:
q, do and g) once; writes nothing per chunk. The contract is ``impl.final_state``'s.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall
from ..impl.final_state import fold
from . import chunk
from .configs import ChunkConfig

__all__ = ["final_state", "segments"]


def segments(programs: int, NT: int, sms: int) -> int:
    """Segments of the walk (a power of two up to 16): up to two programs per SM, each walking at
    least 4 chunks. A states-only walk does one dot per chunk and reads its inputs once; its
    B * H * cdiv(V, BV) programs alone would leave most SMs idle at long T and few heads, the
    shapes that context parallelism runs."""
    P = 1
    while P < 16 and (2 * P) * programs <= 2 * sms and NT >= 4 * (2 * P):  # the doubled count fits
        P *= 2
    return P


def final_state(call: GLACall, do: Optional[Tensor] = None, config: Optional[ChunkConfig] = None,
                num_segments: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(state [B, H, K, V] fp32, decay [B, H, K] (vector gate), [B, H] (scalar, constant) fp32 or an
    empty [0]): see ``impl.final_state``. num_segments overrides ``segments`` (tests)."""
    dual = do is not None
    call, cfg = chunk._prepare(call, config)
    B, T, _, K = call.q.shape
    H, V = call.v.shape[2], call.v.shape[-1]
    x = call.q if dual else call.k
    v = do.to(call.output_dtype) if dual else call.v
    gated = call.gate_kind != "none"
    if T == 0:
        decay = x.new_ones((B, H, K) if call.gate_kind == "vector" else (B, H), dtype=torch.float32)
        return x.new_zeros(B, H, K, V, dtype=torch.float32), decay if gated else x.new_empty(0, dtype=torch.float32)
    NT = math.ceil(T / cfg.block_t)
    P = num_segments
    if P is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        P = segments(B * H * math.ceil(V / cfg.segsum.block_v), NT, sms)
    hs, ds = chunk._Launcher(cfg, call).scan_segment_sums(x, v, dual, P)
    return fold(hs, ds)
