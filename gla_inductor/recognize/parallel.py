"""The parallel form: one contraction

    o[.., i, v] = scale * sum_{j, k} q[.., i, k] k[.., j, k] v[.., j, v] * D[.., i, j(, k)]

with a causal decay D = exp(G_i - G_j) * [i >= j], G = cumsum of the log-gate over time.
Scalar gates (G over time), vector gates (G over time and K, e.g. (q * e^G) @ (k * e^-G)^T
or the pairwise [T, T, K] form) and constant gates (exp((i - j) * gamma[h])) are read from
the exponent's linear form; the mask (tril, masked_fill(-inf), where, 0/1 products) is
evaluated concretely and must be exactly i >= j.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .algebra import AV, Analyzer, Factor, comps, factor_vars, mono_vars
from .consts import _hint, example_value
from .emit import Emitter, Group, LFactor, sizes_from
from .loop import Reject, _cast, _lfactor
from .match import Match, NearMiss
from . import placement


@dataclass
class Roles:
    q: Factor
    k: Factor
    v: Factor
    i: int
    j: int
    kk: int
    vv: int
    batch: list  # batch vars in output order


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    matches, near = [], []
    candidates = {}
    for n in an.graph.nodes:
        av = an.value(n)
        if _looks_parallel(av):
            candidates[n] = av
    covered = set()  # candidates replaced, or computed from a replaced one
    for n, av in candidates.items():  # in graph order

        def extends(u) -> bool:  # u is n cast or scaled: the same GLA with the same inputs
            return u in candidates and _same_inputs(candidates[u], av)

        # Prefer the outermost spelling when nothing but its extensions reads n; a value that
        # something else reads too is replaced itself, and its extensions follow from it.
        if n.users and all(extends(u) for u in n.users):
            continue
        if any(a in covered and _same_inputs(candidates[a], av) for a in n.all_input_nodes):
            covered.add(n)
            continue
        try:
            matches.append(_analyze(an, n, av))
            covered.add(n)
        except Reject as e:
            near.append(NearMiss("parallel", str(e), [n]))
    return matches, near


def _looks_parallel(av: Optional[AV]) -> bool:
    if av is None or av.keep is not None or len(av.terms) != 1:
        return False
    coef, fs = av.terms[0]
    atoms = [f for f in fs if f.kind == "atom"]
    summed = mono_vars(av.terms[0]) - set(av.out)
    return len(atoms) == 3 and len(summed) >= 2 and len(fs) > 3


def _same_inputs(a: AV, b: AV) -> bool:
    na = sorted(f.atom.node.name for f in a.terms[0][1] if f.kind == "atom")
    nb = sorted(f.atom.node.name for f in b.terms[0][1] if f.kind == "atom")
    return na == nb


def _roles(av: AV) -> Roles:
    coef, fs = av.terms[0]
    atoms = [f for f in fs if f.kind == "atom"]
    out = [v for v in av.out if v is not None]
    summed = mono_vars(av.terms[0]) - set(out)
    others = [f for f in fs if f.kind != "atom"]
    other_vars = set().union(*[factor_vars(f) for f in others]) if others else set()

    def holders(v):
        return [f for f in atoms if v in factor_vars(f)]

    vv_c = [v for v in out if len(holders(v)) == 1 and v not in other_vars and any(s in factor_vars(holders(v)[0]) for s in summed)]
    vv_c = [v for v in vv_c if not any(v in factor_vars(f) for f in atoms if f is not holders(v)[0])]
    if len(vv_c) < 1:
        raise Reject("no value axis: an output axis that only v carries")
    vv = vv_c[-1]
    v = holders(vv)[0]
    j_c = [s for s in summed if s in factor_vars(v)]
    if len(j_c) != 1:
        raise Reject("v must be contracted over exactly one (time) axis")
    j = j_c[0]
    kk_c = [s for s in summed if s != j]
    if len(kk_c) != 1:
        raise Reject(f"expected one contracted key axis, found {len(kk_c)}")
    kk = kk_c[0]
    k_c = [f for f in atoms if f is not v and j in factor_vars(f) and kk in factor_vars(f)]
    q_c = [f for f in atoms if f is not v and j not in factor_vars(f) and kk in factor_vars(f)]
    if len(k_c) != 1 or len(q_c) != 1:
        raise Reject("cannot tell q and k apart")
    q, k = q_c[0], k_c[0]
    i_c = [x for x in out if x in factor_vars(q) and x not in factor_vars(k) and x not in factor_vars(v)]
    if len(i_c) != 1:
        raise Reject("q must carry exactly one query-time axis")
    i = i_c[0]
    if kk in factor_vars(v) or i in factor_vars(k) or i in factor_vars(v):
        raise Reject("inputs are indexed by the wrong axes")
    batch = [x for x in out if x not in (i, vv)]
    if len(batch) > 2:
        raise Reject(f"{len(batch)} batch axes; at most 2 (batch, head) are supported")
    return Roles(q, k, v, i, j, kk, vv, batch)


def _analyze(an: Analyzer, node: fx.Node, av: AV) -> Match:
    r = _roles(av)
    coef, fs = av.terms[0]
    letter = {x: "bh"[n] for n, x in enumerate(r.batch)}
    letter.update({r.kk: "k", r.vv: "v"})
    masks, exps, scalars = [], [], []
    for f in fs:
        if f.kind == "atom":
            continue
        if f.kind == "scalar":
            scalars.append(LFactor(f.node, ""))
            continue
        if not factor_vars(f) <= set(r.batch) | {r.i, r.j, r.kk}:
            raise Reject("the decay is indexed by the value axis")
        (exps if f.kind == "exp" else masks).append(f)
    mask = _mask_product(an, masks, r)
    if mask is None:
        raise Reject("the mask could not be evaluated")
    tri = torch.ones_like(mask, dtype=torch.bool).tril()
    if not torch.equal(mask != 0, tri):
        raise Reject("the mask is not causal lower-triangular (i >= j)")
    if not torch.all(mask[tri] == 1):
        raise Reject("the mask is not a 0/1 mask")
    gate = _gate(an, exps, r, letter)
    keys = {r.q.atom.node, r.k.atom.node} | {g.atom.node for f in exps for _, gs in f.inner for g in gs if g.kind == "atom"}
    if depends_on(an, r.v.atom.node, keys):
        raise Reject("the values are computed from the keys or the decay (a delta-rule correction, not an input)")
    _check_unmodified(an, node, av)
    return _build(an, node, av, r, letter, gate, coef, scalars)


def _check_unmodified(an: Analyzer, node: fx.Node, av: AV) -> None:
    """The op reads its inputs where `node` is; the expression read them at its own nodes:
    no in-place write to an input may fall in between."""
    atoms = set()

    def visit(factors):
        for f in factors:
            if f.kind == "atom":
                atoms.add(f.atom.node)
            elif f.node is not None:
                atoms.add(f.node)
            for _, inner in f.inner:
                visit(inner)

    visit(av.terms[0][1])
    seen, frontier = set(), [node]
    while frontier:  # the expression: the nodes between the atoms and `node`
        n = frontier.pop()
        for x in n.all_input_nodes:
            if x not in atoms and x not in seen and not an.consts.is_const(x):
                seen.add(x)
                frontier.append(x)
    start = min((an.order[n] for n in seen), default=an.order[node])
    placement.check_unmodified(an, list(atoms), start, an.order[node])


def depends_on(an: Analyzer, node: fx.Node, targets: set) -> bool:
    """Whether `node` is computed from one of `targets` (searching only nodes after them)."""
    start = min(an.order[t] for t in targets)
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        for x in n.all_input_nodes:
            if x in targets:
                return True
            if x not in seen and an.order[x] > start:
                seen.add(x)
                frontier.append(x)
    return False


def _mask_product(an: Analyzer, masks: list, r: Roles) -> Optional[torch.Tensor]:
    ti = int(_hint(an.sizes[r.i]))
    tj = int(_hint(an.sizes[r.j]))
    if ti * tj > (1 << 26):
        return None
    total = torch.ones(ti, tj)
    for f in masks:
        if not factor_vars(f) <= {r.i, r.j}:
            return None  # a constant decay per batch or head: not supported
        if f.kind == "tri":
            n_i, n_j = torch.arange(ti)[:, None], torch.arange(tj)[None, :]
            if tuple(f.idx) == (r.i, r.j):
                row, col = n_i, n_j
            elif tuple(f.idx) == (r.j, r.i):
                row, col = n_j, n_i
            else:
                return None
            keep = (col - row <= f.diagonal) if f.lower else (col - row >= f.diagonal)
            total = total * keep.float()
            continue
        val = an.consts.evaluate(f.node)
        if val is None:
            return None
        if f.negate:
            val = ~val.bool()
        val = val.float()
        # squeeze size-1 axes, then order as (i, j)
        axes = [x for x in f.idx]
        val = val.reshape([s for s, x in zip(val.shape, axes) if x is not None])
        axes = [x for x in axes if x is not None]
        if axes == [r.j, r.i]:
            val = val.T
        elif axes == [r.i]:
            val = val[:, None]
        elif axes == [r.j]:
            val = val[None, :]
        total = total * val
    return total


@dataclass
class Gate:
    kind: str  # none | scalar | vector | constant
    terms: list  # (coef, LFactor) whose weighted sum is g (or g_gamma)


def _gate(an: Analyzer, exps: list, r: Roles, letter: dict) -> Gate:
    inner = [m for f in exps for m in f.inner]
    if not inner:
        return Gate("none", [])
    by_key: dict = {}
    const_terms = []
    for c, fs in inner:
        atoms = [f for f in fs if f.kind == "atom"]
        consts = [f for f in fs if f.kind == "const"]
        if len(fs) == 1 and atoms:
            f = atoms[0]
            if f.atom.fixed:
                raise Reject("the decay exponent indexes a gate at an integer position")
            has_i, has_j = r.i in f.idx, r.j in f.idx
            if has_i == has_j:
                raise Reject("a decay exponent term is not indexed by exactly one time axis")
            side = "i" if has_i else "j"
            key = (f.atom.node, tuple("t" if x in (r.i, r.j) else x for x in f.idx))
            by_key.setdefault(key, {}).setdefault(side, 0.0)
            by_key[key][side] += c
        elif len(consts) == 1 and len(atoms) <= 1 and len(fs) == len(consts) + len(atoms):
            const_terms.append((c, consts[0], atoms[0] if atoms else None))
        else:
            raise Reject("the decay exponent is not a difference of cumulative log-gates")
    if by_key and const_terms:
        raise Reject("the decay mixes data-dependent and constant gates")
    if const_terms:
        return _constant_gate(an, const_terms, r, letter)
    terms = []
    vector = False
    for (g_node, idx), sides in by_key.items():
        ci, cj = sides.get("i", 0.0), sides.get("j", 0.0)
        if ci != -cj or ci == 0:
            raise Reject("the decay exponent is not of the form G_i - G_j")
        src, axis = _cumsum_source(g_node)
        t_axis = idx.index("t")
        if src is None or axis % len(idx) != t_axis:
            raise Reject("the decay is not built from a cumulative sum over time")
        letters = "".join("t" if x == "t" else ("1" if x is None else letter.get(x, "?")) for x in idx)
        if "?" in letters:
            raise Reject("the gate is indexed by an unknown axis")
        vector |= "k" in letters
        terms.append((ci, LFactor(src, letters)))
    return Gate("vector" if vector else "scalar", terms)


def _cumsum_source(node: fx.Node):
    if node.op == "call_function" and node.target is torch.cumsum:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return node.args[0], dim
    if node.op == "call_method" and node.target == "cumsum":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return node.args[0], dim
    return None, None


def _constant_gate(an: Analyzer, const_terms, r: Roles, letter: dict) -> Gate:
    """exp(c * C[i, j] * gamma[h]) with C = (i - j) * lam on the causal triangle."""
    terms = []
    for c, cf, atom in const_terms:
        val = an.consts.evaluate(cf.node)
        if val is None or not factor_vars(cf) <= {r.i, r.j}:
            raise Reject("the constant decay exponent could not be evaluated")
        axes = list(cf.idx)
        val = val.float().reshape([s for s, x in zip(val.shape, axes) if x is not None])
        axes = [x for x in axes if x is not None]
        if axes == [r.j, r.i]:
            val = val.T
        if axes not in ([r.i, r.j], [r.j, r.i]) or val.shape[0] < 2:
            raise Reject("the constant decay exponent is not a [T, T] matrix")
        n = torch.arange(val.shape[0])
        diff = (n[:, None] - n[None, :]).float()
        lam = float(val[1, 0])
        tri = diff >= 0
        if not torch.allclose(val[tri], diff[tri] * lam, rtol=1e-6, atol=1e-6):
            raise Reject("the constant decay exponent is not proportional to i - j")
        if atom is None:
            raise Reject("a decay fixed at trace time is not supported yet")
        if atom.atom.fixed or not set(factor_vars(atom)) <= set(r.batch):
            raise Reject("the constant gate depends on more than the head")
        letters = "".join("1" if x is None else letter[x] for x in atom.idx)
        if "b" in letters and len(r.batch) == 2:
            raise Reject("the constant gate depends on the batch")
        terms.append((c * lam, LFactor(atom.atom.node, letters.replace("b", "h") if len(r.batch) == 1 else letters)))
    return Gate("constant", terms)


def _build(an: Analyzer, node: fx.Node, av: AV, r: Roles, letter: dict, gate: Gate, coef: float, scalars: list) -> Match:
    def axis(x, tvar) -> tuple:
        """(letters, sizes) of one axis: several letters where the code merged roles (a [B, T, H * K]
        projection viewed as [B, T, H, K] is read through the view, merged)."""
        if x is None:
            return "1", (1,)
        if x == tvar:
            return "t", None
        cs = comps(x)
        if any(c not in letter for c in cs):
            raise Reject("an input is indexed by an axis that is not a role")
        return "".join(letter[c] for c in cs), tuple(an.sizes[c] for c in cs)

    def lf(f: Factor, tvar: int) -> LFactor:
        return _lfactor(f.atom.node, f.atom.fixed, [axis(x, tvar) for x in f.idx])

    q, k, v = lf(r.q, r.i), lf(r.k, r.j), lf(r.v, r.j)
    out_axes = [axis(x, r.i) for x in av.out]
    if any(len(ls) > 1 for ls, _ in out_axes):
        raise Reject("the output merges role axes")
    out_letters = "".join(ls for ls, _ in out_axes)
    sizes = sizes_from([q, k, v])
    if not all(c in sizes for c in "tkv"):
        raise Reject("the sizes of the inputs could not be read")
    shapes = {c.upper(): _shape_of(sizes[c]) for c in "bthkv"}

    def apply(txn) -> None:
        em = Emitter(txn, node, sizes)
        qn = em.lift(Group(1.0, (q, *scalars)), "bthk")
        kn = em.lift(Group(1.0, (k,)), "bthk")
        vn = em.lift(Group(1.0, (v,)), "bthv")
        g, g_gamma = _emit_gate(em, gate)
        op = em.call(torch.ops.gla_inductor.chunk_fwd.default, qn, kn, vn, g, g_gamma, None, float(coef), False, False)
        o = em.call(operator.getitem, op, 0)
        txn.replace_all_uses(node, _cast(em, em.relayout(o, "bthv", out_letters), node))

    return Match("parallel", gate.kind, q.letters, shapes, [node], apply, {"scale": coef})


def _shape_of(s):
    if isinstance(s, tuple):
        return example_value(s[0]).shape[s[1]]
    return s


def _emit_gate(em: Emitter, gate: Gate):
    if gate.kind == "none":
        return None, None
    letters = {"vector": "bthk", "scalar": "bth", "constant": "h"}[gate.kind]
    total = None
    for c, lf in gate.terms:
        node = em.lift(Group(c, (lf,)), letters, full=False)
        total = node if total is None else em.call(torch.add, total, node)
    total = em.expand_to(em.as_float32(total), letters)
    return (None, total) if gate.kind == "constant" else (total, None)
