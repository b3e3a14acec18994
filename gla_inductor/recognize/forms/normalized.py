"""Parallel retention normalized by its scores' own row sums (torchscale's RetNet):

    A = (q k^T) * D                                   scores, D a GLA decay (times a row factor)
    o = (A / n(A.sum(-1))) @ v      or      o = (A @ v) / n(A.sum(-1))

for any elementwise function n of the row sums (torchscale: ``A.detach().sum(-1, keepdim=True)
.abs().clamp(min=1)``). A row sum of A is itself GLA, sum_j A[i, j] = GLA(q, k, v = 1)[i], and
dividing A's rows commutes with the product over j, (A / N) @ v = (A @ v) / N for any N constant
along j. So both the product with v and every row sum are read from one GLA call whose values
are v with a column of ones appended: its last output column is A's row sums. One call, not a
second with v = 1: q, k and the decay are read once and the scores computed once per tile; on
GPU an extra column costs one more value tile where V is a multiple of the tile (V = 64 -> 65).

The user's normalizer stays the user's: the nodes between the row sum and the divisor (abs,
clamp, ...) read the op's row sums instead of A's, through the same ``detach`` where A was
detached before its sum, so the gradients are the user's exactly. Where the division comes before
the product, the op's output is divided by the user's divisor N instead.

Found here (``find``): scores A (one product of two inputs under a decay, contracted over one
axis) read by a row sum or divided by a tensor; every reader of A must be one of: its row sum
(through value copies: detach, casts, contiguous), a division of A by a tensor of one column (whose
only reader is the product with v) or the product with v itself. Anything else that reads A
(``A.abs().sum(-1)``, a maximum) is no GLA output: a near miss naming it. The parallel form
(``parallel.py``) analyzes the product with v as any candidate and emits the op (``Plan``); the
rewrite is certified in float64 as a whole (``certify/trial.py``) before it is kept.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import AV, comps, factor_vars, mono_vars, out_vars, sub_mono
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import Emitter
from ..core.match import NearMiss, Reject
from ..core.op_names import op_name
from . import static_decay

CONTRACTIONS = ("matmul", "bmm", "einsum")
_COPY_METHODS = {"detach", "contiguous", "clone", "float", "double", "half", "bfloat16", "to", "type_as"}
_COPY_FUNCTIONS = {torch.detach, torch.clone}


@dataclass
class Normalized:
    """Scores whose row sums normalize them, and the product with v read from them."""

    scores: fx.Node  # A
    attention: fx.Node  # A @ v, or (A / N) @ v
    rowsums: list  # (sum node, detached on the way from A, summed axis of A, keepdim)
    division: Optional[fx.Node] = None  # A / N (or A * N) read by the attention; None: A itself is
    copies: list = field(default_factory=list)  # the value copies between A and its row sums

    @property
    def divisor(self) -> Optional[fx.Node]:
        return self.division.args[1] if self.division is not None else None

    def nodes(self) -> list:
        return [self.attention] + [s for s, *_ in self.rowsums]

    def covers(self) -> set:
        return {self.scores, *self.copies} | ({self.division} if self.division is not None else set())


# ---- finding --------------------------------------------------------------------------------------
def find(an: Analyzer) -> tuple[dict, list]:
    """({attention node: Normalized}, near misses) of the graph's normalized scores."""
    found, near = {}, []
    for a in an.nodes:
        if not _is_scores(an, a):
            continue
        try:
            inst = _read(an, a)
        except Reject as e:
            near.append(NearMiss("parallel", str(e), [a]))
            continue
        if inst is not None:
            found[inst.attention] = inst
    return found, near


def _is_scores(an: Analyzer, a: fx.Node) -> bool:
    """One product of two inputs (q, k) contracted over the axes both have, under a decay or a mask
    over the pairs (i, j): a factor indexed by an axis of q's that k lacks and one of k's that q
    lacks. (q e^G times an initial state, e^G over (i, K), is no pair of steps.)"""
    av = an.value(a)
    if av is None or av.keep is not None or len(av.terms) != 1 or len(out_vars(av.out)) < 2:
        return False
    fs = av.terms[0][1]
    data = [f for f in fs if f.kind == "atom" and not static_decay.is_static_atom(an, f)]
    decay = [f for f in fs if f.kind != "scalar" and not any(f is d for d in data)]
    summed = mono_vars(av.terms[0]) - out_vars(av.out)  # (K, or K split in parts by a rotary embedding)
    if len(data) != 2 or not all(summed <= factor_vars(f) for f in data):
        return False
    only_q, only_k = factor_vars(data[0]) - factor_vars(data[1]), factor_vars(data[1]) - factor_vars(data[0])
    return any(factor_vars(f) & only_q and factor_vars(f) & only_k for f in decay)


def _read(an: Analyzer, a: fx.Node) -> Optional[Normalized]:
    """The Normalized of scores `a` read by a row sum or divided, None where neither reads them
    (plain scores: the parallel form's); Reject, saying what was found, where a reader of A is
    none of those the rewrite replaces."""
    rowsums, divisions, products, others, copies = [], [], [], [], []
    stack = [(a, False)]
    while stack:
        x, detached = stack.pop()
        for u in x.users:
            if _copy_of(u, x):
                copies.append(u)
                stack.append((u, detached or _is_detach(u)))
            elif op_name(u) == "sum" and u.args[0] is x:
                rowsums.append((u, detached))
            elif x is a and op_name(u) in ("div", "mul") and u.args[0] is a and _row_tensor(an, u.args[1], a):
                divisions.append(u)
            elif x is a and op_name(u) in CONTRACTIONS:
                products.append(u)
            else:
                others.append(u)
    if not rowsums and not divisions:
        return None
    for d in divisions:
        for u in d.users:
            (products if op_name(u) in CONTRACTIONS else others).append(u)
    if others:
        raise Reject(_others_reason(others))
    if len(products) != 1 or len(divisions) > 1:
        raise Reject(f"the normalized scores q k^T D are read by {len(products)} products and {len(divisions)} "
                     "divisions, expected one product with v (after or before one division of their rows)")
    sums = [(s, det, *_summed_axis(s, a)) for s, det in rowsums]
    return Normalized(a, products[0], sums, divisions[0] if divisions else None, copies)


def _others_reason(others: list) -> str:
    names = ", ".join(sorted({_describe(u) for u in others}))
    return (f"the scores q k^T D are read by {names}; expected only their row sum over the key axis (through "
            "detach or casts), a division of their rows and the product with v: the row sums of |A|, a maximum "
            "or any other function of A is no GLA output, so neither is the normalization")


def _describe(u: fx.Node) -> str:
    name = op_name(u) or (u.target if isinstance(u.target, str) else getattr(u.target, "__name__", str(u.target)))
    return f"{name} ({u.name})"


def _copy_of(u: fx.Node, x: fx.Node) -> bool:
    """u's value is x's (a copy, a cast, detached)."""
    if not u.args or u.args[0] is not x:
        return False
    if u.op == "call_method":
        return u.target in _COPY_METHODS
    return u.op == "call_function" and u.target in _COPY_FUNCTIONS


def _is_detach(u: fx.Node) -> bool:
    return u.target == "detach" or u.target is torch.detach


def _row_tensor(an: Analyzer, n, a: fx.Node) -> bool:
    """A tensor n computed from data, broadcast along A's last axis (the key axis is checked
    against the roles later). A factor from positions and buffers is part of the decay."""
    if not isinstance(n, fx.Node) or an.consts.is_static(n):
        return False
    nv, av = example_value(n), example_value(a)
    if not isinstance(nv, torch.Tensor) or not isinstance(av, torch.Tensor) or nv.dim() > av.dim():
        return False
    return nv.dim() >= 1 and nv.shape[-1] == 1 and nv.numel() > 1


def _summed_axis(s: fx.Node, a: fx.Node) -> tuple:
    """(axis of A, keepdim) of a sum over one axis; (None, False) for any other sum."""
    dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
    keep = s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if type(dim) is not int or s.kwargs.get("dtype") is not None:
        return None, False
    return dim % example_value(a).dim(), bool(keep)


def virtual_value(an: Analyzer, inst: Normalized) -> Optional[AV]:
    """The value of the product with v with A's product of q, k and the decay in place of A / N
    (the same contraction of the same inputs: dividing rows commutes with it) or of A itself
    (which the analysis reads as one tensor, as it has several readers)."""
    av = an.value(inst.attention)
    if av is None or av.keep is not None or len(av.terms) != 1:
        return av
    coef, fs = av.terms[0]
    read = inst.division if inst.division is not None else inst.scores
    mine = [f for f in fs if f.kind == "atom" and an.canon.get(read, read) is f.atom.node and not f.atom.fixed]
    scores = an.value(inst.scores)
    if not mine and inst.division is None:
        return av  # (A read through its product)
    if len(mine) != 1 or scores is None or len(scores.out) != len(mine[0].idx):
        return None
    inner = an.instantiate(scores)
    mp = {}
    for e, x in zip(inner.out, mine[0].idx):
        if (e is None) != (x is None) or type(e) is tuple:
            return None
        if e is not None:
            mp[e] = x
    c2, fs2 = sub_mono(inner.terms[0], mp)
    rest = tuple(f for f in fs if f is not mine[0])
    return AV(av.out, ((coef * c2, fs2 + rest),), None, av.origin)


# ---- the replacement ------------------------------------------------------------------------------
@dataclass
class Plan:
    """The role letters of what the rewrite writes besides the op's output: each row sum, and
    the divisor N (in the layout of A's axes, "j" the key axis)."""

    inst: Normalized
    sums: list  # (sum node, detached, letter groups of its axes)
    divisor: Optional[list]  # N's letter groups, or None
    per_row: float  # the op's last column over A's row sum (the product's own coefficient)

    def with_ones(self, em: Emitter, v: fx.Node) -> fx.Node:
        """v [B, T, H, V] with a column of ones appended, where a row sum is read."""
        if not self.sums:
            return v
        one = em.call(torch.ones_like, em.call(operator.getitem, v, (Ellipsis, slice(0, 1))))
        return em.call(torch.cat, (v, one), -1)

    def split(self, em: Emitter, txn, o: fx.Node) -> fx.Node:
        """The op's output without the ones column; each row sum replaced by that column."""
        if not self.sums:
            return o
        rs = em.call(operator.getitem, o, (Ellipsis, -1))
        if self.per_row != 1.0:
            rs = em.call(torch.mul, rs, 1.0 / self.per_row)
        for s, detached, groups in self.sums:
            x = em.relayout(rs, "bth", groups)
            x = em.call(torch.detach, x) if detached else x
            txn.replace_all_uses(s, em.cast_like(x, s))
        return em.call(operator.getitem, o, (Ellipsis, slice(None, -1)))

    def divide(self, em: Emitter, out: fx.Node, out_groups: list) -> fx.Node:
        """(A @ v) / N for (A / N) @ v (times N for a product), N read in the output's layout."""
        if self.divisor is None:
            return out
        n = em.relayout(self.inst.divisor, self.divisor, out_groups)
        return em.call(torch.div if op_name(self.inst.division) == "div" else torch.mul, out, n)


def plan(an: Analyzer, inst: Normalized, q, k, i: int, j: int, axis) -> Plan:
    """The Plan of an instance whose product with v has roles q, k (factors), query time i, key
    time j; `axis(var, i)` gives the (letters, sizes) of an output variable (the parallel form's)."""
    groups = _scores_groups(an, inst.scores, q, k, i, j, axis)
    sums = []
    for s, detached, p, keepdim in inst.rowsums:
        if p is None or groups[p] != "j":
            raise Reject("the scores are summed over another axis than the key axis (sum_j A[i, j] is GLA's, "
                         "a sum over queries or over several axes is not)")
        kept = ["1" if n == p else g for n, g in enumerate(groups) if n != p or keepdim]
        sums.append((s, detached, kept))
    divisor = _divisor_groups(inst, groups) if inst.division is not None else None
    scores, product = an.value(inst.scores).terms[0], virtual_value(an, inst).terms[0]
    if _scalars(scores) != _scalars(product):
        raise Reject("the product with v is scaled by a number computed in the graph that the scores are not")
    return Plan(inst, sums, divisor, product[0] / scores[0])


def _scalars(m) -> list:
    return sorted(f.node.name for f in m[1] if f.kind == "scalar")


def _scores_groups(an: Analyzer, a: fx.Node, q, k, i: int, j: int, axis) -> list:
    """A's axes as role letters, read by aligning its q and k with the product's."""
    if q.atom.node is k.atom.node:
        raise Reject("q and k are one tensor: the scores' axes cannot be told apart")
    fs, kept = an.value(a).terms[0][1], out_vars(an.value(a).out)
    mp = {}
    for ref in (q, k):
        mine = [f for f in fs if f.kind == "atom" and f.atom == ref.atom]
        if len(mine) != 1 or len(mine[0].idx) != len(ref.idx):
            raise Reject("the normalized scores are not the product's q and k")
        for e, er in zip(mine[0].idx, ref.idx):
            if not set(comps(e)) & kept:
                continue  # the contracted key axis (read as one variable in the product)
            if len(comps(e)) != len(comps(er)):
                raise Reject("the normalized scores split an axis differently from the product")
            mp.update(zip(comps(e), comps(er)))
    groups = []
    for e in an.value(a).out:
        cs = [mp.get(c) for c in comps(e)]
        if None in cs:
            raise Reject("the scores keep an axis that q and k do not have")
        groups.append("j" if cs == [j] else "".join(axis(c, i)[0] for c in cs) or "1")
    return groups


def _divisor_groups(inst: Normalized, groups: list) -> list:
    """N's axes as role letters (right-aligned against A's); its key axis must have size 1."""
    shape = example_value(inst.divisor).shape
    off = len(groups) - len(shape)
    out = []
    for p, size in enumerate(shape):
        g = groups[off + p]
        if size == 1:
            out.append("1")
        elif g == "j":
            raise Reject("the scores are divided by a tensor that varies along the key axis, expected one "
                         "factor per query row")
        else:
            out.append(g)
    return out
