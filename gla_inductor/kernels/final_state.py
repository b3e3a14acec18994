"""Host launcher of the states-only pass: the final state of a GLA run from a zero state (or, in
the dual mode, the gradient w.r.t. its initial state) and the decay across it, no outputs.

It is gla_chunk_segsum, the first launch of a scan walked in segments: P programs per (value tile,
batch * head) each walk NT / P chunks from a zero state, one dot per chunk (the states walk's
work), and write the state their segment leaves and the decay across it; ``impl.final_state.fold``
then combines the P segments (a product and a sum over [N, P, H, K, V]). Reads k, v and g (dual:
q, do and g) once; writes nothing per chunk. The contract is ``impl.final_state``'s.

Its tiles are its own (``tiles``), not the scan's: the pass does nothing but read its inputs and
walk, so a value tile that covers all of V (read k and the gate once per head, not once per value
tile) and deeper load pipelines pay here where the scan's registers would not allow them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall
from ..impl.final_state import fold
from . import chunk
from .configs import ChunkConfig, TileConfig, pow2, walk_segments

__all__ = ["final_state", "launch_plan", "segments", "tiles"]


def segments(programs: int, NT: int, sms: int, per_sm: int = 2) -> int:
    """Segments of the walk (a power of two up to 16): up to ``per_sm`` programs per SM, each
    walking at least 4 chunks. A states-only walk does one dot per chunk and reads its inputs once;
    its B * H * cdiv(V, BV) programs alone would leave most SMs idle at long T and few heads, the
    shapes that context parallelism runs."""
    return walk_segments(programs, NT, per_sm * sms)


def tiles(cfg: ChunkConfig, K: int, V: int, x_dtype: torch.dtype, v_dtype: torch.dtype,
          vector_gate_dtype: Optional[torch.dtype]) -> tuple[TileConfig, int]:
    """(gla_chunk_segsum's tile, programs per SM) for this pass; x is k (q in the dual mode), v is v
    (do), vector_gate_dtype the dtype of a vector gate's tensor (None for other gates). With 16-bit
    x and v and K <= 128, one value tile of up to 128 (x and the gate read once per head) and, for a
    vector gate, 8 warps loading three chunks ahead, one program per SM; scalar and constant gates,
    with no [BT, K] gate tile, 4 warps and two programs per SM. Measured against the scan's tiles at
    B = 1, T = 32768, H = 16, K = V = 128 (bf16): vector gate 0.71 -> 0.33 ms, dual 0.66 -> 0.34;
    scalar 0.24 -> 0.11, dual 0.14 -> 0.11 (benchmarks/results/h200-2026-11-27-states-tiles.md).
    Elsewhere (fp32 inputs, K > 128: the [K, V] state and the stages outgrow the registers and
    shared memory) the scan's tile."""
    if pow2(K) > 128 or x_dtype.itemsize != 2 or v_dtype.itemsize != 2:
        return cfg.segsum, 2
    block_v = min(max(16, pow2(V)), 128)
    if vector_gate_dtype is not None:
        stages = 3 if vector_gate_dtype.itemsize == 2 else 2  # an fp32 gate tile takes twice the shared memory
        return TileConfig(block_v=block_v, num_warps=8, num_stages=stages), 1
    return TileConfig(block_v=block_v, num_warps=4, num_stages=2), 2


def launch_plan(cfg: ChunkConfig, N: int, T: int, H: int, K: int, V: int, x_dtype: torch.dtype,
                v_dtype: torch.dtype, vector_gate_dtype: Optional[torch.dtype], device: torch.device,
                own_tiles: bool = True) -> tuple[ChunkConfig, int]:
    """(the config with the pass's tile, ``tiles``, unless ``own_tiles`` is off; its segments P) for N
    sequences of T steps: what the eager launch and the Inductor lowering both run."""
    per_sm = 2
    if own_tiles:
        tile, per_sm = tiles(cfg, K, V, x_dtype, v_dtype, vector_gate_dtype)
        cfg = dataclasses.replace(cfg, segsum=tile)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    P = segments(N * H * math.ceil(V / cfg.segsum.block_v), math.ceil(T / cfg.block_t), sms, per_sm)
    return cfg, P


def final_state(call: GLACall, do: Optional[Tensor] = None, config: Optional[ChunkConfig] = None,
                num_segments: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(state [B, H, K, V] fp32, decay [B, H, K] (vector gate), [B, H] (scalar, constant) fp32 or an
    empty [0]): see ``impl.final_state``. num_segments overrides ``segments`` (tests)."""
    dual = do is not None
    call, cfg = chunk._prepare(call, config)
    B, T, _, K = call.q.shape
    H, V = call.v.shape[2], call.v.shape[-1]
    x = call.q if dual else call.k
    v = do if dual else call.v  # do as it comes, as the backward reads it (the kernel converts on load)
    gated = call.gate_kind != "none"
    if T == 0:
        decay = x.new_ones((B, H, K) if call.gate_kind == "vector" else (B, H), dtype=torch.float32)
        return x.new_zeros(B, H, K, V, dtype=torch.float32), decay if gated else x.new_empty(0, dtype=torch.float32)
    gate_dtype = call.g.dtype if call.gate_kind == "vector" else None
    cfg, P = launch_plan(cfg, B, T, H, K, V, x.dtype, v.dtype, gate_dtype, x.device, own_tiles=config is None)
    P = num_segments or P
    hs, ds = chunk._Launcher(cfg, call).scan_segment_sums(x, v, dual, P)
    return fold(hs, ds)
