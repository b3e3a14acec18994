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
    """Log gates of every chunk, [B, H, NT, BT, Kg]."""

    g: Tensor  # per step
    gc: Tensor  # inclusive prefix sum: log decay from the chunk start through step i
    gr: Tensor  # exclusive suffix sum: log decay from after step j to the chunk end

    @property
    def gl(self) -> Tensor:
        """Log decay of the whole chunk, [..., 1, Kg]."""
        return self.gc[..., -1:, :]


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
    h0: Tensor  # [B, H, K, V]


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
        h0 = initial_state.to(dtype)
    return _Chunked(chunks(q), chunks(k), chunks(v), gates, h0)


def _tri(n: int, like: Tensor, diagonal: int = 0) -> Tensor:
    """[n, n] ones on and below ``diagonal``, in like's dtype.

    As a matmul it sums directly, never by differences: (L @ x)[i] sums x[j] over j <= i (over
    j < i for diagonal=-1), and (L.mT @ x)[i] over j >= i (j > i).
    """
    return torch.ones(n, n, dtype=like.dtype, device=like.device).tril(diagonal)


# ----------------------------------------------------------------------------------------------
# in-chunk attention, every chunk at once
# ----------------------------------------------------------------------------------------------
#
# A[i, j] = sum_k q[i, k] k[j, k] E[i, j, k] for j <= i, with E the decay over the span (j, i].
# One decay for all K (Kg == 1): E is a [BT, BT] matrix and A a masked matmul. A vector gate
# would need E as [BT, BT, K]; instead A is built by recursive halving ("split" below).


def _pair_decay(g: Tensor) -> Tensor:
    """E = exp(g[j+1] + ... + g[i]) for j <= i and 0 above the diagonal, [..., BT, BT], for Kg == 1.

    The spans are summed directly (a cumsum over i of the steps after j) instead of as
    gc[i] - gc[j]. Pairs above the diagonal are masked to -inf before exp.
    """
    causal = torch.ones(BT, BT, dtype=torch.bool, device=g.device).tril()
    span = torch.where(causal.tril(-1), g, 0).cumsum(-2)
    return span.masked_fill(~causal, float("-inf")).exp()


def _halves(x: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """Views of the left and right halves of every block of 2s steps: [..., BT / (2s), s, D] each."""
    x = x.unflatten(-2, (BT // (2 * s), 2, s))
    return x[..., 0, :, :], x[..., 1, :, :]


def _cross_blocks(A: Tensor, s: int) -> Tensor:
    """View of A [..., BT, BT] at (right half, left half) of every block of 2s: [..., BT / (2s), s, s]."""
    nb = BT // (2 * s)
    A = A.unflatten(-1, (nb, 2, s)).unflatten(-4, (nb, 2, s))  # [..., nb, 2, s, nb, 2, s]
    return A.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _split_levels() -> list[int]:
    """Half-block sizes BT/2, ..., 1: every pair i > j of a chunk lies across exactly one split."""
    return [BT >> n for n in range(1, BT.bit_length())]


def _split_decays(g: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """Decays across the split m of every block of 2s steps (m starts its right half).

    qd[i] = exp(g[m] + ... + g[i]) for i in the right half, kd[j] = exp(g[j+1] + ... + g[m-1]) for
    j in the left half: qd[i] kd[j] is the decay of the pair (i, j), and each factor is the exp of
    a direct sum inside one half, <= 1 for g <= 0. See NOTE:[GLA chunk stability].
    """
    g_l, g_r = _halves(g, s)
    L = _tri(s, g)
    return (L @ g_r).exp(), (L.tril(-1).mT @ g_l).exp()


def _intra_scores(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """The in-chunk attention matrix A, [..., BT, BT], zero above the diagonal."""
    if g.shape[-1] == 1:
        return (q @ k.mT) * _pair_decay(g)
    A = q.new_zeros(*q.shape[:-1], BT)
    A.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))  # empty span, no decay
    for s in _split_levels():
        qd, kd = _split_decays(g, s)
        (_, q_r), (k_l, _) = _halves(q, s), _halves(k, s)
        _cross_blocks(A, s).copy_((q_r * qd) @ (k_l * kd).mT)
    return A


def _intra_grads(q, k, g, dA, with_dg: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """dq, dk of A given dA, and the part of dg through the in-chunk decays (None unless with_dg).

    dE[i, j] / dg[t] = E[i, j] for j < t <= i, so dg[t] sums M[i, j] = dA[i, j] q[i] k[j] E[i, j]
    over the pairs whose span holds t: every term is a well-scaled part of the result.
    NB the shorter telescoping form, a reverse cumsum of q dq - k dk, cancels O(1) terms down to
    an O(exp(g)) result, and loses all precision under strong decay (seen: 4e3 relative error on
    dg_gamma with g ~ U[-20, 0], T = 4096 in fp32).
    """
    if g.shape[-1] == 1:
        return _pair_grads(q, k, g, dA, with_dg)
    dA_ii = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    dq, dk = dA_ii * k, dA_ii * q  # the diagonal spans nothing: no dg
    dg = torch.zeros_like(g) if with_dg else None
    for s in _split_levels():
        qd, kd = _split_decays(g, s)
        (_, q_r), (k_l, _) = _halves(q, s), _halves(k, s)
        b_dA = _cross_blocks(dA, s)
        dq_r = (b_dA @ (k_l * kd)) * qd
        dk_l = (b_dA.mT @ (q_r * qd)) * kd
        _halves(dq, s)[1].add_(dq_r)
        _halves(dk, s)[0].add_(dk_l)
        if with_dg:
            # a pair across the split holds t if i >= t (t on the right) or j < t (t on the left);
            # q dq and k dk per step are exactly those pair sums
            L = _tri(s, g)
            dg_l, dg_r = _halves(dg, s)
            dg_r.add_(L.mT @ (q_r * dq_r))
            dg_l.add_(L.tril(-1) @ (k_l * dk_l))
    return dq, dk, dg


def _pair_grads(q, k, g, dA, with_dg: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``_intra_grads`` for Kg == 1, through the [BT, BT] decay matrix."""
    dAE = dA * _pair_decay(g)  # zero above the diagonal
    dg = None
    if with_dg:
        M = dAE * (q @ k.mT)
        # exclusive cumsum by shifting, not by subtracting: M_ii is O(1), the sums it would hide are not
        R = F.pad(M[..., :, :-1], (1, 0)).cumsum(-1)  # R[i, t] = sum_{j < t} M[i, j]
        dg = R.tril().sum(-2).unsqueeze(-1)  # then the sum over i >= t
    return dAE @ k, dAE.mT @ q, dg


# ----------------------------------------------------------------------------------------------
# whole sequence: only the state recurrences loop over chunks
# ----------------------------------------------------------------------------------------------


def _chunk_states(x: _Chunked) -> Tensor:
    """State entering every chunk, then the final state: [B, H, NT + 1, K, V]."""
    decay = x.gates.gl.mT.exp()  # [B, H, NT, Kg, 1]
    update = (x.k * x.gates.gr.exp()).mT @ x.v  # k_j decayed to the chunk end
    B, H, NT, K, V = update.shape
    states = x.h0.new_empty(B, H, NT + 1, K, V)
    states[:, :, 0] = x.h0
    for n in range(NT):
        torch.addcmul(update[:, :, n], decay[:, :, n], states[:, :, n], out=states[:, :, n + 1])
    return states


def _state_grads(x: _Chunked, do: Tensor, dht: Optional[Tensor], scale: float) -> Tensor:
    """Gradient w.r.t. every state of ``_chunk_states``, from the final state's dht back to dh0."""
    decay = x.gates.gl.mT.exp()
    update = scale * ((x.q * x.gates.gc.exp()).mT @ do)  # through the outputs of each chunk
    NT = update.shape[2]
    dhs = x.h0.new_zeros(*x.h0.shape[:2], NT + 1, *x.h0.shape[2:])
    if dht is not None:
        dhs[:, :, -1] = dht
    for n in reversed(range(NT)):
        torch.addcmul(update[:, :, n], decay[:, :, n], dhs[:, :, n + 1], out=dhs[:, :, n])
    return dhs


def _chunk_fwd_torch(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    states = _chunk_states(x)
    o = (x.q * x.gates.gc.exp()) @ states[:, :, :-1] + _intra_scores(x.q, x.k, x.gates.g) @ x.v
    o = _from_chunks(scale * o, q.shape[1], reverse, _output_dtype(q, k, v))
    state_dtype = _state_dtype(q, k, v, g, g_gamma, initial_state)
    if not output_final_state:
        return o, q.new_empty(0, dtype=state_dtype)
    return o, states[:, :, -1].to(state_dtype).clone(memory_format=torch.contiguous_format)


def _chunk_bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    T = q.shape[1]
    b_do = _to_chunks(do.to(x.q.dtype), x.q.shape[2], reverse)
    states = _chunk_states(x)
    dhs = _state_grads(x, b_do, dht, scale)
    h, dh = states[:, :, :-1], dhs[:, :, 1:]  # entering each chunk / gradient leaving it
    qd, kd = x.gates.gc.exp(), x.gates.gr.exp()  # decay from the chunk start / to its end

    with_dg = g is not None or g_gamma is not None
    dA = scale * (b_do @ x.v.mT)  # only read on and below the diagonal
    dq, dk, dgate = _intra_grads(x.q, x.k, x.gates.g, dA, with_dg)
    dq_h = scale * (b_do @ h.mT) * qd  # through the state entering the chunk
    dk_h = (x.v @ dh.mT) * kd  # through the state leaving it
    A = _intra_scores(x.q, x.k, x.gates.g)
    dv = scale * (A.mT @ b_do) + (x.k * kd) @ dh
    if with_dg:
        dgate = dgate + _inter_gate_grad(x, dq_h, dk_h, h, dh)
    dh0 = q.new_empty(0) if initial_state is None else dhs[:, :, 0].to(initial_state.dtype).contiguous()
    dg, dg_gamma = _split_gate_grad(dgate, T, reverse, q, g, g_gamma)
    return (
        _from_chunks(dq + dq_h, T, reverse, q.dtype),
        _from_chunks(dk + dk_h, T, reverse, k.dtype),
        _from_chunks(dv, T, reverse, v.dtype),
        dg,
        dg_gamma,
        dh0,
    )


def _inter_gate_grad(x: _Chunked, dq_h, dk_h, h, dh) -> Tensor:
    """Part of dg through the chunk-level decays, [B, H, NT, BT, Kg].

    dg_t = exp(g_t) <dH_t, S_{t-1}> (summed over V), with dH_t the gradient w.r.t. S_t. The
    in-chunk pairs are ``_intra_grads``'; the rest goes through the states entering and leaving
    the chunk: sum_{i >= t} q_i dq_i^h + sum_{j < t} k_j dk_j^h + exp(gl) <h, dh>, each of whose
    terms carries exp(g_t).
    """
    q_dq, k_dk = x.q * dq_h, x.k * dk_h
    h_dh = (h * dh).sum(-1).unsqueeze(-2)  # [..., 1, K]
    if x.gates.g.shape[-1] == 1:
        q_dq, k_dk, h_dh = (t.sum(-1, keepdim=True) for t in (q_dq, k_dk, h_dh))
    L = _tri(BT, q_dq)
    return L.mT @ q_dq + L.tril(-1) @ k_dk + x.gates.gl.exp() * h_dh


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
