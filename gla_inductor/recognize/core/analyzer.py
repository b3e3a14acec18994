"""The analysis of one graph: the normal form (``algebra.py``) of every tensor node, and the
facts about memory the recognizers share (in-place writes, aliases, what each read sees).

Broadcast-multiply-sum, ``matmul``, ``bmm``, ``einsum``, scalar scales, casts, views,
permutes and keepdim slices all canonicalize to the same normal form (``rules.py``), so the
recognizers match semantics, not spellings. Reading each node costs time proportional to its
own expression (bounded by ``MAX_TERMS``), so the whole analysis is linear in graph size.

A sum of several monomials that is multiplied with something else is *cut*: the consumer
sees it as an opaque atom. That keeps expressions small and is exactly what recurrences
need: ``S_t = S_{t-1} * d_t + k_t v_t`` is read with ``S_{t-1}`` as an atom.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx

from .algebra import (
    AV, MAX_TERMS, Atom, Factor, Opaque, comps, factor_vars, merge_exps, mono_vars, out_vars, resolve,
    sub_av, sub_mono,
)
from .consts import ConstAnalysis, example_value, storage_key, written_args
from .op_names import VIEW_OPS, is_pointwise, op_name
from .rules import RULES
from .versions import STALE, read_versions, value_numbering


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
        self.canon = value_numbering(self.nodes, self.writes, keys)
        self.memo: dict = {}  # results the recognizers share (the state updates of forms/steps.py)
        self._consumers: dict = {}  # node -> non-view readers, through views (see consumers)
        self.versions = read_versions(self.nodes, self.order, self.writes, keys)
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
            raise Opaque
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
        return replace(sub_av(av, av.out, mp), origin=self.new_origin())

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
        except Opaque:
            av = None
        if av is not None and len(av.terms) > MAX_TERMS:
            av = None
        if av is None:
            av = self._pointwise_atom(node) or self.atom_av(node)
        elif op_name(node) not in VIEW_OPS:
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
        """Whether a product reads `node` as one atom (see cuts)."""
        av = self.value(node)
        return av is not None and self.cuts(node, av)

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
        rule = RULES.get(name) if name else None
        if rule is None:
            return None
        val = example_value(node)
        if not isinstance(val, torch.Tensor):
            return None
        # For call_method nodes args[0] is self, so methods and functions read alike.
        args, kwargs = fx.node.map_arg((node.args, dict(node.kwargs)), lambda x: self.read(node, x))
        av = rule(self, node, *args, **kwargs)
        if av is not None and len(av.out) != val.dim():
            return None
        return av

    # ---- helpers for the rules -------------------------------------------------------
    def operand(self, x):
        """(node, AV) of a tensor operand, or (None, scalar) for Python numbers."""
        if isinstance(x, fx.Node):
            av = self.value(x)
            if av is None:
                val = example_value(x)
                if not isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) or isinstance(val, bool):
                    raise Opaque
                if _concrete(val):  # a size Dynamo specialized: the same number in every step
                    return None, float(val)
                # A number computed in the graph (K ** -0.5 under dynamic shapes).
                av = AV((), ((1.0, (Factor("scalar", node=x),)),), None, self.new_origin())
            return x, av
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return None, float(x)
        raise Opaque

    def contract(self, operands: list, out_labels: tuple) -> AV:
        """Generalized einsum over abstract values.

        operands: list of (node, AV, labels) with one label per axis; equal labels are the
        same index; labels missing from out_labels are summed."""
        multi = len(operands) > 1
        insts = []
        seen: frozenset = frozenset()
        for node, av, labels in operands:
            if multi and self.cuts(node, av):
                av = self.cut_av(node, av)  # see module docstring
                if av is None:
                    raise Opaque
            elif not multi and av.keep is not None:
                raise Opaque
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
            terms.append(merge_exps(sub_mono((coef, factors), mp)))
            if len(terms) > MAX_TERMS:
                raise Opaque
        out = tuple(resolve(rep[lab], mp) if lab in rep else None for lab in out_labels)
        kept = out_vars(out)
        for lab, e in rep.items():
            if lab in out_labels:
                continue
            for v in comps(resolve(e, mp)):
                if v in kept:
                    raise Opaque  # a summed axis that is also kept (not an einsum)
                for i, m in enumerate(terms):
                    if v not in mono_vars(m):  # summing a broadcast axis multiplies by its size
                        size = self.sizes[v]
                        if not isinstance(size, int):
                            raise Opaque
                        terms[i] = (m[0] * size, m[1])
        return AV(out, tuple(terms), None, seen)

    def unify(self, x, y, mp: dict) -> None:
        """Make entries x and y (of one axis, as two operands index it) the same, recording
        substitutions in `mp`. A plain variable against a merged axis is split into parts."""
        x, y = resolve(x, mp), resolve(y, mp)
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
                raise Opaque
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
                raise Opaque
        if cx or cy:
            raise Opaque

    def cuts(self, node: fx.Node, av: AV) -> bool:
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
            count = sum(self.consumers(u) if op_name(u) in VIEW_OPS else 1 for u in node.users)
            self._consumers[node] = count
        return count


def _concrete(val) -> bool:
    """A number, or a symbolic one whose expression is a constant (K ** -0.5 where Dynamo
    specialized K: each step computes its own node of the same value)."""
    if isinstance(val, (int, float)):
        return True
    from torch.fx.experimental.symbolic_shapes import is_concrete_float, is_concrete_int

    return is_concrete_int(val) if isinstance(val, torch.SymInt) else is_concrete_float(val)
