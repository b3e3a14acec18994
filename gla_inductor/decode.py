"""Custom op ``gla_inductor::fused_recurrent`` (decoding, short steps) and the public ``fused_recurrent_gla``.

    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, state, scale, reverse)

runs T steps of GLA from ``state`` [B, H, K, V] and overwrites ``state`` with the final state (in
its own dtype; the math is fp32, fp64 for fp64 inputs). It returns o [B, T, H, V] in the promoted
dtype of q, k, v. Meant for decoding (T = 1) and short multi-token steps (T <= 64), where the state's
HBM traffic dominates: on CUDA the fused recurrent Triton kernel reads and writes it exactly once.

Inference only: the op has no backward, and refuses inputs that require grad under grad mode
(training runs ``gla_inductor::chunk_fwd``). Under ``torch.compile`` the mutation is functionalized
(``auto_functionalized``) and Inductor's reinplacing pass turns it back into an in-place call on the
caller's state.
"""

from typing import Callable, Optional

import torch
from torch import Tensor

from . import ops

__all__ = ["fused_recurrent_gla", "register_cuda_impl", "STEP_LOOP_MAX_T"]

# Longest T the PyTorch implementation runs as a time loop. The loop passes over the whole
# [B, H, K, V] state three times per step; the chunked algorithm (chunk_fwd) touches the state once
# per chunk of 64 steps, at the price of more setup, so it wins on longer sequences.
STEP_LOOP_MAX_T = 64

# The CUDA implementation (same signature as the op), set by gla_inductor/__init__.py.
_CUDA_IMPL: Optional[Callable] = None


def register_cuda_impl(fn: Callable) -> None:
    """Route the op's CUDA calls to ``fn(q, k, v, g, g_gamma, state, scale, reverse) -> o``."""
    global _CUDA_IMPL
    _CUDA_IMPL = fn


# ----------------------------------------------------------------------------------------------
# PyTorch implementation (CPU, and the CUDA fallback)
# ----------------------------------------------------------------------------------------------


def _step_decay(g: Optional[Tensor], g_gamma: Optional[Tensor], t: int, dtype: torch.dtype) -> Optional[Tensor]:
    """exp(g_t), shaped to scale a [B, H, K, V] state: [B, H, K, 1], [B, H, 1, 1], [H, 1, 1] or None."""
    if g is not None:
        g_t = g[:, t].to(dtype)
        return (g_t.unsqueeze(-1) if g.dim() == 4 else g_t[..., None, None]).exp()
    if g_gamma is not None:
        return g_gamma.to(dtype).view(-1, 1, 1).exp()
    return None


def _step_loop(q, k, v, g, g_gamma, state, scale, reverse) -> Tensor:
    dtype = ops._compute_dtype(q, k, v, g, g_gamma, state)
    out_dtype = ops._output_dtype(q, k, v)
    B, T, H, _ = q.shape
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # the running state: the caller's tensor itself when it has the compute dtype (it is overwritten
    # anyway), else a working copy written back at the end
    S = state if state.dtype == dtype else state.to(dtype)
    o = q.new_empty(B, T, H, v.shape[-1])
    for t in reversed(range(T)) if reverse else range(T):
        decay = _step_decay(g, g_gamma, t, dtype)
        if decay is not None:
            S.mul_(decay)
        S.addcmul_(k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2))
        o[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
    if S is not state:
        state.copy_(S)
    return o.mul_(scale).to(out_dtype)


@torch.no_grad()
def _fused_recurrent_torch(q, k, v, g, g_gamma, state, scale, reverse) -> Tensor:
    """The op in PyTorch: a time loop for short sequences, else the chunked algorithm."""
    if q.shape[1] <= STEP_LOOP_MAX_T:
        return _step_loop(q, k, v, g, g_gamma, state, scale, reverse)
    return _via_chunks(q, k, v, g, g_gamma, state, scale, reverse)


def _via_chunks(q, k, v, g, g_gamma, state, scale, reverse) -> Tensor:
    """The op through ``chunk_fwd`` (chunked PyTorch on CPU, the chunked kernels on CUDA)."""
    o, ht = torch.ops.gla_inductor.chunk_fwd(q, k, v, g, g_gamma, state, scale, True, reverse)
    state.copy_(ht)
    return o


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------


def _check_state(q: Tensor, v: Tensor, state: Tensor) -> None:
    """The kernel would write out of bounds through a wrong state: check it (the rest is the caller's)."""
    B, _, H, K = q.shape
    expected = (B, H, K, v.shape[-1])
    if tuple(state.shape) != expected:
        raise ValueError(
            f"gla_inductor::fused_recurrent: state has shape {tuple(state.shape)} but q has shape "
            f"{tuple(q.shape)} and v {tuple(v.shape)}; expected state to be [B, H, K, V] = {list(expected)}"
        )


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
) -> Tensor:
    """GLA over T steps from ``state`` [B, H, K, V], which it overwrites with the final state.

    Returns o [B, T, H, V] in the promoted dtype of q, k, v.
    """
    _check_state(q, v, state)
    impl = _CUDA_IMPL if q.is_cuda else None
    if impl is None:
        impl = _fused_recurrent_torch
    return impl(q, k, v, g, g_gamma, state, scale, reverse)


@fused_recurrent.register_fake
def _fused_recurrent_fake(q, k, v, g, g_gamma, state, scale, reverse):
    _check_state(q, v, state)
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1], dtype=ops._output_dtype(q, k, v))


_ARG_NAMES = ("q", "k", "v", "g", "g_gamma", "state")


def _inference_only(keyset, *args):
    """The op's autograd kernel: refuse inputs that require grad, else run the op below autograd.

    A mutating custom op cannot register a backward (``register_autograd`` refuses it), and without
    one ``custom_op``'s own autograd kernel would run the op, mutate the state, and fail only at
    backward time; this fails before anything runs.
    """
    if torch.is_grad_enabled():
        needing = [n for n, x in zip(_ARG_NAMES, args) if isinstance(x, Tensor) and x.requires_grad]
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


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _validate(q, k, v, g, g_gamma, initial_state) -> None:
    # ops._validate_inputs names chunk_gla in its messages; name this function instead
    try:
        ops._validate_inputs(q, k, v, g, g_gamma, initial_state)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("chunk_gla:", "fused_recurrent_gla:", 1)) from None


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
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated linear attention as a recurrence, for decoding and short steps; FLA-compatible.

    The same map as ``chunk_gla`` (same arguments and returns), computed step by step: on CUDA one
    kernel that reads and writes the state once. Inference only (no backward). ``initial_state`` is
    not modified; for in-place decoding call ``torch.ops.gla_inductor.fused_recurrent`` on the cache.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: per-step log gate, [B, T, H, K] (vector) or [B, T, H] (scalar). Usually <= 0.
        g_gamma: [H] constant log gate; at most one of g / g_gamma.
        scale: defaults to K ** -0.5.
        initial_state: [B, H, K, V] state before the first processed step.
        output_final_state: also return the state after the last processed step.
        reverse: run the recurrence from t = T - 1 down to 0.

    Returns:
        o [B, T, H, V] in the promoted dtype of q, k, v, and the final state [B, H, K, V]
        (fp32, fp64 for fp64 inputs) or None.
    """
    _validate(q, k, v, g, g_gamma, initial_state)
    B, _, H, K = q.shape
    if scale is None:
        scale = K**-0.5
    dtype = ops._state_dtype(q, k, v, g, g_gamma, initial_state)
    if initial_state is None:
        state = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype)
    else:
        state = initial_state.to(dtype, copy=True)
    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, state, float(scale), bool(reverse))
    return o, (state if output_final_state else None)
