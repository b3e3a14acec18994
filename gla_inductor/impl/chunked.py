"""The chunked GLA algorithm in plain PyTorch: the ops' implementation for fp64 (the oracles'
dtype), for CPUs without a C++ compiler, and wherever the kernels do not apply.

O(T * BT * (K + V)) work per head, batched over all chunks at once but for the state recurrence,
the only loop over chunks. ``forward(call)`` and ``backward(call, do, dht)`` follow the contract of
the ``chunk_fwd`` / ``chunk_bwd`` ops for a ``GLACall`` whose gate is a log gate (no fused gate
function: ``GLACall.with_log_gate``); q and k may have grouped heads.

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
one for j, so that the pairs of a level are a batched matmul (``_intra``). The factors come from
a block scan that multiplies exp(g) over blocks of 1, 2, 4, ... steps (``_scan_step``); it
carries q and k times them in place, and ends with q * exp(gc) and k * exp(gr), which carry
the states between chunks. For Kg == 1 the same scan and split build the [BT, BT] decays. The
forward skips the split on the chunks whose decays stay well inside fp32's range: there one
anchor mid-chunk factors every pair's decay at once (NOTE:[GLA anchored fast path]).

NOTE:[GLA chunk stability] Every decay is exp of a sum of gates over a span inside one chunk,
computed as a product of exp(g[t]) over the span's steps by the block scan, whose every factor is
the decay of one step or the product over a block of steps, multiplied as a tree. The spans are
the chunk prefix gc[i], suffix gr[j] = g[j+1] + ... + g[BT-1], gl, and for a pair across the cut
m of a block the prefix g[m] + ... + g[i] and suffix g[j+1] + ... + g[m-1], whose product is the
pair's decay exp(g[j+1] + ... + g[i]). For g <= 0 every exponent is <= 0 and every factor and
product <= 1, so nothing can overflow however long T is (a factor that underflows only drops
terms smaller still); for g > 0 they grow by at most exp(BT * max g). Each is a factor of a term
the time loop forms too (exp(span) k_j v_j, exp(gc[i]) h), so it stays in range while the loop's
state does; the exceptions need a span of one chunk to exceed fp32's exp range (~88, a mean gate
above 1.38 over 64 steps) while the loop stays finite, i.e. exp(gc[i]) with a state h entering
the chunk below exp(-88), or a product one of whose sub-spans decays that much while another
grows as much (tests/ops/test_bad_input.py checks g up to 1 per step, past the loop's own overflow).
Pairs above the diagonal are never formed (the split), or their decay is 0 and the product
with it is cleared again by ``tril_``, which writes zeros, so they can produce neither inf nor
NaN. No decay is ever a difference of two long prefix sums, nor a quotient of two long prefix
products: the rounding error of the first (|sum| * eps) would dominate when gates are strongly
negative, the second underflows to 0 / 0, and a log gate of -inf, a reset, would give -inf -
(-inf) = NaN; a product of the steps' decays is no less accurate than exp of the summed span,
and a reset makes it 0. Likewise dg[t] is summed from the terms that go through exp(g[t]), never
as a difference of larger sums. The one exception, the forward's anchored fast path, forms
exp(x[i]) exp(-x[j]) from an anchor only on chunks whose gates are finite and whose every such
factor lies within exp(+-60) (NOTE:[GLA anchored fast path]).

NOTE:[GLA non-finite inputs] A NaN or Inf in k_t, v_t or g_t reaches o from step t on, one in q_t
only o_t, as in the time loop (tests/ops/test_bad_input.py): NaN exactly where the loop has NaN; for
Inf the same non-finite entries, though which are NaN rather than +-Inf may differ (the chunked
form forms q_i . k_j before multiplying by v_j). One product would leak such a value to the
steps before t of its chunk, as 0 * inf = NaN: A @ v, whose zeros above the diagonal multiply a
non-finite v_j all the same (q k^T of a scalar gate has its upper triangle cleared by ``tril_``
after the product with the decays). It is redone in ``_add_intra_nonfinite``, only when the final state is not
finite, which every non-finite k, v, gate or initial state makes it (a NaN or Inf in a chunk's
update survives every later decay and sum). Gradients of non-finite inputs are not specified.
"""

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..contract import GLACall, compute_dtype, output_dtype, repeat_groups, sum_groups
from . import scratch, varlen

__all__ = ["BT", "backward", "forward"]

BT = 64  # a power of two: the block scan halves it down to single steps


def _to_chunks(
    x: Tensor,
    NT: int,
    reverse: bool,
    dtype: torch.dtype,
    *,
    strided: bool = False,
    exp: bool = False,
    scale: float = 1.0,
    name: str = "",
) -> Tensor:
    """[B, T, H, D] -> contiguous [B, H, NT, BT, D] in dtype, time-flipped for reverse, zero-padded.

    Zero padding is inert: padded steps have k = v = 0 (no state update) and g = 0 (no decay).
    Contiguous, as the batched matmuls would otherwise copy their operands at every use; with
    strided, a view of x where there is one, for operands that only elementwise ops read. With
    exp, exp(x) (padded with exp(0) = 1), strided (exp's vectorized kernel wants the input's own
    layout: exp of a transposing view took 3x longer than the copy and an exp after it). With
    scale, scale * x, in the copy's pass where x is already in dtype (else rounded in x's dtype).
    A copy goes to ``scratch``'s buffer of that name.
    """
    B, T, H, D = x.shape
    if (strided or exp) and not reverse and T == NT * BT and x.dtype == dtype:
        if exp:  # in x's own layout (above): a kept buffer only for a contiguous x
            x = torch.exp(x, out=scratch.like(name, x)) if x.is_contiguous() else x.exp()
        return x.unflatten(1, (NT, BT)).permute(0, 3, 1, 2, 4)
    shape = (B, H, NT * BT, D)
    chunks = scratch.empty(name, shape, dtype, x.device)
    src = (x.flip(1) if reverse else x).transpose(1, 2)
    if scale != 1.0 and x.dtype == dtype:
        torch.mul(src, scale, out=chunks[:, :, :T])
    else:
        chunks[:, :, :T] = src
        if scale != 1.0:
            chunks[:, :, :T].mul_(scale)
    chunks[:, :, T:] = 0
    return chunks.view(B, H, NT, BT, D).exp_() if exp else chunks.view(B, H, NT, BT, D)


def _from_chunks(x: Tensor, T: int, reverse: bool, dtype: torch.dtype) -> Tensor:
    """Inverse of ``_to_chunks``; always a fresh contiguous tensor (custom-op outputs may not alias
    each other, nor ``scratch``'s buffers, which x may be)."""
    x = x.flatten(2, 3)[:, :, :T].transpose(1, 2)
    if reverse:
        x = x.flip(1)
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _log_gate(q: Tensor, g: Optional[Tensor], g_gamma: Optional[Tensor]) -> Optional[Tensor]:
    """Every gate kind as a per-step log gate [B, T, H, Kg]; None without a gate.

    A constant gate is [1, T, H, 1]: its decays are the same for every batch entry, so they are
    computed once and broadcast.
    """
    if g is not None:
        return g if g.dim() == 4 else g.unsqueeze(-1)
    if g_gamma is not None:
        _, T, H, _ = q.shape
        return g_gamma.view(1, 1, H, 1).expand(1, T, H, 1)
    return None


class _Chunked(NamedTuple):
    q: Tensor  # [B, H, NT, BT, K]
    k: Tensor  # [B, H, NT, BT, K]
    v: Tensor  # [B, H, NT, BT, V]
    g: Optional[Tensor]  # Kg == 1: the log gate of every step, [B, H, NT, BT, 1] (B = 1 if constant)
    e: Optional[Tensor]  # vector gate: exp(g), the decay of every step, [B, H, NT, BT, K], maybe strided
    h0: Tensor  # [B, H, K, V]
    log_g: Optional[Tensor] = None  # vector gate with log_vector: g itself instead of e, maybe strided


def _prepare(q, k, v, g, g_gamma, initial_state, reverse, strided=(), log_vector=False) -> _Chunked:
    """The inputs in chunks.

    With a vector gate, the inputs named in strided ("q", "k", "g") may be strided views of the
    input (see ``_to_chunks``): only elementwise ops read them there. With log_vector, a vector
    gate comes as its log gate ``log_g`` (for ``_intra_vector``) rather than as ``e``.
    """
    dtype = compute_dtype(q, k, v, g, g_gamma, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // BT)
    vector = g is not None and g.dim() == 4

    def chunks(x, name, exp=False):
        return _to_chunks(x, NT, reverse, dtype, strided=vector and name in strided, exp=exp, name=name)

    if initial_state is None:
        h0 = scratch.empty("h0", (B, H, K, V), dtype, q.device).zero_()
    else:
        h0 = initial_state.to(dtype)
    log_gate = None if vector else _log_gate(q, g, g_gamma)
    return _Chunked(
        chunks(q, "q"),
        chunks(k, "k"),
        chunks(v, "v"),
        None if log_gate is None else chunks(log_gate, "g"),
        chunks(g, "g", exp=True) if vector and not log_vector else None,
        h0,
        chunks(g, "g") if vector and log_vector else None,
    )


# ----------------------------------------------------------------------------------------------
# decays: products of exp(g) over spans, by a block scan
# ----------------------------------------------------------------------------------------------


def _levels() -> list[int]:
    """The half-block sizes s = 1, 2, 4, ..., BT / 2 of the block scan and of the split."""
    return [1 << n for n in range(BT.bit_length() - 1)]


def _half(x: Tensor, s: int, right: bool) -> Tensor:
    """View of the left or right half of every block of 2s steps (dim -2): [..., n / (2s), s, D].

    One as_strided, not unflatten and select: the levels take a few dozen such views per call.
    """
    *lead, n, d = x.shape
    *lead_strides, st, sd = x.stride()
    size, stride = (*lead, n // (2 * s), s, d), (*lead_strides, 2 * s * st, st, sd)
    return x.as_strided(size, stride, x.storage_offset() + s * st * right)


def _halves(x: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """Views of the left and right halves of every block of 2s steps: [..., BT / (2s), s, D] each."""
    return _half(x, s, False), _half(x, s, True)


def _scan_step(total: Tensor, right_half: Tensor, left_half: Tensor) -> Tensor:
    """One step of the block scan, from blocks of s steps to blocks of 2s; returns the new totals.

    total [..., BT / s, Kg] holds the decay over every block, the product of exp(g) over its
    steps; right [..., BT, Kg'] the decay from the start of each step's block through the step,
    left that from after the step to the end of its block, each times any factor (q, k), and
    maybe with more leading dims; the step takes ``_half(right, s, True)`` and
    ``_half(left, s, False)``. Within a block of 2s, the steps of the right half take in the left
    half's total, those of the left half the right half's: every product a tree of factors, never
    a quotient. In place on right and left; the scan begins at s = 1 with right = exp(g), left = 1
    and total = exp(g), and ends at s = BT with exp(gc), exp(gr) and exp(gl).
    """
    left_total, right_total = _halves(total, 1)  # [..., BT / (2s), 1, Kg]
    right_half.mul_(left_total)
    left_half.mul_(right_total)
    return torch.mul(left_total, right_total).squeeze(-2)


def _block_scan_grad(dpre: Tensor, dsuf: Tensor, level_grads: Tensor) -> Tensor:
    """Gradient w.r.t. g through the block scan, from those w.r.t. its final log decays gc, gr.

    In log space the scan adds: pre (log right) on a right half gains the left half's total, suf
    (log left) on a left half the right half's, and the totals are pre at the ends of the blocks.
    level_grads[n] holds the gradients w.r.t. pre on the right halves and suf on the left halves
    at s = 2**n (where the split reads them). Runs the scan backwards, in place; every step only
    adds, so each dg[t] stays a sum of the terms that go through exp(g[t]).
    """
    for s in reversed(_levels()):
        (dpre_l, dpre_r), dsuf_l = _halves(dpre, s), _half(dsuf, s, False)
        right_total = dpre_r.sum(-2, keepdim=True)
        dpre_r[..., -1:, :].add_(dsuf_l.sum(-2, keepdim=True))
        dpre_l[..., -1:, :].add_(right_total)
        grad_l, grad_r = _halves(level_grads[s.bit_length() - 1], s)
        dpre_r.add_(grad_r)
        dsuf_l.add_(grad_l)
    return dpre  # pre = g at s = 1


class _Decays(NamedTuple):
    """Decays of every chunk, [..., BT, Kg]."""

    qd: Tensor  # exp(gc): from the chunk start through step i
    kd: Tensor  # exp(gr): from after step j to the chunk end
    total: Tensor  # exp(gl): over the whole chunk, [..., 1, Kg]


def _pair_decay(g: Tensor) -> tuple[Tensor, _Decays]:
    """D[i, j] = exp(g[j+1] + ... + g[i]) for j <= i and 0 above the diagonal, [..., BT, BT], for
    Kg == 1, and the chunk decays.

    By the split of the block scan, as for a vector gate: the pairs across the cuts of level s
    take the outer product of the decays into the right halves and out of the left halves, so D is
    a product of exp(g) over the span, never exp(gc[i] - gc[j]). Its zeros do not clear a
    non-finite factor: products with D are masked again by ``tril_``, which writes zeros.
    """
    e = g.exp()
    D = scratch.empty("D", (*e.shape[:-1], BT), e.dtype, e.device).zero_()
    D.diagonal(dim1=-2, dim2=-1).fill_(1)
    right, left, total = e.clone(), torch.ones_like(e), e
    for s in _levels():
        right_half, left_half = _half(right, s, True), _half(left, s, False)
        torch.mul(right_half, left_half.mT, out=_cross_blocks(D, s))
        total = _scan_step(total, right_half, left_half)
    return D, _Decays(right, left, total)


# ----------------------------------------------------------------------------------------------
# in-chunk attention, every chunk at once
# ----------------------------------------------------------------------------------------------
#
# A[i, j] = sum_k q[i, k] k[j, k] E[i, j, k] for j <= i, with E the decay over the span (j, i].
# One decay for all K (Kg == 1): E is a [BT, BT] matrix and A a masked matmul. A vector gate
# would need E as [BT, BT, K]; instead the chunk is split level by level of the block scan:
#
# Every pair i > j of a chunk lies across the cut m of exactly one level s, a block of 2s steps
# whose halves hold i and j. There its decay exp(g[j+1] + ... + g[i]) is qd[i] kd[j]: qd[i] =
# exp(g[m] + ... + g[i]) from the start of the right half (right at s), kd[j] = exp(g[j+1] + ...
# + g[m-1]) to the end of the left half (left at s). So the scores of the pairs across the cuts
# of level s are one batched matmul of q * qd by (k * kd)^T. See NOTE:[GLA chunk stability].


class _Intra(NamedTuple):
    """The in-chunk part of the forward, and the decayed q and k that carry the states."""

    A: Tensor  # [..., BT, BT], zero above the diagonal
    qg: Tensor  # q * exp(gc), [..., BT, K]
    kg: Tensor  # k * exp(gr)
    decay: Optional[Tensor]  # exp(gl), [..., 1, Kg]; None without a gate


def _cross_blocks(A: Tensor, s: int) -> Tensor:
    """View of A [..., BT, BT] at (right half, left half) of every block of 2s: [..., BT / (2s), s, s]."""
    *lead, n, _ = A.shape
    *lead_strides, sr, sc = A.stride()
    size, stride = (*lead, n // (2 * s), s, s), (*lead_strides, 2 * s * (sr + sc), sr, sc)
    return A.as_strided(size, stride, A.storage_offset() + s * sr)


def _bmm(a: Tensor, b: Tensor, out: str = "") -> Tensor:
    """a @ b for operands of one batch shape, as one bmm (matmul's batch folding takes ~10 ops),
    into ``scratch``'s buffer out."""
    c = scratch.empty(out, (*a.shape[:-1], b.shape[-1]), a.dtype, a.device)  # bmm takes one dtype
    torch.bmm(a.flatten(0, -3), b.flatten(0, -3), out=_batched(c))
    return c


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b; a contraction of 1 or 2 as outer products, where CPU bmm takes a ~10x slower path."""
    if a.shape[-1] > 2:
        return _bmm(a, b)
    return sum(a[..., c : c + 1] * b[..., c : c + 1, :] for c in range(a.shape[-1]))


def _scores(qs: Tensor, ks: Tensor) -> Tensor:
    """qs @ ks^T for the blocks of one level, [..., s, K] each; s = 1 as a dot product."""
    if qs.shape[-2] == 1:
        return torch.linalg.vecdot(qs, ks).unsqueeze(-1)
    return _bmm(qs, ks.mT)


def _diag_scores(q: Tensor, k: Tensor, out: str = "") -> Tensor:
    """[..., BT, BT] zeros but for A[i, i] = q[i] . k[i]: the empty span, no decay; in ``scratch``'s
    buffer out."""
    A = scratch.empty(out, (*q.shape[:-1], BT), q.dtype, q.device).zero_()
    A.diagonal(dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(q, k))
    return A


def _intra(q: Tensor, k: Tensor, g: Optional[Tensor], e: Optional[Tensor]) -> _Intra:
    """A and the decayed q, k, for every gate kind (``_Chunked``'s g and e).

    With a vector gate, q may be strided (``_prepare``), and k is decayed in place.
    """
    if e is not None:
        # the split: q * right and k * left scanned in place; e = exp(g), the totals at s = 1
        A, qg, kg, total = _diag_scores(q, k), torch.mul(q, e, out=e.new_empty(e.shape)), k, e
        for s in _levels():
            qs, ks = _half(qg, s, True), _half(kg, s, False)
            _cross_blocks(A, s).copy_(_scores(qs, ks))
            total = _scan_step(total, qs, ks)
        return _Intra(A, qg, kg, total)
    if g is None:
        return _Intra(_bmm(q, k.mT, out="A").tril_(), q, k, None)
    D, decays = _pair_decay(g)
    qg = torch.mul(q, decays.qd, out=scratch.like("qg", q))
    kg = torch.mul(k, decays.kd, out=scratch.like("kg", k))
    return _Intra(_bmm(q, k.mT, out="A").mul_(D).tril_(), qg, kg, decays.total)


# NOTE:[GLA anchored fast path] With a vector gate the forward takes a shortcut on every chunk whose
# decays stay in range. With a the anchor (``_ANCHOR``, mid-chunk) and x[i] the log decay from
# the anchor to step i, g[a+1] + ... + g[i] after it and -(g[i+1] + ... + g[a]) before it, the
# decay of every pair j <= i is exp(x[i]) exp(-x[j]), so A is one matmul of q * exp(x) by
# (k * exp(-x))^T, in place of the split's six levels of small matmuls and in-place scans (~40%
# of the forward's time at B=2, H=4, T=512, K=V=64 on CPU); qg and kg take one more factor
# each: exp(gc[i]) = exp(ga) exp(x[i]) with ga = g[0] + ... + g[a], and exp(gr[j]) = exp(-x[j])
# exp(x[BT-1]).
#
# Rounding: x itself would not do in fp32. It reaches ~+-40 for common gates, and rounding it
# to fp32 puts an error of an ulp of |x| (4e-6 below 64) into the decay of pairs however close,
# where the split's factors span no more than the pair itself (seen: 20x the split's error of o,
# test_decays_near_one_far_from_the_anchor). So exp(x) is built in two parts
# (``_anchor_factors``): x[i] = X[b] + y[i] for step i of block b of _BLOCK steps, y[i] the gates
# from the block's start through i (fp32 partial sums) and X[b] the log decay from the anchor to
# the block's start, summed in fp64 from the blocks' totals (the y at their ends), and exp(x) =
# exp(y) exp(X), each rounded once. Both are kept in log2 units, every gate times log2(e) rounded
# once, for exp2. A pair's decay then carries only the roundings of the gates and of the partial
# sums along its own span, of at most _BLOCK steps' gates each, an error that grows with the
# span as the split's does (test_anchor_factors_round_like_spans). Only a gate far larger than
# its neighbours costs up to an ulp of itself on the pairs after it in its block.
#
# Range: the factors exp(+-x) grow to exp(|x|) where the split's never exceed the decays
# themselves, and the pairs above the diagonal, which the split never forms, may overflow (the
# ``tril_`` writes zeros over them). So a chunk takes the shortcut only if every factor exp(x)
# and exp(ga) lies within exp(+-_ANCHOR_RANGE) ~ 1e+-26, where it stays finite times |q|, |k|
# below ~1e12, and every exp(y) is a normal number, keeping its precision in the product (a
# non-finite gate fails too). The other chunks are redone by the split, which holds NOTE:[GLA
# chunk stability] for any gates. logsigmoid of a normal, ~-0.8 per step, reaches |x| ~ 40 at
# most; log gates beyond ~-1.9 per step leave the shortcut. A NaN or Inf in q, k or v reaches the
# same outputs as through the split (NOTE:[GLA non-finite inputs]).

_ANCHOR = BT // 2 - 1  # x sums at most BT / 2 steps on either side of it; it ends a block
_ANCHOR_RANGE = 60.0  # bound on |x| and |ga|: exp(+-60) ~ 1e+-26, far inside fp32's range
_BLOCK = 4  # steps per block of y: |y| stays within 4 steps' gates
_LOG2_E = 1 / math.log(2)


def _anchor_factors(log_g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """exp(x) [..., BT, K] and exp(ga) [..., 1, K] of every chunk of log gates, and [...] whether
    the chunk is in the anchor's range (NOTE:[GLA anchored fast path]). log_g is not written."""
    n = BT // _BLOCK
    blocks = log_g.unflatten(-2, (n, _BLOCK))
    # in log2 units: exp2 took a third of exp's time on CPU (AVX-512, torch 2.13)
    y = torch.mul(blocks, _LOG2_E, out=scratch.empty("decays", tuple(blocks.shape), blocks.dtype, blocks.device))
    for s in range(1, _BLOCK):  # a few adds in place: cumsum over so short a dim takes ~2x as long
        y[..., s, :].add_(y[..., s - 1, :])
    # X of every block and ga, from the blocks' totals (y at their ends) in fp64
    e_X = torch.matmul(_block_sums(y.device), y[..., -1, :].double()).exp2_().to(y.dtype)
    e_y = y.exp2_()
    normal = e_y.amin((-3, -2, -1)) >= torch.finfo(e_y.dtype).tiny
    e = e_y.mul_(e_X[..., :n, None, :]).flatten(-3, -2)
    from_start = e_X[..., n:, :]
    return e, from_start, normal & _in_range(e) & _in_range(from_start)


@functools.lru_cache
def _block_sums(device: torch.device) -> Tensor:
    """[n + 1, n] fp64 that maps the n block totals to X and ga: row b < n to X[b], x at the step
    before block b, the sum of the totals from the anchor up to block b (b after the anchor) or
    minus those from block b up to the anchor (b before it); row n to ga, the totals up to the
    anchor."""
    n, after = BT // _BLOCK, (_ANCHOR + 1) // _BLOCK  # the block that starts right after the anchor
    b, c = torch.arange(n + 1, device=device)[:, None], torch.arange(n, device=device)
    sums = ((after <= c) & (c < b)).double() - ((b <= c) & (c < after)).double()
    sums[n] = (c < after).double()
    return sums


def _in_range(e: Tensor) -> Tensor:
    """[...] bool: whether all of e [..., n, K] lies within exp(+-_ANCHOR_RANGE) (NaN does not)."""
    bound = math.exp(_ANCHOR_RANGE)
    return (e.amax((-2, -1)) <= bound) & (e.amin((-2, -1)) >= 1 / bound)


def _anchored_intra(q: Tensor, k: Tensor, e: Tensor, from_start: Tensor) -> _Intra:
    """``_intra`` through the anchor, given exp(x) and exp(ga) (``_anchor_factors``); e is taken over."""
    to_end = e[..., -1:, :].clone()  # exp(x[BT - 1])
    # k exp(-x) contiguous: bmm reads a transposed operand as fast as a contiguous one, where a
    # transposed store took 8x as long as this division (torch 2.13, CPU)
    ka = torch.div(k, e, out=scratch.like("kg", e))
    qa = e.mul_(q)  # q exp(x), contiguous for the matmul, in place of exp(x): one buffer less
    A = _bmm(qa, ka.mT, out="A").tril_()
    return _Intra(A, qa.mul_(from_start), ka.mul_(to_end), from_start * to_end)


def _intra_vector(q: Tensor, k: Tensor, log_g: Tensor) -> _Intra:
    """``_intra`` for a vector gate given its log gates: through the anchor where in range, the
    split elsewhere. q, k and log_g may be strided views of the inputs; none is written."""
    if log_g.numel() == 0:  # nothing to gain, and no chunk extrema to take
        return _split_intra(q, k, log_g)
    e, from_start, ok = _anchor_factors(log_g)
    if not ok.any():
        return _split_intra(q, k, log_g)
    intra = _anchored_intra(q, k, e, from_start)
    if not ok.all():
        _redo_by_split(intra, ok.logical_not().nonzero(as_tuple=True), q, k, log_g)
    return intra


def _split_intra(q: Tensor, k: Tensor, log_g: Tensor) -> _Intra:
    """``_intra`` by the split, on a copy of k (it decays k in place; k may be a view of the input)."""
    return _intra(q, k.clone(memory_format=torch.contiguous_format), None, log_g.exp())


def _redo_by_split(intra: _Intra, idx: tuple, q: Tensor, k: Tensor, log_g: Tensor) -> None:
    """Overwrites every output of the chunks at idx (out of the anchor's range) by the split's."""
    part = _intra(q[idx], k[idx], None, log_g[idx].exp())  # indexing copies: k[idx] is ours to decay
    for out, redone in zip(intra, part):
        out[idx] = redone


class _IntraGrads(NamedTuple):
    """What the backward needs of the in-chunk part."""

    fwd: _Intra
    decays: Optional[_Decays]  # exp(gc), exp(gr), exp(gl); None without a gate
    dq: Tensor
    dk: Tensor
    dg: Optional[Tensor]  # Kg == 1: the part of dg through the in-chunk decays
    level_grads: Optional[Tensor]  # vector gate: the same as gradients for ``_block_scan_grad``


def _intra_grads(q, k, g, e, dA) -> _IntraGrads:
    """``_intra``, dq and dk of A given dA, and with a gate its gradient w.r.t. the gates.

    dE[i, j] / dg[t] = E[i, j] for j < t <= i, so dg[t] sums M[i, j] = dA[i, j] q[i] k[j] E[i, j]
    over the pairs whose span holds t: every term is a well-scaled part of the result.
    NB the shorter telescoping form, a reverse cumsum of q dq - k dk, cancels O(1) terms down to
    an O(exp(g)) result, and loses all precision under strong decay (seen: 4e3 relative error on
    dg_gamma with g ~ U[-20, 0], T = 4096 in fp32). With a vector gate, q and k may be strided.
    """
    if g is None and e is None:
        dA = dA.tril_()
        fwd = _Intra(_bmm(q, k.mT, out="A").tril_(), q, k, None)
        return _IntraGrads(fwd, None, _bmm(dA, k, out="dq"), _bmm(dA.mT, q, out="dk"), None, None)
    if e is None:
        return _pair_grads(q, k, g, dA)
    A = _diag_scores(q, k, out="A")
    dA_ii = dA.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    # the diagonal spans nothing: no dg; out= keeps dq, dk contiguous whatever q and k's strides
    dq, dk = torch.mul(dA_ii, k, out=scratch.like("dq", e)), torch.mul(dA_ii, q, out=scratch.like("dk", e))
    # the scan carries the decays (for dq, dk) and q, k times them (the split's operands) at once
    right, left = (scratch.empty(name, (2, *e.shape), e.dtype, e.device) for name in ("right", "left"))
    torch.mul(q, e, out=right[0])
    right[1], left[0], left[1] = e, k, 1
    level_grads = scratch.empty("level_grads", (len(_levels()), *e.shape), q.dtype, q.device)
    total = e
    for n, s in enumerate(_levels()):
        right_half, left_half = _half(right, s, True), _half(left, s, False)
        (qs, qd), (ks, kd) = right_half.unbind(0), left_half.unbind(0)
        _cross_blocks(A, s).copy_(_scores(qs, ks))
        b_dA = _cross_blocks(dA, s).contiguous()  # one copy for both products, not one each
        b_dqs, b_dks = _mm(b_dA, ks), _mm(b_dA.mT, qs)  # w.r.t. q * qd and k * kd
        _half(dq, s, True).addcmul_(b_dqs, qd)
        _half(dk, s, False).addcmul_(b_dks, kd)
        # (q qd) d(q qd) is the gradient w.r.t. pre on the right (log qd), (k kd) d(k kd) that
        # w.r.t. suf on the left
        grad_l, grad_r = _halves(level_grads[n], s)
        torch.mul(b_dqs, qs, out=grad_r)
        torch.mul(b_dks, ks, out=grad_l)
        total = _scan_step(total, right_half, left_half)
    (qg, qd), (kg, kd) = right.unbind(0), left.unbind(0)
    return _IntraGrads(_Intra(A, qg, kg, total), _Decays(qd, kd, total), dq, dk, None, level_grads)


def _pair_grads(q, k, g, dA) -> _IntraGrads:
    """``_intra_grads`` for Kg == 1, through the [BT, BT] decay matrix."""
    D, decays = _pair_decay(g)
    QK = _bmm(q, k.mT, out="A")
    dAD = dA.mul_(D).tril_()  # dA is the caller's scratch product, ours to overwrite
    # exclusive cumsum by shifting, not by subtracting: M_ii is O(1), the sums it would hide are not
    R = scratch.like("R", dAD)  # R[i, t] = sum_{j < t} M[i, j], M = dAD * QK
    R[..., 0] = 0
    torch.mul(dAD[..., :-1], QK[..., :-1], out=R[..., 1:]).cumsum_(-1)
    dg = R.tril_().sum(-2).unsqueeze(-1)  # then the sum over i >= t
    qg = torch.mul(q, decays.qd, out=scratch.like("qg", q))
    kg = torch.mul(k, decays.kd, out=scratch.like("kg", k))
    fwd = _Intra(QK.mul_(D).tril_(), qg, kg, decays.total)
    return _IntraGrads(fwd, decays, _bmm(dAD, k, out="dq"), _bmm(dAD.mT, q, out="dk"), dg, None)


# ----------------------------------------------------------------------------------------------
# whole sequence: only the state recurrences loop over chunks
# ----------------------------------------------------------------------------------------------


def _state_scan(
    update: Tensor, decay: Optional[Tensor], x: Tensor, reverse: bool = False, out: str = ""
) -> tuple[Tensor, Tensor]:
    """x <- decay[n]^T * x + update[n] over the chunks n (downwards for reverse), from x = [B, H, K, V].

    decay [B, H, NT, 1, Kg] (None: 1) scales the rows of x. Returns x before every step,
    [B, H, NT, K, V], and after the last. With update the keys decayed to the chunk end times v,
    that is the state entering every chunk and the final state; backwards, with scale * q decayed
    from the chunk start times do, the gradient w.r.t. the state leaving every chunk and dh0.
    The states go to ``scratch``'s buffer out; the last is a fresh tensor.
    """
    before = scratch.like(out, update)
    updates, states = update.unbind(2), before.unbind(2)
    decays = None if decay is None else decay.mT.unbind(2)  # [B, H, Kg, 1] each
    order = list(range(len(updates) - 1, -1, -1) if reverse else range(len(updates)))
    if not order:
        return before, x

    def step(n, out=None):
        if decays is None:
            return torch.add(updates[n], states[n], out=out)
        return torch.addcmul(updates[n], decays[n], states[n], out=out)

    states[order[0]].copy_(x)
    for n, after in zip(order, order[1:]):
        step(n, out=states[after])  # written in place: no copy of every state
    return before, step(order[-1])


def _batched(x: Tensor) -> Tensor:
    """[..., M, N] as a [batch, M, N] view, for the in-place baddbmm_."""
    return x.view(-1, *x.shape[-2:])


def _fresh(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous copy in dtype: custom-op outputs may alias neither inputs nor each other."""
    return x.to(dtype).clone(memory_format=torch.contiguous_format)


def _add_intra_nonfinite(o: Tensor, A: Tensor, v: Tensor) -> None:
    """o += A @ v chunk by chunk, for inputs that are not all finite. See NOTE:[GLA non-finite inputs].

    Step j feeds rows i >= j only, but the matmul multiplies the zeros of A above the diagonal by
    v_j all the same: chunks holding a non-finite v take a masked elementwise product instead.
    """
    causal = torch.ones(BT, BT, dtype=torch.bool, device=A.device).tril()
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
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse, strided=("q", "k", "g"), log_vector=True)
    intra = _intra(x.q, x.k, x.g, x.e) if x.log_g is None else _intra_vector(x.q, x.k, x.log_g)
    h, ht = _state_scan(_bmm(intra.kg.mT, x.v, out="update"), intra.decay, x.h0, out="h")
    o = _bmm(intra.qg, h, out="o")
    # a non-finite k, v, gate or initial state always reaches the final state (see NOTE:[GLA
    # non-finite inputs]): this one small check keeps the finite path as it is. Its sum is
    # non-finite then too (and, harmlessly, when it overflows): cheaper than isfinite(ht).all()
    if math.isfinite(ht.sum()):
        _batched(o).baddbmm_(_batched(intra.A), _batched(x.v), beta=scale, alpha=scale)
    else:
        _add_intra_nonfinite(o, intra.A, x.v)
        o.mul_(scale)
    o = _from_chunks(o, q.shape[1], reverse, output_dtype(q, k, v))
    state_dtype = compute_dtype(q, k, v, g, g_gamma, initial_state)
    return o, (_fresh(ht, state_dtype) if output_final_state else q.new_empty(0, dtype=state_dtype))


@torch.no_grad()
def _chunk_bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    x = _prepare(q, k, v, g, g_gamma, initial_state, reverse, strided=("q", "k"))
    T = q.shape[1]
    # do only ever enters times scale
    b_do = _to_chunks(do, x.v.shape[2], reverse, x.v.dtype, scale=scale, name="do")
    with_dg = x.g is not None or x.e is not None
    intra = _intra_grads(x.q, x.k, x.g, x.e, _bmm(b_do, x.v.mT, out="dA"))
    fwd, decays = intra.fwd, intra.decays

    h, _ = _state_scan(_bmm(fwd.kg.mT, x.v, out="update"), fwd.decay, x.h0, out="h")  # entering each chunk
    dht = torch.zeros_like(x.h0) if dht is None else dht
    # leaving it
    dh, dh0 = _state_scan(_bmm(fwd.qg.mT, b_do, out="dupdate"), fwd.decay, dht, reverse=True, out="dh")

    dq_h = _bmm(b_do, h.mT, out="dq_h")  # through the state entering the chunk, w.r.t. q * exp(gc)
    dk_h = _bmm(x.v, dh.mT, out="dk_h")  # through the state leaving it, w.r.t. k * exp(gr)
    dv = _bmm(fwd.kg, dh, out="dv")
    _batched(dv).baddbmm_(_batched(fwd.A.mT), _batched(b_do))
    dgate = None
    if with_dg:
        # q dq^h and k dk^h, the gradients w.r.t. gc and gr, before dq^h and dk^h take the decays
        d_gc = torch.mul(dq_h, fwd.qg, out=scratch.like("d_gc", dq_h))
        d_gr = torch.mul(dk_h, fwd.kg, out=scratch.like("d_gr", dk_h))
        dgate = _gate_grad(d_gc, d_gr, h, dh, intra)
        intra.dq.addcmul_(dq_h, decays.qd)
        intra.dk.addcmul_(dk_h, decays.kd)
    else:
        intra.dq.add_(dq_h)
        intra.dk.add_(dk_h)
    dg, dg_gamma = _split_gate_grad(dgate, T, reverse, q, g, g_gamma)
    return (
        _from_chunks(intra.dq, T, reverse, q.dtype),
        _from_chunks(intra.dk, T, reverse, k.dtype),
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
    if intra.level_grads is not None:
        d_gc[..., -1:, :].addcmul_(intra.decays.total, h_dh)
        return _block_scan_grad(d_gc, d_gr, intra.level_grads)
    d_gc, d_gr, h_dh = (t.sum(-1, keepdim=True) for t in (d_gc, d_gr, h_dh))
    d_gc[..., -1:, :].addcmul_(intra.decays.total, h_dh)
    # gc[i] sums g[t] for t <= i, gr[j] for t > j: reverse and exclusive cumsums, direct sums of terms
    dg = d_gc.flip(-2).cumsum(-2).flip(-2)
    dg[..., 1:, :].add_(d_gr[..., :-1, :].cumsum(-2))
    return dg.add_(intra.dg)


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


def forward(call: GLACall) -> tuple[Tensor, Tensor]:
    """(o, final state or an empty [0]); grouped q and k are repeated to v's heads first: not the
    path grouped heads are optimized for (the kernels read them shared). Packed sequences run one
    after another (``varlen``)."""
    if call.varlen:
        return varlen.forward(call, forward)
    c, H = call, call.v.shape[2]
    return _chunk_fwd_torch(repeat_groups(c.q, H), repeat_groups(c.k, H), c.v, c.g, c.g_gamma, c.initial_state,
                            c.scale, c.output_final_state, c.reverse)


def backward(call: GLACall, do: Tensor, dht: Optional[Tensor]) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dg_gamma, dh0) on repeated q and k, their gradients summed back over the groups."""
    if call.varlen:
        return varlen.backward(call, do, dht, backward)
    c, H, G = call, call.v.shape[2], call.q.shape[2]
    dq, dk, *rest = _chunk_bwd_torch(repeat_groups(c.q, H), repeat_groups(c.k, H), c.v, c.g, c.g_gamma,
                                     c.initial_state, do, dht, c.scale, c.reverse)
    return (sum_groups(dq, G, c.q.dtype), sum_groups(dk, G, c.k.dtype), *rest)
