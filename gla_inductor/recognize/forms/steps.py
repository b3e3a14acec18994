"""The steps of an unrolled time loop: state updates and the query reads of their states.

    S_t = S_{t-1} * d_t + k_t (x) v_t        (decay d_t = exp(g_t) over K, or absent)
    o_t = scale * sum_K q_t * S_t

(a decay may also be a factor the graph computes, proven >= 0 by decay_sign.py, and the outer
product may be divided by a tensor per batch, head or key: ``expand_quotients``)

``find_steps`` reads every node as a possible state update (``parse_step``); ``chains_of``
links the updates S_{t-1} -> S_t; ``parse_read`` reads an output element as a query read of a
state (a single step's read is found among the users of its state: ``read_of_step``). The
state's axes are then named by role (``state_roles``, ``state_letters``): batch b/h, key k,
value v. A long loop whose steps ``periodic.py`` proves alike by their structure is parsed at
three steps only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import (
    AV, Atom, Factor, Mono, Opaque, comps, factor_vars, make_entry, mono_vars, out_vars, resolve,
    separates_axes, sub_mono,
)
from ..core.analyzer import Analyzer
from ..core.assembly import Assembly, find_outputs
from ..core.match import NearMiss, Reject
from ..core.op_names import VIEW_OPS, op_name
from . import periodic

BATCH_LETTERS = ("b", "h")
SUB_LETTERS = "ABCDEFGHIJKLMNOPQRSUWXYZ"  # parts of a role the user's code merged
MAX_READ_DEPTH = 6  # views and casts between a decode step's state and its read


@dataclass
class Step:
    node: fx.Node
    av: AV
    prev: Optional[fx.Node]  # the previous state, None when it is zero
    decay: Optional[Mono]  # the decay monomial without the previous-state factor
    outer: Mono
    # the update reads the previous state through a view of another shape (same elements,
    # same order): fine for a state of the loop, which takes the update's shape (see
    # _align_states), not for an initial state the op would read as the update's shape
    prev_view: bool = False


@dataclass
class Read:
    node: fx.Node  # the element of the assembly
    av: AV
    state: fx.Node
    state_factor: Factor
    kvar: Optional[int]  # None: the read sums over no axis (K of size 1)
    q: list  # factors of the read other than the state
    coef: float


# ---- reading nodes ---------------------------------------------------------------------
def parse_step(an: Analyzer, node: fx.Node) -> Optional[Step]:
    if op_name(node) in VIEW_OPS:
        return None  # a view or cast of a state is that state, not a further step
    av = an.value(node)
    if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2 or len(av.out) < 2:
        return None
    av = expand_quotients(an, av)
    out_set = out_vars(av.out)
    terms = av.terms
    if not all(mono_vars(m) <= out_set for m in terms):
        return None
    full = [_state_factors([f for f in fs if is_full_atom(f, av.out)]) for _, fs in terms]
    decay, prev, prev_view = None, None, False
    if len(terms) == 1:
        if full[0]:
            return None
        outer = terms[0]
    else:
        d = _decay_term(terms, full, av.out)
        if d is None:
            return None
        pf, (coef, fs) = full[d][0], terms[d]
        prev, prev_view = pf.atom.node, _grouping(pf.idx) != _grouping(av.out)
        decay = (coef, tuple(f for f in fs if f is not pf))
        outer = terms[1 - d]
    if not _is_outer_product(outer, av.out):
        return None
    return Step(node, av, prev, decay, outer, prev_view)


def _state_factors(full: list) -> list:
    """The factors of a term indexed like the whole state that may be the state: where K = V = 1
    a decay sigmoid(x_t) [B, H, 1, 1] is indexed like the state S [B, H, 1, 1] it multiplies;
    of several such, the one that may be a state (an update, an input) where it is the only one."""
    if len(full) > 1:
        states = [f for f in full if _state_like(f.atom.node)]
        if len(states) == 1:
            return states
    return full


def expand_quotients(an: Analyzer, av: AV) -> AV:
    """av with a quotient x / y that a term reads whole (a tensor divided by a tensor is an
    atom to the algebra) read as x * (1 / y): the "inv" factor of y (exp(-L) for y = exp(L)).
    torchscale's update adds kv / sqrt(scale), an outer product scaled per head; the op takes
    the factor 1 / y into k or v (see loop._divisors)."""
    terms = tuple(_expanded_term(an, m, av.out) or m for m in av.terms)
    return av if terms == av.terms else AV(av.out, terms, av.keep, av.origin, av.root)


def _expanded_term(an: Analyzer, m: Mono, out: tuple) -> Optional[Mono]:
    quotients = [f for f in m[1] if is_full_atom(f, out) and not f.atom.fixed and op_name(f.atom.node) == "div"]
    if len(quotients) != 1:
        return None
    f = quotients[0]
    node = f.atom.node
    if len(node.args) != 2 or node.kwargs.get("rounding_mode") is not None:
        return None
    parts = [_operand_mono(an, node, x) for x in node.args]
    if None in parts:
        return None
    (cx, fs_x, out_x), (cy, fs_y, out_y) = parts
    inv = _inverse(fs_y)
    if inv is None or cy == 0:
        return None
    fs_x, inv = aligned(an, f.idx, out_x, fs_x), aligned(an, f.idx, out_y, inv)
    if fs_x is None or inv is None:
        return None
    rest = tuple(g for g in m[1] if g is not f)
    return (m[0] * cx / cy, rest + fs_x + inv)


def aligned(an: Analyzer, target: tuple, entries: tuple, fs: tuple) -> Optional[tuple]:
    """The factors fs of an operand whose axes are `entries`, on the quotient's variables
    `target` (right-aligned broadcasting). An operand axis the code merged from parts (a
    rotary key's K from its halves) is collapsed back onto the quotient's one variable, where
    every factor indexes those parts together; None where the axes do not line up."""
    mp: dict = {}
    off = len(target) - len(entries)
    for p, e in enumerate(entries):
        t = target[off + p] if off + p >= 0 else None
        if e is None:
            continue
        if t is None:
            return None
        if len(comps(e)) > 1 and len(comps(t)) == 1:
            fs = _collapsed(fs, comps(e), t)
            if fs is None:
                return None
            continue
        try:
            an.unify(t, e, mp)
        except Opaque:
            return None
        if resolve(t, mp) != t:
            return None  # the quotient's own variable would be split
    return tuple(sub_mono((1.0, fs), mp)[1])


def _collapsed(fs: tuple, parts: tuple, var: int) -> Optional[tuple]:
    """fs with the merged entry `parts` replaced by `var`; None where a factor indexes only
    some of the parts (or reads them inside an exponent)."""
    res = []
    for f in fs:
        idx = []
        for ent in f.idx:
            c = comps(ent)
            if c == parts:
                idx.append(var)
            elif set(c) & set(parts):
                return None
            else:
                idx.append(ent)
        if f.inner and set(parts) & factor_vars(f):
            return None
        res.append(Factor(f.kind, tuple(idx), f.atom, f.node, f.negate, f.inner, f.lower, f.diagonal))
    return tuple(res)


def _operand_mono(an: Analyzer, div: fx.Node, x) -> Optional[tuple]:
    """(coef, factors, out) of one operand of a division read as a product (fresh variables),
    or None where it is a sum or not a tensor."""
    if not isinstance(x, fx.Node) or an.versions.get((div, x), x) is not x:
        return None
    av = an.value(x)
    if av is None or av.keep is not None:
        return None
    if an.cuts(x, av):
        av = an.cut_av(x, av)
    if av is None or len(av.terms) != 1:
        return None
    av = an.instantiate(av)
    return av.terms[0][0], av.terms[0][1], av.out


def _inverse(fs: tuple) -> Optional[tuple]:
    """The factors of 1 / prod(fs): an atom a becomes inv(a), exp(L) becomes exp(-L). A tensor
    built from constants (torch.full((H, 1, 1), 2.0), sqrt(1 + arange(H))) becomes inv of it as
    an atom: the op divides by that node as by any other tensor (a mask, a negated const, is
    not a value to divide by)."""
    res = []
    for f in fs:
        if f.kind == "atom":
            res.append(Factor("inv", f.idx, atom=f.atom))
        elif f.kind == "const" and not f.negate and f.node is not None:
            res.append(Factor("inv", f.idx, atom=Atom(f.node)))
        elif f.kind == "exp":
            res.append(Factor("exp", f.idx, inner=tuple((-c, g) for c, g in f.inner)))
        else:
            return None
    return tuple(res)


def _decay_term(terms: tuple, full: list, out: tuple) -> Optional[int]:
    """Which of two terms decays the previous state: the one with one factor indexed like the
    whole state. Both may have one where K or V has size 1: v_t [B, H, V] is indexed like the
    state [B, H, 1, V] where it is read at no time index (a decode step, or a v_t each step
    computes); then the one whose factor may be a state (an update, an input), and of those
    the one with fewer other tensor factors (S * exp(g) rather than k * v), then the one of the
    state's rank (the cache [B, H, 1, V] rather than v_t [B, H, V] viewed to it, with k_t and a
    decay sigmoid(x) [B, H, 1, 1] alike at K of 1), then the one indexed as the state is (the
    cache [B, H, K, 1] rather than k_t [B, H, 1, K] transposed to it at V of 1), then the one
    whose other factors are fewer graph inputs (S * sigmoid(x) rather than k * v, alike where
    the V-first state is [B, H, 1, K] and v [B, H, 1]). (A full factor in the other term is no
    outer product, unless the state has a size-1 axis.)"""
    cands = [i for i in (0, 1) if len(full[i]) == 1]
    if len(cands) == 2:
        cands.sort(key=lambda i: (not _state_like(full[i][0].atom.node), sum(f.kind == "atom" for f in terms[i][1]),
                                  len(full[i][0].idx) != len(out), full[i][0].idx != out, _inputs(terms[i], full[i][0])))
    return cands[0] if cands else None


def _inputs(term: Mono, pf: Factor) -> int:
    """How many factors of a term besides pf are graph inputs read whole (k, v; not a decay the
    graph computes)."""
    return sum(f is not pf and f.kind == "atom" and f.atom.node.op == "placeholder" for f in term[1])


def _is_outer_product(m: Mono, out: tuple) -> bool:
    """Some two axes of the update are never indexed by one factor together (k^T v),
    unlike an elementwise product k * x. With K or V of size 1 the outer product is an
    elementwise product k * v, which a state with a size-1 axis may hold: which axes are
    which is then decided by the roles (see state_roles), as for any state."""
    return None in out or separates_axes(m, out_vars(out))


def accumulates_outer(st: Step) -> bool:
    """Whether a parsed step adds a true outer product k^T v: two axes of size above 1 that no
    factor indexes together. A state with a size-1 axis takes any added term as an outer
    product (see _is_outer_product); a residual stream x = x + f(x) at batch size 1 is no
    GLA state for that."""
    return st.outer is not None and _is_outer_product(st.outer, tuple(e for e in st.av.out if e is not None))


def is_full_atom(f: Factor, out: tuple) -> bool:
    """Whether f is a whole tensor read element for element as `out`, possibly through a view
    of another shape: the same variables in the same row-major order (a first state
    `bmm(k, v)` of [B * H, K, V] viewed as [B, H, K, V] by the update that decays it)."""
    return f.kind == "atom" and not f.atom.fixed and _flat(f.idx) == _flat(out)


def _flat(entries) -> list:
    return [c for e in entries for c in comps(e)]


def _grouping(entries) -> list:
    return [len(comps(e)) for e in entries]


def _regrouped(an: Analyzer, st: Step, like: tuple) -> Optional[Step]:
    """st with its axes grouped like `like` (the next step's), when both hold the same
    elements in the same order: only the shape of the state differs, not its values."""
    flat, target = _flat(st.av.out), _flat(like)
    if len(flat) != len(target) or any(an.sizes[a] != an.sizes[b] for a, b in zip(flat, target)):
        return None
    it = iter(flat)
    out = tuple(make_entry([next(it) for _ in comps(e)]) for e in like)
    return Step(st.node, AV(out, st.av.terms, st.av.keep, st.av.origin, st.av.root), st.prev, st.decay, st.outer)


def _align_states(an: Analyzer, found: dict) -> None:
    """Give a state the shape of the step that updates it, where the two differ (the first
    state computed by bmm on flattened heads): letters are read by axis position."""
    for st in list(found.values()):
        prev = found.get(st.prev) if isinstance(st, Step) and st.av is not None else None
        if isinstance(prev, Step) and prev.av is not None and _grouping(prev.av.out) != _grouping(st.av.out):
            aligned = _regrouped(an, prev, st.av.out)
            if aligned is None:  # the view splits the state's own axes: no step-by-step reading
                found[st.node] = "a state is viewed in a shape whose axes its update splits"
            else:
                found[st.prev] = aligned


def unsupported_update_reason(an: Analyzer, node: fx.Node) -> Optional[str]:
    """Why a sum that updates a state-shaped tensor from itself is not a GLA step."""
    if op_name(node) not in ("add", "sub"):
        return None
    av = an.value(node)
    if av is None or len(av.out) < 2 or parse_step(an, node) is not None:
        return None
    out_set = out_vars(av.out)
    selfish = [m for m in av.terms if any(is_full_atom(f, av.out) for f in m[1])]
    states = {s for s in _state_atoms(av) if not _part_of_sum(an, s, node, selfish)}
    if not states:
        return None
    summed = [m for m in av.terms if mono_vars(m) - out_set]
    if summed and any(_reads_states(an, m, states, node) for m in summed):
        return "the state is read inside its own update (delta-rule style)"
    if summed:
        return None  # a product summed over positions (a chunk's k^T v): the chunked form's to judge
    if len(av.terms) > 2:
        return "the update has more terms than a decay and an outer product"
    others = [m for m in av.terms if m not in selfish]
    if others and not _is_outer_product(others[0], av.out):
        why = "the update adds no outer product k^T v (elementwise recurrence)"
        return why + _decay_over_all(selfish, states, av.out)
    shared = _shared_outer(an, av, node)
    if shared is not None:
        why = ("the outer product k^T v the update adds is used outside the update too (e.g. an RWKV-style bonus "
               "u k^T v added to the state before its update in the read); expected it used by the update alone")
        return why + _decay_over_all(selfish, states | {shared}, av.out)
    return None


def _part_of_sum(an: Analyzer, s: fx.Node, update: fx.Node, terms: list) -> bool:
    """Whether `s` is the first part of a longer sum, (x + a) + b, rather than a state: a sum read
    by `update` alone, undecayed (its `terms` hold it times a number only), whose own terms read
    no state (loop-free code adding three tensors)."""
    reading = [fs for _, fs in terms if any(f.kind == "atom" and f.atom.node is s for f in fs)]
    if op_name(s) not in ("add", "sub") or list(s.users) != [update] or any(len(fs) != 1 for fs in reading):
        return False
    av = an.value(s)
    return av is not None and not _state_atoms(av)


def _state_atoms(av: AV) -> set:
    """The nodes a value reads whole, element for element, that may be states: an earlier update
    or a tensor from outside (`G[:, :1] - G` updates nothing)."""
    return {f.atom.node for _, fs in av.terms for f in fs if is_full_atom(f, av.out) and _state_like(f.atom.node)}


def _shared_outer(an: Analyzer, av: AV, update: fx.Node) -> Optional[fx.Node]:
    """The node of an update's term that is a whole outer product k^T v with other readers than
    the update (the algebra keeps such a node an atom, so the update reads as a sum of two
    state-like tensors, neither of them k^T v), or None."""
    for _, fs in av.terms:
        if len(fs) != 1 or not is_full_atom(fs[0], av.out):
            continue
        node = fs[0].atom.node
        value = an.value(node)
        if value is None or len(value.terms) != 1 or any(is_full_atom(f, value.out) for f in value.terms[0][1]):
            continue
        if _is_outer_product(value.terms[0], value.out) and set(an.users(node)) - {update}:
            return node
    return None


def _reads_states(an: Analyzer, m: Mono, states: set, update: fx.Node) -> bool:
    """Whether a term of `update` has a factor computed from one of `states` (the state
    itself, or a value derived from it before the update: a delta rule's S^T k)."""
    derived, frontier = set(states), list(states)
    stop = an.order[update]
    while frontier:
        for u in frontier.pop().users:
            if u not in derived and an.order.get(u, stop) < stop:
                derived.add(u)
                frontier.append(u)
    factors = list(m[1])
    while factors:
        f = factors.pop()
        factors += [g for _, inner in f.inner for g in inner]  # exp(w S) reads S too
        if f.kind == "atom" and f.atom.node in derived:
            return True
    return False


def _decay_over_all(selfish: list, states: set, out: tuple) -> str:
    """A decay indexed by every axis of the state (Mamba-1's exp(A[d, n] dt[d])) decays V as
    well as K: the second reason such a recurrence is not GLA."""
    axes = [e for e in out if e is not None]
    for _, fs in selfish:
        decay_vars = set().union(set(), *(factor_vars(f) for f in fs if f.kind != "atom" or f.atom.node not in states))
        if len(axes) >= 2 and out_vars(tuple(axes)) <= decay_vars:
            return "; its decay acts over every axis of the state (expected over K only, not V)"
    return ""


def _state_like(node: fx.Node) -> bool:
    return op_name(node) in ("add", "sub", "mul", "div") or node.op in ("placeholder", "get_attr")


def parse_read(an: Analyzer, node: fx.Node, states: dict) -> Optional[Read]:
    av = an.value(node)
    if av is None or av.keep is not None or len(av.terms) != 1:
        return None
    coef, fs = av.terms[0]
    sf = [f for f in fs if f.kind == "atom" and f.atom.node in states and not f.atom.fixed]
    if len(sf) != 1:
        return None
    sf = sf[0]
    summed = mono_vars(av.terms[0]) - out_vars(av.out)
    if len(summed) > 1:
        fs = _one_summed_axis(an, fs, sf, summed)
        if fs is None:
            return None
        sf = next(f for f in fs if f.kind == "atom" and f.atom.node in states and not f.atom.fixed)
        summed = mono_vars((coef, fs)) - out_vars(av.out)
    # the sum over K; nothing is summed where K has size 1 (q_t * S_t: K is a size-1 axis
    # of the state, which one state_roles decides)
    kvar = next(iter(summed), None)
    if kvar is not None and sf.idx.count(kvar) != 1 or kvar is None and None not in sf.idx:
        return None
    return Read(node, av, sf.atom.node, sf, kvar, [f for f in fs if f is not sf], coef)


def _one_summed_axis(an: Analyzer, fs: tuple, sf: Factor, summed: set) -> Optional[tuple]:
    """A read summed over the parts of one merged axis of the state (a rotary query, whose K
    the code stacked from halves, splits the state's K to match) read as summed over that
    axis, one variable: the factors with the parts collapsed; None for other sums."""
    parts = next((comps(e) for e in sf.idx if set(comps(e)) == summed and len(comps(e)) > 1), None)
    if parts is None:
        return None
    size = 1
    for c in parts:
        if not isinstance(an.sizes[c], int):
            return None
        size *= an.sizes[c]
    return _collapsed(fs, parts, an.fresh(size))


# ---- the steps of a graph ---------------------------------------------------------------
def find_steps(an: Analyzer) -> tuple[dict, list]:
    """Every state update of the graph, and near misses for updates that are not GLA steps
    (computed once per graph: the loop and decode recognizers share them). Steps 3 and
    later of a long loop proven periodic are not parsed: they are step 1 (see periodic.py)."""
    if "steps" not in an.memo:
        proofs = periodic.find(an, find_outputs(an))
        skip = set().union(*(p.nodes for p in proofs))
        found = {n: _read_node(an, n) for n in an.graph.nodes if n not in skip}
        _align_states(an, found)
        for p in proofs:
            if _samples_parse(an, p, found):
                found.update((p.states[i], Step(p.states[i], None, p.states[i - 1], None, None)) for i in p.interior)
            else:  # parsed after all, in graph order (each step's normal form reads the last's)
                p.failed = True
                found.update((n, _read_node(an, n)) for n in an.graph.nodes if n in p.nodes)
                _align_states(an, found)
        steps = {n: found[n] for n in an.graph.nodes if isinstance(found.get(n), Step)}
        near = [NearMiss("loop", found[n], [n]) for n in an.graph.nodes if isinstance(found.get(n), str)]
        an.memo["steps"] = (steps, near)
    return an.memo["steps"]


def _read_node(an: Analyzer, n: fx.Node):
    """n as a Step, or why it is an update but not a GLA step, or None."""
    return parse_step(an, n) or unsupported_update_reason(an, n)


def _samples_parse(an: Analyzer, p: periodic.Proof, found: dict) -> bool:
    """The head and steps 1 and 2 parse as GLA steps of the chain, with axes alike (a step
    sees of the previous state only its axes), and nothing else in steps 1 and 2 is a step
    from a state or a near miss: so each later step, having their structure, is one too."""
    for i in (0, 1, 2):
        st = found.get(p.states[i])
        if not isinstance(st, Step) or i and st.prev is not p.states[i - 1]:
            return False
    if not an.read_whole(p.states[0]):  # (a sum always is; the head may be a product k v)
        return False
    if len({_axes(an, found[p.states[i]].av) for i in (0, 1, 2)}) != 1:
        return False
    others = (found.get(n) for n in p.sample if n not in p.states)
    return not any(isinstance(x, str) or isinstance(x, Step) and x.prev is not None for x in others)


def _axes(an: Analyzer, av: AV) -> tuple:
    """The sizes of the variables of each axis of a value (an axis may merge several), as
    hashable keys: a symbolic size (`dynamic=True`) by its expression, which SymInt does not
    hash."""
    return tuple(tuple(_size_key(an.sizes[v]) for v in comps(e)) for e in av.out)


def _size_key(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def chains_of(steps: dict) -> list[list[Step]]:
    succ: dict = {}
    for st in steps.values():
        if st.prev is not None and st.prev in steps:
            succ.setdefault(st.prev, []).append(st)
    chains = []
    for st in steps.values():
        if st.prev is not None and st.prev in steps:
            continue  # not a head
        chain = [st]
        while len(succ.get(chain[-1].node, [])) == 1:
            chain.append(succ[chain[-1].node][0])
        chains.append(chain)
    return chains


def read_of_step(an: Analyzer, st: Step) -> Assembly:
    """The query read of a single step's new state, among its users (through views)."""
    states = {st.node: 0}
    found, frontier, parent = [], [st.node], {st.node: None}
    for _ in range(MAX_READ_DEPTH):
        nxt = []
        for n in frontier:
            for u in an.users(n):  # also a read of the cache the new state was copied into
                if u in parent:
                    continue
                parent[u] = n
                rd = parse_read(an, u, states)
                if rd is not None:
                    found.append(u)
                if rd is not None and rd.kvar is None or rd is None and (op_name(u) in VIEW_OPS or op_name(u) == "mul"):
                    nxt.append(u)  # a product q * S that sums nothing may be summed over K next
        frontier = nxt
    found = _outermost(found, parent)
    if not found:
        raise Reject("a one-step state update (decode) whose new state is not read by a query")
    if len(found) > 1:
        raise Reject("the new state is read by more than one query")
    return Assembly("read", found[0], found, -1)


def _outermost(found: list, parent: dict) -> list:
    """The reads that no other read is computed from: q * S before its sum over K reads
    like a read of K of size 1, and the sum is the read."""
    inner = set()
    for n in found:
        p = parent[n]
        while p is not None and p not in inner:
            inner.add(p)
            p = parent[p]
    return [n for n in found if n not in inner]


# ---- roles and letters -------------------------------------------------------------------
@dataclass
class Roles:
    kpos: int
    vpos: int
    batch: list  # state positions of the batch axes, in order

    def letter(self, pos: int) -> str:
        if pos == self.kpos:
            return "k"
        if pos == self.vpos:
            return "v"
        return BATCH_LETTERS[self.batch.index(pos)]


@dataclass
class Letters:
    """Index variables named by role letters. A state axis the code merged from parts
    (heads = groups x repeats) gets one upper-case sub-letter per part."""

    of_var: dict = field(default_factory=dict)  # var -> letter or sub-letter
    role_of: dict = field(default_factory=lambda: {c: c for c in "bhtkv1"})
    splits: dict = field(default_factory=dict)  # role -> its sub-letters
    sizes: dict = field(default_factory=dict)  # sub-letter -> size

    def groups(self, entries, of_var: Optional[dict] = None) -> list:
        """Role letters of each axis ('1' for size 1); parts of a role must come whole."""
        of_var = self.of_var if of_var is None else of_var
        res = []
        for e in entries:
            subs = [of_var.get(c) for c in comps(e)]
            if None in subs:
                raise Reject("an output is indexed by an axis the state does not have")
            res.append(self._collapse(subs) or "1")
        return res

    def _collapse(self, subs: list) -> str:
        out = ""
        while subs:
            role = self.role_of[subs[0]]
            parts = list(self.splits.get(role, role))
            if subs[: len(parts)] != parts:
                raise Reject("an output axis holds part of a merged axis of the state")
            subs = subs[len(parts) :]
            out += role
        return out


def state_letters(an: Analyzer, out: tuple, roles: Roles) -> Letters:
    letters = Letters()
    fresh = iter(SUB_LETTERS)
    for p, e in enumerate(out):
        cs = comps(e)
        if len(cs) == 1:
            letters.of_var[cs[0]] = roles.letter(p)
        elif cs:
            role = roles.letter(p)
            letters.splits[role] = ""
            for c in cs:
                sub = next(fresh)
                if not isinstance(an.sizes[c], int):
                    raise Reject("a merged state axis has a symbolic size")
                letters.of_var[c], letters.role_of[sub], letters.sizes[sub] = sub, role, an.sizes[c]
                letters.splits[role] += sub
    return letters


def read_letters(an: Analyzer, rd: Read, st: Step, letters: Letters) -> dict:
    """The read's variables named by the letters of the step's (position by position)."""
    res = {}
    # position by position in row-major order: the read may view the state in another shape
    cr, cs = _flat(rd.state_factor.idx), _flat(st.av.out)
    if len(cr) != len(cs) or any(an.sizes[r] != an.sizes[s] for r, s in zip(cr, cs)):
        raise Reject("the read splits the state's axes differently from its update")
    for r, s in zip(cr, cs):
        res[r] = letters.of_var[s]
    if rd.kvar is not None:
        res[rd.kvar] = "k"
    return res


def state_roles(st: Step, rd: Read) -> Roles:
    """Roles of the state's axes, from the last step parsed (every step has its structure).
    K is the axis the read sums over, V an axis neither the keys nor the query index. A role
    of size 1 has no variable (nothing is summed, nothing indexes it): it is a size-1 axis of
    the state, and which one does not matter (each holds one element); the last such axis is
    taken for V and the one before for K, as in the usual [..., K, V] layout."""
    if _grouping(rd.state_factor.idx) != _grouping(st.av.out):
        raise Reject("the last state is read in another shape than its update's")
    out = st.av.out
    kpos = rd.state_factor.idx.index(rd.kvar) if rd.kvar is not None else None
    kvars = set(comps(out[kpos])) if kpos is not None else set()
    kgroup_vars = set()
    for f in st.outer[1]:
        if kvars & factor_vars(f):
            kgroup_vars |= factor_vars(f)
    read_to_state = {}
    for e_read, e_state in zip(rd.state_factor.idx, out):
        read_to_state.update(zip(comps(e_read), comps(e_state)))
    q_vars_state = {read_to_state.get(v) for f in rd.q for v in factor_vars(f)}

    def free(p, avoid):
        return p != kpos and out[p] is not None and not set(comps(out[p])) & avoid

    cands = [p for p in range(len(out)) if free(p, kgroup_vars | q_vars_state)]
    ones = [p for p in range(len(out)) if out[p] is None and p != kpos]
    if not cands and len(ones) >= (kpos is None) + 1:  # V of size 1 (and K, where it has no axis yet)
        cands = ones
    if not cands and kpos is not None:
        cands = [p for p in range(len(out)) if free(p, kgroup_vars)]
    if not cands:
        raise Reject("cannot tell the value axis of the state")
    vpos = cands[-1]
    if kpos is None:  # K of size 1
        ones = [p for p in ones if p != vpos]
        if not ones:
            raise Reject("cannot tell the key axis of the state: the read sums over no axis")
        kpos = ones[-1]
    batch = [p for p in range(len(out)) if p not in (kpos, vpos)]
    if len(batch) > 2:
        raise Reject(f"the state has {len(batch)} batch axes; at most 2 (batch, head) are supported")
    return Roles(kpos, vpos, batch)
