"""Custom ops ``gla_inductor::chunk_fwd`` / ``gla_inductor::chunk_bwd`` and the public ``chunk_gla``.

The ops are opaque to Dynamo and AOTAutograd: the forward graph holds one ``chunk_fwd`` node and
the backward graph one ``chunk_bwd`` node (through ``register_autograd``), which the lowerings can
then replace by Triton templates. This module holds their CPU (and fallback) implementation: a
chunked algorithm in plain PyTorch, O(T * BT * (K + V)) work per head.

Notation, per (batch, head), after the [B, T, H, D] -> [B, H, NT, BT, D] chunking:
  BT    chunk length; NT number of chunks (the last one zero-padded)
  Kg    gate width: K for a vector gate, 1 for scalar, constant and absent gates
  b_gc  chunk-local cumulative log gate, b_gc[i] = g[c0] + ... + g[c0 + i]   # [BT, Kg]
  b_gr  log decay from after step j to the chunk end                         # [BT, Kg]
  b_gl  b_gc[BT - 1], the log decay of the whole chunk                        # [1, Kg]
  h     state entering a chunk; dh gradient w.r.t. the state leaving it      # [K, V]

NOTE:[GLA chunk stability] Every exponential is exp of a sum of gates over a span inside one
chunk: g[j+1] + ... + g[i] for j <= i, the prefix b_gc[i], the suffix b_gr[j] = g[j+1] + ... +
g[BT-1], or b_gl. For g <= 0 they are <= 0, so no exponential can overflow however long T is;
for g > 0 they grow by at most exp(BT * max g), within range whenever the naive recurrence is.
Pairs above the diagonal are masked to -inf *before* exp, so they can produce neither inf nor
NaN. Spans are summed directly, never as a difference of two long prefix sums, whose rounding
error (|sum| * eps) would otherwise dominate when gates are strongly negative.
"""

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_gla", "register_cuda_impl", "BT"]

BT = 64

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# CUDA implementations with the same signatures as the ops, filled in by the Triton kernels.
_CUDA_IMPL: dict[str, Optional[Callable]] = {"fwd": None, "bwd": None}


def register_cuda_impl(fwd: Optional[Callable] = None, bwd: Optional[Callable] = None) -> None:
    """Route the ops to ``fwd`` / ``bwd`` for CUDA inputs; an argument left None keeps its entry."""
    if fwd is not None:
        _CUDA_IMPL["fwd"] = fwd
    if bwd is not None:
        _CUDA_IMPL["bwd"] = bwd


# ----------------------------------------------------------------------------------------------
# dtypes and layout
# ----------------------------------------------------------------------------------------------


def _compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    # fp64 oracles must stay fp64 end to end; every other dtype accumulates in fp32
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _output_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def _state_dtype(q, k, v, g, g_gamma, initial_state) -> torch.dtype:
    """dtype of the final state: fp32, or fp64 when the op computes in fp64."""
    return _compute_dtype(q, k, v, g, g_gamma, initial_state)


def _to_chunks(x: Tensor, NT: int, reverse: bool) -> Tensor:
    """[B, T, H, D] -> [B, H, NT, BT, D], time-flipped for reverse, zero-padded at the end.

    Zero padding is inert: padded steps have k = v = 0 (no state update) and g = 0 (no decay).
    """
    B, T, H, D = x.shape
    if reverse:
        x = x.flip(1)
    x = F.pad(x.transpose(1, 2), (0, 0, 0, NT * BT - T))
    return x.reshape(B, H, NT, BT, D)


def _from_chunks(x: Tensor, T: int, reverse: bool, dtype: torch.dtype) -> Tensor:
    """Inverse of ``_to_chunks``; always a fresh contiguous tensor (custom-op outputs may not alias)."""
    x = x.flatten(2, 3)[:, :, :T].transpose(1, 2)
    if reverse:
        x = x.flip(1)
    return x.to(dtype).contiguous()


def _log_gate(q: Tensor, g: Optional[Tensor], g_gamma: Optional[Tensor]) -> Tensor:
    """Every gate kind as a per-step log gate [B, T, H, Kg]."""
    B, T, H, _ = q.shape
    if g is not None:
        return g if g.dim() == 4 else g.unsqueeze(-1)
    if g_gamma is not None:
        return g_gamma.view(1, 1, H, 1).expand(B, T, H, 1)
    return q.new_zeros(B, T, H, 1)


class _Gates(NamedTuple):
    """Log gates of every chunk, [B, H, NT, BT, Kg], or of one chunk, [B, H, BT, Kg]."""

    g: Tensor  # per step
    gc: Tensor  # inclusive prefix sum: log decay from the chunk start through step i
    gr: Tensor  # exclusive suffix sum: log decay from after step j to the chunk end

    @property
    def gl(self) -> Tensor:
        """Log decay of the whole chunk, [..., 1, Kg]."""
        return self.gc[..., -1:, :]

    def chunk(self, n: int) -> "_Gates":
        return _Gates(self.g[:, :, n], self.gc[:, :, n], self.gr[:, :, n])


def _make_gates(g: Tensor) -> _Gates:
    # gr is summed directly rather than taken as gl - gc, which carries an error of
    # |gl| * eps into every entry when a chunk decays hard
    later = F.pad(g[..., 1:, :], (0, 0, 0, 1))
    return _Gates(g, g.cumsum(-2), later.flip(-2).cumsum(-2).flip(-2))


class _Chunked(NamedTuple):
    q: Tensor  # [B, H, NT, BT, K]
    k: Tensor  # [B, H, NT, BT, K]
    v: Tensor  # [B, H, NT, BT, V]
    gates: _Gates
    h0: Tensor  # [B, H, K, V], a private copy
    causal: Tensor  # [BT, BT] bool, j <= i

    def chunk(self, n: int) -> tuple[Tensor, Tensor, Tensor, _Gates]:
        return self.q[:, :, n], self.k[:, :, n], self.v[:, :, n], self.gates.chunk(n)


def _prepare(q, k, v, g, g_gamma, initial_state, reverse) -> _Chunked:
    dtype = _compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // BT)

    def chunks(x):
        return _to_chunks(x.to(dtype), NT, reverse)

    gates = _make_gates(chunks(_log_gate(q, g, g_gamma)))
    if initial_state is None:
        h0 = q.new_zeros(B, H, K, V, dtype=dtype)
    else:
        h0 = initial_state.to(dtype, copy=True)
    causal = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    return _Chunked(chunks(q), chunks(k), chunks(v), gates, h0, causal)


# ----------------------------------------------------------------------------------------------
# one chunk
# ----------------------------------------------------------------------------------------------


def _intra_decay(b_g: Tensor, causal: Tensor) -> Tensor:
    """exp(g[j+1] + ... + g[i]) for j <= i and 0 above the diagonal.

    [..., BT, BT, K] for a vector gate, [..., BT, BT] when Kg == 1. The spans are summed
    directly (a cumsum over i of the steps after j) instead of as gc[i] - gc[j], which would
    carry an error of |gc| * eps into every entry. See NOTE:[GLA chunk stability].
    """
    after = causal.tril(-1)  # i > j
    if b_g.shape[-1] == 1:
        span = torch.where(after, b_g, 0).cumsum(-2)
    else:
        after, causal = after[:, :, None], causal[:, :, None]
        span = torch.where(after, b_g[..., :, None, :], 0).cumsum(-3)
    return span.masked_fill(~causal, float("-inf")).exp()


def _intra_scores(b_q: Tensor, b_k: Tensor, b_E: Tensor) -> Tensor:
    """A[i, j] = sum_k q[i, k] k[j, k] E[i, j, k]: the in-chunk attention matrix, [..., BT, BT]."""
    if b_E.dim() == b_q.dim():  # one decay for all K
        return (b_q @ b_k.transpose(-1, -2)) * b_E
    return (b_q[..., :, None, :] * b_k[..., None, :, :] * b_E).sum(-1)


def _intra_grads(b_q: Tensor, b_k: Tensor, b_dAE: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``_intra_scores`` w.r.t. q and k, given b_dAE = dA * E (broadcast over K)."""
    if b_dAE.dim() == b_q.dim():
        return b_dAE @ b_k, b_dAE.transpose(-1, -2) @ b_q
    b_dq = (b_dAE * b_k[..., None, :, :]).sum(-2)
    b_dk = (b_dAE * b_q[..., :, None, :]).sum(-3)
    return b_dq, b_dk


def _advance(h: Tensor, b_k: Tensor, b_v: Tensor, b_gates: _Gates) -> Tensor:
    """State leaving a chunk from the state h entering it."""
    b_kd = b_k * b_gates.gr.exp()  # k_j decayed to the chunk end
    return b_gates.gl.transpose(-1, -2).exp() * h + b_kd.transpose(-1, -2) @ b_v


def _chunk_states(x: _Chunked) -> Tensor:
    """State entering every chunk, then the final state: [B, H, NT + 1, K, V]."""
    states = [x.h0]
    for n in range(x.q.shape[2]):
        b_q, b_k, b_v, b_gates = x.chunk(n)
        states.append(_advance(states[-1], b_k, b_v, b_gates))
    return torch.stack(states, dim=2)


def _chunk_output(b_q, b_k, b_v, b_gates: _Gates, h, scale, causal) -> Tensor:
    """o for one chunk: the inter-chunk part through h plus the in-chunk part through A."""
    b_A = _intra_scores(b_q, b_k, _intra_decay(b_gates.g, causal))
    return scale * ((b_q * b_gates.gc.exp()) @ h + b_A @ b_v)


def _chunk_grads(b_q, b_k, b_v, b_gates: _Gates, b_do, h, dh, scale, causal, with_dg: bool):
    """dq, dk, dv and dg (None unless ``with_dg``) of one chunk, and the gradient w.r.t. h.

    h is the state entering the chunk, dh the gradient w.r.t. the state leaving it.
    """
    b_E = _intra_decay(b_gates.g, causal)
    b_A = _intra_scores(b_q, b_k, b_E)
    b_dA = scale * (b_do @ b_v.transpose(-1, -2))  # b_E zeroes the part above the diagonal
    b_dAE = b_dA * b_E if b_E.dim() == b_q.dim() else b_dA.unsqueeze(-1) * b_E
    b_dq, b_dk = _intra_grads(b_q, b_k, b_dAE)

    b_qd, b_kd = b_gates.gc.exp(), b_gates.gr.exp()  # decay from the chunk start / to its end
    b_dq_h = scale * (b_do @ h.transpose(-1, -2)) * b_qd  # through the state entering the chunk
    b_dk_h = (b_v @ dh.transpose(-1, -2)) * b_kd  # through the state leaving it
    b_dv = scale * (b_A.transpose(-1, -2) @ b_do) + (b_k * b_kd) @ dh
    dh_in = scale * ((b_q * b_qd).transpose(-1, -2) @ b_do) + b_gates.gl.transpose(-1, -2).exp() * dh

    b_dg = None
    if with_dg:
        b_dg = _chunk_gate_grad(b_q, b_k, b_dAE, b_q * b_dq_h, b_k * b_dk_h, b_gates, h, dh, causal)
    return b_dq + b_dq_h, b_dk + b_dk_h, b_dv, b_dg, dh_in


def _chunk_gate_grad(b_q, b_k, b_dAE, b_qdq_h, b_kdk_h, b_gates: _Gates, h, dh, causal) -> Tensor:
    """Gradient w.r.t. the log gates of one chunk, [..., BT, Kg].

    dg_t = exp(g_t) <dH_t, S_{t-1}> (summed over V), with dH_t the gradient w.r.t. S_t. Expanding
    S_{t-1} over h and the steps j < t, and dH_t over dh and the steps i >= t, gives four sums
    whose every term carries exp(g_t):
        sum_{i >= t > j} dA_ij q_i k_j E_ij  +  sum_{i >= t} q_i dq_i^h  +  sum_{j < t} k_j dk_j^h
        +  exp(gl) <h, dh>
    NB the shorter telescoping form, a reverse cumsum of q dq - k dk, cancels O(1) terms down to
    an O(exp(g)) result, and loses all precision under strong decay (seen: 4e3 relative error on
    dg_gamma with g ~ U[-20, 0], T = 4096 in fp32).
    """
    if b_dAE.dim() == b_q.dim():  # one decay for all K: M_ij = dA_ij E_ij (q_i . k_j)
        b_M = (b_dAE * (b_q @ b_k.transpose(-1, -2))).unsqueeze(-1)
        b_qdq_h, b_kdk_h = b_qdq_h.sum(-1, keepdim=True), b_kdk_h.sum(-1, keepdim=True)
    else:
        b_M = b_dAE * b_q[..., :, None, :] * b_k[..., None, :, :]  # [BT(i), BT(j), K]
    # exclusive cumsums by shifting, not by subtracting: M_ii is O(1), the sums it would hide are not
    b_R = F.pad(b_M[..., :, :-1, :], (0, 0, 1, 0)).cumsum(-2)  # R[i, t] = sum_{j < t} M[i, j]
    b_cross = b_R.masked_fill(~causal[:, :, None], 0).sum(-3)  # sum over i >= t
    b_q_after = b_qdq_h.flip(-2).cumsum(-2).flip(-2)
    b_k_before = F.pad(b_kdk_h[..., :-1, :], (0, 0, 1, 0)).cumsum(-2)
    b_hdh = (h * dh).sum(-1).unsqueeze(-2)  # [1, K]
    if b_M.shape[-1] == 1:
        b_hdh = b_hdh.sum(-1, keepdim=True)
    return b_cross + b_q_after + b_k_before + b_gates.gl.exp() * b_hdh


# ----------------------------------------------------------------------------------------------
# whole sequence
# ----------------------------------------------------------------------------------------------


def _chunk_fwd_torch(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    o = torch.empty_like(x.v)
    h = x.h0
    for n in range(x.q.shape[2]):
        b_q, b_k, b_v, b_gates = x.chunk(n)
        o[:, :, n] = _chunk_output(b_q, b_k, b_v, b_gates, h, scale, x.causal)
        h = _advance(h, b_k, b_v, b_gates)

    o = _from_chunks(o, q.shape[1], reverse, _output_dtype(q, k, v))
    state_dtype = _state_dtype(q, k, v, g, g_gamma, initial_state)
    # contiguous: for T = 0, h is a copy of initial_state with its strides
    ht = h.to(state_dtype).contiguous() if output_final_state else q.new_empty(0, dtype=state_dtype)
    return o, ht


def _chunk_bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    T = q.shape[1]
    NT = x.q.shape[2]
    b_dos = _to_chunks(do.to(x.q.dtype), NT, reverse)
    states = _chunk_states(x)
    dh = torch.zeros_like(x.h0) if dht is None else dht.to(x.h0.dtype, copy=True)

    with_dg = g is not None or g_gamma is not None
    dq, dk, dv = torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(x.v)
    dgate = torch.empty_like(x.gates.g)
    for n in reversed(range(NT)):
        b_q, b_k, b_v, b_gates = x.chunk(n)
        b_dq, b_dk, b_dv, b_dg, dh = _chunk_grads(
            b_q, b_k, b_v, b_gates, b_dos[:, :, n], states[:, :, n], dh, scale, x.causal, with_dg
        )
        dq[:, :, n], dk[:, :, n], dv[:, :, n] = b_dq, b_dk, b_dv
        if with_dg:
            dgate[:, :, n] = b_dg

    dg, dg_gamma = _split_gate_grad(dgate, T, reverse, q, g, g_gamma)
    dh0 = q.new_empty(0) if initial_state is None else dh.to(initial_state.dtype).contiguous()
    return (
        _from_chunks(dq, T, reverse, q.dtype),
        _from_chunks(dk, T, reverse, k.dtype),
        _from_chunks(dv, T, reverse, v.dtype),
        dg,
        dg_gamma,
        dh0,
    )


def _split_gate_grad(dgate, T, reverse, q, g, g_gamma) -> tuple[Tensor, Tensor]:
    """(dg, dg_gamma) from the chunked gate gradient; a fresh [0] tensor for an absent input."""
    if g is not None:
        dg = _from_chunks(dgate, T, reverse, g.dtype)
        return (dg if g.dim() == 4 else dg.squeeze(-1)), q.new_empty(0)
    if g_gamma is not None:
        # the constant gate is shared by every batch and step
        dg = _from_chunks(dgate, T, reverse, dgate.dtype)
        return q.new_empty(0), dg.sum((0, 1, 3)).to(g_gamma.dtype)
    return q.new_empty(0), q.new_empty(0)


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("gla_inductor::chunk_fwd", mutates_args=())
def chunk_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    initial_state: Optional[Tensor],
    scale: float,
    output_final_state: bool,
    reverse: bool,
) -> tuple[Tensor, Tensor]:
    """GLA forward. Returns (o [B, T, H, V], final state [B, H, K, V], or [0] when not requested)."""
    impl = _CUDA_IMPL["fwd"] if q.is_cuda else None
    if impl is None:
        impl = _chunk_fwd_torch
    return impl(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse)


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    B, T, H, K = q.shape
    V = v.shape[-1]
    state_dtype = _state_dtype(q, k, v, g, g_gamma, initial_state)
    o = q.new_empty(B, T, H, V, dtype=_output_dtype(q, k, v))
    ht = q.new_empty((B, H, K, V) if output_final_state else (0,), dtype=state_dtype)
    return o, ht


@torch.library.custom_op("gla_inductor::chunk_bwd", mutates_args=())
def chunk_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    initial_state: Optional[Tensor],
    do: Tensor,
    dht: Optional[Tensor],
    scale: float,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """GLA backward, recomputing the states from the inputs.

    Returns (dq, dk, dv, dg, dg_gamma, dh0), each shaped like its input; [0] for an absent input.
    """
    impl = _CUDA_IMPL["bwd"] if q.is_cuda else None
    if impl is None:
        impl = _chunk_bwd_torch
    return impl(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse)


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    def grad_like(x):
        # new_empty, not empty_like: the real op returns contiguous tensors whatever x's strides
        return q.new_empty(0) if x is None else x.new_empty(x.shape)

    return tuple(grad_like(x) for x in (q, k, v, g, g_gamma, initial_state))


def _chunk_fwd_setup_context(ctx, inputs, output):
    q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse = inputs
    ctx.save_for_backward(q, k, v, g, g_gamma, initial_state)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.reverse = reverse


def _chunk_fwd_backward(ctx, do, dht):
    q, k, v, g, g_gamma, initial_state = ctx.saved_tensors
    if not ctx.output_final_state:
        dht = None
    if do is None:
        B, T, H, _ = q.shape
        do = q.new_zeros(B, T, H, v.shape[-1], dtype=_output_dtype(q, k, v))
    dq, dk, dv, dg, dg_gamma, dh0 = torch.ops.gla_inductor.chunk_bwd(
        q, k, v, g, g_gamma, initial_state, do, dht, ctx.scale, ctx.reverse
    )

    def present(grad, x):
        return None if x is None else grad

    return (
        dq, dk, dv,
        present(dg, g), present(dg_gamma, g_gamma), present(dh0, initial_state),
        None, None, None,
    )


chunk_fwd.register_autograd(_chunk_fwd_backward, setup_context=_chunk_fwd_setup_context)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def _shape_str(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"chunk_gla: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"chunk_gla: {name} has dtype {x.dtype}; expected float16, bfloat16, float32 or float64"
        )


def _check_shape(name: str, x: Tensor, q: Tensor, layout: str, expected: tuple) -> None:
    """Raise unless x has the ``expected`` shape; None entries of ``expected`` are free."""
    if x.dim() == len(expected) and all(e is None or d == e for d, e in zip(x.shape, expected)):
        return
    letters = layout.strip("[]").split(", ")
    want = _shape_str(letter if e is None else e for letter, e in zip(letters, expected))
    raise ValueError(
        f"chunk_gla: {name} has shape {tuple(x.shape)} but q has shape {tuple(q.shape)}; "
        f"expected {name} to be {layout} = {want}"
    )


def _validate_inputs(q, k, v, g, g_gamma, initial_state) -> None:
    """Clear errors for the public API (the ops themselves trust their callers)."""
    named = {"q": q, "k": k, "v": v, "g": g, "g_gamma": g_gamma, "initial_state": initial_state}
    for name, x in named.items():
        if x is not None or name in ("q", "k", "v"):
            _check_tensor(name, x)
    if q.dim() != 4:
        raise ValueError(f"chunk_gla: q has shape {tuple(q.shape)}; expected q to be 4-D [B, T, H, K]")
    B, T, H, K = q.shape
    _check_shape("k", k, q, "[B, T, H, K]", (B, T, H, K))
    _check_shape("v", v, q, "[B, T, H, V]", (B, T, H, None))
    if g is not None and g_gamma is not None:
        raise ValueError("chunk_gla: got both g and g_gamma; pass at most one gate")
    if g is not None and g.dim() == 3:
        _check_shape("g", g, q, "[B, T, H]", (B, T, H))
    elif g is not None:
        _check_shape("g", g, q, "[B, T, H, K]", (B, T, H, K))
    if g_gamma is not None:
        _check_shape("g_gamma", g_gamma, q, "[H]", (H,))
    if initial_state is not None:
        _check_shape("initial_state", initial_state, q, "[B, H, K, V]", (B, H, K, v.shape[-1]))
    for name, x in named.items():
        if x is not None and x.device != q.device:
            raise ValueError(
                f"chunk_gla: {name} is on {x.device} but q is on {q.device}; "
                "all tensors must share one device"
            )


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
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated linear attention, FLA-compatible.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V].
        g: per-step log gate, [B, T, H, K] (vector) or [B, T, H] (scalar). Usually <= 0.
        g_gamma: [H] constant log gate (g_t = g_gamma[h] at every step); at most one of g / g_gamma.
        scale: defaults to K ** -0.5.
        initial_state: [B, H, K, V] state before the first processed step.
        output_final_state: also return the state after the last processed step.
        reverse: run the recurrence from t = T - 1 down to 0.

    Returns:
        o [B, T, H, V] in the promoted dtype of q, k, v, and the final state [B, H, K, V]
        (fp32, fp64 for fp64 inputs) or None.
    """
    _validate_inputs(q, k, v, g, g_gamma, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, ht = torch.ops.gla_inductor.chunk_fwd(
        q, k, v, g, g_gamma, initial_state, float(scale), bool(output_final_state), bool(reverse)
    )
    return o, (ht if output_final_state else None)
