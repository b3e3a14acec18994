"""The rules of the normal form: for each operation (by its name in ``op_names.py``), the
abstract value of a node from its operands'. A rule returns None, or raises ``Opaque``, where
the node is not expressible; the analyzer then reads the node as an atom.

``RULES`` maps operation names to rules ``rule(an, node, *args, **kwargs)``: ``an`` is the
``Analyzer`` (fresh variables, operands' values, contraction), args and kwargs the node's with
each tensor argument replaced by what the node reads (see ``Analyzer.read``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx

from .algebra import (
    AV, Factor, Opaque, comps, factor_vars, fix_var, make_entry, mono_vars, out_vars, resolve, separates_axes, sub_av,
    sub_mono, unit_slice,
)
from .consts import example_value
from .op_names import op_name


def _shape(x) -> tuple:
    val = example_value(x)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _binary_labels(a_rank: int, b_rank: int):
    n = max(a_rank, b_rank)
    labels = tuple(range(n))
    return labels[n - a_rank :], labels[n - b_rank :], labels


def _scaled(av: AV, c: float) -> AV:
    if c == 0.0:
        return AV(av.out, (), None, av.origin)
    return AV(av.out, tuple((m[0] * c, m[1]) for m in av.terms), av.keep, av.origin)


# ---- arithmetic ------------------------------------------------------------------
def _op_mul(an, node, a, b, **kw):
    (na, va), (nb, vb) = an.operand(a), an.operand(b)
    if na is None and nb is None:
        return None
    if na is None:
        return _scaled(vb, va)
    if nb is None:
        return _scaled(va, vb)
    la, lb, lo = _binary_labels(len(va.out), len(vb.out))
    return an.contract([(na, va, la), (nb, vb, lb)], lo)


def _op_div(an, node, a, b, rounding_mode=None, **kw):
    (na, va), (nb, vb) = an.operand(a), an.operand(b)
    if rounding_mode is not None or nb is not None or na is None or vb == 0:
        return None
    return _scaled(va, 1.0 / vb)


def _op_neg(an, node, a, **kw):
    return _scaled(an.operand(a)[1], -1.0)


def _op_add(an, node, a, b, alpha=1, **kw):
    return _sum(an, node, a, b, float(alpha))


def _op_sub(an, node, a, b, alpha=1, **kw):
    return _sum(an, node, a, b, -float(alpha))


def _op_rsub(an, node, a, b, alpha=1, **kw):
    return _sum(an, node, b, a, -float(alpha))


def _sum(an, node, a, b, cb: float) -> Optional[AV]:
    shape = _shape(node)
    parts = []
    for x, c in ((a, 1.0), (b, cb)):
        nx, vx = an.operand(x)
        if nx is None:
            parts.append(AV((), ((vx * c, ()),)))
            continue
        if vx.keep is not None:
            raise Opaque
        if an.cuts(nx, vx):
            vx = an.cut_av(nx, vx)  # S_t = S_{t-1} + k v keeps S_{t-1} whole
        parts.append(_scaled(vx, c))
    # Align both sides to the output shape (right-aligned broadcasting).
    rank = len(shape)
    outs: list = [None] * rank
    terms: list = []
    mp: dict = {}
    seen: frozenset = frozenset()
    for vx in parts:
        if vx.origin & seen or not vx.origin:
            vx = an.instantiate(vx)
        seen |= vx.origin
        off = rank - len(vx.out)
        for p, v in enumerate(vx.out):
            if v is None:
                continue
            if outs[off + p] is None:
                outs[off + p] = v
            else:
                an.unify(outs[off + p], v, mp)
        terms += vx.terms
    terms = [sub_mono(m, mp) for m in terms]
    outs = [resolve(e, mp) for e in outs]
    for p, s in enumerate(shape):
        if outs[p] is None and not (isinstance(s, int) and s == 1):
            outs[p] = an.fresh(s)  # a broadcast axis no term depends on
    return AV(tuple(outs), tuple(terms), None, seen)


def _op_exp(an, node, a, **kw):
    _, va = an.operand(a)
    return _exp(va, 1.0)


def _op_exp2(an, node, a, **kw):
    _, va = an.operand(a)
    return _exp(va, math.log(2.0))


def _op_pow(an, node, a, b, **kw):
    # c ** x == exp(x * log c) for a positive Python number c.
    if isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0:
        _, vb = an.operand(b)
        return _exp(vb, math.log(a))
    return None


def _exp(va: AV, c: float) -> Optional[AV]:
    out_set = out_vars(va.out)
    for m in va.terms:
        if not mono_vars(m) <= out_set or any(f.kind == "exp" for f in m[1]):
            return None  # exp of a contraction or of an exp: not a linear form
    inner = tuple((m[0] * c, m[1]) for m in va.terms)
    factors = (Factor("exp", inner=inner),) if inner else ()
    if va.keep is not None:
        factors += (va.keep,)
    return AV(va.out, ((1.0, factors),), None, va.origin)


# ---- contractions ----------------------------------------------------------------
def _op_sum(an, node, a, dim=None, keepdim=False, dtype=None, **kw):
    na, va = an.operand(a)
    rank = len(va.out)
    if dim is None:
        dims = set(range(rank))
    else:
        dims = {d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    labels = tuple(range(rank))
    res = an.contract([(na, va, labels)], tuple(i for i in labels if i not in dims))
    if keepdim:
        out = list(res.out)
        for i in sorted(dims):
            out.insert(i, None)
        res = AV(tuple(out), res.terms, None, res.origin)
    return res


def _op_matmul(an, node, a, b, **kw):
    (na, va), (nb, vb) = an.operand(a), an.operand(b)
    if na is None or nb is None:
        return None
    ra, rb = len(va.out), len(vb.out)
    if ra == 0 or rb == 0:
        return None
    # Labels: batch dims right-aligned; "m" contracted; "i"/"j" kept.
    if ra >= 2 and rb >= 2:
        nbatch = max(ra, rb) - 2
        bl = tuple(("b", i) for i in range(nbatch))
        la = bl[nbatch - (ra - 2) :] + ("i", "m")
        lb = bl[nbatch - (rb - 2) :] + ("m", "j")
        lo = bl + ("i", "j")
    elif ra == 1 and rb >= 2:
        nbatch = rb - 2
        bl = tuple(("b", i) for i in range(nbatch))
        la, lb, lo = ("m",), bl + ("m", "j"), bl + ("j",)
    elif ra >= 2 and rb == 1:
        nbatch = ra - 2
        bl = tuple(("b", i) for i in range(nbatch))
        la, lb, lo = bl + ("i", "m"), ("m",), bl + ("i",)
    else:
        la, lb, lo = ("m",), ("m",), ()
    return an.contract([(na, va, la), (nb, vb, lb)], lo)


def _op_einsum(an, node, equation, *operands, **kw):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str):
        return None
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    specs = lhs.split(",")
    if len(specs) != len(operands):
        return None
    ops = [an.operand(x) for x in operands]
    if any(n is None for n, _ in ops):
        return None
    ell = max((len(v.out) - len(s.replace("...", "")) for (n, v), s in zip(ops, specs) if "..." in s), default=0)
    ell_labels = tuple(("e", i) for i in range(ell))

    def labels_of(spec: str, rank: int) -> tuple:
        if "..." in spec:
            pre, post = spec.split("...")
            n = rank - len(pre) - len(post)
            return tuple(pre) + ell_labels[ell - n :] + tuple(post)
        return tuple(spec)

    if not _:
        # Implicit output: letters that appear once, sorted; ellipsis first.
        letters = [c for c in lhs.replace("...", "").replace(",", "")]
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1)
        )
    out = labels_of(rhs, ell + len(rhs.replace("...", "")))
    operands_l = [(n, v, labels_of(s, len(v.out))) for (n, v), s in zip(ops, specs)]
    return an.contract(operands_l, out)


# ---- views -----------------------------------------------------------------------
def _relabel(av: AV, out: tuple) -> AV:
    return AV(out, av.terms, av.keep, av.origin, av.root)


def _op_identity(an, node, a, *args, **kw):
    na, va = an.operand(a)
    if na is None or _shape(node) != _shape(a):
        return None
    return va


def _op_unsqueeze(an, node, a, dim, **kw):
    _, va = an.operand(a)
    out = list(va.out)
    d = dim % (len(out) + 1)
    out.insert(d, None)
    return _relabel(va, tuple(out))


def _op_squeeze(an, node, a, dim=None, **kw):
    _, va = an.operand(a)
    shape = _shape(a)
    if dim is None:
        dims = [i for i, s in enumerate(shape) if isinstance(s, int) and s == 1]
    else:
        dims = [d % max(len(shape), 1) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    out = [v for i, v in enumerate(va.out) if not (i in dims and va.out[i] is None)]
    return _relabel(va, tuple(out))


def _op_permute(an, node, a, *dims, **kw):
    _, va = an.operand(a)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])
    dims = kw.get("dims", dims)
    rank = len(va.out)
    return _relabel(va, tuple(va.out[d % rank] for d in dims))


def _op_transpose(an, node, a, d0, d1, **kw):
    _, va = an.operand(a)
    out = list(va.out)
    rank = len(out)
    d0, d1 = d0 % rank, d1 % rank
    out[d0], out[d1] = out[d1], out[d0]
    return _relabel(va, tuple(out))


def _op_getattr(an, node, a, attr, *default):
    """x.mT (x.mH of a real tensor): the last two axes swapped; x.T: all axes reversed."""
    _, va = an.operand(a)
    if attr == "mT" or attr == "mH" and not example_value(node).is_complex():
        return _op_transpose(an, node, a, -2, -1) if len(va.out) >= 2 else None
    if attr == "T":
        return _relabel(va, tuple(reversed(va.out)))
    return None


def _op_matrix_transpose(an, node, a):
    """aten.mT / aten.mH: as the attribute (``_op_getattr``)."""
    return _op_getattr(an, node, a, "mT" if op_name(node) == "mT" else "mH")


def _op_numpy_t(an, node, a):
    """aten.numpy_T: x.T, all axes reversed."""
    return _op_getattr(an, node, a, "T")


def _op_t(an, node, a, **kw):
    _, va = an.operand(a)
    return _relabel(va, tuple(reversed(va.out))) if len(va.out) <= 2 else None


def _op_reshape(an, node, a, *shape, **kw):
    """Any reshape: the row-major sequence of index variables is regrouped by the new
    sizes; a variable that a new axis boundary cuts through is split in two."""
    if any(isinstance(x, torch.dtype) for x in shape):
        return None  # x.view(dtype) reinterprets bits
    _, va = an.operand(a)
    src, dst = _shape(a), _shape(node)
    if len(src) != len(va.out):
        return None
    pending = [c for e in va.out for c in comps(e)]
    mp: dict = {}
    out = []
    for d in dst:
        if isinstance(d, int) and d == 1:
            out.append(None)
            continue
        group = _take(an, pending, d, mp)
        if group is None:
            return None
        out.append(make_entry(group))
    if pending:
        return None
    return sub_av(va, tuple(out), mp)


def _take(an, pending: list, d, mp: dict) -> Optional[list]:
    """Pop the leading variables of `pending` whose sizes multiply to d."""
    if not pending:
        return None
    s = an.sizes[pending[0]]
    if not (isinstance(s, int) and isinstance(d, int)):
        return [pending.pop(0)] if (s is d or s == d) else None
    group, prod = [], 1
    while pending:
        c = pending[0]
        s = an.sizes[c]
        if not isinstance(s, int):
            return None
        if prod * s <= d and d % (prod * s) == 0:
            group.append(pending.pop(0))
            prod *= s
        elif (d // prod) > 1 and d % prod == 0 and s % (d // prod) == 0:
            c1, c2 = an.fresh(d // prod), an.fresh(s // (d // prod))
            mp[c] = (c1, c2)
            group.append(c1)
            pending[0] = c2
            prod = d
        else:
            return None
        if prod == d:
            return group
    return None


def _op_repeat_interleave(an, node, a, repeats=None, dim=None, output_size=None, **kw):
    """x.repeat_interleave(r, dim): out[.., i * r + j, ..] = x[.., i, ..], a merged axis."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or dim is None:
        return None
    _, va = an.operand(a)
    d = dim % len(va.out)
    out = list(va.out)
    out[d] = make_entry(comps(out[d]) + comps(an.fresh(repeats)))
    return _relabel(va, tuple(out))


def _op_repeat(an, node, a, *sizes, **kw):
    """x.repeat(r, ...) tiles: out[.., j * n + i, ..] = x[.., i, ..]."""
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = tuple(sizes[0])
    if not all(isinstance(r, int) for r in sizes):
        return None
    _, va = an.operand(a)
    off = len(sizes) - len(va.out)
    if off < 0:
        return None
    out = []
    for p, r in enumerate(sizes):
        e = va.out[p - off] if p >= off else None
        out.append(make_entry(comps(an.fresh(r)) + comps(e)))
    return _relabel(va, tuple(out))


def _op_expand(an, node, a, *sizes, **kw):
    _, va = an.operand(a)
    dst = _shape(node)
    off = len(dst) - len(va.out)
    out = []
    for p, s in enumerate(dst):
        v = va.out[p - off] if p >= off else None
        if v is None and not (isinstance(s, int) and s == 1):
            v = an.fresh(s)
        out.append(v)
    return _relabel(va, tuple(out))


# ---- indexing --------------------------------------------------------------------
def _select(av: AV, pos: int, index: int, size) -> Optional[AV]:
    """Fix axis `pos` of av to `index`."""
    v = av.out[pos]
    out = av.out[:pos] + av.out[pos + 1 :]
    if v is None:
        return replace(av, out=out)
    if isinstance(v, tuple):
        return None  # a merged axis: one index fixes several variables
    if isinstance(size, int):
        index = index % size
    elif index < 0:
        return None
    terms = []
    for coef, fs in av.terms:
        new_fs = []
        for f in fs:
            f = fix_var(f, v, index)
            if f is None:
                return None
            new_fs.append(f)
        terms.append((coef, tuple(new_fs)))
    if av.keep is not None and v in factor_vars(av.keep):
        return None
    root = fix_var(av.root, v, index) if av.root is not None else None
    return AV(out, tuple(terms), av.keep, av.origin, root)


def _op_getitem(an, node, a, index, **kw):
    if isinstance(a, fx.Node) and op_name(a) == "unbind":
        src = an.read(a, a.args[0])
        dim = a.args[1] if len(a.args) > 1 else a.kwargs.get("dim", 0)
        _, va = an.operand(src)
        return _select(va, dim % len(va.out), index, _shape(src)[dim])
    _, va = an.operand(a)
    if not isinstance(index, tuple):
        index = (index,)
    shape = _shape(a)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list = []
    for i in index:
        if i is Ellipsis:
            expanded += [slice(None)] * (len(shape) - n_real)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (len(shape) - sum(1 for i in expanded if i is not None))
    out_pos = 0  # position in the (partially indexed) result
    src_pos = 0
    cur = va
    for i in expanded:
        if i is None:
            out = list(cur.out)
            out.insert(out_pos, None)
            cur = replace(cur, out=tuple(out))
            out_pos += 1
        elif isinstance(i, slice):
            size = shape[src_pos]
            sl = unit_slice(i, size)
            if sl == "full":
                out_pos += 1
            elif sl is not None:
                cur = _select(cur, out_pos, sl, size)
                if cur is None:
                    return None
                out = list(cur.out)
                out.insert(out_pos, None)
                cur = replace(cur, out=tuple(out))
                out_pos += 1
            else:
                return None
            src_pos += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            cur = _select(cur, out_pos, i, shape[src_pos])
            if cur is None:
                return None
            src_pos += 1
        else:
            return None
    return cur


def _op_select(an, node, a, dim, index, **kw):
    _, va = an.operand(a)
    if not isinstance(index, int):
        return None
    return _select(va, dim % len(va.out), index, _shape(a)[dim % len(va.out)])


def _op_narrow(an, node, a, dim, start, length, **kw):
    if length != 1 or not isinstance(start, int):
        return None
    _, va = an.operand(a)
    d = dim % len(va.out)
    cur = _select(va, d, start, _shape(a)[d])
    if cur is None:
        return None
    out = list(cur.out)
    out.insert(d, None)
    return replace(cur, out=tuple(out))


# ---- masks -----------------------------------------------------------------------
def _mask_factor(an, mask, target_out: tuple, negate: bool) -> Optional[Factor]:
    if not isinstance(mask, fx.Node) or not an.consts.is_const(mask):
        return None
    mshape = _shape(mask)
    off = len(target_out) - len(mshape)
    if off < 0:
        return None
    idx = []
    for p, s in enumerate(mshape):
        v = target_out[off + p]
        if isinstance(s, int) and s == 1:
            idx.append(None)
        elif v is None:
            return None  # the mask would broadcast the value: not a pure mask
        else:
            idx.append(v)
    return Factor("const", tuple(idx), node=an.canon.get(mask, mask), negate=negate)


def _masked(an, node, x, mask, value, negate_mask: bool) -> Optional[AV]:
    nx, vx = an.operand(x)
    if nx is None or vx.keep is not None:
        return None
    keep = _mask_factor(an, mask, vx.out, negate=negate_mask)
    if keep is None:
        return None
    if value == 0:
        return AV(vx.out, tuple((c, fs + (keep,)) for c, fs in vx.terms), None, vx.origin)
    if value == float("-inf"):
        return AV(vx.out, vx.terms, keep, vx.origin)
    return None


def _op_masked_fill(an, node, x, mask, value, **kw):
    if isinstance(value, fx.Node) or isinstance(value, bool):
        return None
    return _masked(an, node, x, mask, float(value), negate_mask=True)


def _op_where(an, node, cond, x, other=None, **kw):
    if other is None:
        return None
    if isinstance(other, (int, float)) and isinstance(x, fx.Node):
        return _masked(an, node, x, cond, float(other), negate_mask=False)
    if isinstance(x, (int, float)) and isinstance(other, fx.Node):
        return _masked(an, node, other, cond, float(x), negate_mask=True)
    return None


def _op_tril(an, node, a, diagonal=0, **kw):
    return _tri(an, a, True, diagonal)


def _op_triu(an, node, a, diagonal=0, **kw):
    return _tri(an, a, False, diagonal)


def _tri(an, a, lower: bool, diagonal: int) -> Optional[AV]:
    na, va = an.operand(a)
    if len(va.out) < 2 or None in va.out[-2:] or va.keep is not None:
        return None
    f = Factor("tri", va.out[-2:], lower=lower, diagonal=diagonal)
    return AV(va.out, tuple((c, fs + (f,)) for c, fs in va.terms), None, va.origin)


def _op_cumsum(an, node, a, dim, dtype=None, **kw):
    """A prefix sum over time of an outer product, cumsum(k (x) v, t)[.., t, k, v] (linear
    attention's states, materialized): the product at a new position s, summed under the causal
    triangle s <= t (a "tri" factor over (t, s)), so a query's product with it reads as q k^T v
    contracted over time under a mask. Anything else (a log gate's cumsum, which the decay readers
    take as a cumulative gate; a sum that already contracts positions) stays an atom."""
    if not isinstance(dim, int) or dtype is not None:
        return None
    return _prefix_sum(an, a, dim, lower=True)


def _op_flip(an, node, a, *dims, **kw):
    """A suffix sum over time of an outer product, flip(cumsum(flip(k (x) v, t), t), t) (the
    reverse form's states, materialized): as a prefix sum (_op_cumsum), under the anti-causal
    triangle s >= t. Any other flip stays an atom."""
    d = flip_dim(node)
    if d is None or not isinstance(a, fx.Node) or cumsum_dim(a) != d:
        return None
    inner = an.read(a, a.args[0])
    if flip_dim(inner) != d:
        return None
    return _prefix_sum(an, an.read(inner, inner.args[0]), d, lower=False)


def _prefix_sum(an, a, dim: int, lower: bool) -> Optional[AV]:
    """The sum of an outer product over the steps s <= t of its time axis `dim` (s >= t where not
    `lower`), or None where `a` is no outer product at one time step."""
    na, va = an.operand(a)
    if na is None or va.keep is not None or len(va.terms) != 1:
        return None
    d = dim % len(va.out)
    t = va.out[d]
    if t is None or type(t) is tuple or mono_vars(va.terms[0]) - out_vars(va.out):
        return None  # a size-1 or merged time axis, or a sum over positions already
    if not separates_axes(va.terms[0], out_vars(va.out) - {t}):
        return None  # no outer product over the other axes
    s = an.fresh(an.sizes[t])
    coef, fs = sub_mono(va.terms[0], {t: s})
    return AV(va.out, ((coef, fs + (Factor("tri", (t, s), lower=lower, diagonal=0),)),), None, va.origin)


def cumsum_dim(node) -> Optional[int]:
    """The axis a cumsum node sums along (non-negative), None for another node or a cast sum."""
    if not isinstance(node, fx.Node) or op_name(node) != "cumsum":
        return None
    if not isinstance(node.args[0], fx.Node) or node.kwargs.get("dtype") is not None:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dim % example_value(node).dim() if isinstance(dim, int) else None


def flip_dim(node) -> Optional[int]:
    """The one axis a flip node reverses (non-negative), None for another node or several axes."""
    if not isinstance(node, fx.Node) or op_name(node) != "flip" or not isinstance(node.args[0], fx.Node):
        return None
    dims = node.args[1:] if len(node.args) > 1 else (node.kwargs.get("dims"),)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])
    if len(dims) != 1 or not isinstance(dims[0], int):
        return None
    return dims[0] % example_value(node).dim()


RULES = {
    "mul": _op_mul, "div": _op_div, "neg": _op_neg, "add": _op_add, "sub": _op_sub, "rsub": _op_rsub,
    "exp": _op_exp, "exp2": _op_exp2, "pow": _op_pow,
    "sum": _op_sum, "matmul": _op_matmul, "bmm": _op_matmul, "mm": _op_matmul, "einsum": _op_einsum,
    "identity": _op_identity, "unsqueeze": _op_unsqueeze, "squeeze": _op_squeeze, "permute": _op_permute,
    "transpose": _op_transpose, "getattr": _op_getattr, "mT": _op_matrix_transpose, "mH": _op_matrix_transpose,
    "numpy_T": _op_numpy_t, "t": _op_t, "reshape": _op_reshape,
    "repeat_interleave": _op_repeat_interleave, "repeat": _op_repeat, "expand": _op_expand,
    "getitem": _op_getitem, "select": _op_select, "narrow": _op_narrow,
    "masked_fill": _op_masked_fill, "where": _op_where, "tril": _op_tril, "triu": _op_triu, "cumsum": _op_cumsum,
    "flip": _op_flip,
}
