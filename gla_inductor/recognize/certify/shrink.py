"""The chunked form's certificate at fewer batches and heads.

The certificate (``certificate.certify``) runs the user's subgraph F and the replacement R in
float64 on random inputs. At model sizes F materializes [b, c, l, l, h] and larger tensors:
gigabytes in float64. Here F is rebuilt with KEEP batches and KEEP heads, when it is *proven*
to treat every (batch, head) slice alike, and the certificate runs on that.

*Tags.* Every axis of every value of F is a tuple of components, outermost first: a role
letter of ``ROLES`` (a batch or head axis the reduction shrinks), an int (a size kept as is)
or a ``_Free`` (an axis whose entries are all equal, see below). The leaves' axes come from
the spec's letters; each node's from its inputs', by a table of ops (``_HANDLERS``) that admit
a node only when it acts on each slice independently and identically:

* elementwise ops (with broadcasting), casts, in-place elementwise writes: aligned axes must
  be the same components (a head axis never meets a time axis of the same size);
* sums, cumsums, flips, triangles, pads, concatenations, splits, slices, selects, the
  contracted axes of ``einsum`` and ``matmul``: only along axes without a tag;
* permutes, transposes, (un)squeezes, ``einsum`` and ``matmul`` batch letters: move axes;
* reshapes and views: the input's components are matched row-major to the output's sizes;
  an untagged run may be split or merged, a tagged component never (it would mix slices);
* ``expand`` (and ``repeat`` / ``repeat_interleave`` of a size-1 axis) creates a ``_Free``
  axis: copies, equal along it, so it may become a batch or head axis, or stay untagged;
* constants (masks, zero states, NaN buffers) have ``_Free`` axes too; one that becomes
  tagged is admitted only if its *values* are equal along it, and is then cut to KEEP.

Anything else refuses: an op not in the table, an index or slice along a tagged axis, a
tagged component split by a reshape, a size computed in the graph, a constant that differs
between heads, or outputs whose tagged axes are not the spec's letters.

*Soundness.* By induction over the nodes, each value of F at slice s (a batch and head index)
is a function of the leaves' slice s alone, the same function for every s, whose code does
not depend on how many slices there are: the rules above never let an element cross from
one slice to another, and only the sizes of tagged axes are rewritten (sizes in ``reshape``,
``expand``, ``repeat``, attributed by axis position, never by value; Python scalars such as a
``/ 4`` are kept, so they mean at KEEP slices what they meant at full size). So F applies
one function f to each slice, at any number of slices. The replacement R is the GLA op per
(batch, head) between lifts and relayouts by letter: one function r on each slice likewise (a
decay constant per head must be the same for every head to be cut). The outputs' tagged axes
are checked to be where the spec's letters put them, so f and r are compared slice for slice.
f and r are exponential polynomials of one slice's inputs, so agreement of the reduced F and
R at random inputs (KEEP x KEEP slices, two seeds) gives f = r by the certificate's own
argument, hence F = R at full size. KEEP is 2, not 1: a slip in the table that let slices mix
would then show as a disagreement. A role of size KEEP or less is not reduced (nor tagged).
On a refusal, the certificate runs at full size within its memory budget, or not at all.

The trial certificate (``trial.py``) runs the same table on both of its modules, the user's and
the rewritten one: there the GLA op itself is a row (``trial._gla_axes``), and so is the
elementwise glue its normalizers keep (abs, clamp, log).

Groups (Mamba2's B and C shared by groups of heads) are repeated over heads before the leaves
of the chunked form (a leaf's axis is one role), so they do not occur inside F and no
groups-to-heads ratio needs keeping.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..core.consts import example_value

KEEP = 2  # slices kept along each reduced axis: two, so that mixing them would be seen
ROLES = "bh"  # the roles reduced: batch and heads


class Refuse(Exception):
    """The subgraph is not proven to treat every batch and head alike; the message says where."""


class _Free:
    """An axis whose entries are all equal (an expand's copies, a constant's axis before its
    values are checked): it becomes the first axis it meets, and stays untagged if none."""

    __slots__ = ("size", "link")

    def __init__(self, size: int):
        self.size = size
        self.link: Optional[tuple] = None  # the axis it became

    def __repr__(self) -> str:
        return f"Free({self.size})"


@dataclass
class Reduction:
    """F at reduced sizes: what the certificate needs to build and run it."""

    sizes: dict  # the spec's role sizes, reduced
    shapes: dict  # leaf role -> reduced shape
    consts: dict  # constant node -> its value at reduced sizes
    remake: dict  # node -> (op, target, args, kwargs) that carry sizes, rewritten
    gamma: Optional[tuple]  # the spec's constant decay per head, reduced
    numel: dict = field(default_factory=dict)  # node -> elements at reduced sizes


def reduce(spec, nodes: set, consts: dict, outputs: list, order: dict) -> Reduction:
    """F (`nodes` between the spec's leaves and `outputs`, with `consts`' values) at KEEP
    batches and heads; raises Refuse when that is not proven to be F on fewer slices."""
    full = {r: spec.sizes.get(r, 1) for r in ROLES if spec.sizes.get(r, 1) > KEEP}
    if not full:
        raise Refuse("batch and heads are already small")
    if spec.splits or any(lf.select or lf.unflatten or getattr(lf, "lifted", None) is not None
                          for lf in (spec.q, spec.k, spec.v, spec.g) if lf):
        raise Refuse("an input is read through a selection or a merged role")
    gamma = spec.gamma
    if gamma is not None and "h" in full:
        if len(set(gamma)) != 1:
            raise Refuse("the constant decay differs between heads")
        gamma = gamma[:KEEP]
    s = _Shrink(full)
    letters = _leaf_letters(spec)
    for role, n in spec.leaves().items():
        s.axes[n] = s.leaf(n, letters[role])
    for n, val in consts.items():
        if isinstance(val, torch.Tensor):
            s.axes[n] = [(_Free(d),) if d > 1 else () for d in val.shape]
    for n in sorted(nodes, key=order.__getitem__):
        s.visit(n)
    expected = {spec.out: spec.out_groups}
    if spec.final is not None:
        expected[spec.final] = spec.final_groups
    for o in outputs:
        s.check_output(o, expected[o])
    sizes = dict(spec.sizes, **{r: KEEP for r in full})
    shapes = {role: tuple(s.reduced(a) for a in s.axes[n]) for role, n in spec.leaves().items()}
    remake = {n: s.remake(n, how) for n, how in s.sized.items()}
    numel = {n: math.prod(s.reduced(a) for a in s.axes[n]) for n in nodes if isinstance(s.axes.get(n), list)}
    return Reduction(sizes, shapes, s.cut_consts(consts), remake, gamma, numel)


def _leaf_letters(spec) -> dict:
    res = {r: lf.letters for r, lf in (("q", spec.q), ("k", spec.k), ("v", spec.v), ("g", spec.g)) if lf}
    if spec.h0 is not None:
        if any(len(g) != 1 for g in spec.h0_groups):
            raise Refuse("the initial state merges roles in one axis")
        res["h0"] = "".join(spec.h0_groups)
    return res


# ---- the propagation ----------------------------------------------------------------------------
class _Shrink:
    """The axes of every value of F, filled in node by node by the table."""

    def __init__(self, full: dict, handlers: Optional[dict] = None):
        self.full = full  # reduced role -> full size
        self.handlers = {**_HANDLERS, **(handlers or {})}  # (the trial's: the GLA op, "gla")
        self.axes: dict = {}  # node -> [axis, ...] (a tensor) or tuple of those (split, unbind)
        self.sized: dict = {}  # node -> how its size arguments are rebuilt

    # -- axes --
    def resolve(self, axis: tuple) -> tuple:
        """The components of `axis`, with the free axes that became something replaced."""
        out: list = []
        for c in axis:
            while isinstance(c, _Free) and c.link is not None and len(c.link) == 1:
                c = c.link[0]
            if isinstance(c, _Free) and c.link is not None:
                out += self.resolve(c.link)
            elif c != 1:
                out.append(c)
        return _normal(out)

    def size(self, axis: tuple) -> int:
        return math.prod(self._size(c, False) for c in self.resolve(axis))

    def reduced(self, axis: tuple) -> int:
        return math.prod(self._size(c, True) for c in self.resolve(axis))

    def _size(self, c, reduced: bool) -> int:
        if isinstance(c, str):
            return KEEP if reduced else self.full[c]
        return c.size if isinstance(c, _Free) else c

    def unify(self, a: tuple, b: tuple, what: str) -> tuple:
        ra, rb = self.resolve(a), self.resolve(b)
        if ra == rb:
            return ra
        if self.size(ra) != self.size(rb):
            raise Refuse(f"{what}: axes of different sizes meet")
        if len(ra) == 1 and isinstance(ra[0], _Free):
            ra[0].link = rb
            return rb
        if len(rb) == 1 and isinstance(rb[0], _Free):
            rb[0].link = ra
            return ra
        raise Refuse(f"{what}: a batch or head axis meets another axis")

    def plain(self, axis: tuple, what: str) -> tuple:
        """`axis`, required untagged (an op acts along it): free parts stay as they are."""
        r = self.resolve(axis)
        for c in r:
            if isinstance(c, str):
                raise Refuse(f"{what} acts along a batch or head axis")
            if isinstance(c, _Free):
                c.link = (c.size,)
        return self.resolve(r)

    def leaf(self, n: fx.Node, letters: str) -> list:
        shape = tuple(example_value(n).shape)
        if len(letters) != len(shape):
            raise Refuse("an input's letters do not name its axes")
        axes = []
        for c, d in zip(letters, shape):
            axis = (c,) if c in self.full else _normal([d])
            if self.size(axis) != d:
                raise Refuse("an input's axis is not its role's size")
            axes.append(axis)
        return axes

    def of(self, x) -> list:
        if not isinstance(x, fx.Node):
            raise Refuse("an operand is not a tensor")
        if x not in self.axes:
            raise Refuse(f"{x.name} is a size or value computed in the graph")
        return self.axes[x]

    # -- nodes --
    def visit(self, n: fx.Node) -> None:
        handler = self.handlers.get(_kind(n))
        if handler is None:
            raise Refuse(f"{n.name} ({_target_name(n)}) is not an op known to treat every batch and head alike")
        for x in n.all_input_nodes:
            self.of(x)
        out = handler(self, n)
        val = example_value(n)
        if out is None:  # setitem
            return
        if isinstance(out, tuple):
            self.axes[n] = tuple(self._settle(o, v, n) if isinstance(v, torch.Tensor) else None
                                 for o, v in zip(out, val))
        else:
            self.axes[n] = self._settle(out, val, n)

    def _settle(self, out: list, val, n: fx.Node) -> list:
        """Axes marked None take the example's size, untagged; every size is checked."""
        shape = tuple(val.shape)
        if len(out) != len(shape):
            raise Refuse(f"{n.name}: rank not understood")
        res = []
        for a, d in zip(out, shape):
            a = _normal([d]) if a is None else a
            if self.size(a) != d:
                raise Refuse(f"{n.name}: sizes not understood")
            res.append(a)
        return res

    def check_output(self, o: fx.Node, groups: list) -> None:
        axes = self.axes.get(o)
        if not isinstance(axes, list) or len(axes) != len(groups):
            raise Refuse("an output's axes are not its letters")
        for axis, g in zip(axes, groups):
            tags = [c for c in self.resolve(axis) if isinstance(c, str)]
            want = [c for c in g if c in self.full]
            if tags != want or (want and len(self.resolve(axis)) != len(want)):
                raise Refuse("an output's batch and head axes are not where its letters say")

    def remake(self, n: fx.Node, how: tuple) -> tuple:
        kind, base, extra = how
        out = [self.reduced(a) for a in self.axes[n]]
        if kind in ("reshape", "view", "expand"):
            return "call_method", kind, (base, *out), {}
        if kind == "repeat":
            counts = [self.reduced(self.axes[n][i]) if free else r for i, (r, free) in enumerate(extra)]
            return "call_method", "repeat", (base, *counts), {}
        dim = extra  # repeat_interleave of a size-1 axis
        return "call_method", "repeat_interleave", (base, out[dim]), {"dim": dim, "output_size": out[dim]}

    def cut_consts(self, consts: dict) -> dict:
        """Constants at reduced sizes: cut along tagged axes, along which they must be equal."""
        res = {}
        for n, val in consts.items():
            if not isinstance(val, torch.Tensor):
                res[n] = val
                continue
            for i, axis in enumerate(self.axes[n]):
                if any(isinstance(c, str) for c in self.resolve(axis)):
                    if not _equal_along(val, i):
                        raise Refuse(f"the constant {n.name} differs between batches or heads")
                    val = val.narrow(i, 0, self.reduced(axis))
            res[n] = val.clone()
        return res


def _normal(cs: list) -> tuple:
    """Components with adjacent ints merged and 1s dropped (a size-1 axis is ())."""
    out: list = []
    for c in cs:
        if isinstance(c, int) and out and isinstance(out[-1], int):
            out[-1] *= c
        elif c != 1:
            out.append(c)
    return tuple(c for c in out if c != 1)


def _equal_along(val: torch.Tensor, axis: int) -> bool:
    first = val.narrow(axis, 0, 1).expand_as(val)
    same = val == first
    if val.is_floating_point():
        same |= val.isnan() & first.isnan()
    return bool(same.all())


def _target_name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target))


def _dim(d: int, rank: int) -> int:
    if not isinstance(d, int) or not -rank <= d < max(rank, 1):
        raise Refuse("a dimension that is not a number")
    return d % rank if rank else 0


def _arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _varargs(n: fx.Node, name: str) -> list:
    """`x.permute(0, 2, 1)`, `x.permute([0, 2, 1])`, `torch.permute(x, dims=...)`."""
    if name in n.kwargs:
        return _as_list(n.kwargs[name])
    rest = n.args[1:]
    return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)) else list(rest)


def _tensors(n: fx.Node, s: _Shrink) -> list:
    return [s.axes[x] for x in n.all_input_nodes]


# ---- the table ----------------------------------------------------------------------------------
def _pointwise(s: _Shrink, n: fx.Node) -> list:
    return _broadcast(s, _tensors(n, s), n.name)


def _broadcast(s: _Shrink, operands: list, what: str) -> list:
    rank = max(len(o) for o in operands)
    out = []
    for i in range(rank):
        axes = [o[i - rank + len(o)] for o in operands if i - rank + len(o) >= 0]
        big = [a for a in axes if s.resolve(a)]
        for a in big[1:]:
            s.unify(big[0], a, what)
        out.append(big[0] if big else ())
    return out


def _inplace(s: _Shrink, n: fx.Node) -> list:
    """Writes into the first argument, the others broadcast into it."""
    target = s.of(n.args[0])
    for x in n.all_input_nodes:
        if x is n.args[0]:
            continue
        src = s.axes[x]
        if len(src) > len(target):
            raise Refuse(f"{n.name}: a write from a larger tensor")
        for a, b in zip(reversed(src), reversed(target)):
            if s.resolve(a):
                s.unify(b, a, n.name)
    return list(target)


def _cast(s: _Shrink, n: fx.Node) -> list:
    return list(s.of(n.args[0]))


def _along(s: _Shrink, n: fx.Node, dims, drop: bool = False) -> list:
    """An op acting along `dims`; drop: those axes are removed (a sum)."""
    axes = list(s.of(n.args[0]))
    rank = len(axes)
    dims = {_dim(d, rank) for d in dims}
    for d in dims:
        axes[d] = s.plain(axes[d], n.name)
    return [a for i, a in enumerate(axes) if i not in dims] if drop else axes


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _sum(s: _Shrink, n: fx.Node) -> list:
    rank = len(s.of(n.args[0]))
    dim = _arg(n, 1, "dim", _arg(n, 1, "axis"))
    dims = list(range(rank)) if dim is None else _as_list(dim)
    keep = _arg(n, 2, "keepdim", False)
    out = _along(s, n, dims, drop=not keep)
    if keep:
        return [() if i in {_dim(d, rank) for d in dims} else a for i, a in enumerate(out)]
    return out


def _cumsum(s: _Shrink, n: fx.Node) -> list:
    return _along(s, n, [_arg(n, 1, "dim")])


def _flip(s: _Shrink, n: fx.Node) -> list:
    return _along(s, n, _varargs(n, "dims"))


def _tri(s: _Shrink, n: fx.Node) -> list:
    return _along(s, n, [-1, -2])


def _permute(s: _Shrink, n: fx.Node) -> list:
    axes = s.of(n.args[0])
    dims = _varargs(n, "dims")
    if len(dims) != len(axes):
        raise Refuse(f"{n.name}: a permute not understood")
    return [axes[_dim(d, len(axes))] for d in dims]


def _transpose(s: _Shrink, n: fx.Node) -> list:
    axes = list(s.of(n.args[0]))
    if _kind_name(n) == "t":
        return axes[::-1]
    a, b = _dim(_arg(n, 1, "dim0"), len(axes)), _dim(_arg(n, 2, "dim1"), len(axes))
    axes[a], axes[b] = axes[b], axes[a]
    return axes


def _unsqueeze(s: _Shrink, n: fx.Node) -> list:
    axes = list(s.of(n.args[0]))
    axes.insert(_dim(_arg(n, 1, "dim"), len(axes) + 1), ())
    return axes


def _squeeze(s: _Shrink, n: fx.Node) -> list:
    axes = s.of(n.args[0])
    dim = _arg(n, 1, "dim")
    dims = range(len(axes)) if dim is None else [_dim(d, len(axes)) for d in _as_list(dim)]
    return [a for i, a in enumerate(axes) if not (i in dims and not s.resolve(a))]


def _reshape(s: _Shrink, n: fx.Node) -> list:
    """Row-major: input components matched to the output's sizes; untagged runs split or
    merge, a tagged component stays whole."""
    shape = tuple(example_value(n).shape)
    axes = [s.resolve(a) for a in s.of(n.args[0]) if s.resolve(a)]
    out, pending, i = [], [], 0
    for d in shape:
        if d == 1:
            out.append(())
            continue
        if not pending and i < len(axes) and s.size(axes[i]) == d:
            out.append(axes[i])
            i += 1
            continue
        need, got = d, []
        while need > 1:
            if not pending:
                if i == len(axes):
                    raise Refuse(f"{n.name}: a reshape not understood")
                pending = list(s.plain(axes[i], n.name) if _has_free(axes[i]) else axes[i])
                i += 1
            c = pending.pop(0)
            size = s._size(c, False)
            if need % size == 0:
                got.append(c)
                need //= size
            elif isinstance(c, int) and size % need == 0:
                got.append(need)
                pending.insert(0, size // need)
                need = 1
            else:
                raise Refuse(f"{n.name}: a reshape splits a batch or head axis")
        out.append(_normal(got))
    if pending or i < len(axes):
        raise Refuse(f"{n.name}: a reshape not understood")
    s.sized[n] = ("view" if n.op == "call_method" and n.target == "view" else "reshape", n.args[0], None)
    return out


def _has_free(axis: tuple) -> bool:
    return any(isinstance(c, _Free) for c in axis)


def _expand(s: _Shrink, n: fx.Node) -> list:
    shape = tuple(example_value(n).shape)
    src = s.of(n.args[0])
    out = []
    for i, d in enumerate(shape):
        j = i - len(shape) + len(src)
        if j >= 0 and s.size(src[j]) == d:
            out.append(src[j])
        elif j < 0 or not s.resolve(src[j]):
            out.append((_Free(d),) if d > 1 else ())
        else:
            raise Refuse(f"{n.name}: an expand not understood")
    s.sized[n] = ("expand", n.args[0], None)
    return out


def _repeat(s: _Shrink, n: fx.Node) -> list:
    counts = _varargs(n, "sizes")
    src = s.of(n.args[0])
    if not all(isinstance(r, int) for r in counts) or len(counts) < len(src):
        raise Refuse(f"{n.name}: a repeat not understood")
    out, how = [], []
    for i, r in enumerate(counts):
        j = i - len(counts) + len(src)
        a = src[j] if j >= 0 else ()
        if r == 1:
            out.append(a)
            how.append((r, False))
        elif not s.resolve(a):
            out.append((_Free(r),))
            how.append((r, True))
        else:
            out.append(None)  # repeats along the axis: it must be untagged
            s.plain(a, n.name)
            how.append((r, False))
    s.sized[n] = ("repeat", n.args[0], how)
    return out


def _repeat_interleave(s: _Shrink, n: fx.Node) -> list:
    src = list(s.of(n.args[0]))
    repeats, dim = _arg(n, 1, "repeats"), _arg(n, 2, "dim")
    if not isinstance(repeats, int) or dim is None:
        raise Refuse(f"{n.name}: a repeat_interleave not understood")
    dim = _dim(dim, len(src))
    if s.resolve(src[dim]):
        s.plain(src[dim], n.name)
        src[dim] = None
        return src
    src[dim] = (_Free(repeats),) if repeats > 1 else ()
    s.sized[n] = ("repeat_interleave", n.args[0], dim)
    return src


def _index(s: _Shrink, axes: list, idx, what: str) -> list:
    """The axes of x[idx] (basic indexing): integers and partial slices only along untagged
    axes."""
    idx = list(idx) if isinstance(idx, tuple) else [idx]
    used = sum(1 for x in idx if x is not None and x is not Ellipsis)
    if used > len(axes) or sum(1 for x in idx if x is Ellipsis) > 1:
        raise Refuse(f"{what}: an index not understood")
    at = idx.index(Ellipsis) if Ellipsis in idx else len(idx)
    idx[at : at + 1 if at < len(idx) else at] = [slice(None)] * (len(axes) - used)
    out, j = [], 0
    for x in idx:
        if x is None:
            out.append(())
            continue
        axis = axes[j]
        j += 1
        if isinstance(x, slice) and _whole(x, s.size(axis)):
            out.append(axis)
        elif isinstance(x, (int, slice)) and not isinstance(x, bool):
            s.plain(axis, what)
            if isinstance(x, slice):
                out.append(None)
        else:
            raise Refuse(f"{what}: an index not understood")
    return out


def _whole(x: slice, size: int) -> bool:
    return x.start in (None, 0) and x.step in (None, 1) and (x.stop is None or isinstance(x.stop, int) and x.stop >= size)


def _getitem(s: _Shrink, n: fx.Node):
    src = s.of(n.args[0])
    if isinstance(src, tuple):  # a part of a split
        if not isinstance(n.args[1], int):
            raise Refuse(f"{n.name}: an index not understood")
        return list(src[n.args[1]])
    return _index(s, src, n.args[1], n.name)


def _select(s: _Shrink, n: fx.Node) -> list:
    axes = s.of(n.args[0])
    d = _dim(_arg(n, 1, "dim"), len(axes))
    s.plain(axes[d], n.name)
    if _kind_name(n) == "narrow":
        return [None if i == d else a for i, a in enumerate(axes)]
    return [a for i, a in enumerate(axes) if i != d]


def _split(s: _Shrink, n: fx.Node) -> tuple:
    axes = s.of(n.args[0])
    unbind = _kind_name(n) == "unbind"
    d = _dim(_arg(n, 1, "dim", 0) if unbind else _arg(n, 2, "dim", 0), len(axes))
    s.plain(axes[d], n.name)
    parts = example_value(n)
    if unbind:
        return tuple([a for i, a in enumerate(axes) if i != d] for _ in parts)
    return tuple([None if i == d else a for i, a in enumerate(axes)] for _ in parts)


def _cat(s: _Shrink, n: fx.Node) -> list:
    parts = [s.of(x) for x in _as_list(_arg(n, 0, "tensors"))]
    rank = len(parts[0])
    if any(len(p) != rank for p in parts):
        raise Refuse(f"{n.name}: tensors of different ranks joined")
    if _kind_name(n) == "stack":
        out = _aligned(s, parts, n.name)
        out.insert(_dim(_arg(n, 1, "dim", 0), rank + 1), None)
        return out
    d = _dim(_arg(n, 1, "dim", 0), rank)
    for p in parts:
        s.plain(p[d], n.name)
    out = _aligned(s, [[a for i, a in enumerate(p) if i != d] for p in parts], n.name)
    out.insert(d, None)
    return out


def _aligned(s: _Shrink, parts: list, what: str) -> list:
    """Axes of same-shaped tensors (no broadcasting), unified position by position."""
    out = []
    for axes in zip(*parts):
        for a in axes[1:]:
            s.unify(axes[0], a, what)
        out.append(axes[0])
    return out


def _pad(s: _Shrink, n: fx.Node) -> list:
    axes = list(s.of(n.args[0]))
    pad = _arg(n, 1, "pad")
    for i in range(0, len(pad), 2):
        if pad[i] or pad[i + 1]:
            d = len(axes) - 1 - i // 2
            s.plain(axes[d], n.name)
            axes[d] = None
    return axes


def _einsum(s: _Shrink, n: fx.Node) -> list:
    eq = n.args[0]
    ops = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        raise Refuse(f"{n.name}: an einsum not understood")
    ins, out = eq.replace(" ", "").split("->")
    specs = ins.split(",")
    if len(specs) != len(ops):
        raise Refuse(f"{n.name}: an einsum not understood")
    by_letter: dict = {}
    for spec, x in zip(specs, ops):
        axes = s.of(x)
        if len(spec) != len(axes):
            raise Refuse(f"{n.name}: an einsum not understood")
        for c, a in zip(spec, axes):
            if spec.count(c) > 1:  # a diagonal: within a slice only
                a = s.plain(a, f"{n.name}'s diagonal")
            by_letter.setdefault(c, []).append(a)
    res = {}
    for c, axes in by_letter.items():
        big = [a for a in axes if s.resolve(a)]
        for a in big[1:]:
            s.unify(big[0], a, n.name)
        res[c] = big[0] if big else ()
        if c not in out and big:
            s.plain(big[0], n.name)
    return [res[c] for c in out]


def _matmul(s: _Shrink, n: fx.Node) -> list:
    a, b = s.of(n.args[0]), s.of(n.args[1])
    if len(a) < 2 or len(b) < 2:
        raise Refuse(f"{n.name}: a matmul of vectors")
    batch = _broadcast(s, [a[:-2], b[:-2]], n.name)
    s.plain(s.unify(a[-1], b[-2], n.name), n.name)
    return batch + [a[-2], b[-1]]


def _setitem(s: _Shrink, n: fx.Node) -> None:
    view = _index(s, s.of(n.args[0]), n.args[1], n.name)
    value = n.args[2]
    if isinstance(value, fx.Node):
        src = s.of(value)
        if len(src) > len(view):
            raise Refuse(f"{n.name}: a write from a larger tensor")
        for a, b in zip(reversed(src), reversed(view)):
            if not s.resolve(a):
                continue
            if b is None:  # the axis of a partial slice: untagged
                s.plain(a, n.name)
            else:
                s.unify(b, a, n.name)
    return None


_HANDLERS: dict[str, Callable] = {
    "pointwise": _pointwise, "inplace": _inplace, "cast": _cast, "sum": _sum, "cumsum": _cumsum,
    "flip": _flip, "tri": _tri, "permute": _permute, "transpose": _transpose, "t": _transpose,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "reshape": _reshape, "expand": _expand,
    "repeat": _repeat, "repeat_interleave": _repeat_interleave, "getitem": _getitem,
    "select": _select, "narrow": _select, "split": _split, "unbind": _split, "cat": _cat,
    "stack": _cat, "pad": _pad, "einsum": _einsum, "matmul": _matmul, "setitem": _setitem,
}

_FUNCTIONS = {
    **dict.fromkeys((operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
                     torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.neg, torch.exp,
                     torch.exp2, torch.pow, torch.rsub, torch.masked_fill, torch.where,
                     # (not analytic: only the trial certificate's subgraphs have them)
                     torch.abs, torch.clamp, torch.clamp_min, torch.clamp_max, torch.log, torch.sqrt,
                     torch.rsqrt), "pointwise"),
    **dict.fromkeys((operator.iadd, operator.isub, operator.imul, operator.itruediv), "inplace"),
    torch.clone: "cast", torch.detach: "cast", torch.ones_like: "cast", torch.zeros_like: "cast",
    torch.sum: "sum", torch.cumsum: "cumsum", torch.flip: "flip", torch.tril: "tri",
    torch.triu: "tri", torch.permute: "permute", torch.transpose: "transpose", torch.swapaxes: "transpose",
    torch.t: "t", torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.reshape: "reshape",
    torch.flatten: "reshape", torch.unflatten: "reshape", torch.broadcast_to: "expand",
    torch.repeat_interleave: "repeat_interleave", operator.getitem: "getitem", torch.select: "select",
    torch.narrow: "narrow", torch.split: "split", torch.chunk: "split", torch.unbind: "unbind",
    torch.cat: "cat", torch.concat: "cat", torch.stack: "stack", F.pad: "pad", torch._C._nn.pad: "pad",
    torch.einsum: "einsum", operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul",
    torch.mm: "matmul", operator.setitem: "setitem",
}
_METHODS = {
    **dict.fromkeys(("add", "sub", "mul", "div", "true_divide", "neg", "exp", "exp2", "pow", "rsub", "__add__",
                     "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
                     "__neg__", "__pow__", "masked_fill", "where", "abs", "clamp", "clamp_min", "clamp_max", "log",
                     "sqrt", "rsqrt"), "pointwise"),
    **dict.fromkeys(("add_", "sub_", "mul_", "div_", "neg_", "exp_", "masked_fill_", "copy_", "zero_", "fill_",
                     "__iadd__", "__isub__", "__imul__", "__itruediv__"), "inplace"),
    **dict.fromkeys(("contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type_as"), "cast"),
    **dict.fromkeys(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"), "reshape"),
    "sum": "sum", "cumsum": "cumsum", "flip": "flip", "tril": "tri", "triu": "tri", "permute": "permute",
    "transpose": "transpose", "swapaxes": "transpose", "t": "t", "unsqueeze": "unsqueeze",
    "squeeze": "squeeze", "expand": "expand", "expand_as": "expand", "repeat": "repeat",
    "repeat_interleave": "repeat_interleave", "__getitem__": "getitem", "select": "select",
    "narrow": "narrow", "split": "split", "chunk": "split", "unbind": "unbind", "__setitem__": "setitem",
}


def _kind(n: fx.Node) -> Optional[str]:
    if n.op == "call_function" and n.target is torch.ops.gla_inductor.chunk_fwd.default:
        return "gla"
    if n.op == "call_function":
        try:
            return _FUNCTIONS.get(n.target)
        except TypeError:  # an unhashable target
            return None
    return _METHODS.get(n.target) if n.op == "call_method" else None


def _kind_name(n: fx.Node) -> str:
    """The op's own name (t, narrow, unbind, stack), where a handler serves several."""
    return n.target if n.op == "call_method" else _target_name(n)


# ---- the estimate -------------------------------------------------------------------------------
_ALIASING = {"permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "getitem", "select", "narrow",
             "split", "unbind", "setitem", "inplace"}


def peak_bytes(nodes: list, numel: Callable[[fx.Node], int], outputs: list) -> int:
    """The most float64 memory the intermediates of `nodes` (in order) hold at once, when each
    is freed after its last use and views share their base's memory."""
    position = {n: i for i, n in enumerate(nodes)}
    base: dict = {}  # a view -> the node whose memory it is
    for n in nodes:
        if _kind(n) in _ALIASING and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in position:
            base[n] = base.get(n.args[0], n.args[0])
    end: dict = {}  # memory -> the position after which nothing reads it
    for i, n in enumerate(nodes):
        root = base.get(n, n)
        end[root] = max(end.get(root, i), len(nodes) if n in outputs else i)
        for x in n.all_input_nodes:
            if x in position:
                end[base.get(x, x)] = max(end[base.get(x, x)], i)
    live, peak, dying = 0, 0, {}
    for i, n in enumerate(nodes):
        if n not in base:
            size = numel(n) * 8
            live += size
            dying.setdefault(end[n], []).append(size)
        peak = max(peak, live)
        live -= sum(dying.pop(i, ()))
    return peak
