"""Host launcher of the fused recurrent GLA Triton kernel (``templates/gla_recurrent.py.jinja``).

For decoding (T = 1) and short multi-token steps: one program per (V tile, batch * head) loads its
[K, BV] slice of the state once, walks the T steps, writes o at every step and the state once at the
end. Its cost is the state's HBM traffic, 2 * B * H * K * V * 4 bytes for an fp32 state, plus
(3K + 2V) * 2 bytes per step and head for q, k, g, v and o (bf16, vector gate); at K = V = 128 the
state outweighs the per-step traffic up to T ~ 100. The chunked scan does the per-step work as
tensor-core dots and wins as T grows: ``ops.dispatch.RECURRENT_MAX_T`` decides where the ops switch.

``forward(call, state_out)`` runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
With ``call.state_indices`` the initial state is a pool [P, H, K, V] (any strides: a V-first
[P, H, V, K] pool is passed as its transpose) that the kernel reads and writes in place through the
slot indices, which it loads on the device: the launch is capturable in a CUDA graph.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall
from .configs import MAX_GRID_YZ, TRITON_INSTALLED, interpreting, pow2
from .standalone import OUT, needs_int64, render

__all__ = ["RecurrentConfig", "default_recurrent_config", "forward", "keys_contiguous", "recurrent_grid",
           "recurrent_options", "unsupported_reason"]

MAX_K = 256  # every program holds whole key rows: a [K, BV] fp32 state tile in registers
MAX_V = 512
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class RecurrentConfig:
    """Tiles of one launch; pass one to ``fused_recurrent_triton`` to override the heuristic."""

    block_v: int
    num_warps: int
    num_stages: int = 1
    early_state: bool = False  # the final state stored before the last step's output (EARLY_HT)
    # both 0: each program holds its whole [K, block_v] state tile; else one step (T == 1 only) over
    # that tile key_block keys (or value_block values) at a time (the template's BKB, VBB)
    key_block: int = 0
    value_block: int = 0


def default_recurrent_config(B: int, H: int, K: int, V: int, device: torch.device,
                             state_dtype: torch.dtype = torch.float32,
                             keys_contiguous: bool = False, steps: Optional[int] = None) -> RecurrentConfig:
    """Value tile and warps for a bandwidth-bound pass over the state (``steps``: T where known).

    A program's [BK, BV] fp32 state tile has about 8192 elements, 64 per thread over 4 warps, with
    rows of at least 32 floats (128 contiguous bytes of a contiguous state). BV = 64 with 4 warps
    came closest to copy bandwidth in the decode benchmark's tile sweep at K = V = 128, T = 1
    (benchmarks/results/h100-2026-11-22-decode.md). The tile
    narrows while B * H * cdiv(V, BV) programs leave fewer than ~4 per SM (a program loads its whole
    tile, then computes, then stores: bandwidth needs other programs' loads in flight meanwhile).

    The state's layout and dtype move the optimum (tile sweep of decoding into a pool, B = 64 and
    256, H = 32, K = V = 128, benchmarks/results/h200-2026-11-27-pool-tiles.md): a state whose keys
    are contiguous (a V-first pool [P, H, V, K], read as its transpose) reduces over K within a
    warp, and value tiles of 16 with one warp came closest to the copy floor (fp32: 88 -> 93%); a
    16-bit state moves half the bytes per tile, and halved value tiles with the final state stored
    before the output's reduction (the writes then overlap it) did best (bf16: 56 -> 66%; V-first
    65 -> 84%), where for fp32 the early store lost (88 -> 77%).

    One step (``steps == 1``, decoding) may walk the tile in blocks (``_one_step_blocks``).
    """
    half = state_dtype.itemsize == 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    if steps == 1 and sms is not None:
        blocks = _one_step_blocks(B * H, K, V, sms, half, keys_contiguous)
        if blocks is not None:
            return blocks
    if keys_contiguous:
        return RecurrentConfig(block_v=16, num_warps=1, early_state=half)
    BK = max(16, pow2(K))
    block_v = min(max(16, pow2(V)), max(32, min(64, 8192 // BK)))
    if half:
        block_v = max(16, block_v // 2)
    if sms is not None:
        block_v = _narrowed(block_v, B * H, V, sms)
    num_warps = min(8, max(1, BK * block_v // 2048))
    return RecurrentConfig(block_v=block_v, num_warps=num_warps, early_state=half)


def _one_step_blocks(pairs: int, K: int, V: int, sms: int, half: bool,
                     keys_contiguous: bool) -> Optional[RecurrentConfig]:
    """The blocks of one step over B * H = ``pairs`` states, or None for whole tiles. Tile sweep of
    decoding into a pool (B = 16, 64, 256, H = 32, K = V = 128;
    benchmarks/results/h100-2026-11-28-pool-blocks.md): with few pairs (fewer than 4 per SM), blocks
    of 32 keys by 64 values with 2 warps (K-first) or of 16 values by all keys with one warp
    (V-first) reached 101-169% of the copy floor where whole tiles reached 77-140% (the floor
    itself is not at full bandwidth there); the K-first value tile narrows as the whole tiles' does
    while the programs leave SMs idle (B = 1), its blocks keeping 2048 elements. With more pairs, a
    16-bit K-first state in blocks of 16 keys by 128 values with 2 warps reached 89-91% where whole
    tiles reached 76-77%, and fp32 states kept whole tiles (within 3% of the best blocks). A 16-bit
    V-first state takes the few pairs' value blocks there too: on an H200 they reached 89% and 91%
    of the floor at B = 64 and 256 where whole tiles reached 85% and 88%
    (benchmarks/results/h200-2026-11-29-pool-blocks.md)."""
    BK, wide = max(16, pow2(K)), min(max(16, pow2(V)), 128)
    if keys_contiguous and (pairs < 4 * sms or half):
        return RecurrentConfig(block_v=min(wide, 32), num_warps=1, num_stages=2, value_block=16)
    if pairs < 4 * sms:
        # blocks of 2048 elements; the value tile narrows while the programs leave SMs idle (B = 1)
        block_v = _narrowed(min(wide, 64), pairs, V, sms)
        return RecurrentConfig(block_v=block_v, num_warps=2, num_stages=2, key_block=min(BK, 2048 // block_v))
    if half:
        return RecurrentConfig(block_v=wide, num_warps=2, num_stages=2, key_block=min(BK, 2048 // wide))
    return None


def _narrowed(block_v: int, pairs: int, V: int, sms: int) -> int:
    """The value tile halved (down to 16) while its pairs * cdiv(V, block_v) programs leave fewer than
    4 per SM."""
    while block_v > 16 and pairs * -(-V // block_v) < 4 * sms:
        block_v //= 2
    return block_v


def keys_contiguous(stride) -> bool:
    """Whether a [.., K, V] state's strides make its keys the contiguous axis (a V-first pool)."""
    return stride[-2] == 1 and stride[-1] != 1


def recurrent_grid(B: int, H: int, V: int, block_v: int) -> tuple[int, int]:
    """(cdiv(V, BV), B * H): one program per value tile of one (batch, head).

    Each program owns a [K, BV] slice of one head's state, independent of all others (the update is
    per key row, the output reduces over keys only), so no two programs touch the same state bytes:
    the state may be updated in place. K is not split, so o needs no cross-program reduction.
    """
    return (-(-V // block_v), B * H)


def unsupported_reason(call: GLACall, state_out: Optional[Tensor] = None) -> Optional[str]:
    """None when the kernel handles the call (from its initial state, into ``state_out``), else the
    reason to fall back."""
    q, v = call.q, call.v
    if not TRITON_INSTALLED:
        return "triton is not installed"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return f"device {q.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    named = (("q", q), ("k", call.k), ("v", v), ("g", call.g), ("g_gamma", call.g_gamma),
             ("state", call.initial_state), ("final state", state_out))
    for name, x in named:
        if x is not None and x.dtype not in _SUPPORTED_DTYPES:
            return f"{name} dtype {x.dtype} (supported: float32, float16, bfloat16)"
    if call.state_indices is not None and call.state_indices.dtype not in _INDEX_DTYPES:
        return f"state_indices dtype {call.state_indices.dtype} (supported: int32, int64)"
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]
    if K > MAX_K:
        return f"K = {K} > {MAX_K}"
    if V > MAX_V:
        return f"V = {V} > {MAX_V}"
    if B * H > MAX_GRID_YZ:
        return f"B * H = {B * H} > {MAX_GRID_YZ}"
    return None


def recurrent_options(K: int, V: int, gate: str, scale: float, reverse: bool, *, block_v: int, use_h0: bool,
                      store_ht: bool, group: int = 1, use_indices: bool = False, ht_is_h0: bool = False,
                      early_ht: bool = False, key_block: int = 0, value_block: int = 0) -> dict:
    """The template's options (jinja variables and constexprs); ``gate`` as ``GLACall.gate_kind``;
    ``group`` the heads of v per head of q and k; ``use_indices``: the states are slots of a pool;
    ``ht_is_h0``: the final state overwrites the initial one, passed once (Inductor's lowering);
    ``early_ht``: the final state is stored before the last step's output; ``key_block``,
    ``value_block``: one step in blocks of that many keys or values (all ``RecurrentConfig``)."""
    return dict(
        BK=max(16, pow2(K)),
        BV=block_v,
        EVEN_V=V % block_v == 0,
        USE_GK=gate == "vector",
        USE_G=gate == "scalar",
        USE_G_GAMMA=gate == "constant",
        USE_H0=use_h0,
        STORE_HT=store_ht,
        HT_IS_H0=bool(ht_is_h0),
        REVERSE=bool(reverse),
        SCALE=float(scale),
        GROUP=int(group),
        USE_INDICES=bool(use_indices),
        EARLY_HT=bool(early_ht),
        BKB=int(key_block),
        VBB=int(value_block),
    )


def forward(call: GLACall, state_out: Optional[Tensor], config: Optional[RecurrentConfig] = None) -> Tensor:
    """o [B, T, H, V] in the promoted dtype of q, k, v; the final state goes to ``state_out``.

    The call has a log gate (no fused gate function); q, k [B, T, H, K], or [B, T, G, K] with G
    dividing H (head h reads q/k head h // (H // G)); its initial_state [B, H, K, V] (None: zeros),
    state_out [B, H, K, V] (None: not stored), any strides and any supported dtypes each; state_out
    may be the initial state itself. Math in fp32.

    With ``call.state_indices`` [B]: the initial state is a pool [P, H, K, V], updated in place
    (state_out is that pool, an identical view of it, or None); entry b reads and writes slot
    state_indices[b], an entry whose index lies outside [0, P) gets o = 0 and touches no slot.
    """
    q, v = call.q, call.v
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]
    indices = call.state_indices
    if indices is not None:
        _check_pool(call, state_out)
    o = torch.empty(B, T, H, V, dtype=call.output_dtype, device=q.device)
    if indices is not None and (T == 0 or B * H == 0):
        return o  # no step: every slot keeps its state
    if T == 0 or B * H == 0:
        # no step: the final state is the initial one (the kernel would get an empty o)
        if state_out is not None:
            state_out.copy_(call.initial_state if call.initial_state is not None else torch.zeros_like(state_out))
        return o
    state = call.initial_state if call.initial_state is not None else state_out
    cfg = config or (default_recurrent_config(B, H, K, V, q.device, steps=T) if state is None else
                     default_recurrent_config(B, H, K, V, q.device, state.dtype, keys_contiguous(state.stride()), T))
    _check_blocks(cfg, K, T)
    options = recurrent_options(K, V, call.gate_kind, call.scale, call.reverse, block_v=cfg.block_v,
                                use_h0=call.initial_state is not None, store_ht=state_out is not None,
                                group=call.group_size, use_indices=indices is not None, early_ht=cfg.early_state,
                                key_block=cfg.key_block, value_block=cfg.value_block)
    tensors = {"q": q, "k": call.k, "v": v, "g": call.g, "g_gamma": call.g_gamma, "h0": call.initial_state,
               "ht": state_out, "idx": indices}
    present = {n: t for n, t in tensors.items() if t is not None}
    ndims = {n: t.dim() for n, t in present.items()}
    ndims[OUT] = o.dim()
    int64_index = any(needs_int64(t) for t in (*present.values(), o))
    kernel = render(("gla_recurrent", "gla_common"), "gla_recurrent", options, ndims, int64_index)
    kernel(recurrent_grid(B, H, V, cfg.block_v), present, o, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o


def _check_blocks(cfg: RecurrentConfig, K: int, T: int) -> None:
    """A config that steps in blocks takes one step, in blocks (one kind) that tile its keys (padded
    to BK) or its value tile."""
    if not (cfg.key_block or cfg.value_block):
        return
    size, of, name = ((cfg.key_block, max(16, pow2(K)), "key_block") if cfg.key_block else
                      (cfg.value_block, cfg.block_v, "value_block"))
    if T != 1 or (cfg.key_block and cfg.value_block) or size != pow2(size) or size > of:
        raise ValueError(f"gla_recurrent: {name} = {size} needs T = 1 (got {T}), no other blocks and a power of "
                         f"two of at most {of}")


def _check_pool(call: GLACall, state_out: Optional[Tensor]) -> None:
    """The launch reads and writes the pool through raw pointers: check what it relies on."""
    pool, indices = call.initial_state, call.state_indices
    if pool is None:
        raise ValueError("gla_recurrent: state_indices need an initial state: the pool [P, H, K, V]")
    same = state_out is None or (state_out.data_ptr() == pool.data_ptr() and state_out.shape == pool.shape
                                 and state_out.stride() == pool.stride() and state_out.dtype == pool.dtype)
    if not same:
        raise ValueError("gla_recurrent: with state_indices the final states go to the pool itself "
                         "(state_out must be the initial state or None)")
    B, _, _, K = call.q.shape
    H, V = call.v.shape[2], call.v.shape[-1]
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V) or tuple(indices.shape) != (B,):
        raise ValueError(f"gla_recurrent: pool has shape {tuple(pool.shape)} and state_indices "
                         f"{tuple(indices.shape)}; expected [P, H, K, V] = [P, {H}, {K}, {V}] and [B] = [{B}]")
