"""Custom ops ``gla_inductor::chunk_fwd`` / ``gla_inductor::chunk_bwd`` and the public ``chunk_gla``.

The ops are opaque to Dynamo and AOTAutograd: the forward graph holds one ``chunk_fwd`` node and
the backward graph one ``chunk_bwd`` node (through ``register_autograd``), which the lowerings can
then replace by Triton templates. This module holds their CPU (and fallback) implementation: a
chunked algorithm in plain PyTorch, O(T * BT * (K + V)) work per head, batched over all chunks at
once but for the state recurrence, the only loop over chunks.

Notation, per (batch, head), after the [B, T, H, D] -> [B, H, NT, BT, D] chunking:
  BT    chunk length, a power of two; NT number of chunks (the last one zero-padded)
  Kg    gate width: K for a vector gate, 1 for scalar, constant and absent gates
  gc    chunk-local cumulative log gate, gc[i] = g[c0] + ... + g[c0 + i]     # [BT, Kg]
  gr    log decay from after step j to the chunk end                        # [BT, Kg]
  gl    gc[BT - 1], the log decay of the whole chunk                        # [1, Kg]
  A     in-chunk attention matrix, A[i, j] = sum_k q[i, k] k[j, k] exp(g[j+1, k] + ... + g[i, k])
        for j <= i                                                           # [BT, BT]
  h     state entering a chunk; dh gradient w.r.t. the state leaving it     # [K, V]

For Kg == 1 the decays of A are one [BT, BT] matrix. A vector gate would need them as
[BT, BT, K]; instead the chunk is halved recursively (blocks of 2s steps cut in two, s = BT/2 ..
1), every pair i > j lies across exactly one cut, and there its decay factors into one for i and
one for j, so that the pairs of a level are a batched matmul (``_Split``).

NOTE:[GLA chunk stability] Every exponential is exp of a sum of gates over a span inside one
chunk: g[j+1] + ... + g[i] for j <= i (Kg == 1), the chunk prefix gc[i], suffix gr[j] = g[j+1] +
... + g[BT-1] or gl, or for a vector gate the prefix g[m] + ... + g[i] and suffix g[j+1] + ... +
g[m-1] of a pair across the cut m of a block, whose product is the pair's decay. For g <= 0 they
are <= 0, so no exponential can overflow however long T is (one that underflows only drops
terms smaller still); for g > 0 they grow by at most exp(BT * max g). Each is a factor of a term
the time loop forms too (exp(span) k_j v_j, exp(gc[i]) h), so it stays in range while the loop's
state does; the exceptions need a span of one chunk to exceed fp32's exp range (~88, a mean gate
above 1.38 over 64 steps) while the loop stays finite, i.e. exp(gc[i]) with a state h entering
the chunk below exp(-88), or a vector-gate cut whose prefix decays that much and whose suffix
grows as much (tests/test_bad_input.py checks g up to 1 per step, past the loop's own overflow).
Pairs above the diagonal are masked to -inf *before* exp, or never formed, so they can produce
neither inf nor NaN. Spans are summed directly (a cumsum, or the tree sums of ``_block_scan``),
never as a difference of two long prefix sums, whose rounding error (|sum| * eps) would otherwise
dominate when gates are strongly negative (and a log gate of -inf, a reset, would give -inf -
(-inf) = NaN). Likewise dg[t] is summed from the terms that go through exp(g[t]), never as a
difference of larger sums.

NOTE:[GLA non-finite inputs] A NaN or Inf in k_t, v_t or g_t reaches o from step t on, one in q_t
only o_t, as in the time loop (tests/test_bad_input.py): NaN exactly where the loop has NaN; for
Inf the same non-finite entries, though which are NaN rather than +-Inf may differ (the chunked
form forms q_i . k_j before multiplying by v_j). Two products would leak such a value to the
steps before t of its chunk, as 0 * inf = NaN: q k^T times the decay matrix of a scalar gate,
whose zeros above the diagonal do not mask a non-finite k_j, and A @ v for a non-finite v_j.
Both are redone in ``_add_intra_nonfinite``, only when the final state is not finite, which
every non-finite k, v, gate or initial state makes it (a NaN or Inf in a chunk's update survives
every later decay and sum). Gradients of non-finite inputs are not specified.
"""

from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_gla", "register_cuda_impl", "BT"]

BT = 64  # a power of two: the block scan halves it down to single steps

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


def _to_chunks(x: Tensor, NT: int, reverse: bool, dtype: torch.dtype) -> Tensor:
    """[B, T, H, D] -> contiguous [B, H, NT, BT, D] in dtype, time-flipped for reverse, zero-padded.

    Zero padding is inert: padded steps have k = v = 0 (no state update) and g = 0 (no decay).
    Contiguous, as the batched matmuls would otherwise copy their operands at every use.
    """
    B, T, H, D = x.shape
    chunks = x.new_empty(B, H, NT * BT, D, dtype=dtype)
    chunks[:, :, :T] = (x.flip(1) if reverse else x).transpose(1, 2)
    chunks[:, :, T:] = 0
    return chunks.view(B, H, NT, BT, D)


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


class _Chunked(NamedTuple):
    q: Tensor  # [B, H, NT, BT, K]
    k: Tensor  # [B, H, NT, BT, K]
    v: Tensor  # [B, H, NT, BT, V]
    g: Tensor  # [B, H, NT, BT, Kg], the log gate of every step
    h0: Tensor  # [B, H, K, V]


def _prepare(q, k, v, g, g_gamma, initial_state, reverse) -> _Chunked:
    dtype = _compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // BT)

    def chunks(x):
        return _to_chunks(x, NT, reverse, dtype)

    if initial_state is None:
        h0 = q.new_zeros(B, H, K, V, dtype=dtype)
    else:
        h0 = initial_state.to(dtype)
    return _Chunked(chunks(q), chunks(k), chunks(v), chunks(_log_gate(q, g, g_gamma)), h0)


# ----------------------------------------------------------------------------------------------
# gate sums: the block scan
# ----------------------------------------------------------------------------------------------


def _block_sizes() -> list[int]:
    """1, 2, 4, ..., BT."""
    return [1 << n for n in range(BT.bit_length())]


def _halves(x: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """Views of the left and right halves of every block of 2s steps: [..., BT / (2s), s, D] each."""
    x = x.unflatten(-2, (BT // (2 * s), 2, s))
    return x[..., 0, :, :], x[..., 1, :, :]


def _block_scan(g: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(s, pre, suf) for s = 1, 2, 4, ..., BT, with the steps of each chunk in blocks of s:

    pre[i] = g summed from the start of i's block through i, and suf[j] = g summed from after j
    to the end of j's block, [..., BT, Kg] each; at s = BT they are gc and gr. Going to 2s adds
    the total of each left half to the prefixes of its right half, and that of each right half to
    the suffixes of its left half, so every entry is a direct (tree) sum of the gates it spans,
    never a difference. pre and suf are updated in place after each yield.
    """
    pre, suf = g.clone(), torch.zeros_like(g)
    for s in _block_sizes():
        yield s, pre, suf
        if s == BT:
            return
        (pre_l, pre_r), (suf_l, _) = _halves(pre, s), _halves(suf, s)
        suf_l.add_(pre_r[..., -1:, :])
        pre_r.add_(pre_l[..., -1:, :])


def _block_scan_grad(dpre: Tensor, dsuf: Tensor, level_grads: Optional[Tensor]) -> Tensor:
    """Gradient w.r.t. g through ``_block_scan``, from those w.r.t. its final pre and suf (gc, gr).

    level_grads[n], if given, holds the gradients w.r.t. pre on the right halves and suf on the
    left halves at s = 2**n (where ``_split`` reads them). Runs the scan backwards, in place;
    every step only adds, so each dg[t] stays a sum of the terms that go through exp(g[t]).
    """
    for n in reversed(range(BT.bit_length() - 1)):
        s = 1 << n
        (dpre_l, dpre_r), (dsuf_l, _) = _halves(dpre, s), _halves(dsuf, s)
        right_total = dpre_r.sum(-2, keepdim=True)
        dpre_r[..., -1:, :].add_(dsuf_l.sum(-2, keepdim=True))
        dpre_l[..., -1:, :].add_(right_total)
        if level_grads is not None:
            grad_l, grad_r = _halves(level_grads[n], s)
            dpre_r.add_(grad_r)
            dsuf_l.add_(grad_l)
    return dpre  # pre = g at s = 1


class _Gates(NamedTuple):
    """Chunk-level log decays of every chunk, [B, H, NT, BT, Kg]."""

    gc: Tensor  # inclusive prefix sum: log decay from the chunk start through step i
    gr: Tensor  # exclusive suffix sum: log decay from after step j to the chunk end

    @property
    def gl(self) -> Tensor:
        """Log decay of the whole chunk, [..., 1, Kg]."""
        return self.gc[..., -1:, :]


def _make_gates(g: Tensor) -> _Gates:
    # by the block scan, a direct sum: gr taken as gl - gc would carry an error of |gl| * eps
    # into every entry when a chunk decays hard
    for s, pre, suf in _block_scan(g):
        pass
    return _Gates(pre, suf)


# ----------------------------------------------------------------------------------------------
# in-chunk attention, every chunk at once
# ----------------------------------------------------------------------------------------------
#
# A[i, j] = sum_k q[i, k] k[j, k] E[i, j, k] for j <= i, with E the decay over the span (j, i].
# One decay for all K (Kg == 1): E is a [BT, BT] matrix and A a masked matmul. A vector gate
# would need E as [BT, BT, K]; instead A is built level by level of the block scan, as matmuls.


def _pair_decay(g: Tensor) -> Tensor:
    """E = exp(g[j+1] + ... + g[i]) for j <= i and 0 above the diagonal, [..., BT, BT], for Kg == 1.

    The spans are summed directly (a cumsum over i of the steps after j) instead of as
    gc[i] - gc[j]. Pairs above the diagonal are masked to -inf before exp.
    """
    causal = torch.ones(BT, BT, dtype=torch.bool, device=g.device).tril()
    span = torch.where(causal.tril(-1), g, 0).cumsum(-2)
    return span.masked_fill_(~causal, float("-inf")).exp_()


class _Split(NamedTuple):
    """One level of the split: blocks of 2s steps, each cut at m, the start of its right half.

    Every pair i > j of a chunk lies across the cut of exactly one level, where its decay
    exp(g[j+1] + ... + g[i]) is qd[i] kd[j]: qd[i] = exp(g[m] + ... + g[i]) into the right half
    (pre at s), kd[j] = exp(g[j+1] + ... + g[m-1]) out of the left half (suf at s). Each is the
    exp of a direct sum of gates inside one half, <= 1 for g <= 0. See NOTE:[GLA chunk stability].
    """

    s: int
    qd: Tensor  # [..., BT / (2s), s, K], right halves
    kd: Tensor  # left halves
    qs: Tensor  # q * qd
    ks: Tensor  # k * kd

    def scores(self) -> Tensor:
        """A at (right half, left half) of every block: [..., BT / (2s), s, s]."""
        return self.qs @ self.ks.mT


def _split(q: Tensor, k: Tensor, s: int, pre: Tensor, suf: Tensor, work: Tensor) -> _Split:
    """Level s from the block scan's pre and suf at s, in work ([2, ..., BT, K], for every level)."""
    (kd, qd), (ks, qs) = _halves(work[0], s), _halves(work[1], s)
    torch.exp(_halves(pre, s)[1], out=qd)
    torch.exp(_halves(suf, s)[0], out=kd)
    torch.mul(_halves(q, s)[1], qd, out=qs)
    torch.mul(_halves(k, s)[0], kd, out=ks)
    return _Split(s, qd, kd, qs, ks)


def _cross_blocks(A: Tensor, s: int) -> Tensor:
    """View of A [..., BT, BT] at (right half, left half) of every block of 2s: [..., BT / (2s), s, s]."""
    nb = BT // (2 * s)
    A = A.unflatten(-1, (nb, 2, s)).unflatten(-4, (nb, 2, s))  # [..., nb, 2, s, nb, 2, s]
    return A.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b; a contraction of 1 or 2 as outer products, where CPU bmm takes a ~10x slower path."""
    if a.shape[-1] > 2:
        return a @ b
    return sum(a[..., c : c + 1] * b[..., c : c + 1, :] for c in range(a.shape[-1]))


def _diag_scores(q: Tensor, k: Tensor) -> Tensor:
    """[..., BT, BT] zeros but for A[i, i] = q[i] . k[i]: the empty span, no decay."""
    A = q.new_zeros(*q.shape[:-1], BT)
    A.diagonal(dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(q, k))
    return A


def _intra_scores(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, _Gates]:
    """The in-chunk attention matrix A, [..., BT, BT] zero above the diagonal, and the gates."""
    if g.shape[-1] == 1:
        return (q @ k.mT).mul_(_pair_decay(g)), _make_gates(g)
    A, work = _diag_scores(q, k), q.new_empty(2, *q.shape)
    for s, pre, suf in _block_scan(g):
        if s == BT:
            break  # pre and suf now sum over whole chunks
        _cross_blocks(A, s).copy_(_split(q, k, s, pre, suf, work).scores())
    return A, _Gates(pre, suf)


class _IntraGrads(NamedTuple):
    """What the backward needs of the in-chunk part; the gates come from the same block scan."""

    A: Tensor
    dq: Tensor
    dk: Tensor
    gates: _Gates
    dg: Optional[Tensor]  # Kg == 1: the part of dg through the in-chunk decays
    level_grads: Optional[Tensor]  # vector gate: the same as gradients for ``_block_scan_grad``


def _intra_grads(q, k, g, dA, with_dg: bool) -> _IntraGrads:
    """``_intra_scores``, dq and dk of A given dA, and (with_dg) its gradient w.r.t. the gates.

    dE[i, j] / dg[t] = E[i, j] for j < t <= i, so dg[t] sums M[i, j] = dA[i, j] q[i] k[j] E[i, j]
    over the pairs whose span holds t: every term is a well-scaled part of the result.
    NB the shorter telescoping form, a reverse cumsum of q dq - k dk, cancels O(1) terms down to
    an O(exp(g)) result, and loses all precision under strong decay (seen: 4e3 relative error on
    dg_gamma with g ~ U[-20, 0], T = 4096 in fp32).
    """
    if g.shape[-1] == 1:
        return _pair_grads(q, k, g, dA, with_dg)
    A, work = _diag_scores(q, k), q.new_empty(2, *q.shape)
    dA_ii = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    dq, dk = dA_ii * k, dA_ii * q  # the diagonal spans nothing: no dg
    level_grads = q.new_empty(BT.bit_length() - 1, *q.shape) if with_dg else None
    for s, pre, suf in _block_scan(g):
        if s == BT:
            break
        level = _split(q, k, s, pre, suf, work)
        _cross_blocks(A, s).copy_(level.scores())
        b_dA = _cross_blocks(dA, s)
        b_dq = _mm(b_dA, level.ks).mul_(level.qd)
        b_dk = _mm(b_dA.mT, level.qs).mul_(level.kd)
        _halves(dq, s)[1].add_(b_dq)
        _halves(dk, s)[0].add_(b_dk)
        if with_dg:
            # q dq is the gradient w.r.t. pre on the right (through qd), k dk that w.r.t. suf on
            # the left (through kd)
            grad_l, grad_r = _halves(level_grads[s.bit_length() - 1], s)
            torch.mul(b_dq, _halves(q, s)[1], out=grad_r)
            torch.mul(b_dk, _halves(k, s)[0], out=grad_l)
    return _IntraGrads(A, dq, dk, _Gates(pre, suf), None, level_grads)


def _pair_grads(q, k, g, dA, with_dg: bool) -> _IntraGrads:
    """``_intra_grads`` for Kg == 1, through the [BT, BT] decay matrix."""
    E = _pair_decay(g)
    QK = q @ k.mT
    dAE = dA * E  # zero above the diagonal
    dg = None
    if with_dg:
        M = dAE * QK
        # exclusive cumsum by shifting, not by subtracting: M_ii is O(1), the sums it would hide are not
        R = F.pad(M[..., :, :-1], (1, 0)).cumsum(-1)  # R[i, t] = sum_{j < t} M[i, j]
        dg = R.tril_().sum(-2).unsqueeze(-1)  # then the sum over i >= t
    return _IntraGrads(QK.mul_(E), dAE @ k, dAE.mT @ q, _make_gates(g), dg, None)


# ----------------------------------------------------------------------------------------------
# whole sequence: only the state recurrences loop over chunks
# ----------------------------------------------------------------------------------------------


def _state_scan(update: Tensor, gl: Tensor, x: Tensor, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """x <- exp(gl[n]) x + update[n] over the chunks n (downwards for reverse), from x = [B, H, K, V].

    Returns x before every step, [B, H, NT, K, V], and after the last. With update the keys
    decayed to the chunk end times v, that is the state entering every chunk and the final state;
    backwards, with scale * q decayed from the chunk start times do, the gradient w.r.t. the state
    leaving every chunk and dh0.
    """
    decay = gl.mT.exp()  # [B, H, NT, Kg, 1]
    before = torch.empty_like(update)
    for n in reversed(range(update.shape[2])) if reverse else range(update.shape[2]):
        before[:, :, n] = x
        x = torch.addcmul(update[:, :, n], decay[:, :, n], x)
    return before, x


def _decayed(x: Tensor, log_decay: Tensor) -> Tensor:
    """x * exp(log_decay), with a single [..., BT, K] temporary for a vector gate."""
    decay = log_decay.exp()
    return decay.mul_(x) if decay.shape == x.shape else x * decay


def _batched(x: Tensor) -> Tensor:
    """[..., M, N] as a [batch, M, N] view, for the in-place baddbmm_."""
    return x.view(-1, *x.shape[-2:])


def _fresh(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous copy in dtype: custom-op outputs may alias neither inputs nor each other."""
    return x.to(dtype).clone(memory_format=torch.contiguous_format)


def _add_intra_nonfinite(o: Tensor, A: Tensor, v: Tensor) -> None:
    """o += A @ v chunk by chunk, for inputs that are not all finite. See NOTE:[GLA non-finite inputs].

    Step j feeds rows i >= j only, but the matmul multiplies the zeros above the diagonal by
    k_j (in A, scalar gates) and v_j all the same: masking A again clears the first, and chunks
    holding a non-finite v take a masked elementwise product instead of the matmul.
    """
    causal = torch.ones(BT, BT, dtype=torch.bool, device=A.device).tril()
    A.masked_fill_(~causal, 0)
    bad = ~torch.isfinite(v).flatten(-2).all(-1)  # [B, H, NT]: chunks with a non-finite v
    good = bad.logical_not()
    o[good] += A[good] @ v[good]
    idx = bad.nonzero(as_tuple=True)
    per_slice = max(1, 2**24 // (BT * BT * v.shape[-1]))  # bounds the [n, BT, BT, V] products
    parts = [
        torch.where(causal[:, :, None], a[..., None] * w[..., None, :, :], 0).sum(-2)
        for a, w in zip(A[idx].split(per_slice), v[idx].split(per_slice))
    ]
    if parts:
        o.index_put_(idx, torch.cat(parts), accumulate=True)


# no_grad: the ops carry their own backward, and the out= and in-place writes into views below
# would refuse inputs that require grad when called outside the op
@torch.no_grad()
def _chunk_fwd_torch(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    A, gates = _intra_scores(x.q, x.k, x.g)
    h, ht = _state_scan(_decayed(x.k, gates.gr).mT @ x.v, gates.gl, x.h0)
    o = _decayed(x.q, gates.gc) @ h
    # a non-finite k, v, gate or initial state always reaches the final state (see NOTE:[GLA
    # non-finite inputs]): this one small check keeps the finite path as it is
    if torch.isfinite(ht).all():
        _batched(o).baddbmm_(_batched(A), _batched(x.v))
    else:
        _add_intra_nonfinite(o, A, x.v)
    o = _from_chunks(o.mul_(scale), q.shape[1], reverse, _output_dtype(q, k, v))
    state_dtype = _state_dtype(q, k, v, g, g_gamma, initial_state)
    return o, (_fresh(ht, state_dtype) if output_final_state else q.new_empty(0, dtype=state_dtype))


@torch.no_grad()
def _chunk_bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse)
    T = q.shape[1]
    b_do = _to_chunks(do, x.q.shape[2], reverse, x.q.dtype)
    with_dg = g is not None or g_gamma is not None
    intra = _intra_grads(x.q, x.k, x.g, (b_do @ x.v.mT).mul_(scale), with_dg)

    gates = intra.gates
    qd, kd = gates.gc.exp(), gates.gr.exp()  # decay from the chunk start / to its end
    k_out = kd * x.k  # decayed to the chunk end
    h, _ = _state_scan(k_out.mT @ x.v, gates.gl, x.h0)  # entering each chunk
    dht = torch.zeros_like(x.h0) if dht is None else dht
    dh, dh0 = _state_scan((qd * x.q).mT @ (scale * b_do), gates.gl, dht, reverse=True)  # leaving it

    dq_h = (b_do @ h.mT).mul_(qd).mul_(scale)  # through the state entering the chunk
    dk_h = (x.v @ dh.mT).mul_(kd)  # through the state leaving it
    dv = k_out @ dh
    _batched(dv).baddbmm_(_batched(intra.A.mT), _batched(b_do), alpha=scale)
    dgate = _gate_grad(x.q * dq_h, x.k * dk_h, h, dh, intra) if with_dg else None
    dg, dg_gamma = _split_gate_grad(dgate, T, reverse, q, g, g_gamma)
    return (
        _from_chunks(intra.dq.add_(dq_h), T, reverse, q.dtype),
        _from_chunks(intra.dk.add_(dk_h), T, reverse, k.dtype),
        _from_chunks(dv, T, reverse, v.dtype),
        dg,
        dg_gamma,
        q.new_empty(0) if initial_state is None else _fresh(dh0, initial_state.dtype),
    )


def _gate_grad(d_gc: Tensor, d_gr: Tensor, h: Tensor, dh: Tensor, intra: _IntraGrads) -> Tensor:
    """Gradient w.r.t. the log gates of every chunk, [B, H, NT, BT, Kg].

    dg_t = exp(g_t) <dH_t, S_{t-1}> (summed over V), with dH_t the gradient w.r.t. S_t. Beside
    the in-chunk pairs (``intra``) it goes through the states entering and leaving the chunk,
    as q dq^h = d_gc through exp(gc), k dk^h = d_gr through exp(gr), and exp(gl) <h, dh> through
    gl = gc[BT - 1]; every one of their terms carries exp(g_t).
    """
    h_dh = torch.linalg.vecdot(h, dh).unsqueeze(-2)  # [..., 1, K]
    if intra.gates.gc.shape[-1] == 1:
        d_gc, d_gr, h_dh = (t.sum(-1, keepdim=True) for t in (d_gc, d_gr, h_dh))
    d_gc[..., -1:, :].addcmul_(intra.gates.gl.exp(), h_dh)
    dg = _block_scan_grad(d_gc, d_gr, intra.level_grads)
    return dg if intra.dg is None else dg.add_(intra.dg)


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


def _register_lowerings() -> None:
    """Inductor lowers our ops with ``gla_inductor.lowerings``. A graph reaches Inductor only after
    its ops were traced through their fake implementations, so these import the lowerings (loading
    Inductor with the package itself would slow every ``import gla_inductor``)."""
    from . import lowerings  # noqa: F401


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    _register_lowerings()
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
    _register_lowerings()
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
    elif g is not None and g.dim() == 4:
        _check_shape("g", g, q, "[B, T, H, K]", (B, T, H, K))
    elif g is not None:
        raise ValueError(
            f"chunk_gla: g has shape {tuple(g.shape)} but q has shape {tuple(q.shape)}; expected g to be "
            f"[B, T, H, K] = {_shape_str((B, T, H, K))} (vector gate) or [B, T, H] = {_shape_str((B, T, H))} "
            "(scalar gate)"
        )
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
