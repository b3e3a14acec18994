"""An index-variable tensor algebra over Dynamo FX graphs.

Every tensor node is read as a *sum of products* ("monomials") of factors, each factor a
tensor indexed by integer index variables, einsum style:

    value[out_0, ..., out_r] = sum_m  coef_m * prod_f factor_f[idx_f]     (summed over
                                                                           non-output vars)

Factors are
  * ``atom``  an opaque graph tensor (a node), optionally with some axes fixed to an integer
              (``k[:, t]`` is the atom ``k`` with axis 1 fixed to ``t``);
  * ``exp``   the exponential of a linear form (itself a list of monomials);
  * ``const`` a tensor that depends only on constants and sizes (a mask), evaluated later;
  * ``tri``   the triangular mask that ``tril``/``triu`` multiplies in;
  * ``scalar`` a number computed in the graph (a symbolic ``K ** -0.5``).

Broadcast-multiply-sum, ``matmul``, ``bmm``, ``einsum``, scalar scales, casts, views,
permutes and keepdim slices all canonicalize to the same representation, so the
recognizers in ``loop.py`` and ``parallel.py`` match semantics, not spellings. A size-1
axis has the variable ``None``. An axis that is several axes merged row-major (a reshape of
[B, H, D] to [B*H, D], ``repeat_interleave`` of groups over heads, a time axis split into
chunks) has a *composite* entry: a tuple of variables, outermost first. Reading each node costs time proportional to its own
expression (bounded by ``MAX_TERMS``), so the whole analysis is linear in graph size.

A sum of several monomials that is multiplied with something else is *cut*: the consumer
sees it as an opaque atom. That keeps expressions small and is exactly what recurrences
need: ``S_t = S_{t-1} * d_t + k_t v_t`` is read with ``S_{t-1}`` as an atom.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx as fx

from .consts import ConstAnalysis, example_value, freeze, is_inplace, storage_key, written_args

MAX_TERMS = 8


@dataclass(frozen=True)
class Atom:
    node: fx.Node
    fixed: tuple[tuple[int, int], ...] = ()  # (axis of node, index), sorted by axis

    def free_axes(self) -> list[int]:
        fixed_axes = {a for a, _ in self.fixed}
        return [a for a in range(_rank(self.node)) if a not in fixed_axes]


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


def _resolve(entry, mp: dict):
    """An entry with every variable replaced through `mp` (var -> entry, possibly chained)."""
    if type(entry) is int:  # the common case, kept fast
        r = mp.get(entry)
        return entry if r is None else _resolve(r, mp)
    if entry is None:
        return None
    res = []
    for c in entry:
        r = mp.get(c)
        res.extend((c,) if r is None else comps(_resolve(r, mp)))
    return make_entry(res)


def _rank(node: fx.Node) -> int:
    val = example_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else 0


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


def _sub_factor(f: Factor, mp: dict) -> Factor:
    idx = tuple([_resolve(e, mp) for e in f.idx])
    inner = tuple(_sub_mono(m, mp) for m in f.inner) if f.inner else ()
    return Factor(f.kind, idx, f.atom, f.node, f.negate, inner, f.lower, f.diagonal)


def _sub_mono(m: Mono, mp: dict) -> Mono:
    return (m[0], tuple(_sub_factor(f, mp) for f in m[1]))


def _sub_av(av: AV, out: tuple, mp: dict) -> AV:
    """`av` with variables substituted and the given output entries."""
    if not mp:
        return AV(out, av.terms, av.keep, av.origin, av.root)
    return AV(
        tuple(_resolve(e, mp) for e in out),
        tuple(_sub_mono(m, mp) for m in av.terms),
        _sub_factor(av.keep, mp) if av.keep is not None else None,
        av.origin,
        _sub_factor(av.root, mp) if av.root is not None else None,
    )


def _merge_exps(m: Mono) -> Mono:
    """exp(a) * exp(b) -> exp(a + b): one exp factor per monomial."""
    exps = [f for f in m[1] if f.kind == "exp"]
    if len(exps) < 2:
        return m
    rest = tuple(f for f in m[1] if f.kind != "exp")
    inner = tuple(itertools.chain.from_iterable(f.inner for f in exps))
    return (m[0], rest + (Factor("exp", inner=inner),))


class Analyzer:
    """Computes (and caches) the abstract value of every tensor node of a graph."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self._keys: dict = {}
        keys = {n: self.key(n) for n in self.nodes}  # hot loops below index it directly
        # every in-place write: (node, the tensors it writes), in graph order
        self.writes = [(n, ts) for n in self.nodes for ts in (written_args(n),) if ts]
        self.consts = ConstAnalysis(graph, dict(self.writes), keys.__getitem__)
        self.sizes: dict[int, Any] = {}
        self._counter = itertools.count()
        self._cache: dict[fx.Node, Optional[AV]] = {}
        self.canon = _value_numbering(self.nodes, self.writes, keys)
        self.memo: dict = {}  # results the recognizers share (the state updates of loop.py)
        self._consumers: dict = {}  # node -> non-view readers, through views (see consumers)
        self.versions = _versions(self.nodes, self.order, self.writes, keys)
        self.readers: dict = {}  # node -> consumers that read it through a tensor it was written into
        for (consumer, _), value in self.versions.items():
            if value is not STALE:
                self.readers.setdefault(value, []).append(consumer)

    def key(self, node: fx.Node):
        """The memory `node`'s value lives in (see consts.storage_key); a tuple of views (split,
        unbind) lives in its parts' memory."""
        k = self._keys.get(node)
        if k is None:
            val = example_value(node)
            if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor) and node.args:
                k = storage_key(node.args[0]) if isinstance(node.args[0], fx.Node) else ("node", node)
            else:
                k = storage_key(node)
            self._keys[node] = k
        return k

    def writes_into(self, node: fx.Node) -> list:
        """The in-place writes into `node`'s memory (through any alias), in graph order."""
        if "writes_by_key" not in self.memo:
            index: dict = {}
            for w, ts in self.writes:
                for k in {self.key(t) for t in ts}:
                    index.setdefault(k, []).append(w)
            self.memo["writes_by_key"] = index
        return self.memo["writes_by_key"].get(self.key(node), [])

    def written_between(self, node: fx.Node, start: int, stop: int) -> list:
        """The in-place writes into `node`'s memory at positions start <= p < stop."""
        return [w for w in self.writes_into(node) if start <= self.order[w] < stop]

    def aliases(self, node: fx.Node) -> list:
        """The nodes whose values live in `node`'s memory (itself included), in graph order."""
        if "nodes_by_key" not in self.memo:
            index: dict = {}
            for n in self.nodes:
                index.setdefault(self.key(n), []).append(n)
            self.memo["nodes_by_key"] = index
        return self.memo["nodes_by_key"].get(self.key(node), [node])

    def read(self, consumer: fx.Node, x):
        """What `consumer` reads for its argument x: x, or the value written into x in place
        before (`cache.copy_(S)` then `cache` reads S); opaque where that is not known."""
        if not isinstance(x, fx.Node):
            return x
        v = self.versions.get((consumer, x), x)
        if v is STALE:
            raise _Opaque
        return v

    def users(self, node: fx.Node) -> list:
        """The nodes that read `node`'s value: its users, and readers through a write-back."""
        return list(node.users) + self.readers.get(node, [])

    # ---- variables -------------------------------------------------------------------
    def fresh(self, size) -> Optional[int]:
        if isinstance(size, int) and size == 1:
            return None
        v = next(self._counter)
        self.sizes[v] = size
        return v

    def instantiate(self, av: AV) -> AV:
        """Alpha-rename every variable, so operands of one product never share vars."""
        mp: dict = {}
        for m in av.terms:
            for v in mono_vars(m):
                mp.setdefault(v, None)
        for v in out_vars(av.out):
            mp.setdefault(v, None)
        for f in (av.keep, av.root):
            if f is not None:
                for v in factor_vars(f):
                    mp.setdefault(v, None)
        for v in list(mp):
            nv = next(self._counter)
            self.sizes[nv] = self.sizes[v]
            mp[v] = nv
        return replace(_sub_av(av, av.out, mp), origin=self.new_origin())

    def new_origin(self) -> frozenset:
        return frozenset((next(self._counter),))

    # ---- entry -----------------------------------------------------------------------
    def value(self, node: Any) -> Optional[AV]:
        if not isinstance(node, fx.Node):
            return None
        if node in self._cache:
            return self._cache[node]
        self._cache[node] = None  # recursion guard
        try:
            av = self._compute(node)
        except _Opaque:
            av = None
        if av is not None and len(av.terms) > MAX_TERMS:
            av = None
        if av is None:
            av = self._pointwise_atom(node) or self.atom_av(node)
        elif op_name(node) not in _VIEW_OPS:
            av = AV(av.out, av.terms, av.keep, av.origin, Factor("atom", av.out, atom=Atom(self.canon.get(node, node))))
        self._cache[node] = av
        return av

    def atom_av(self, node: fx.Node) -> Optional[AV]:
        val = example_value(node)
        if not isinstance(val, torch.Tensor):
            return None
        node = self.canon.get(node, node)
        if self.consts.is_const(node):
            if self.consts.is_zeros(node):
                return AV(tuple(self.fresh(s) for s in val.shape), (), None, self.new_origin())
            out = tuple(self.fresh(s) for s in val.shape)
            return AV(out, ((1.0, (Factor("const", out, node=node),)),), None, self.new_origin())
        out = tuple(self.fresh(s) for s in val.shape)
        return AV(out, ((1.0, (Factor("atom", out, atom=Atom(node)),)),), None, self.new_origin())

    def read_whole(self, node: fx.Node) -> bool:
        """Whether a product reads `node` as one atom (see _cut)."""
        av = self.value(node)
        return av is not None and self._cut(node, av)

    def cut_av(self, node: fx.Node, av: AV) -> Optional[AV]:
        """The value read as one atom: its root through views, else the node itself."""
        if av.root is not None:
            return AV(av.out, ((1.0, (av.root,)),), None, av.origin, av.root)
        return self.atom_av(node)

    def _pointwise_atom(self, node: fx.Node) -> Optional[AV]:
        """An elementwise op (softplus, clamp, exp of a non-linear form, ...) as an atom that
        is read at index 0 along every axis all of its inputs are constant along.

        `softplus(dt.expand(-1, -1, P))` is the same for every p; reading it at p = 0 lets the
        recognizers see that it does not vary over P (a gate over heads, not over values)."""
        if not is_pointwise(node):
            return None
        val = example_value(node)
        if not isinstance(val, torch.Tensor) or self.consts.is_const(node):
            return None
        rank = val.dim()
        varies = [False] * rank
        for x in node.all_input_nodes:
            if self.versions.get((node, x), x) is not x:
                return None
            xv = example_value(x)
            if not isinstance(xv, torch.Tensor):
                continue
            av = self.value(x)
            if av is None or len(av.out) > rank:
                return None
            used = set().union(*[mono_vars(m) for m in av.terms]) if av.terms else set()
            if av.keep is not None:
                used |= factor_vars(av.keep)
            off = rank - len(av.out)
            for p, e in enumerate(av.out):
                varies[off + p] |= bool(set(comps(e)) & used)
        shape = tuple(val.shape)
        fixed = tuple((p, 0) for p in range(rank) if not varies[p] and not (isinstance(shape[p], int) and shape[p] == 1))
        if not fixed:
            return None
        out = tuple(self.fresh(s) for s in shape)
        fixed_axes = {p for p, _ in fixed}
        idx = tuple(out[p] for p in range(rank) if p not in fixed_axes)
        atom = Atom(self.canon.get(node, node), fixed)
        return AV(out, ((1.0, (Factor("atom", idx, atom=atom),)),), None, self.new_origin())

    # ---- dispatch --------------------------------------------------------------------
    def _compute(self, node: fx.Node) -> Optional[AV]:
        if node.op not in ("call_function", "call_method"):
            return None
        if self.consts.is_const(node):
            return None
        name = op_name(node)
        handler = getattr(self, f"_op_{name}", None) if name else None
        if handler is None:
            return None
        val = example_value(node)
        if not isinstance(val, torch.Tensor):
            return None
        # For call_method nodes args[0] is self, so methods and functions read alike.
        args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), lambda x: self.read(node, x))
        av = handler(node, *args, **kwargs)
        if av is not None and len(av.out) != val.dim():
            return None
        return av

    # ---- helpers ---------------------------------------------------------------------
    def _shape(self, x) -> tuple:
        val = example_value(x)
        return tuple(val.shape) if isinstance(val, torch.Tensor) else ()

    def _operand(self, x):
        """(node, AV) of a tensor operand, or (None, scalar) for Python numbers."""
        if isinstance(x, fx.Node):
            av = self.value(x)
            if av is None:
                val = example_value(x)
                if not isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) or isinstance(val, bool):
                    raise _Opaque
                # A number computed in the graph (K ** -0.5 under dynamic shapes).
                av = AV((), ((1.0, (Factor("scalar", node=x),)),), None, self.new_origin())
            return x, av
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return None, float(x)
        raise _Opaque

    def contract(self, operands: list, out_labels: tuple) -> AV:
        """Generalized einsum over abstract values.

        operands: list of (node, AV, labels) with one label per axis; equal labels are the
        same index; labels missing from out_labels are summed."""
        multi = len(operands) > 1
        insts = []
        seen: frozenset = frozenset()
        for node, av, labels in operands:
            if multi and self._cut(node, av):
                av = self.cut_av(node, av)  # see module docstring
                if av is None:
                    raise _Opaque
            elif not multi and av.keep is not None:
                raise _Opaque
            if av.origin & seen or not av.origin:
                av = self.instantiate(av)
            seen |= av.origin
            insts.append((av, labels))
        rep: dict = {}
        mp: dict = {}
        for av, labels in insts:
            for v, lab in zip(av.out, labels):
                if v is None:
                    continue
                if lab in rep:
                    self.unify(rep[lab], v, mp)
                else:
                    rep[lab] = v
        terms = []
        for combo in itertools.product(*[av.terms for av, _ in insts]):
            coef = 1.0
            factors: tuple = ()
            for c, fs in combo:
                coef *= c
                factors += fs
            terms.append(_merge_exps(_sub_mono((coef, factors), mp)))
            if len(terms) > MAX_TERMS:
                raise _Opaque
        out = tuple(_resolve(rep[lab], mp) if lab in rep else None for lab in out_labels)
        kept = out_vars(out)
        for lab, e in rep.items():
            if lab in out_labels:
                continue
            for v in comps(_resolve(e, mp)):
                if v in kept:
                    raise _Opaque  # a summed axis that is also kept (not an einsum)
                for i, m in enumerate(terms):
                    if v not in mono_vars(m):  # summing a broadcast axis multiplies by its size
                        size = self.sizes[v]
                        if not isinstance(size, int):
                            raise _Opaque
                        terms[i] = (m[0] * size, m[1])
        return AV(out, tuple(terms), None, seen)

    def unify(self, x, y, mp: dict) -> None:
        """Make entries x and y (of one axis, as two operands index it) the same, recording
        substitutions in `mp`. A plain variable against a merged axis is split into parts."""
        x, y = _resolve(x, mp), _resolve(y, mp)
        if x == y:
            return
        cx, cy = list(comps(x)), list(comps(y))
        if len(cx) == 1 and len(cy) == 1:
            mp[cy[0]] = cx[0]
            return
        while cx and cy:
            a, b = cx[0], cy[0]
            sa, sb = self.sizes[a], self.sizes[b]
            if not (isinstance(sa, int) and isinstance(sb, int)):
                raise _Opaque
            if sa == sb:
                mp[b] = a
                cx.pop(0)
                cy.pop(0)
            elif sa > sb and sa % sb == 0:
                a1, a2 = self.fresh(sb), self.fresh(sa // sb)
                mp[a] = (a1, a2)
                mp[b] = a1
                cx[0] = a2
                cy.pop(0)
            elif sb > sa and sb % sa == 0:
                b1, b2 = self.fresh(sa), self.fresh(sb // sa)
                mp[b] = (b1, b2)
                mp[b1] = a
                cy[0] = b2
                cx.pop(0)
            else:
                raise _Opaque
        if cx or cy:
            raise _Opaque

    def _cut(self, node: fx.Node, av: AV) -> bool:
        """Whether a product operand is read as an opaque atom rather than expanded.

        Sums are cut (several monomials, or a sum in the source even where a zero term
        vanished: ``S_1 = 0 * d + k v`` is a state), and so are products of data that are
        used more than once (``S = k0 v0`` before a loop is read by two consumers)."""
        if len(av.terms) > 1 or av.keep is not None:
            return True
        root = av.root.atom.node if av.root is not None else node
        if op_name(node) in ("add", "sub", "rsub") or op_name(root) in ("add", "sub", "rsub"):
            return True
        # consumers counted through views: `kv = bmm(k, v).view(..)` read by a reshape for the
        # query and by the next update is used twice, though each node has one user
        if max(len(node.users), self.consumers(root)) > 1 and av.terms:
            atoms = sum(1 for f in av.terms[0][1] if f.kind == "atom")
            return atoms >= 2
        return False

    def consumers(self, node: fx.Node) -> int:
        """How many nodes that are not views read `node`, directly or through views of it."""
        count = self._consumers.get(node)
        if count is None:
            count = sum(self.consumers(u) if op_name(u) in _VIEW_OPS else 1 for u in node.users)
            self._consumers[node] = count
        return count

    def _binary_labels(self, a_rank: int, b_rank: int):
        n = max(a_rank, b_rank)
        labels = tuple(range(n))
        return labels[n - a_rank :], labels[n - b_rank :], labels

    def _scaled(self, av: AV, c: float) -> AV:
        if c == 0.0:
            return AV(av.out, (), None, av.origin)
        return AV(av.out, tuple((m[0] * c, m[1]) for m in av.terms), av.keep, av.origin)

    # ---- arithmetic ------------------------------------------------------------------
    def _op_mul(self, node, a, b, **kw):
        (na, va), (nb, vb) = self._operand(a), self._operand(b)
        if na is None and nb is None:
            return None
        if na is None:
            return self._scaled(vb, va)
        if nb is None:
            return self._scaled(va, vb)
        la, lb, lo = self._binary_labels(len(va.out), len(vb.out))
        return self.contract([(na, va, la), (nb, vb, lb)], lo)

    def _op_div(self, node, a, b, rounding_mode=None, **kw):
        (na, va), (nb, vb) = self._operand(a), self._operand(b)
        if rounding_mode is not None or nb is not None or na is None or vb == 0:
            return None
        return self._scaled(va, 1.0 / vb)

    def _op_neg(self, node, a, **kw):
        return self._scaled(self._operand(a)[1], -1.0)

    def _op_add(self, node, a, b, alpha=1, **kw):
        return self._sum(node, a, b, float(alpha))

    def _op_sub(self, node, a, b, alpha=1, **kw):
        return self._sum(node, a, b, -float(alpha))

    def _op_rsub(self, node, a, b, alpha=1, **kw):
        return self._sum(node, b, a, -float(alpha))

    def _sum(self, node, a, b, cb: float) -> Optional[AV]:
        shape = self._shape(node)
        parts = []
        for x, c in ((a, 1.0), (b, cb)):
            nx, vx = self._operand(x)
            if nx is None:
                parts.append(AV((), ((vx * c, ()),)))
                continue
            if vx.keep is not None:
                raise _Opaque
            if self._cut(nx, vx):
                vx = self.cut_av(nx, vx)  # S_t = S_{t-1} + k v keeps S_{t-1} whole
            parts.append(self._scaled(vx, c))
        # Align both sides to the output shape (right-aligned broadcasting).
        rank = len(shape)
        outs: list = [None] * rank
        terms: list = []
        mp: dict = {}
        seen: frozenset = frozenset()
        for vx in parts:
            if vx.origin & seen or not vx.origin:
                vx = self.instantiate(vx)
            seen |= vx.origin
            off = rank - len(vx.out)
            for p, v in enumerate(vx.out):
                if v is None:
                    continue
                if outs[off + p] is None:
                    outs[off + p] = v
                else:
                    self.unify(outs[off + p], v, mp)
            terms += vx.terms
        terms = [_sub_mono(m, mp) for m in terms]
        outs = [_resolve(e, mp) for e in outs]
        for p, s in enumerate(shape):
            if outs[p] is None and not (isinstance(s, int) and s == 1):
                outs[p] = self.fresh(s)  # a broadcast axis no term depends on
        return AV(tuple(outs), tuple(terms), None, seen)

    def _op_exp(self, node, a, **kw):
        _, va = self._operand(a)
        return self._exp(va, 1.0)

    def _op_exp2(self, node, a, **kw):
        _, va = self._operand(a)
        return self._exp(va, math.log(2.0))

    def _op_pow(self, node, a, b, **kw):
        # c ** x == exp(x * log c) for a positive Python number c.
        if isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0:
            _, vb = self._operand(b)
            return self._exp(vb, math.log(a))
        return None

    def _exp(self, va: AV, c: float) -> Optional[AV]:
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
    def _op_sum(self, node, a, dim=None, keepdim=False, dtype=None, **kw):
        na, va = self._operand(a)
        rank = len(va.out)
        if dim is None:
            dims = set(range(rank))
        else:
            dims = {d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
        labels = tuple(range(rank))
        res = self.contract([(na, va, labels)], tuple(i for i in labels if i not in dims))
        if keepdim:
            out = list(res.out)
            for i in sorted(dims):
                out.insert(i, None)
            res = AV(tuple(out), res.terms, None, res.origin)
        return res

    def _op_matmul(self, node, a, b, **kw):
        (na, va), (nb, vb) = self._operand(a), self._operand(b)
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
        return self.contract([(na, va, la), (nb, vb, lb)], lo)

    _op_bmm = _op_matmul
    _op_mm = _op_matmul

    def _op_einsum(self, node, equation, *operands, **kw):
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        if not isinstance(equation, str):
            return None
        eq = equation.replace(" ", "")
        lhs, _, rhs = eq.partition("->")
        specs = lhs.split(",")
        if len(specs) != len(operands):
            return None
        ops = [self._operand(x) for x in operands]
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
        return self.contract(operands_l, out)

    # ---- views -----------------------------------------------------------------------
    def _relabel(self, av: AV, out: tuple) -> AV:
        return AV(out, av.terms, av.keep, av.origin, av.root)

    def _op_identity(self, node, a, *args, **kw):
        na, va = self._operand(a)
        if na is None or self._shape(node) != self._shape(a):
            return None
        return va

    def _op_unsqueeze(self, node, a, dim, **kw):
        _, va = self._operand(a)
        out = list(va.out)
        d = dim % (len(out) + 1)
        out.insert(d, None)
        return self._relabel(va, tuple(out))

    def _op_squeeze(self, node, a, dim=None, **kw):
        _, va = self._operand(a)
        shape = self._shape(a)
        if dim is None:
            dims = [i for i, s in enumerate(shape) if isinstance(s, int) and s == 1]
        else:
            dims = [d % max(len(shape), 1) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        out = [v for i, v in enumerate(va.out) if not (i in dims and va.out[i] is None)]
        return self._relabel(va, tuple(out))

    def _op_permute(self, node, a, *dims, **kw):
        _, va = self._operand(a)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = tuple(dims[0])
        dims = kw.get("dims", dims)
        rank = len(va.out)
        return self._relabel(va, tuple(va.out[d % rank] for d in dims))

    def _op_transpose(self, node, a, d0, d1, **kw):
        _, va = self._operand(a)
        out = list(va.out)
        rank = len(out)
        d0, d1 = d0 % rank, d1 % rank
        out[d0], out[d1] = out[d1], out[d0]
        return self._relabel(va, tuple(out))

    def _op_getattr(self, node, a, attr, *default):
        """x.mT (x.mH of a real tensor): the last two axes swapped; x.T: all axes reversed."""
        _, va = self._operand(a)
        if attr == "mT" or attr == "mH" and not example_value(node).is_complex():
            return self._op_transpose(node, a, -2, -1) if len(va.out) >= 2 else None
        if attr == "T":
            return self._relabel(va, tuple(reversed(va.out)))
        return None

    def _op_t(self, node, a, **kw):
        _, va = self._operand(a)
        return self._relabel(va, tuple(reversed(va.out))) if len(va.out) <= 2 else None

    def _op_reshape(self, node, a, *shape, **kw):
        """Any reshape: the row-major sequence of index variables is regrouped by the new
        sizes; a variable that a new axis boundary cuts through is split in two."""
        if any(isinstance(x, torch.dtype) for x in shape):
            return None  # x.view(dtype) reinterprets bits
        _, va = self._operand(a)
        src, dst = self._shape(a), self._shape(node)
        if len(src) != len(va.out):
            return None
        pending = [c for e in va.out for c in comps(e)]
        mp: dict = {}
        out = []
        for d in dst:
            if isinstance(d, int) and d == 1:
                out.append(None)
                continue
            group = self._take(pending, d, mp)
            if group is None:
                return None
            out.append(make_entry(group))
        if pending:
            return None
        return _sub_av(va, tuple(out), mp)

    def _take(self, pending: list, d, mp: dict) -> Optional[list]:
        """Pop the leading variables of `pending` whose sizes multiply to d."""
        if not pending:
            return None
        s = self.sizes[pending[0]]
        if not (isinstance(s, int) and isinstance(d, int)):
            return [pending.pop(0)] if (s is d or s == d) else None
        group, prod = [], 1
        while pending:
            c = pending[0]
            s = self.sizes[c]
            if not isinstance(s, int):
                return None
            if prod * s <= d and d % (prod * s) == 0:
                group.append(pending.pop(0))
                prod *= s
            elif (d // prod) > 1 and d % prod == 0 and s % (d // prod) == 0:
                c1, c2 = self.fresh(d // prod), self.fresh(s // (d // prod))
                mp[c] = (c1, c2)
                group.append(c1)
                pending[0] = c2
                prod = d
            else:
                return None
            if prod == d:
                return group
        return None

    def _op_repeat_interleave(self, node, a, repeats=None, dim=None, output_size=None, **kw):
        """x.repeat_interleave(r, dim): out[.., i * r + j, ..] = x[.., i, ..], a merged axis."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or dim is None:
            return None
        _, va = self._operand(a)
        d = dim % len(va.out)
        out = list(va.out)
        out[d] = make_entry(comps(out[d]) + comps(self.fresh(repeats)))
        return self._relabel(va, tuple(out))

    def _op_repeat(self, node, a, *sizes, **kw):
        """x.repeat(r, ...) tiles: out[.., j * n + i, ..] = x[.., i, ..]."""
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = tuple(sizes[0])
        if not all(isinstance(r, int) for r in sizes):
            return None
        _, va = self._operand(a)
        off = len(sizes) - len(va.out)
        if off < 0:
            return None
        out = []
        for p, r in enumerate(sizes):
            e = va.out[p - off] if p >= off else None
            out.append(make_entry(comps(self.fresh(r)) + comps(e)))
        return self._relabel(va, tuple(out))

    def _op_expand(self, node, a, *sizes, **kw):
        _, va = self._operand(a)
        dst = self._shape(node)
        off = len(dst) - len(va.out)
        out = []
        for p, s in enumerate(dst):
            v = va.out[p - off] if p >= off else None
            if v is None and not (isinstance(s, int) and s == 1):
                v = self.fresh(s)
            out.append(v)
        return self._relabel(va, tuple(out))

    # ---- indexing --------------------------------------------------------------------
    def _select(self, av: AV, pos: int, index: int, size) -> Optional[AV]:
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
                f = _fix(f, v, index)
                if f is None:
                    return None
                new_fs.append(f)
            terms.append((coef, tuple(new_fs)))
        if av.keep is not None and v in factor_vars(av.keep):
            return None
        root = _fix(av.root, v, index) if av.root is not None else None
        return AV(out, tuple(terms), av.keep, av.origin, root)

    def _op_getitem(self, node, a, index, **kw):
        if isinstance(a, fx.Node) and op_name(a) == "unbind":
            src = self.read(a, a.args[0])
            dim = a.args[1] if len(a.args) > 1 else a.kwargs.get("dim", 0)
            _, va = self._operand(src)
            return self._select(va, dim % len(va.out), index, self._shape(src)[dim])
        _, va = self._operand(a)
        if not isinstance(index, tuple):
            index = (index,)
        shape = self._shape(a)
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
                sl = _unit_slice(i, size)
                if sl == "full":
                    out_pos += 1
                elif sl is not None:
                    cur = self._select(cur, out_pos, sl, size)
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
                cur = self._select(cur, out_pos, i, shape[src_pos])
                if cur is None:
                    return None
                src_pos += 1
            else:
                return None
        return cur

    def _op_select(self, node, a, dim, index, **kw):
        _, va = self._operand(a)
        if not isinstance(index, int):
            return None
        return self._select(va, dim % len(va.out), index, self._shape(a)[dim % len(va.out)])

    def _op_narrow(self, node, a, dim, start, length, **kw):
        if length != 1 or not isinstance(start, int):
            return None
        _, va = self._operand(a)
        d = dim % len(va.out)
        cur = self._select(va, d, start, self._shape(a)[d])
        if cur is None:
            return None
        out = list(cur.out)
        out.insert(d, None)
        return replace(cur, out=tuple(out))

    # ---- masks -----------------------------------------------------------------------
    def _mask_factor(self, mask, target_out: tuple, negate: bool) -> Optional[Factor]:
        if not isinstance(mask, fx.Node) or not self.consts.is_const(mask):
            return None
        mshape = self._shape(mask)
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
        return Factor("const", tuple(idx), node=self.canon.get(mask, mask), negate=negate)

    def _masked(self, node, x, mask, value, negate_mask: bool) -> Optional[AV]:
        nx, vx = self._operand(x)
        if nx is None or vx.keep is not None:
            return None
        keep = self._mask_factor(mask, vx.out, negate=negate_mask)
        if keep is None:
            return None
        if value == 0:
            return AV(vx.out, tuple((c, fs + (keep,)) for c, fs in vx.terms), None, vx.origin)
        if value == float("-inf"):
            return AV(vx.out, vx.terms, keep, vx.origin)
        return None

    def _op_masked_fill(self, node, x, mask, value, **kw):
        if isinstance(value, fx.Node) or isinstance(value, bool):
            return None
        return self._masked(node, x, mask, float(value), negate_mask=True)

    def _op_where(self, node, cond, x, other=None, **kw):
        if other is None:
            return None
        if isinstance(other, (int, float)) and isinstance(x, fx.Node):
            return self._masked(node, x, cond, float(other), negate_mask=False)
        if isinstance(x, (int, float)) and isinstance(other, fx.Node):
            return self._masked(node, other, cond, float(x), negate_mask=True)
        return None

    def _op_tril(self, node, a, diagonal=0, **kw):
        return self._tri(a, True, diagonal)

    def _op_triu(self, node, a, diagonal=0, **kw):
        return self._tri(a, False, diagonal)

    def _tri(self, a, lower: bool, diagonal: int) -> Optional[AV]:
        na, va = self._operand(a)
        if len(va.out) < 2 or None in va.out[-2:] or va.keep is not None:
            return None
        f = Factor("tri", va.out[-2:], lower=lower, diagonal=diagonal)
        return AV(va.out, tuple((c, fs + (f,)) for c, fs in va.terms), None, va.origin)


class _Opaque(Exception):
    """The node is not expressible; it becomes an atom for its consumers."""


def _fix(f: Factor, v: int, index: int) -> Optional[Factor]:
    """Factor f with variable v fixed to `index` (f unchanged when it does not use v).
    exp(sum_m c_m m)[v = i] is exp(sum_m c_m m[v = i]): a decay computed before a loop
    (`d = g.exp()`) and read one step at a time (`d[:, t]`)."""
    if v not in factor_vars(f):
        return f
    if f.kind == "exp":
        inner = []
        for c, fs in f.inner:
            fixed = [_fix(g, v, index) for g in fs]
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


def _unit_slice(s: slice, size):
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


_FUNCTIONS = {
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    torch.true_divide: "div", operator.add: "add", torch.add: "add", operator.sub: "sub",
    torch.sub: "sub", torch.rsub: "rsub", operator.neg: "neg", torch.neg: "neg",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm", torch.mm: "mm",
    torch.einsum: "einsum", torch.exp: "exp", torch.exp2: "exp2", operator.pow: "pow",
    torch.pow: "pow", torch.sum: "sum", torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze",
    torch.permute: "permute", torch.transpose: "transpose", torch.swapaxes: "transpose",
    torch.reshape: "reshape", torch.t: "t", torch.masked_fill: "masked_fill",
    torch.where: "where", torch.tril: "tril", torch.triu: "triu", operator.getitem: "getitem",
    torch.select: "select", torch.narrow: "narrow", torch.unbind: "unbind",
    torch.clone: "identity", torch.broadcast_to: "expand", torch.flatten: "reshape",
    torch.unflatten: "reshape", torch.repeat_interleave: "repeat_interleave", getattr: "getattr",
}
_METHODS = {
    "mul": "mul", "__mul__": "mul", "__rmul__": "mul", "div": "div", "__truediv__": "div",
    "add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub",
    "neg": "neg", "__neg__": "neg", "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm",
    "mm": "mm", "exp": "exp", "exp2": "exp2", "sum": "sum", "unsqueeze": "unsqueeze",
    "squeeze": "squeeze", "permute": "permute", "transpose": "transpose",
    "swapaxes": "transpose", "view": "reshape", "reshape": "reshape", "t": "t",
    "expand": "expand", "expand_as": "expand", "contiguous": "identity", "clone": "identity",
    "float": "identity", "double": "identity", "half": "identity", "bfloat16": "identity",
    "to": "identity", "type_as": "identity", "type": "identity", "masked_fill": "masked_fill",
    "tril": "tril", "triu": "triu", "select": "select", "narrow": "narrow", "unbind": "unbind",
    "view_as": "reshape", "reshape_as": "reshape", "__getitem__": "getitem",
    "flatten": "reshape", "unflatten": "reshape", "repeat_interleave": "repeat_interleave",
    "repeat": "repeat",
}

# Ops whose value is their operand's, re-indexed: their abstract value keeps the operand's root.
_VIEW_OPS = {
    "identity", "unsqueeze", "squeeze", "permute", "transpose", "t", "reshape", "expand",
    "getitem", "select", "narrow", "repeat_interleave", "repeat", "getattr",
}


def _pointwise_targets() -> tuple:
    """Elementwise ops (with broadcasting): functions by object, methods by name."""
    import torch.nn.functional as F

    names = (
        "softplus", "sigmoid", "silu", "tanh", "relu", "gelu", "logsigmoid", "log_sigmoid", "log",
        "log1p", "exp", "expm1", "sqrt", "rsqrt", "abs", "clamp", "clamp_min", "clamp_max",
        "square", "reciprocal", "mul", "add", "sub", "div", "true_divide", "neg", "pow", "where",
        "exp2", "elu", "softsign", "erf", "sin", "cos", "minimum", "maximum",
    )
    fns = set()
    for mod in (torch, F, torch._C._nn, torch.special):
        for n in names:
            f = getattr(mod, n, None)
            if callable(f):
                fns.add(f)
    fns |= {operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow}
    methods = set(names) | {"__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
                            "__truediv__", "__rtruediv__", "__neg__", "__pow__", "__rpow__"}
    return fns, methods


_POINTWISE_FNS, _POINTWISE_METHODS = _pointwise_targets()


def is_pointwise(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _POINTWISE_METHODS
    if node.op == "call_function":
        try:
            return node.target in _POINTWISE_FNS
        except TypeError:
            return False
    return False


def op_name(node: fx.Node) -> Optional[str]:
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:
            return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


class _Stale:
    """Marks a read of memory that was written in place with a value not known here."""


STALE = _Stale()


def storage_root(node: fx.Node) -> fx.Node:
    """The tensor whose memory `node` may alias: through views, casts (conservatively) and
    in-place ops, which return their first argument."""
    while (op_name(node) in _VIEW_OPS or is_inplace(node)) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _versions(nodes: list, order: dict, writes: list, keys: dict) -> dict:
    """(consumer, input) -> what the consumer reads, for each input whose memory (through any
    alias) was written in place after the input was computed: the written value for a whole
    write of that very tensor (`x.copy_(y)`, `x[:] = y`, same shape; y as the write read it),
    else STALE. The algebra reads node values, so without this a read after a write would see
    the value before it."""
    if not writes:
        return {}
    targets = dict(writes)
    first = order[writes[0][0]]
    written: dict = {}  # storage -> (position of the last write, value or STALE, the tensor written)
    res: dict = {}
    for i, n in enumerate(nodes[first:], first):
        if written:
            for a in n.all_input_nodes:
                w = written.get(keys[a])
                if w is not None and w[0] > order[a]:
                    res[(n, a)] = w[1] if w[2] is a else STALE
        for target in targets.get(n, ()):
            value = _whole_write(n, target)
            if value is not None:
                value = res.get((n, value), value)  # y itself may have been written before the copy
            written[keys[target]] = (i, STALE if value is None else value, target)
    return res


def _whole_write(n: fx.Node, target: fx.Node) -> Optional[fx.Node]:
    """y for `x.copy_(y)` / `x[:] = y` into target x (y of x's shape), else None."""
    if n.op == "call_method" and n.target == "copy_" and len(n.args) >= 2:
        x, value = n.args[0], n.args[1]
    elif n.op == "call_function" and n.target is operator.setitem:
        x, index, value = n.args
        whole = (slice(None), Ellipsis)
        if not (index in whole or isinstance(index, tuple) and all(i in whole for i in index)):
            return None
    else:
        return None
    tv, vv = example_value(x), example_value(value) if isinstance(value, fx.Node) else None
    if x is not target or not isinstance(vv, torch.Tensor) or tuple(vv.shape) != tuple(tv.shape):
        return None
    return value


def _value_numbering(nodes: list, writes: list, keys: dict) -> dict:
    """Map each pure node to the first node that computes the same thing.

    Dynamo does not CSE, so a loop that recomputes `-A_log.exp()` every step holds T
    equal nodes; atoms compare by their canonical node. Nodes that hold or read memory that
    is written in place anywhere (through any alias) are left alone: their value depends on
    program order."""
    mutated = {keys[t] for _, ts in writes for t in ts}
    # the writes, and every node that holds written memory
    unstable = {w for w, _ in writes} | {n for n in nodes if keys[n] in mutated} if mutated else set()
    canon: dict = {}
    seen: dict = {}
    for n in nodes:
        if n.op not in ("call_function", "call_method") or n.target is operator.getitem:
            continue  # index tuples are costly to hash and Dynamo never repeats them
        if _random(n):
            continue  # two draws with the same arguments differ
        if unstable and (n in unstable or any(a in unstable for a in n.all_input_nodes)):
            continue
        try:
            k = (n.op, n.target, freeze(n.args, canon), freeze(n.kwargs, canon))
            hash(k)
        except TypeError:
            continue
        if k in seen:
            canon[n] = seen[k]
        else:
            seen[k] = n
    return canon


# Sampling ops: equal arguments, different values (a per-step dropout is not one value).
_RANDOM_NAMES = {
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d",
    "alpha_dropout", "feature_alpha_dropout", "feature_dropout", "rrelu", "gumbel_softmax",
}


def _random(n: fx.Node) -> bool:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name in _RANDOM_NAMES
