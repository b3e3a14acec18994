"""Custom op ``gla_inductor::fused_recurrent``, for decoding and short steps.

    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, state, scale, reverse)

runs T steps of GLA from ``state`` [B, H, K, V] and overwrites ``state`` with the final state (in
its own dtype; the math is fp32, fp64 for fp64 inputs). It returns o [B, T, H, V] in the promoted
dtype of q, k, v. q and k are [B, T, G, K] with G dividing H, v [B, T, H, V]: head h reads q/k head
h // (H // G), so heads shared by groups (GQA-style) are passed unrepeated.

    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, pool, scale, reverse, state_indices)

decodes into a serving engine's state pool [P, H, K, V]: sequence b reads and overwrites slot
``state_indices[b]`` ([B], int32 or int64, on the pool's device), the other slots are untouched; an
index outside [0, P) (by convention -1) marks a padded batch entry, whose o is zeros and which
touches no slot. Valid indices must be distinct. The indices are read on the device only, so the
call can be captured in a CUDA graph. A V-first pool [P, H, V, K] is passed as its transpose
(``pool.transpose(-1, -2)``, a view: no copy).

Meant for decoding (T = 1) and short multi-token steps (T <= 64), where the state's HBM traffic
dominates: on CUDA the fused recurrent Triton kernel reads and writes it exactly once.

Inference only: the op has no backward, and refuses inputs that require grad under grad mode
(training runs ``gla_inductor::chunk_fwd``). Under ``torch.compile`` the mutation is functionalized
(``auto_functionalized``) and Inductor's reinplacing pass turns it back into an in-place call on the
caller's state (or pool: only the slots named are written, the rest of the pool is never copied).
Inductor then lowers that call to generated code (``gla_inductor.lowerings.recurrent``, chosen by
``config.decode_lowering``): the recurrent kernel as a template, or the steps decomposed into
pointwise and reduction IR, writing the state in place; no Python runs per call.
"""

from typing import Optional

import torch
from torch import Tensor

from ..contract import RECURRENT_ARGS, GLACall, output_dtype
from . import dispatch
from .chunk import _first_trace

__all__ = ["fused_recurrent"]


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------


def _check_state(q: Tensor, v: Tensor, state: Tensor, state_indices: Optional[Tensor] = None) -> None:
    """The kernel would read or write out of bounds through a wrong state or head count: check them
    (the rest is the caller's)."""
    B, _, G, K = q.shape
    H = v.shape[2]
    if G == 0 or H % G:
        raise ValueError(
            f"gla_inductor::fused_recurrent: q has shape {tuple(q.shape)} and v {tuple(v.shape)}; expected q's "
            f"heads (dim 2) to divide v's {H} (q and k [B, T, G, K] shared by groups of H / G heads)")
    if state_indices is not None:
        _check_pool(q, v, state, state_indices)
        return
    expected = (B, H, K, v.shape[-1])
    if tuple(state.shape) != expected:
        raise ValueError(
            f"gla_inductor::fused_recurrent: state has shape {tuple(state.shape)} but q has shape "
            f"{tuple(q.shape)} and v {tuple(v.shape)}; expected state to be [B, H, K, V] = {list(expected)}"
        )


def _check_pool(q: Tensor, v: Tensor, pool: Tensor, state_indices: Tensor) -> None:
    B, K = q.shape[0], q.shape[3]
    H, V = v.shape[2], v.shape[-1]
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(
            f"gla_inductor::fused_recurrent: state has shape {tuple(pool.shape)} but q has shape "
            f"{tuple(q.shape)} and v {tuple(v.shape)}; with state_indices expected state to be a pool "
            f"[P, H, K, V] = [P, {H}, {K}, {V}]")
    if tuple(state_indices.shape) != (B,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"gla_inductor::fused_recurrent: state_indices has shape {tuple(state_indices.shape)} and dtype "
            f"{state_indices.dtype}; expected [B] = [{B}] of int32 or int64 (one slot per sequence)")
    if state_indices.device != pool.device:
        raise ValueError(f"gla_inductor::fused_recurrent: state_indices is on {state_indices.device} but "
                         f"the pool on {pool.device}")


@torch.library.custom_op("gla_inductor::fused_recurrent", mutates_args=("state",))
def fused_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    state: Tensor,
    scale: float,
    reverse: bool,
    state_indices: Optional[Tensor] = None,
) -> Tensor:
    """GLA over T steps from ``state`` [B, H, K, V], which it overwrites with the final state; with
    ``state_indices`` [B], from and into slots of the pool ``state`` [P, H, K, V].

    Returns o [B, T, H, V] in the promoted dtype of q, k, v (zeros for padded entries).
    """
    _check_state(q, v, state, state_indices)
    call = GLACall.from_op_args((q, k, v, g, g_gamma, state, scale, reverse, state_indices), names=RECURRENT_ARGS)
    return dispatch.fused_recurrent(call, state)


@fused_recurrent.register_fake
def _fused_recurrent_fake(q, k, v, g, g_gamma, state, scale, reverse, state_indices=None):
    _first_trace()  # registers the lowerings (the package face's hook) before Inductor sees the op
    _check_state(q, v, state, state_indices)
    B, T = q.shape[:2]
    return q.new_empty(B, T, v.shape[2], v.shape[-1], dtype=output_dtype(q, k, v))


def _inference_only(keyset, *args):
    """The op's autograd kernel: refuse inputs that require grad, else run the op below autograd.

    A mutating custom op cannot register a backward (``register_autograd`` refuses it), and without
    one ``custom_op``'s own autograd kernel would run the op, mutate the state, and fail only at
    backward time; this fails before anything runs.
    """
    if torch.is_grad_enabled():
        needing = [n for n, x in zip(RECURRENT_ARGS, args) if isinstance(x, Tensor) and x.requires_grad]
        if needing:
            raise RuntimeError(
                f"gla_inductor::fused_recurrent is inference-only (it has no backward), but "
                f"{', '.join(needing)} require{'s' if len(needing) == 1 else ''} grad under grad mode. "
                "For training use gla_inductor.chunk_gla (the gla_inductor::chunk_fwd op); for "
                "inference call it under torch.no_grad() or torch.inference_mode()."
            )
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.gla_inductor.fused_recurrent.default.redispatch(
            keyset & torch._C._after_autograd_keyset, *args)


# Registered per backend: a backend's own autograd key takes precedence over the "Autograd" alias
# under which custom_op registered its generic kernel, so nothing is overridden.
_lib = torch.library.Library("gla_inductor", "IMPL")
for _key in ("AutogradCPU", "AutogradCUDA"):
    _lib.impl("fused_recurrent", _inference_only, _key, with_keyset=True)
