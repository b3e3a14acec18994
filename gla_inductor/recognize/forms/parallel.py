"""The parallel form: one contraction

    o[.., i, v] = scale * sum_{j, k} q[.., i, k] k[.., j, k] v[.., j, v] * D[.., i, j(, k)]
                + scale * sum_k q[.., i, k] * exp(G_i)[.., k] * h0[.., k, v]        (optional)

with a decay D = exp(G_i - G_j) on the causal triangle (i >= j; j >= i for the reverse,
anti-causal form), and optionally the final state, a separate value

    S[.., k, v] = sum_j exp(G_last - G_j)[.., k] k[.., j, k] v[.., j, v] + exp(G_last) h0.

The mask (tril, triu, masked_fill(-inf), where, 0/1 products) is evaluated concretely and
must be exactly i >= j or j >= i. The decays are read as cumulative log gates by
``parallel_decay.py``; a decay that depends only on positions, constants and module buffers
(RetNet's masks) is evaluated as a whole by ``static_decay.py``, or, scaled per query row
(torchscale's), by ``row_factor.py``, the row factor folded into q. Scores divided by a function
of their own row sums are read by ``normalized.py``: the row sums come from the same op call, and
the rewrite is certified by trial (``certify/trial.py``). q and k with fewer heads than v,
repeated over the heads in the code, reach the op unrepeated (``grouped_heads.head_letters``).
Left alone with a reason: a decay computed from a function's arguments, scores read by anything
but their row sums, and what discovery finds that is no candidate
(``parallel_terms.not_candidates``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ...contract import GLACall
from ..core import placement
from ..core.algebra import AV, Factor, comps, factor_vars, mono_vars, out_vars, sub_mono
from ..core.analyzer import Analyzer
from ..core.consts import example_value, size_hint
from ..core.emit import Emitter, Group, LFactor, emit_op, lfactor, sizes_from
from ..core.match import Match, NearMiss, Reject
from ..core.op_names import op_name
from ..certify import trial
from . import buffer_mask, grouped_heads, normalized, periodic, row_factor, state_sum, static_decay
from .parallel_decay import (
    COEF_RTOL, Gate, all_steps, check_decay, final_window, read_gate, start_window,
)
from .parallel_terms import data_atoms, input_leaves, input_name, is_parallel, not_candidates


@dataclass
class Roles:
    q: Factor
    k: Factor
    v: Factor
    i: int
    j: int
    kk: Optional[int]  # None: K has size 1
    vv: Optional[int]  # None: V has size 1
    batch: list  # batch vars in output order


@dataclass
class Candidate:
    av: AV
    par: tuple  # the monomial q k v D
    h0: Optional[tuple]  # the monomial q exp(G_i) h0, or None


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    cands = _candidates(an)

    def extends(n, u) -> bool:  # u is n cast, scaled or plus h0's share: the same GLA
        return u in cands and _same_inputs(cands[u], cands[n])

    def taken_over(n) -> bool:
        """Only extensions read n, and each is replaced (or taken over itself): n goes with them."""
        users = list(n.users)
        return bool(users) and all(extends(n, u) for u in users) and all(
            isinstance(analyze(an, u), Match) or taken_over(u) for u in users)

    matches, near, covered = [], [], set()
    for n in cands:  # in graph order
        if taken_over(n):
            continue
        if any(a in covered and extends(a, n) for a in n.all_input_nodes):
            covered.add(n)  # computed from a replaced candidate: it follows from it
            r = analyze(an, n)
            if not isinstance(r, Match):  # plus a state term that is not GLA's: computed as written
                near.append(NearMiss("parallel", f"{r}; the attention alone is GLA", [n]))
            continue
        r = analyze(an, n)
        if isinstance(r, Match):
            matches.append(r)
            covered.add(n)
        elif not any(u in cands and _within(cands[n], cands[u]) for u in n.users):
            near.append(NearMiss("parallel", str(r), [n]))  # (a part of a larger candidate is not one)
    insts, norm_near = _normalized(an)
    for n in (n for n in insts if n not in cands):  # (A / N) @ v: no candidate of its own
        r = analyze(an, n)
        if isinstance(r, Match):
            matches.append(r)
        else:
            near.append(NearMiss("parallel", str(r), [n]))
    reported = {n for nm in norm_near for n in nm.nodes} | {x for i in insts.values() for x in (i.scores, *i.nodes())}
    return matches, near + norm_near + not_candidates(an, cands, reported)


def _within(a: Candidate, b: Candidate) -> bool:
    """Whether b's product holds every input of a's and more: a is a part of b (the scores
    q k^T D of b = scores @ v, read alone as a product of three inputs)."""
    names_a, names_b = _names(a), _names(b)
    return len(names_b) > len(names_a) and all(names_b.count(x) >= names_a.count(x) for x in names_a)


def judged(an: Analyzer, node: fx.Node) -> bool:
    """Whether this module reads `node` (rewritten, or left alone with its reason): a candidate, or
    a sum of candidates (a forward and a backward attention added)."""
    cands = _candidates(an)
    if node in cands:
        return True
    return op_name(node) in ("add", "sub") and all(a in cands for a in node.all_input_nodes)


def proven(an: Analyzer, node: fx.Node) -> bool:
    """Whether `node` is a parallel form this module proves (the chunked form leaves one chunk
    with an initial-state read to it)."""
    return node in _candidates(an) and isinstance(analyze(an, node), Match)


def analyze(an: Analyzer, node: fx.Node):
    """The Match of a candidate, or the Reject that says why not (computed once per graph)."""
    results = an.memo.setdefault("parallel_results", {})
    if node not in results:
        inst = _normalized(an)[0].get(node)
        try:
            results[node] = (_analyze(an, node, _candidates(an)[node]) if inst is None
                             else _analyze_normalized(an, node, inst))
        except Reject as e:
            results[node] = e
    return results[node]


def _normalized(an: Analyzer) -> tuple:
    """({attention node: normalized.Normalized}, near misses), found once per graph."""
    if "parallel_normalized" not in an.memo:
        an.memo["parallel_normalized"] = normalized.find(an)
    return an.memo["parallel_normalized"]


def _analyze_normalized(an: Analyzer, node: fx.Node, inst) -> Match:
    """Scores normalized by their row sums: the product with v read with A in place of A / N,
    analyzed as any candidate, then the whole rewrite certified in float64."""
    cand = _candidate(an, normalized.virtual_value(an, inst))
    if cand is None:
        raise Reject("the normalized scores' product with v is not q k^T D v contracted over time (and K)")
    return _analyze(an, node, cand, inst)


def _candidates(an: Analyzer) -> dict:
    if "parallel_candidates" not in an.memo:
        cands = {}
        unread = periodic.unread(an, lambda n: _candidate(an, state_sum.value(an, n)) is not None)
        for n in (n for n in an.graph.nodes if n not in unread):
            c = _candidate(an, state_sum.value(an, n))
            if c is not None:
                cands[n] = c
        an.memo["parallel_candidates"] = cands
    return an.memo["parallel_candidates"]


def _candidate(an: Analyzer, av: Optional[AV]) -> Optional[Candidate]:
    """One monomial of three inputs contracted over two axes under a decay, and at most one
    more: a product of two inputs contracted over one axis (q and the initial state)."""
    if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2:
        return None
    ov = out_vars(av.out)
    par = [m for m in av.terms if is_parallel(an, m, ov)]
    if len(par) != 1 or len(data_atoms(an, par[0][1])) == 4 and _input_decay_reason(an, av, par[0]) is None:
        return None
    rest = [m for m in av.terms if m is not par[0]]
    if rest and not _is_state_read(rest[0], ov):
        return None
    return Candidate(av, par[0], rest[0] if rest else None)


def _is_state_read(m, ov: set) -> bool:
    """q times the initial state, contracted over K (over nothing where K has size 1)."""
    atoms = [f for f in m[1] if f.kind == "atom"]
    return len(atoms) == 2 and len(mono_vars(m) - ov) <= 1


def _names(c: Candidate) -> list:
    return sorted(f.atom.node.name for f in c.par[1] if f.kind == "atom")


def _same_inputs(a: Candidate, b: Candidate) -> bool:
    return _names(a) == _names(b)


def _input_decay_reason(an: Analyzer, av: AV, term) -> Optional[str]:
    """Why a product of four inputs is left alone where one of them is a decay D[.., i, j] of
    the other three's attention: it is computed from inputs that change from call to call.
    None where none of them is such a decay."""
    atoms = data_atoms(an, term[1])
    for d in atoms:
        try:
            r = _roles(an, av, term, [f for f in atoms if f is not d])
        except Reject:
            continue
        if {r.i, r.j} <= factor_vars(d) <= set(r.batch) | {r.i, r.j}:
            inputs = sorted({input_name(x) for x in input_leaves(d.atom.node)})
            return (f"the decay D[i, j] is computed from the input(s) {', '.join(inputs)} (not constants or "
                    "module buffers): its values change from call to call, so its form cannot be proven")
    return None


def _roles(an: Analyzer, av: AV, term, atoms: Optional[list] = None) -> Roles:
    """q, k, v and the axes: i (query time), j (key time, summed), kk (summed), vv (kept).
    K or V of size 1 has no variable (kk or vv is None): a size-1 contraction is a product."""
    coef, fs = term
    atoms = data_atoms(an, fs) if atoms is None else atoms
    # time and value are single axes; batch entries may be roles merged (B * H for bmm)
    out = [v for v in av.out if type(v) is int]
    summed = mono_vars(term) - out_vars(av.out)
    others = [f for f in fs if f not in atoms]
    other_vars = set().union(*[factor_vars(f) for f in others]) if others else set()

    def holders(v):
        return [f for f in atoms if v in factor_vars(f)]

    vv_c = [v for v in out if len(holders(v)) == 1 and v not in other_vars and any(s in factor_vars(holders(v)[0]) for s in summed)]
    vv_c = [v for v in vv_c if not any(v in factor_vars(f) for f in atoms if f is not holders(v)[0])]
    if vv_c:
        vv = vv_c[-1]
        q, k, v, j, kk = _qkv_by_value(atoms, holders(vv)[0], summed)
    else:
        vv = None
        q, k, v, j, kk = _qkv_by_query(an, atoms, out, summed)
    i_c = [x for x in out if x in factor_vars(q) and x not in factor_vars(k) and x not in factor_vars(v)]
    if len(i_c) != 1:
        raise Reject("q must carry exactly one query-time axis")
    i = i_c[0]
    if kk is not None and kk in factor_vars(v) or i in factor_vars(k) or i in factor_vars(v):
        raise Reject("inputs are indexed by the wrong axes")
    batch = [x for e in av.out if e not in (i, vv) for x in comps(e)]  # (checked by head_letters)
    return Roles(q, k, v, i, j, kk, vv, batch)


def _time_and_key(time_candidates: list, summed: set, contracted: str) -> tuple:
    """(j, kk): the one summed time axis among the candidates, and the key axis, the other summed
    axis (None for K of size 1)."""
    if len(time_candidates) != 1:
        raise Reject(f"{contracted} must be contracted over exactly one (time) axis")
    j = time_candidates[0]
    kk_c = [s for s in summed if s != j]
    if len(kk_c) > 1:
        raise Reject(f"expected one contracted key axis, found {len(kk_c)}")
    return j, kk_c[0] if kk_c else None


def _qkv_by_value(atoms: list, v: Factor, summed: set) -> tuple:
    """(q, k, v, j, kk) given v, the only input that has the value axis. K of size 1: k is the
    other input contracted with v over time, q the one that is not."""
    j, kk = _time_and_key([s for s in summed if s in factor_vars(v)], summed, "v")
    rest = [f for f in atoms if f is not v]
    k_c = [f for f in rest if j in factor_vars(f) and (kk is None or kk in factor_vars(f))]
    q_c = [f for f in rest if j not in factor_vars(f) and (kk is None or kk in factor_vars(f))]
    if len(k_c) != 1 or len(q_c) != 1:
        raise Reject("cannot tell q and k apart")
    return q_c[0], k_c[0], v, j, kk


def _qkv_by_query(an: Analyzer, atoms: list, out: list, summed: set) -> tuple:
    """(q, k, v, j, kk) where no axis is the value's alone: V of size 1. q is the input with the
    query-time axis, an output axis no other input has; k and v share the summed time axis,
    and k the key axis. With K of size 1 too, k and v are alike (o = sum_j q_i k_j v_j D_ij
    is symmetric in them): the first is taken for k. Where q and k are shared by groups of
    heads, v has an output axis of its own too (its part of the heads): q is the one whose own
    axis is as long as the axis the other two contract (for q: the key time; for v: the key axis)."""
    def private(f):
        return {x for x in out if x in factor_vars(f)} - set().union(*(factor_vars(g) for g in atoms if g is not f))

    q_c = [f for f in atoms if private(f)]
    if len(q_c) > 1:
        q_c = [f for f in q_c if any(_same_size(an, x, _key_time(atoms, f, summed)) for x in private(f))]
        if len(q_c) > 1:
            raise Reject("V has size 1 and q and k are shared by groups of heads: two inputs carry an output axis "
                         "of their own (the query time; the value's part of the heads) as long as an axis the "
                         "other two contract (the key time; the key axis), so which is q cannot be told by shape")
    if len(q_c) != 1:
        raise Reject("no value axis: an output axis that only v carries")
    q = q_c[0]
    rest = [f for f in atoms if f is not q]
    j, kk = _time_and_key([s for s in summed if all(s in factor_vars(f) for f in rest)], summed, "k and v")
    k_c = [f for f in rest if kk is None or kk in factor_vars(f)]
    if kk is not None and (len(k_c) != 1 or kk not in factor_vars(q)):
        raise Reject("cannot tell q and k apart")
    return q, k_c[0], next(f for f in rest if f is not k_c[0]), j, kk


def _key_time(atoms: list, q: Factor, summed: set) -> Optional[int]:
    """The summed axis the two inputs other than `q` share (the key time where `q` is q)."""
    rest = [f for f in atoms if f is not q]
    js = [s for s in summed if all(s in factor_vars(f) for f in rest)]
    return js[0] if len(js) == 1 else None


def _same_size(an: Analyzer, x: int, y: Optional[int]) -> bool:
    return y is not None and isinstance(an.sizes[x], int) and an.sizes[x] == an.sizes[y]


# ---- the whole analysis ---------------------------------------------------------------------
def _analyze(an: Analyzer, node: fx.Node, cand: Candidate, norm=None) -> Match:
    cand = _merge_split_key(an, cand)
    av = cand.av
    if len(data_atoms(an, cand.par[1])) == 4:  # (a candidate only where one is such a decay)
        raise Reject(_input_decay_reason(an, av, cand.par))
    r = _roles(an, av, cand.par)
    coef, fs = cand.par
    letter, heads = grouped_heads.head_letters([e for e in av.out if e not in (r.i, r.vv)], r.q, r.k)
    letter.update({x: c for x, c in ((r.kk, "k"), (r.vv, "v")) if x is not None})  # (none for size 1)
    data = [r.q, r.k, r.v]
    scalars = [f for f in fs if f.kind == "scalar"]
    decay = [f for f in fs if f.kind != "scalar" and not any(f is x for x in data)]
    if any(not factor_vars(f) <= set(r.batch) | {r.i, r.j, r.kk} for f in decay):
        raise Reject("the decay is indexed by the value axis")
    T = int(size_hint(an.sizes[r.i]))
    gate, reverse = _read_decay(an, decay, r, letter, T)
    # (a decay from positions and buffers is shared by stacked layers: the next layer's v is
    # computed from this one's output, which is no correction of v by the decay)
    keys = {r.q.atom.node, r.k.atom.node} | (set(gate.reads) if gate.emit is None else set())
    if depends_on(an, r.v.atom.node, keys):
        raise Reject("the values are computed from the keys or the decay (a delta-rule correction, not an input)")
    if cand.h0 is not None and (gate.emit is not None or norm is not None):
        raise Reject("an initial-state term beside a decay evaluated from positions and buffers or beside "
                     "normalized scores is not read yet")
    h0 = _initial_state(an, cand, r, letter, gate, reverse, T, scalars) if cand.h0 is not None else None
    final = _final_state(an, node, r, letter, gate, reverse, T, h0) if norm is None else []
    m = _build(an, node, av, r, letter, heads, gate, coef, scalars, h0, final, reverse, norm)
    if norm is not None:  # the user's normalizer between the op's row sums and the output: by trial
        why = trial.certify(an, m, list(dict.fromkeys(x.atom.node for x in (r.q, r.k, r.v))), norm.nodes())
        if why is not None:
            raise Reject(f"normalized retention: {why}")
    return buffer_mask.guarded(an, m, gate.emit, [f.atom.node for f in data])


def _merge_split_key(an: Analyzer, cand: Candidate) -> Candidate:
    """The contracted key axis read as one variable where the code split it in parts that q and k
    both hold whole (a rotary embedding's [.., K / 2, 2] flattened back into K)."""
    coef, fs = cand.par
    summed = mono_vars(cand.par) - out_vars(cand.av.out)
    mp = {}
    for e in {e for f in fs for e in f.idx if type(e) is tuple and set(e) <= summed}:
        whole = all(x == e for f in fs for x in f.idx if set(comps(x)) & set(e))
        sizes = [an.sizes[c] for c in e]
        if whole and all(f.kind == "atom" or not factor_vars(f) & set(e) for f in fs) and \
                all(isinstance(n, int) for n in sizes):
            mp.update({e[0]: an.fresh(math.prod(sizes)), **{c: () for c in e[1:]}})  # () drops a part
    if not mp:
        return cand
    par = sub_mono(cand.par, mp)
    return Candidate(AV(cand.av.out, tuple(par if m is cand.par else m for m in cand.av.terms), cand.av.keep,
                        cand.av.origin), par, cand.h0)


def _read_decay(an: Analyzer, decay: list, r: Roles, letter: dict, T: int) -> tuple:
    """(gate, reverse) of the decay factors: read term by term as cumulative log gates, or,
    where that fails and the decay depends on positions and module state only, evaluated."""
    if not any(static_decay.is_static_atom(an, f) for f in decay):
        try:
            masks = [f for f in decay if f.kind != "exp"]
            reverse = _direction(an, masks, r)
            exps = [f for f in decay if f.kind == "exp"]
            return read_gate(an, exps, r.i, r.j, r.batch, letter, reverse, T), reverse
        except Reject:
            if not static_decay.all_static(an, decay):
                raise
    if not static_decay.all_static(an, decay):
        raise Reject("the decay mixes a gate input with a mask computed from module state")
    try:
        st, tables = buffer_mask.read(an, decay, r.i, r.j, r.batch, letter)  # tables: to guard at run time
    except Reject as unscaled:  # unless the decay is GLA's times a factor of each query's row
        return row_factor.gate(an, decay, r.i, r.j, r.batch, letter, unscaled)
    if st.kind == "none":
        return Gate("none", [], reads=st.reads), st.reverse
    emit = buffer_mask.GuardedGate(an, decay, r.i, r.j, letter, st.reverse, tables)
    return Gate("constant", [], reads=st.reads, emit=emit), st.reverse


def _direction(an: Analyzer, masks: list, r: Roles) -> bool:
    """Whether the mask is exactly j >= i (reverse); raises unless it is i >= j or that."""
    mask = _mask_product(an, masks, r)
    if mask is None:
        raise Reject("the mask could not be evaluated")
    if mask.shape[0] != mask.shape[1]:
        raise Reject("queries and keys have different lengths")
    lower = torch.ones_like(mask, dtype=torch.bool).tril()
    if torch.equal(mask != 0, lower):
        reverse = False
    elif torch.equal(mask != 0, lower.T):
        reverse = True
    else:
        raise Reject("the mask is not causal lower-triangular (i >= j) or anti-causal (j >= i)")
    if not torch.all(mask[mask != 0] == 1):
        raise Reject("the mask is not a 0/1 mask")
    return reverse


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
    ti = int(size_hint(an.sizes[r.i]))
    tj = int(size_hint(an.sizes[r.j]))
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
        total = total * _as_matrix(val.float(), f.idx, r.i, r.j)
    return total


def _as_matrix(val: torch.Tensor, idx: tuple, i, j) -> torch.Tensor:
    """A constant indexed by (some of) i and j, as an [i, j] matrix (broadcast where absent)."""
    axes = list(idx)
    val = val.reshape([s for s, x in zip(val.shape, axes) if x is not None])
    axes = [x for x in axes if x is not None]
    if axes == [j, i]:
        return val.T
    if axes == [i]:
        return val[:, None]
    if axes == [j]:
        return val[None, :]
    return val


# ---- the initial state ------------------------------------------------------------------------
def _initial_state(an: Analyzer, cand: Candidate, r: Roles, letter: dict, gate: Gate, reverse: bool,
                   T: int, scalars: list) -> LFactor:
    """h0 of the term scale * q_i exp(G_i) h0: the same q and scale as the parallel term, the
    decay of the initial state to each step (from the start, or from the end reversed)."""
    coef, fs = cand.h0
    if not math.isclose(coef, cand.par[0], rel_tol=COEF_RTOL):
        raise Reject("the initial-state term is scaled differently from the attention")
    if sorted(f.node.name for f in fs if f.kind == "scalar") != sorted(f.node.name for f in scalars):
        raise Reject("the initial-state term is scaled differently from the attention")
    kx = next(iter(mono_vars(cand.h0) - out_vars(cand.av.out)), None)  # its K (None: of size 1)
    if (kx is None) != (r.kk is None):
        raise Reject("the initial-state term is contracted differently from the attention")
    atoms = [f for f in fs if f.kind == "atom"]
    q_idx = tuple(_subst(e, r.kk, kx) for e in r.q.idx) if kx is not None else r.q.idx
    qs = [f for f in atoms if f.atom == r.q.atom and f.idx == q_idx]
    if len(qs) != 1:
        raise Reject("the initial-state term does not read the attention's q")
    h0 = next(f for f in atoms if f is not qs[0])
    hl = {**letter, kx: "k"} if kx is not None else letter
    exps = [f for f in fs if f.kind == "exp"]
    if any(f.kind not in ("atom", "exp", "scalar") for f in fs):
        raise Reject("the initial-state term has a factor other than q, the state and a decay")
    roles = {x for x in (kx, r.vv) if x is not None}
    if not roles <= set(_comps_all(h0.idx)) <= set(r.batch) | roles:
        raise Reject("the initial state is indexed by the wrong axes")
    check_decay(an, exps, {r.i: "i"}, hl, gate, start_window(reverse), reverse, T, [r.i],
                 lambda n: (n.flip(0) + 1) if reverse else n + 1)
    return _role_lfactor(an, h0, hl)


def _comps_all(idx: tuple) -> list:
    return [c for e in idx for c in comps(e)]


def _subst(entry, a, b):
    if entry == a:
        return b
    if type(entry) is tuple:
        return tuple(b if c == a else c for c in entry)
    return entry


def _role_lfactor(an: Analyzer, f: Factor, letter: dict) -> LFactor:
    def axis(x):
        if x is None:
            return "1", (1,)
        cs = comps(x)
        if any(c not in letter for c in cs):
            raise Reject("an input is indexed by an axis that is not a role")
        return "".join(letter[c] for c in cs), tuple(an.sizes[c] for c in cs)

    return lfactor(f.atom.node, f.atom.fixed, [axis(x) for x in f.idx])


# ---- the final state --------------------------------------------------------------------------
@dataclass
class Final:
    node: fx.Node
    groups: list  # role letters of each axis
    coef: float


def _final_state(an: Analyzer, node: fx.Node, r: Roles, letter: dict, gate: Gate, reverse: bool, T: int,
                 h0: Optional[LFactor]) -> list:
    """The values that equal the op's final state (times a number): sum_j of k_j v_j under
    the decay from j to the end (plus the initial state's share)."""
    found = []
    for n in _state_candidates(an).get(frozenset((r.k.atom, r.v.atom)), []):
        if n is node or an.written_between(n, an.order[n] + 1, len(an.nodes)):
            continue  # a state written in place later: its views would not see the op's
        try:
            found.append(_final_of(an, n, r, letter, gate, reverse, T, h0))
        except Reject:
            continue
    return found


def _state_candidates(an: Analyzer) -> dict:
    """{k atom, v atom} -> values with a monomial of those two inputs summed over one axis."""
    if "parallel_states" not in an.memo:
        index: dict = {}
        for n in an.nodes:
            av = an.value(n)
            if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2:
                continue
            ov = out_vars(av.out)
            for m in av.terms:
                atoms = [f.atom for f in m[1] if f.kind == "atom"]
                if len(atoms) == 2 and len(mono_vars(m) - ov) == 1:
                    index.setdefault(frozenset(atoms), []).append(n)
        an.memo["parallel_states"] = index
    return an.memo["parallel_states"]


def _final_of(an: Analyzer, n: fx.Node, r: Roles, ref_letter: dict, gate: Gate, reverse: bool, T: int, h0) -> Final:
    av = an.value(n)
    ov = out_vars(av.out)
    kv = [m for m in av.terms if len(mono_vars(m) - ov) == 1]
    rest = [m for m in av.terms if m not in kv]
    if len(kv) != 1 or len(rest) != (h0 is not None):
        raise Reject("not the final state")
    coef, fs = kv[0]
    j = next(iter(mono_vars(kv[0]) - ov))
    letter = {j: "t"}
    for f, pf in ((_the(fs, r.k.atom), r.k), (_the(fs, r.v.atom), r.v)):
        _align(f.idx, pf.idx, {r.j: "t", **ref_letter}, letter)
    if any(f.kind not in ("atom", "exp") for f in fs) or T < 2:
        raise Reject("not the final state")
    state_letter = {x: c for x, c in letter.items() if c != "t"}
    check_decay(an, [f for f in fs if f.kind == "exp"], {j: "j"}, state_letter, gate, final_window(reverse),
                 reverse, T, [j], lambda n: n if reverse else (n.flip(0)))
    if rest:
        _final_h0(an, rest[0], coef, state_letter, gate, reverse, T, h0)
    groups = []
    for e in av.out:
        cs = comps(e)
        if any(c not in state_letter for c in cs):
            raise Reject("the final state keeps an axis that is not a role")
        groups.append("".join(state_letter[c] for c in cs) or "1")
    if not {c for c, x in (("k", r.kk), ("v", r.vv)) if x is not None} <= set("".join(groups)):
        raise Reject("the final state does not keep K and V")  # (an axis of size 1 it may drop)
    return Final(n, groups, coef)


def _the(fs: tuple, atom) -> Factor:
    found = [f for f in fs if f.kind == "atom" and f.atom == atom]
    if len(found) != 1:
        raise Reject("not the final state")
    return found[0]


def _align(idx: tuple, ref: tuple, ref_letter: dict, letter: dict) -> None:
    """Name the variables of `idx` by the role letters of the reference index, axis by axis."""
    if len(idx) != len(ref):
        raise Reject("not the final state")
    for e, er in zip(idx, ref):
        cs, crs = comps(e), comps(er)
        if len(cs) != len(crs):
            raise Reject("the final state splits an axis differently")
        for c, cr in zip(cs, crs):
            want = ref_letter.get(cr)
            if want is None or letter.setdefault(c, want) != want:
                raise Reject("the final state is indexed differently from the attention")


def _final_h0(an: Analyzer, m, coef: float, letter: dict, gate: Gate, reverse: bool, T: int, h0: LFactor) -> None:
    """The initial state's share of the final state: h0 decayed over every step."""
    c, fs = m
    atoms = [f for f in fs if f.kind == "atom"]
    if len(atoms) != 1 or atoms[0].atom.node is not h0.node or not math.isclose(c, coef, rel_tol=COEF_RTOL):
        raise Reject("not the final state")
    if _role_lfactor(an, atoms[0], letter) != h0 or any(f.kind not in ("atom", "exp") for f in fs):
        raise Reject("not the final state")
    check_decay(an, [f for f in fs if f.kind == "exp"], {}, letter, gate, all_steps, reverse, T, [],
                 lambda n: torch.tensor(float(T), dtype=torch.float64))


# ---- the replacement ----------------------------------------------------------------------------
def _build(an: Analyzer, node: fx.Node, av: AV, r: Roles, letter: dict, heads: "grouped_heads.Heads", gate: Gate,
           coef: float, scalars: list, h0: Optional[LFactor], finals: list, reverse: bool, norm=None) -> Match:
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
        return lfactor(f.atom.node, f.atom.fixed, [axis(x, tvar) for x in f.idx])

    q, k, v = lf(r.q, r.i), lf(r.k, r.j), lf(r.v, r.j)
    # one group of letters per output axis: "bh" where the code flattened the heads for bmm
    out_groups = [ls for ls, _ in (axis(x, r.i) for x in av.out)]
    if any(len(ls) > 1 and not set(ls) <= set("bh" + heads.order) for ls in out_groups):
        raise Reject("the output merges role axes other than batch and heads")
    sizes = sizes_from([q, k, v])
    sizes.update({c: 1 for c, x in (("k", r.kk), ("v", r.vv)) if x is None})  # no input has their axes
    if not all(c in sizes for c in "tkv"):
        raise Reject("the sizes of the inputs could not be read")
    shapes = {c.upper(): _shape_of(sizes[c]) for c in "bthkv"}
    if heads.order:  # the user's heads, of two parts
        shapes["H"] = math.prod(_shape_of(sizes[c]) for c in heads.order)
    scalar_lfs = [LFactor(f.node, "") for f in scalars]
    plan = normalized.plan(an, norm, r.q, r.k, r.i, r.j, axis) if norm is not None else None
    if plan is not None and heads.order:
        raise Reject("normalized scores with q and k shared by groups of heads are not read yet")
    anchor = min([node] + [f.node for f in finals] + (norm.nodes() if norm else []), key=an.order.__getitem__)
    deps = [x.node for x in (q, k, v, h0) if x is not None] + [x.node for x in scalar_lfs]
    deps += [lfac.node for _, lfac in gate.terms] + list(gate.reads)
    late = [d.name for d in deps if an.order[d] >= an.order[anchor]]
    if late:
        raise Reject(f"inputs {late} are computed after the output is used")
    placement.check_unmodified(an, deps, an.order[anchor])

    def apply(txn) -> None:
        em = Emitter(txn, anchor, sizes, heads.splits())
        qn = row_factor.scale_q(em, em.lift(Group(1.0, (q, *scalar_lfs)), heads.qk), gate.row, heads.qk)
        kn = em.lift(Group(1.0, (k,)), heads.qk)
        vn = em.lift(Group(1.0, (v,)), "bthv")
        vn = plan.with_ones(em, vn) if plan is not None else vn
        g, g_gamma = _emit_gate(em, gate)
        h0n = em.as_float32(em.lift(Group(1.0, (h0,)), "bhkv")) if h0 is not None else None
        call = GLACall(qn, kn, vn, g, g_gamma, h0n, scale=coef, output_final_state=bool(finals), reverse=reverse)
        op = emit_op(em, call)
        o = em.call(operator.getitem, op, 0)
        o = plan.split(em, txn, o) if plan is not None else o
        out = em.relayout(o, heads.op_axes("bthv"), out_groups)
        late = em if plan is None else Emitter(txn, node, sizes, heads.splits())  # (after the user's divisor)
        out = plan.divide(late, out, out_groups) if plan is not None else out
        txn.replace_all_uses(node, late.cast_like(out, node))
        for f in finals:
            ht = em.relayout(em.call(operator.getitem, op, 1), heads.op_axes("bhkv"), f.groups)
            if f.coef != 1.0:
                ht = em.call(torch.mul, ht, f.coef)
            txn.replace_all_uses(f.node, em.cast_like(ht, f.node))

    options = {"scale": coef, "reverse": reverse, "initial_state": h0 is not None, "final_state": bool(finals)}
    nodes = [node] + [f.node for f in finals] + (norm.nodes()[1:] if norm else [])
    covers = norm.covers() if norm else set()
    return Match("parallel", gate.kind, q.letters, shapes, nodes, apply, options, covers)


def _shape_of(s):
    if isinstance(s, tuple):
        return example_value(s[0]).shape[s[1]]
    return s


def _emit_gate(em: Emitter, gate: Gate):
    if gate.kind == "none":
        return None, None
    letters = {"vector": "bthk", "scalar": "bth", "constant": "h"}[gate.kind]
    total = gate.emit(em) if gate.emit is not None else None
    for c, lf in gate.terms:
        node = em.lift(Group(c, (lf,)), letters, full=False)
        total = node if total is None else em.call(torch.add, total, node)
    total = em.expand_to(em.as_float32(total), letters)
    return (None, total) if gate.kind == "constant" else (total, None)
