"""The normal form: every tensor node read as an index-variable expression, einsum style.

A value is a *sum of products* ("monomials") of factors, each factor a tensor indexed by
integer index variables:

    value[out_0, ..., out_r] = sum_m  coef_m * prod_f factor_f[idx_f]     (summed over
                                                                           non-output vars)

Factors are
  * ``atom``  an opaque graph tensor (a node), optionally with some axes fixed to an integer
              (``k[:, t]`` is the atom ``k`` with axis 1 fixed to ``t``);
  * ``exp``   the exponential of a linear form (itself a list of monomials);
  * ``const`` a tensor that depends only on constants and sizes (a mask), evaluated later;
  * ``tri``   the triangular mask that ``tril``/``triu`` multiplies in;
  * ``scalar`` a number computed in the graph (a symbolic ``K ** -0.5``).

A size-1 axis has the variable ``None``. An axis that is several axes merged row-major (a
reshape of [B, H, D] to [B*H, D], ``repeat_interleave`` of groups over heads, a time axis
split into chunks of positions) has a *composite* entry: a tuple of variables, outermost
first.

This module holds the data types and the algebra of their variables (substitution, fixing a
variable to an index). ``analyzer.py`` computes the normal form of every node, by the rules of
``rules.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx as fx

from .consts import example_value

MAX_TERMS = 8  # monomials of one value; a larger sum is read as an atom


@dataclass(frozen=True)
class Atom:
    node: fx.Node
    fixed: tuple[tuple[int, int], ...] = ()  # (axis of node, index), sorted by axis

    def free_axes(self) -> list[int]:
        fixed_axes = {a for a, _ in self.fixed}
        return [a for a in range(rank_of(self.node)) if a not in fixed_axes]


@dataclass(frozen=True)
class Factor:
    kind: str  # "atom" | "exp" | "const" | "tri" | "scalar"
    idx: tuple = ()  # a var (int) or None (size-1 axis) per axis of the factor's tensor
    atom: Optional[Atom] = None  # kind == "atom"
    node: Optional[fx.Node] = None  # kind == "const" or "scalar"
    negate: bool = False  # kind == "const": the factor is (not value)
    inner: tuple = ()  # kind == "exp": monomials of the exponent
    lower: bool = True  # kind == "tri": tril (True) or triu
    diagonal: int = 0  # kind == "tri"


Mono = tuple  # (coef: float, factors: tuple[Factor, ...])


@dataclass(frozen=True)
class AV:
    """Abstract value of a tensor node: output vars and monomials."""

    out: tuple
    terms: tuple
    keep: Optional[Factor] = None  # where keep == 0 the value is -inf (masked_fill(-inf))
    # Ids of the fresh values whose variables this one uses: operands whose origins are
    # disjoint cannot share a variable, so only overlapping ones need renaming.
    origin: frozenset = frozenset()
    # The value as one atom: the node that computed it, indexed through the views taken of
    # it since. A sum read through `S.view(...)` is cut at S itself, so a recurrence whose
    # state is reshaped before its next use still chains S_{t-1} -> S_t.
    root: Optional[Factor] = None


def comps(entry) -> tuple:
    """The variables of an index entry: () for a size-1 axis, several for a merged axis."""
    if entry is None:
        return ()
    return entry if type(entry) is tuple else (entry,)


def make_entry(cs) -> Any:
    cs = tuple(cs)
    if not cs:
        return None
    return cs[0] if len(cs) == 1 else cs


def out_vars(out: tuple) -> set:
    return {c for e in out for c in comps(e)}


def resolve(entry, mp: dict):
    """An entry with every variable replaced through `mp` (var -> entry, possibly chained)."""
    if type(entry) is int:  # the common case, kept fast
        r = mp.get(entry)
        return entry if r is None else resolve(r, mp)
    if entry is None:
        return None
    res = []
    for c in entry:
        r = mp.get(c)
        res.extend((c,) if r is None else comps(resolve(r, mp)))
    return make_entry(res)


def rank_of(node: fx.Node) -> int:
    val = example_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else 0


def axis_size(node: fx.Node, axis: int):
    return example_value(node).shape[axis]


def factor_vars(f: Factor) -> set:
    vs = set()
    for e in f.idx:
        if type(e) is int:
            vs.add(e)
        elif e is not None:
            vs.update(e)
    for _, fs in f.inner:
        for g in fs:
            vs |= factor_vars(g)
    return vs


def mono_vars(m: Mono) -> set:
    vs: set = set()
    for f in m[1]:
        vs |= factor_vars(f)
    return vs


def separates_axes(m: Mono, axes) -> bool:
    """Whether some two of ``axes`` are each indexed by an atom of m but never by one atom together:
    m is an outer product over them (k^T v), not an elementwise product k * x."""
    fvars = [factor_vars(f) for f in m[1] if f.kind == "atom"]
    axes = sorted(axes)
    return any(
        not any(a in fv and b in fv for fv in fvars)
        and any(a in fv for fv in fvars)
        and any(b in fv for fv in fvars)
        for i, a in enumerate(axes)
        for b in axes[i + 1 :]
    )


def sub_factor(f: Factor, mp: dict) -> Factor:
    idx = tuple([resolve(e, mp) for e in f.idx])
    inner = tuple(sub_mono(m, mp) for m in f.inner) if f.inner else ()
    return Factor(f.kind, idx, f.atom, f.node, f.negate, inner, f.lower, f.diagonal)


def sub_mono(m: Mono, mp: dict) -> Mono:
    return (m[0], tuple(sub_factor(f, mp) for f in m[1]))


def sub_av(av: AV, out: tuple, mp: dict) -> AV:
    """`av` with variables substituted and the given output entries."""
    if not mp:
        return AV(out, av.terms, av.keep, av.origin, av.root)
    return AV(
        tuple(resolve(e, mp) for e in out),
        tuple(sub_mono(m, mp) for m in av.terms),
        sub_factor(av.keep, mp) if av.keep is not None else None,
        av.origin,
        sub_factor(av.root, mp) if av.root is not None else None,
    )


def merge_exps(m: Mono) -> Mono:
    """exp(a) * exp(b) -> exp(a + b): one exp factor per monomial."""
    exps = [f for f in m[1] if f.kind == "exp"]
    if len(exps) < 2:
        return m
    rest = tuple(f for f in m[1] if f.kind != "exp")
    inner = tuple(itertools.chain.from_iterable(f.inner for f in exps))
    return (m[0], rest + (Factor("exp", inner=inner),))


class Opaque(Exception):
    """The node is not expressible; it becomes an atom for its consumers."""


def fix_var(f: Factor, v: int, index: int) -> Optional[Factor]:
    """Factor f with variable v fixed to `index` (f unchanged when it does not use v).
    exp(sum_m c_m m)[v = i] is exp(sum_m c_m m[v = i]): a decay computed before a loop
    (`d = g.exp()`) and read one step at a time (`d[:, t]`)."""
    if v not in factor_vars(f):
        return f
    if f.kind == "exp":
        inner = []
        for c, fs in f.inner:
            fixed = [fix_var(g, v, index) for g in fs]
            if None in fixed:
                return None
            inner.append((c, tuple(fixed)))
        return replace(f, inner=tuple(inner))
    if f.kind != "atom" or f.idx.count(v) != 1:
        return None
    p = f.idx.index(v)
    axis = f.atom.free_axes()[p]
    atom = Atom(f.atom.node, tuple(sorted(f.atom.fixed + ((axis, index),))))
    return Factor("atom", f.idx[:p] + f.idx[p + 1 :], atom=atom)


def unit_slice(s: slice, size):
    """'full' for a slice that keeps the whole axis, the index i for one that keeps one
    element (`i:i+1`, `-1:`, `:1`), else None."""
    if s.step not in (None, 1):
        return None
    if s.start in (None, 0) and s.stop is None:
        return "full"
    if isinstance(size, int) and all(x is None or isinstance(x, int) for x in (s.start, s.stop)):
        kept = range(size)[s]  # Python's own clamping of negative and out-of-range bounds
        return "full" if len(kept) == size else kept[0] if len(kept) == 1 else None
    if isinstance(s.start, int) and isinstance(s.stop, int) and s.start >= 0 and s.stop - s.start == 1:
        return s.start
    return None
