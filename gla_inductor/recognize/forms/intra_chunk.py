"""The intra-chunk monomial: what marks a computation as chunked GLA.

The output of a chunked computation (Mamba2's SSD scan, a chunk loop) has one monomial

    q[c, i] k[c, j] v[c, j] * decay(c, i, j)

over a chunk of positions c: three atoms, whose time axes are the chunk index c and a position
within it merged (the reshape into chunks split the time variable), under a decay or mask. They
are q, k, v; ``Roles`` names their index variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..core.algebra import AV, Factor, comps, factor_vars, mono_vars, out_vars
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.match import Reject
from ..core.op_names import VIEW_OPS, op_name
from .symbolic_chunks import check_static


@dataclass
class Roles:
    q: Factor
    k: Factor
    v: Factor
    i: int  # position of the query within its chunk
    j: int  # position of the key
    c: Optional[int]  # the chunk (None when there is one)
    kk: Optional[int]  # None: K has size 1
    vv: Optional[int]  # None: V has size 1
    batch: list

    def time(self, pos: int) -> tuple:
        """The variables of a time axis at chunk position `pos`."""
        return (pos,) if self.c is None else (self.c, pos)


# Ops that relate positions within a chunk: masks, segment sums, decay tables from positions.
_POSITION_OPS = {"tril", "triu", "tril_", "triu_", "cumsum", "masked_fill", "masked_fill_", "where", "arange",
                 "lt", "le", "gt", "ge", "logcumsumexp", "tril_indices", "triu_indices"}


def may_hold_chunks(graph: fx.Graph) -> bool:
    """A cheap precondition: the intra-chunk term decays or masks pairs of positions, so the graph
    builds such a relation (a mask, a cumulative sum, positions from arange) or reads a table of it
    ([..., C, C] input or attribute). Graphs without one (a time loop unrolled by Dynamo) skip the
    normal form of every node that finding the intra-chunk monomials takes."""
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            val = example_value(n)
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and _square(val.shape[-2], val.shape[-1]):
                return True
        elif n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            if name in _POSITION_OPS:
                return True
    return False


def _square(rows, cols) -> bool:
    """rows == cols >= 2 where that holds for every value of symbolic sizes: no guard is added,
    so a graph is not recompiled when some other size happens to equal the time axis."""
    return statically_known_true(rows == cols) and statically_known_true(cols >= 2)


def seeds(an: Analyzer) -> dict:
    """node -> (term, roles) for values with an intra-chunk monomial, the last of a chain of
    views (a chunk loop's first chunk, read from a zero state, has no other term)."""
    found = {}
    for n in an.graph.nodes:
        av = an.value(n)
        if av is None or av.keep is not None or op_name(n) in ("getitem", "select"):
            continue
        for term in av.terms:
            roles = _roles(an, av, term)
            if roles is not None:
                found[n] = (term, roles)
                break
    return {n: x for n, x in found.items() if not any(u in found and op_name(u) in VIEW_OPS for u in n.users)}


def _roles(an: Analyzer, av: AV, term) -> Optional[Roles]:
    coef, fs = term
    # a decay table held in module state (a buffer computed once from per-head slopes), or a
    # power gamma ** n of a tensor to constant exponents, is a factor of the decay like a mask,
    # not a fourth input (the certificate reads gamma as the gate)
    atoms = [f for f in fs if f.kind == "atom" and not an.consts.is_static(f.atom.node)
             and not power_decay(an, f.atom.node)]
    data = {id(f) for f in atoms}
    decays = [f for f in fs if id(f) not in data and f.kind in ("exp", "const", "tri", "atom")]
    if len(atoms) != 3 or not decays:
        return None  # three inputs under a decay or mask
    ov = out_vars(av.out)
    summed = mono_vars(term) - ov
    other_vars = set().union(*[factor_vars(f) for f in fs if id(f) not in data])

    def holders(x):
        return [f for f in atoms if x in factor_vars(f)]

    vvs = [x for x in ov if len(holders(x)) == 1 and x not in other_vars and factor_vars(holders(x)[0]) & summed]
    qkv = _qkv_by_value(atoms, vvs, summed, holders) if vvs else _qkv_by_query(atoms, ov, summed)
    if qkv is None:
        return None
    q, k, v, j, kk, vv = qkv
    i_s = [x for x in ov if x in factor_vars(q) and x not in factor_vars(k) | factor_vars(v)]
    if len(i_s) != 1:
        return None
    i = i_s[0]
    if vv is None and not {i, j} <= other_vars:
        return None  # read by q's own axis alone, i and j must be the positions the decay relates
    c = _chunk_var(q, i)  # None: a single chunk (its axis has size 1)
    if _chunk_var(k, j) != c or _chunk_var(v, j) != c or c is None and (i not in q.idx or j not in k.idx):
        return None
    batch = [x for e in av.out for x in comps(e) if x not in (i, vv, c)]
    if len(batch) > 2:
        return None
    return Roles(q, k, v, i, j, c, kk, vv, batch)


def _qkv_by_value(atoms: list, vvs: list, summed: set, holders) -> Optional[tuple]:
    """(q, k, v, j, kk, vv) given the value axis vv, the one output axis only v has; kk None
    for K of size 1 (nothing but the key time is summed)."""
    if len(vvs) != 1:
        return None
    vv, v = vvs[0], holders(vvs[0])[0]
    js = factor_vars(v) & summed
    kks = summed - js
    if len(js) != 1 or len(kks) > 1:
        return None
    j, kk = next(iter(js)), next(iter(kks), None)
    ks = [f for f in atoms if f is not v and j in factor_vars(f) and (kk is None or kk in factor_vars(f))]
    qs = [f for f in atoms if f is not v and j not in factor_vars(f) and (kk is None or kk in factor_vars(f))]
    if len(ks) != 1 or len(qs) != 1:
        return None
    return qs[0], ks[0], v, j, kk, vv


def _qkv_by_query(atoms: list, ov: set, summed: set) -> Optional[tuple]:
    """(q, k, v, j, kk, None) where no output axis is v's alone: V of size 1. q is the input
    with an output axis no other has (the query position); k and v share the summed key time,
    and k the key axis. With K of size 1 too, k and v are alike (sum_j q_i k_j v_j D_ij is
    symmetric in them, and so is the final state): the first is taken for k."""
    def private(f):
        return (factor_vars(f) & ov) - set().union(*(factor_vars(g) for g in atoms if g is not f))

    qs = [f for f in atoms if private(f)]
    if len(qs) != 1:
        return None
    q = qs[0]
    rest = [f for f in atoms if f is not q]
    js = summed & factor_vars(rest[0]) & factor_vars(rest[1])
    kks = summed - js
    if len(js) != 1 or len(kks) > 1:
        return None
    j, kk = next(iter(js)), next(iter(kks), None)
    if kk is not None:
        if kk not in factor_vars(q) or sum(kk in factor_vars(f) for f in rest) != 1:
            return None
        rest.sort(key=lambda f: kk not in factor_vars(f))
    return q, rest[0], rest[1], j, kk, None


def power_decay(an: Analyzer, n: fx.Node) -> bool:
    """n is gamma ** e: a tensor raised to constant exponents (positions, distances), the decay
    written as a power of a per-head tensor rather than as exp (opaque to the normal form)."""
    while op_name(n) in VIEW_OPS and n.all_input_nodes:
        n = n.all_input_nodes[0]
    if op_name(n) != "pow" or len(n.args) < 2 or not isinstance(n.args[0], fx.Node):
        return False
    e = n.args[1]
    return an.consts.is_const(e) if isinstance(e, fx.Node) else isinstance(e, (int, float))


def _chunk_var(f: Factor, pos: int) -> Optional[int]:
    """c where f's time axis is the merged (c, pos): chunk c, position pos within it."""
    for e in f.idx:
        cs = comps(e)
        if len(cs) == 2 and cs[1] == pos:
            return cs[0]
    return None


def batch_letters(r: Roles) -> list:
    """The role letters of the batch variables, in the order to try them. One batch variable
    (the other axis of size 1) may be the batch or the heads: the output's shape cannot tell,
    while a decay per head only reads as GLA with it as the heads (batch-1 inference)."""
    return ["b", "h"] if len(r.batch) == 1 else ["bh"[: len(r.batch)]]


def role_sizes(an: Analyzer, r: Roles, batch: str = "bh") -> dict:
    """Each role's size, the batch variables named by `batch` (``batch_letters``); Reject
    where any size is symbolic (``symbolic_chunks.py`` says why)."""
    variables = {batch[n]: x for n, x in enumerate(r.batch)}
    variables.update({"k": r.kk, "v": r.vv, "c": r.c, "i": r.i})
    check_static(an, variables)
    sizes = {"b": 1, "h": 1, "k": an.sizes[r.kk] if r.kk is not None else 1,
             "v": an.sizes[r.vv] if r.vv is not None else 1}
    sizes["t"] = an.sizes[r.i] * (an.sizes[r.c] if r.c is not None else 1)
    for n, x in enumerate(r.batch):
        sizes[batch[n]] = an.sizes[x]
    return sizes
