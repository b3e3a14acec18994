"""The public functions: ``chunk_gla`` (training and prefill) and ``fused_recurrent_gla`` (decoding),
FLA-compatible. They validate their inputs with clear errors and call the ops."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from ..contract import (GLACall, LayoutWarning, check_shape, check_tensor, validate_gate, validate_inputs,
                        validate_varlen)
from ..gates import GateFn
from ..impl.recurrent import gather_slots, slot_validity
from .chunk import chunk_fwd_states, run_chunk_gla  # noqa: F401  (defines the op called below)
from .recurrent import fused_recurrent  # noqa: F401  (defines the op called below)

__all__ = ["chunk_gla", "fused_recurrent_gla"]


def _warn_if_head_first(q: Tensor) -> None:
    """Warn, once per call site (Python's default filter), where q's sizes suggest [B, H, T, K] was
    passed for [B, T, H, K]: fewer steps than heads is rare in training and prefill and common in a
    head-first tensor. Not while compiling: a warning would break the graph."""
    B, T, H, _ = q.shape
    if T < H and not torch.compiler.is_compiling():
        warnings.warn(
            f"chunk_gla: q has shape {tuple(q.shape)}, read as [B, T, H, K] with T = {T} steps and H = {H} "
            "heads; fewer steps than heads suggests a head-first [B, H, T, K] tensor (transpose it with "
            "q.transpose(1, 2)). If the layout is right, silence this with "
            "warnings.simplefilter('ignore', gla_inductor.LayoutWarning).", LayoutWarning, stacklevel=3)


def chunk_gla(
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
    gate_fn: Optional[str] = None,
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    output_prefix_states: bool = False,
    state_interval: int = 64,
    state_v_first: bool = False,
    cu_seqlens_cpu: Optional[Tensor] = None,
):
    """Gated linear attention, FLA-compatible.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]. Grouped heads (GQA, Mamba2's shared C and B): q, k may be
            [B, T, G, K] with G dividing H; head h reads q/k head h // (H // G), as if they were
            ``q.repeat_interleave(H // G, dim=2)``, without materializing that; their gradients
            come back [B, T, G, K].
        g: per-step log gate, [B, T, H, K] (vector) or [B, T, H] (scalar). Usually <= 0.
        g_gamma: [H] constant log gate (g_t = g_gamma[h] at every step); at most one of g / g_gamma.
        scale: defaults to K ** -0.5.
        initial_state: [B, H, K, V] state before the first processed step.
        output_final_state: also return the state after the last processed step.
        reverse: run the recurrence from t = T - 1 down to 0.
        gate_fn: "logsigmoid" or "softplus": g is the input x of a gate function that the kernels
            apply as they read it (see ``gla_inductor.gates``), with its constants gate_scale,
            gate_lo / gate_hi (clamp bounds) and, for "softplus", gate_a [H] and gate_bias [H]
            (scalar gate) or [H, K] (vector gate):
            logsigmoid: g = clamp(logsigmoid(x) * gate_scale, gate_lo, gate_hi)
            softplus:   g = gate_a * clamp(softplus(x + gate_bias), gate_lo, gate_hi)
        cu_seqlens: packed variable-length sequences (FLA's convention): int32 or int64 offsets
            [N + 1] on any device, 0 = cu_seqlens[0] <= ... <= cu_seqlens[N] = T; B must be 1 and
            sequence n is steps cu_seqlens[n] to cu_seqlens[n + 1] - 1 of every input, each run as
            if alone (from its own initial state, in its own reverse order); initial_state and the
            final state are [N, H, K, V]. The kernels read the offsets on the GPU (a call can be
            captured in a CUDA graph); their values are checked where that needs no
            synchronization with a capturing device (``contract.validate_varlen``).
        output_prefix_states: also return, for prefix caching, the state after every
            ``state_interval`` steps (a power of two, at least 16) of every sequence, as a third
            output (inference only: no gradients; not with reverse). Fixed-length sequences:
            [B, T // P + 1, H, K, V], [:, j] the state after the first j * P steps ([:, 0] the
            initial state). Packed: [1, T // P + N, H, K, V], sequence n's state after its first
            j * P steps at [0, cu_seqlens[n] // P + n + j] for j = 0 .. its length // P (slots
            between the sequences' are left zero or undefined). fp32 (fp64 for fp64 inputs).
        state_v_first: initial_state and the final state are V-first, [.., V, K] (FLA's option):
            read through strides, the final state returned as a [.., V, K] view (prefix states
            stay [.., K, V]).
        cu_seqlens_cpu: a host copy of cu_seqlens (FLA's option), assumed equal to it: its values
            are checked instead, with no device-to-host copy of cu_seqlens (the kernels never need
            one).

    Returns:
        o [B, T, H, V] in the promoted dtype of q, k, v, and the final state [B, H, K, V]
        ([N, H, K, V] with cu_seqlens; fp32, fp64 for fp64 inputs) or None; then the prefix
        states where output_prefix_states.
    """
    if cu_seqlens is not None:
        validate_varlen(q, cu_seqlens, initial_state, host_copy=cu_seqlens_cpu)
    elif cu_seqlens_cpu is not None:
        raise ValueError("chunk_gla: cu_seqlens_cpu is a host copy of cu_seqlens, which is None; pass cu_seqlens too")
    if initial_state is not None and state_v_first:
        check_tensor("chunk_gla", "initial_state", initial_state)
        n, letter = (q.shape[0], "B") if cu_seqlens is None else (cu_seqlens.shape[0] - 1, "N")
        check_shape("chunk_gla", "initial_state", initial_state, q, f"[{letter}, H, V, K]",
                    (n, v.shape[2], v.shape[-1], q.shape[-1]))
        initial_state = _kv(initial_state, True)
    validate_inputs(q, k, v, g, g_gamma, initial_state, grouped=True, cu_seqlens=cu_seqlens)
    _warn_if_head_first(q)
    fn = GateFn(gate_fn or "", float(gate_scale), _opt_float(gate_lo), _opt_float(gate_hi))
    validate_gate(fn, q, g, gate_a, gate_bias)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    call = GLACall(q, k, v, g, g_gamma, initial_state, float(scale), bool(output_final_state), bool(reverse), fn,
                   gate_a, gate_bias, cu_seqlens=cu_seqlens)
    if output_prefix_states:
        _validate_prefix_states(call, state_interval)
        o, ht, states = torch.ops.gla_inductor.chunk_fwd_states(*call.states_op_args(state_interval))
        return o, (_kv(ht, state_v_first) if output_final_state else None), states
    o, ht = run_chunk_gla(call)
    return o, (_kv(ht, state_v_first) if output_final_state else None)


def _validate_prefix_states(call: GLACall, interval) -> None:
    if not isinstance(interval, int) or interval < 16 or interval & (interval - 1):
        raise ValueError(f"chunk_gla: state_interval is {interval!r}; expected a power of two, at least 16")
    if call.reverse:
        raise ValueError("chunk_gla: output_prefix_states needs reverse=False (prefixes are in time order)")


def _opt_float(x) -> Optional[float]:
    return None if x is None else float(x)


def fused_recurrent_gla(
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
    ssm_state_indices: Optional[Tensor] = None,
    inplace_final_state: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated linear attention as a recurrence, for decoding and short steps; FLA-compatible.

    The same map as ``chunk_gla`` (same arguments and returns), computed step by step: on CUDA one
    kernel that reads and writes the state once. Inference only (no backward).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: per-step log gate, [B, T, H, K] (vector) or [B, T, H] (scalar). Usually <= 0.
        g_gamma: [H] constant log gate; at most one of g / g_gamma.
        scale: defaults to K ** -0.5.
        initial_state: [B, H, K, V] state before the first processed step; with ssm_state_indices, a
            state pool [P, H, K, V] (any P). fp32, bf16, fp16 or fp64; any strides.
        output_final_state: also return the state after the last processed step.
        reverse: run the recurrence from t = T - 1 down to 0.
        ssm_state_indices: [B] int32 or int64 on q's device (serving engines' continuous batching,
            as vLLM calls FLA-style recurrent kernels): sequence b starts from slot
            ``initial_state[ssm_state_indices[b]]``. An index outside [0, P), by convention -1 (a
            PAD slot id), marks a padded batch entry: its output is zeros, no slot is read or
            written, and its final state (when returned fresh) is zeros. Valid indices must be
            distinct. The indices are only read on the device: the call can be captured in a
            CUDA graph.
        inplace_final_state: write the final states into ``initial_state`` itself, in its own dtype
            (with ssm_state_indices: each sequence into its slot, all other slots untouched), as
            vLLM's decode does. Otherwise ``initial_state`` is not modified and the final states
            are a fresh fp32 tensor [B, H, K, V] (fp64 for fp64 inputs).
        state_v_first: the states are stored V-first, [.., V, K] (as vLLM and SGLang keep their
            pools): initial_state is [B, H, V, K] or [P, H, V, K], and so is a returned final state.
            Read and written through strides, without a copy.

    Returns:
        o [B, T, H, V] in the promoted dtype of q, k, v, and the final state or None (None unless
        output_final_state; with inplace_final_state it is ``initial_state`` itself).
    """
    api = "fused_recurrent_gla"
    pooled = ssm_state_indices is not None
    validate_inputs(q, k, v, g, g_gamma, None if pooled or state_v_first else initial_state, api=api)
    _validate_state_args(q, v, initial_state, ssm_state_indices, inplace_final_state, state_v_first)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    h0 = None if initial_state is None else _kv(initial_state, state_v_first)
    call = GLACall(q, k, v, g, g_gamma, h0, float(scale), reverse=bool(reverse), state_indices=ssm_state_indices)
    if inplace_final_state:
        o = torch.ops.gla_inductor.fused_recurrent(*call.recurrent_op_args(h0))
        return o, (initial_state if output_final_state else None)
    state, call = _working_state(call, state_v_first)
    o = torch.ops.gla_inductor.fused_recurrent(*call.recurrent_op_args(state))
    return o, (_kv(state, state_v_first) if output_final_state else None)


def _kv(state: Tensor, v_first: bool) -> Tensor:
    """The [.., K, V] view of a state stored V-first (and back): the op reads it through strides."""
    return state.transpose(-1, -2) if v_first else state


def _working_state(call: GLACall, v_first: bool) -> tuple[Tensor, GLACall]:
    """A fresh state [B, H, K, V] in the state dtype (a view of a [B, H, V, K] tensor where v_first)
    holding the initial states, for a call that leaves initial_state alone, and the call to run on it.
    With state indices the gathered slots run as a pool of B slots, entry b in slot b: padded
    entries keep zero states and get zero outputs."""
    q, v, h0, indices = call.q, call.v, call.initial_state, call.state_indices
    if h0 is not None and indices is None:
        # a copy of the caller's state keeps its layout, and its placements where it is a DTensor
        return h0.to(call.state_dtype, copy=True), call
    B, _, H, K = q.shape
    V = v.shape[-1]
    state = _kv(_zeros_like_heads(v, (B, H, V, K) if v_first else (B, H, K, V), call.state_dtype), v_first)
    if indices is not None:
        state.copy_(gather_slots(h0, indices, call.state_dtype))
        valid, _ = slot_validity(indices, h0.shape[0])
        return state, call.replace(state_indices=torch.where(valid, torch.arange(B, device=q.device), -1))
    return state, call


def _zeros_like_heads(v: Tensor, shape: tuple, dtype: torch.dtype) -> Tensor:
    """Zeros of a state's shape [B, H, ., .]. Where v is a DTensor they are sharded as v over its heads
    (dim 2 -> 1) and batch (dim 0), which the op's sharding rule asks of the state it updates in place;
    v's other shards leave the state Replicate, for the rule to refuse v."""
    if not torch.distributed.is_available():
        return v.new_zeros(shape, dtype=dtype)
    from torch.distributed.tensor import DTensor, Replicate, Shard, zeros

    if not isinstance(v, DTensor):
        return v.new_zeros(shape, dtype=dtype)
    dims = {2: 1, 0: 0}
    placements = [Shard(dims[p.dim]) if type(p) is Shard and p.dim in dims else Replicate() for p in v.placements]
    return zeros(shape, dtype=dtype, device_mesh=v.device_mesh, placements=placements)


def _validate_state_args(q: Tensor, v: Tensor, state: Optional[Tensor], indices: Optional[Tensor], inplace: bool,
                         v_first: bool, api: str = "fused_recurrent_gla") -> None:
    """Clear errors for the state, pool and slot arguments (what validate_inputs leaves to this)."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    if state is None:
        if indices is not None or inplace:
            what = "ssm_state_indices" if indices is not None else "inplace_final_state=True"
            raise ValueError(f"{api}: {what} needs initial_state (the state {'pool ' if indices is not None else ''}"
                             "to read and write)")
        return
    check_tensor(api, "initial_state", state)
    if state.device != q.device:
        raise ValueError(f"{api}: initial_state is on {state.device} but q is on {q.device}; all tensors must "
                         "share one device")
    n, letter = (None, "P") if indices is not None else (B, "B")
    layout, dims = ((f"[{letter}, H, V, K]", (n, H, V, K)) if v_first else (f"[{letter}, H, K, V]", (n, H, K, V)))
    check_shape(api, "initial_state", state, q, layout, dims)
    if indices is None:
        return
    if not isinstance(indices, Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{api}: ssm_state_indices must be an int32 or int64 tensor, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    check_shape(api, "ssm_state_indices", indices, q, "[B]", (B,))
    if indices.device != q.device:
        raise ValueError(f"{api}: ssm_state_indices is on {indices.device} but q is on {q.device}; the slots are "
                         "read on the device (no host synchronization)")
