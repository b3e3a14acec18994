"""The time-loop form: a Dynamo-unrolled recurrence

    S_t = S_{t-1} * d_t + k_t (x) v_t        (decay d_t = exp(g_t) over K, or absent)
    o_t = scale * sum_K q_t * S_t             (assembled by stack / cat / o[:, t] = ...)

and its one-step case, the decode step: ``S = S_cache * d + k (x) v; o = q S`` with no time
axis, the state read from a cache (a graph input) and usually written back into it.

Stages: ``find_steps`` reads every node as a possible state update; ``chains`` links the
updates S_{t-1} -> S_t; ``find_outputs`` finds the assembly whose elements read the states
(a single step's read is found among the users of its state); ``analyze_chain`` proves that
every step has the same structure with its time index t (consecutive, or reversed), maps
index variables to roles (batch b/h, key k, value v) and returns a ``Match`` whose ``apply``
inserts the GLA op (``placement.py`` says where, and how the state is written back).
Anything unproven is a near miss. A long loop whose steps ``periodic.py`` proves alike by
their structure is parsed at three steps only; every check holds for the others as for them.

A gate (or key, value, query) the loop body computes, `dA = exp(A * softplus(dt[:, t] + b))`,
is one node per step after unrolling. ``step_walk`` reads each as a function of slices of
tensors computed outside the steps; when every step's is the same function of its own slice t,
the op takes that function over the whole sequence (replayed on the un-sliced tensors, or the
steps' values stacked), and an `exp(x)` decay gives x itself as the log-gate.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .algebra import (
    _VIEW_OPS, AV, Analyzer, Atom, Factor, Mono, _rank, _unit_slice, comps, factor_vars, is_pointwise, make_entry,
    mono_vars, op_name, out_vars, storage_root,
)
from .consts import example_value, written_args
from .emit import Emitter, Group, LFactor, sizes_from
from .match import Match, NearMiss, Reject
from . import periodic, placement

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


@dataclass
class Assembly:
    kind: str  # "stack" | "cat" | "setitem" | "read" (a single step's read itself)
    result: fx.Node  # stack/cat node, or the buffer for setitem
    elements: list  # value nodes, in assembly order (time positions)
    dim: int  # the time axis of the result
    positions: list = field(default_factory=list)  # setitem: the time index of each element
    setitems: list = field(default_factory=list)
    # setitem through a one-step slice, `o[:, :, t:t + 1] = o_t`: the slot keeps the time axis
    keeps_time: bool = False


# ---- reading nodes ---------------------------------------------------------------------
def parse_step(an: Analyzer, node: fx.Node) -> Optional[Step]:
    if op_name(node) in _VIEW_OPS:
        return None  # a view or cast of a state is that state, not a further step
    av = an.value(node)
    if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2 or len(av.out) < 2:
        return None
    out_set = out_vars(av.out)
    terms = av.terms
    if not all(mono_vars(m) <= out_set for m in terms):
        return None
    full = [[f for f in fs if _is_full_atom(f, av.out)] for _, fs in terms]
    decay, prev, prev_view = None, None, False
    if len(terms) == 1:
        if full[0]:
            return None
        outer = terms[0]
    else:
        d = _decay_term(terms, full)
        if d is None:
            return None
        pf, (coef, fs) = full[d][0], terms[d]
        prev, prev_view = pf.atom.node, _grouping(pf.idx) != _grouping(av.out)
        decay = (coef, tuple(f for f in fs if f is not pf))
        outer = terms[1 - d]
    if not _is_outer_product(outer, av.out):
        return None
    return Step(node, av, prev, decay, outer, prev_view)


def _decay_term(terms: tuple, full: list) -> Optional[int]:
    """Which of two terms decays the previous state: the one with one factor indexed like the
    whole state. Both may have one where K or V has size 1: v_t [B, H, V] is indexed like the
    state [B, H, 1, V] where it is read at no time index (a decode step, or a v_t each step
    computes); then the one whose factor may be a state (an update, an input), and of those
    the one with fewer other tensor factors (S * exp(g) rather than k * v). (A full factor in
    the other term is no outer product, unless the state has a size-1 axis.)"""
    cands = [i for i in (0, 1) if len(full[i]) == 1]
    if len(cands) == 2:
        cands.sort(key=lambda i: (not _state_like(full[i][0].atom.node), sum(f.kind == "atom" for f in terms[i][1])))
    return cands[0] if cands else None


def _is_outer_product(m: Mono, out: tuple) -> bool:
    """Some two axes of the update are never indexed by one factor together (k^T v),
    unlike an elementwise product k * x. With K or V of size 1 the outer product is an
    elementwise product k * v, which a state with a size-1 axis may hold: which axes are
    which is then decided by the roles (see _roles), as for any state."""
    if None in out:
        return True
    out_set = out_vars(out)
    fvars = [factor_vars(f) for f in m[1] if f.kind == "atom"]
    axes = sorted(out_set)
    return any(
        not any(a in fv and b in fv for fv in fvars)
        and any(a in fv for fv in fvars)
        and any(b in fv for fv in fvars)
        for i, a in enumerate(axes)
        for b in axes[i + 1 :]
    )


def _is_full_atom(f: Factor, out: tuple) -> bool:
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


def diagnose_update(an: Analyzer, node: fx.Node) -> Optional[str]:
    """Why a sum that updates a state-shaped tensor from itself is not a GLA step."""
    if op_name(node) not in ("add", "sub"):
        return None
    av = an.value(node)
    if av is None or len(av.out) < 2 or parse_step(an, node) is not None:
        return None
    out_set = out_vars(av.out)
    selfish = [m for m in av.terms if any(_is_full_atom(f, av.out) for f in m[1])]
    # a state is an earlier update or comes from outside; `G[:, :1] - G` updates nothing
    if not any(_is_full_atom(f, av.out) and _state_like(f.atom.node) for m in selfish for f in m[1]):
        return None
    for m in av.terms:
        if mono_vars(m) - out_set and any(f.kind == "atom" and _rank(f.atom.node) == len(av.out) for f in m[1]):
            return "the state is read inside its own update (delta-rule style)"
    if len(av.terms) > 2:
        return "the update has more terms than a decay and an outer product"
    others = [m for m in av.terms if m not in selfish]
    if others and not _is_outer_product(others[0], av.out):
        return "the update adds no outer product k^T v (elementwise recurrence)"
    return None


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
        return None
    # the sum over K; nothing is summed where K has size 1 (q_t * S_t: K is a size-1 axis
    # of the state, which one _roles decides)
    kvar = next(iter(summed), None)
    if kvar is not None and sf.idx.count(kvar) != 1 or kvar is None and None not in sf.idx:
        return None
    return Read(node, av, sf.atom.node, sf, kvar, [f for f in fs if f is not sf], coef)


def find_outputs(an: Analyzer) -> list[Assembly]:
    """Stacks, cats, and buffers filled by `buf[..., t, ...] = value` along one axis, of values
    not written in place since they were computed (the elements are read as their nodes)."""
    if "outputs" not in an.memo:
        an.memo["outputs"] = _find_outputs(an)
    return an.memo["outputs"]


def _find_outputs(an: Analyzer) -> list[Assembly]:
    found = []
    buffers: dict = {}
    for n in an.graph.nodes:
        if n.op == "call_function" and n.target in (torch.stack, torch.cat) and n.args:
            elems = n.args[0]
            if isinstance(elems, (list, tuple)) and all(isinstance(e, fx.Node) and _fresh(an, n, e) for e in elems):
                dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
                rank = _rank(n)
                kind = "stack" if n.target is torch.stack else "cat"
                found.append(Assembly(kind, n, list(elems), dim % rank))
        elif n.op == "call_function" and n.target is operator.setitem:
            buf, index, value = n.args
            axis_pos = _time_index(buf, index)
            if axis_pos is None or not isinstance(value, fx.Node) or not _fresh(an, n, value):
                buffers.setdefault(buf, []).append(None)
                continue
            buffers.setdefault(buf, []).append((n, axis_pos, value))
    for buf, writes in buffers.items():
        if None in writes or not writes:
            continue
        axes = {(a, keeps) for _, (a, _, keeps), _ in writes}
        if len(axes) != 1:
            continue
        a, keeps = axes.pop()
        asm = Assembly("setitem", buf, [w[2] for w in writes], a, keeps_time=keeps)
        asm.positions = [w[1][1] for w in writes]
        asm.setitems = [w[0] for w in writes]
        found.append(asm)
    return found


def _fresh(an: Analyzer, consumer: fx.Node, x: fx.Node) -> bool:
    return an.versions.get((consumer, x), x) is x


def _time_index(buf, index) -> Optional[tuple]:
    """(axis, t, keeps_time) for an index that is full slices except on one axis, where it
    is an integer t (keeps_time False) or a one-step slice t:t + 1 (keeps_time True)."""
    if not isinstance(buf, fx.Node):
        return None
    rank = _rank(buf)
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        i = index.index(Ellipsis)
        index = index[:i] + (slice(None),) * (rank - len(index) + 1) + index[i + 1 :]
    index = index + (slice(None),) * (rank - len(index))
    if len(index) != rank:
        return None
    picks = []
    for a, i in enumerate(index):
        if isinstance(i, int) and not isinstance(i, bool):
            size = _size(buf, a)
            picks.append((a, i % size if isinstance(size, int) else i, False))
        elif not isinstance(i, slice):
            return None
        elif i != slice(None):
            t = _unit_slice(i, _size(buf, a))
            if t is None or t == "full":
                return None
            picks.append((a, t, True))
    return picks[0] if len(picks) == 1 else None


def _size(node: fx.Node, axis: int):
    return example_value(node).shape[axis]


# ---- the recognizers ---------------------------------------------------------------------
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
    return parse_step(an, n) or diagnose_update(an, n)


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
    """The sizes of the variables of each axis of a value (an axis may merge several)."""
    return tuple(tuple(an.sizes[v] for v in comps(e)) for e in av.out)


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    """Time loops: chains of two or more steps."""
    steps, near = find_steps(an)
    near = list(near)
    outputs = find_outputs(an)
    matches = []
    for chain in _chains(steps):
        if len(chain) < 2:
            continue
        try:
            matches.append(analyze_chain(an, chain, outputs))
        except Reject as e:
            near.append(NearMiss("loop", str(e), [s.node for s in chain]))
    return matches, near


def recognize_decode(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    """One-token decode steps: a single update of a state that comes from outside the graph
    (a cache), read by a query. Other single updates are left alone: `q (k^T v)` from a zero
    state, or a bonus term `S + u k^T v` inside a loop, is not a recurrence worth a kernel."""
    steps, _ = find_steps(an)
    matches, near = [], []
    for chain in _chains(steps):
        st = chain[0]
        if len(chain) != 1 or st.prev is None:
            continue
        if storage_root(st.prev).op not in ("placeholder", "get_attr"):
            continue
        if _updates(an).get(st.prev, 0) > 1:  # RWKV-6 reads S + u k^T v beside the update S * d + k^T v
            near.append(NearMiss("decode", "the cached state is updated twice (a bonus read, not a recurrence)", [st.node]))
            continue
        try:
            matches.append(analyze_chain(an, chain, [], single=True))
        except Reject as e:
            near.append(NearMiss("decode", str(e), [st.node]))
    return matches, near


def _updates(an: Analyzer) -> dict:
    """state -> how many sums add something to it (whole, decayed or not): GLA steps and
    updates of other shapes (a shared k^T v is one atom to the algebra)."""
    if "updates" in an.memo:
        return an.memo["updates"]
    counts = an.memo["updates"] = {}
    for n in an.graph.nodes:
        av = an.value(n) if op_name(n) in ("add", "sub") else None
        if av is None or len(av.terms) < 2:
            continue
        for x in {f.atom.node for _, fs in av.terms for f in fs if _is_full_atom(f, av.out)}:
            counts[x] = counts.get(x, 0) + 1
    return counts


def _chains(steps: dict) -> list[list[Step]]:
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


def _read_of_step(an: Analyzer, st: Step) -> Assembly:
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
                if rd is not None and rd.kvar is None or rd is None and (op_name(u) in _VIEW_OPS or op_name(u) == "mul"):
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


def _state_letters(an: Analyzer, out: tuple, roles: Roles) -> Letters:
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


def _read_letters(an: Analyzer, rd: Read, st: Step, letters: Letters) -> dict:
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


def analyze_chain(an: Analyzer, chain: list[Step], outputs: list[Assembly], single: bool = False) -> Match:
    """The Match of a chain of steps (raises Reject). A long loop proven periodic is parsed
    at its head and steps 1 and 2; each check below holds for its later steps as it does
    for step 1, at their own time index, and step 2 stands for the last (see periodic.py)."""
    proof = None if single else periodic.proof_of(an, [st.node for st in chain])
    if proof is not None:
        try:
            return _analyze(an, chain, outputs, False, proof)
        except _EveryStep:
            pass
    return _analyze(an, _parsed(an, chain), outputs, single, None)


def _parsed(an: Analyzer, chain: list[Step]) -> list[Step]:
    """The chain with its proven steps parsed after all, in order (each reads the last)."""
    res = [st if st.av is not None else parse_step(an, st.node) for st in chain]
    if None in res:
        raise Reject("a step proven like step 1 does not parse (internal error)")
    return res


class _EveryStep(Exception):
    """What the general path must decide from every step: a per-step tensor stacked from
    every step's node, or an element that does not parse as the read of its own state."""


def _analyze(an: Analyzer, chain: list[Step], outputs: list, single: bool, proof) -> Match:
    if chain[0].prev is not None and chain[0].prev_view:
        raise Reject("the initial state is read through a view of another shape")
    states = {st.node: i for i, st in enumerate(chain)}
    if single:
        asm = _read_of_step(an, chain[0])
        reads = {chain[0].node: parse_read(an, asm.result, states)}
    else:
        asm, reads = _assembly_of(an, chain, states, outputs, proof)
    n = len(chain)
    seen = chain if proof is None else [chain[i] for i in proof.analyzed]
    roles = _roles(seen[-1], reads[seen[-1].node])
    _check_state_free(chain, seen, reads)
    time_axes = _time_axes(an, seen, reads)
    shared = {"steps": n, "stacks": {}, "invariants": {}}  # see _atom_lfactor
    lifted = [_lift_step(an, st, reads.get(st.node), roles, time_axes, shared) for st in seen]
    if proof is not None and shared["stacks"]:
        raise _EveryStep  # (the stack needs the interior steps' nodes)
    taus = _taus(lifted, proof, n)
    reverse = False
    if single:
        if taus[0] is not None:
            raise Reject("a single step reads a time slice")
    elif any(t is None for t in taus):
        raise Reject("a step reads no time slice of its inputs")
    elif taus == list(range(n - 1, -1, -1)):
        reverse = True
    elif taus != list(range(n)):
        raise Reject(f"steps read time indices {taus[:6]}..., not consecutive")
    if not single:
        _check_time_order(asm, reads, {st.node: tau for st, tau in zip(chain, taus)})
    _check_same_structure(chain, lifted)  # (with a proof, lifted step 2 stands for the last)
    for by_tau in shared["stacks"].values():
        if chain[0].prev is None and taus[0] not in by_tau and taus[1] in by_tau:
            by_tau[taus[0]] = by_tau[taus[1]]  # the first decay multiplies a zero state: any gate will do
        if set(by_tau) != set(range(n)):
            raise Reject("a tensor computed inside the loop is not computed at every step")
    time_sizes = {(node, axis) for lf in lifted for node, axis in lf["time_axes"]}
    for node, axis in time_sizes:
        size = _size(node, axis)
        if size != n:
            raise Reject(f"the loop runs {n} steps over a time axis of size {size}")
    return _build_match(an, chain, reads, asm, lifted[-1], reverse)


def _taus(lifted: list, proof, n: int) -> list:
    """The time index each step reads; a later step of a periodic loop reads step 1's moved
    on by as many steps as it is further (its slices' indices are step 1's so moved)."""
    if proof is None:
        return [lf["tau"] for lf in lifted]
    taus = [None] * n
    for i, lf in zip(proof.analyzed, lifted):
        taus[i] = lf["tau"]
    if taus[1] is not None and taus[2] is not None:
        for i in proof.interior:
            taus[i] = taus[1] + (i - 1) * (taus[2] - taus[1])
    return taus


def _check_same_structure(chain: list[Step], lifted: list) -> None:
    """Every step is the last one (which is emitted) at its own time index."""
    for key in ("q", "k", "v"):
        sigs = {lf[key][0] for lf in lifted if lf[key] is not None}
        if len(sigs) != 1:
            raise Reject(f"the {key} of the steps differ in structure")
    last = lifted[-1]
    if any(lf.get("scale") != last.get("scale") for lf in lifted):
        raise Reject("the outputs of the steps are scaled differently")
    if any(lf.get("read_groups") != last.get("read_groups") for lf in lifted):
        raise Reject("the outputs of the steps are laid out differently")
    decays = [lf["decay"] for lf in lifted[1:]] + ([lifted[0]["decay"]] if chain[0].prev is not None else [])
    if len({d[0] if d is not None else None for d in decays}) > 1:
        raise Reject("the decay differs in structure between steps")


def _check_time_order(asm: Assembly, reads: dict, tau_of: dict) -> None:
    """Output position i along the assembled time axis must hold the read of step time i."""
    by_element = {r.node: tau_of[r.state] for r in reads.values()}
    taus = [by_element[e] for e in asm.elements]
    positions = asm.positions if asm.kind == "setitem" else list(range(len(asm.elements)))
    if taus != list(positions):
        raise Reject("the outputs are not assembled in time order (o[t] must hold step t)")
    if asm.kind == "setitem" and _size(asm.result, asm.dim) != len(positions):
        # rows no step writes keep the buffer's own values, which the op's output lacks
        raise Reject("the output buffer has more time steps than the loop writes")


def _check_state_free(chain: list[Step], seen: list[Step], reads: dict) -> None:
    """The inputs of an update or of a read must not be computed from the states (a delta
    rule reads S_{t-1} to form its value; RWKV-style bonuses read it before the update).
    The initial state counts: a decode step's value must not be computed from the cache.
    Checked for the steps `seen` (parsed), computed from any state of the chain."""
    states = {st.node for st in chain} | ({chain[0].prev} if chain[0].prev is not None else set())
    derived: set = set()
    frontier = list(states)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in derived and u not in states:
                derived.add(u)
                frontier.append(u)
    factors = [f for st in seen for _, fs in st.av.terms for f in fs]
    factors += [f for st in seen if st.node in reads for f in reads[st.node].q]
    while factors:
        f = factors.pop()
        factors += [g for _, inner in f.inner for g in inner]  # a gate exp(w S) reads S too
        if f.kind == "atom" and f.atom.node in derived:
            raise Reject("the update reads the state it updates (delta-rule style)")


def _time_axes(an: Analyzer, chain: list[Step], reads: dict) -> set:
    """(ident, axis) pairs whose integer indices change from step to step: the time axes.
    Constant selections (q, k, v of `qkv.unbind(2)`) index the same set in every step. A
    tensor the step computes from slices (see step_walk) counts with the slices it reads.
    Indices are compared per part of the step (decay, outer product, read) among the steps
    that have it: the first step's decay multiplies a zero state and is left out."""
    states = {st.prev for st in chain}
    per_step = []
    for st in chain:
        values: dict = {}
        for part, mono in (("decay", st.decay), ("outer", st.outer)):
            if mono is not None:
                _fixed_indices(an, mono[1], states, part, values)
        if st.node in reads:
            _fixed_indices(an, reads[st.node].q, states, "read", values)
        per_step.append(values)
    keys = set().union(*per_step)
    return {key[1:] for key in keys if len({frozenset(v[key]) for v in per_step if key in v}) > 1}


def _fixed_indices(an: Analyzer, factors, states: set, part: str, values: dict) -> None:
    """values[(part, ident, axis)]: the fixed indices the factors read (inside exp too)."""
    for f in factors:
        walk = step_walk(an, f.atom.node) if f.kind == "atom" and f.atom.node not in states else None
        if walk is not None:
            for leaf in walk.params:
                for ident, axis, index, _ in leaf:
                    values.setdefault((part, ident, axis), set()).add(index)
        if f.kind == "atom":  # `k[:, t]` of a walked k = qkv.unbind(2)[1] reads t here
            for axis, index in f.atom.fixed:
                values.setdefault((part,) + _fixed_key(f.atom.node, axis, walk), set()).add(index)
        for _, inner in f.inner:
            _fixed_indices(an, inner, states, part, values)


def _fixed_key(node: fx.Node, axis: int, walk: Optional[StepWalk]) -> tuple:
    """What a fixed index of an atom indexes, named alike in every step: the node, or for a
    node with a walk (one node per step, or q = qkv.unbind(2)[0] shared by all) the walk's
    structure, as slices of it name it (see _slice_walk)."""
    return (node, axis) if walk is None else (walk.id, axis)


def _assembly_of(an: Analyzer, chain, states, outputs, proof=None):
    for asm in outputs:
        if proof is not None and asm is proof.assembly:
            return asm, _proven_reads(an, chain, states, proof)
        reads = [parse_read(an, e, states) for e in asm.elements]
        if not reads or any(r is None for r in reads):
            continue
        by_state = {r.state: r for r in reads}
        if len(by_state) != len(chain) or set(by_state) != set(states):
            if set(by_state) <= set(states):
                raise Reject("the output reads only some of the states")
            continue
        return asm, by_state
    raise Reject(
        "the states are not read into an assembled output (stack, cat or o[:, t] = ...); "
        "e.g. the read is normalized or reads the state before its update"
    )


def _proven_reads(an: Analyzer, chain, states, proof) -> dict:
    """state -> Read: parsed where the step is; an interior step's read is step 1's, of its
    own state (its window has step 1's structure, the read included)."""
    reads = {}
    for i in proof.analyzed:
        rd = parse_read(an, proof.elements[i], states)
        if rd is None or rd.state is not chain[i].node:
            raise _EveryStep
        reads[rd.node] = rd
    first = reads[proof.elements[1]]
    for i in proof.interior:
        reads[proof.elements[i]] = Read(proof.elements[i], None, chain[i].node, None, first.kvar, [], first.coef)
    return {reads[e].state: reads[e] for e in proof.assembly.elements}  # in the general path's order


def _roles(st: Step, rd: Read) -> Roles:
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


def _lift_step(an: Analyzer, st: Step, rd: Optional[Read], roles: Roles, time_axes: set, shared: dict) -> dict:
    """Per-step structure with index vars replaced by role letters and time slices by 't'."""
    letters = _state_letters(an, st.av.out, roles)
    vvars, kvars = set(comps(st.av.out[roles.vpos])), set(comps(st.av.out[roles.kpos]))
    ctx = {"taus": set(), "time_axes": set(), "is_time": time_axes, "an": an, "shared": shared}
    if kvars:
        kf = [f for f in st.outer[1] if kvars & factor_vars(f)]
        vf = [f for f in st.outer[1] if not kvars & factor_vars(f)]
    elif vvars:  # K of size 1: the keys are the factors that do not run along V (none: k = 1)
        vf = [f for f in st.outer[1] if vvars & factor_vars(f)]
        kf = [f for f in st.outer[1] if not vvars & factor_vars(f)]
    else:  # K and V of size 1, k v a product of numbers: the first tensor is k, so that the op
        # multiplies k and v as the user's code did (a product of two bf16 tensors the
        # replacement computed would be rounded to bf16)
        kf = [f for f in st.outer[1] if f.kind == "atom"][:1]
        vf = [f for f in st.outer[1] if not any(f is g for g in kf)]
    if kvars and not kf:
        raise Reject("the update has no key factor along K")
    if any(vvars & factor_vars(f) for f in kf):
        raise Reject("a factor of the outer product spans both K and V")
    if vvars and not any(vvars & factor_vars(f) for f in vf):
        raise Reject("the update has no value factor along V")
    res = {
        "k": _group(kf, 1.0, letters.of_var, ctx),
        "v": _group(vf, st.outer[0], letters.of_var, ctx),
        "decay": _decay(st, letters.of_var, vvars, ctx),
        "q": None,
        "letters": letters,
        "state_groups": letters.groups(st.av.out),
    }
    if rd is not None:
        if rd.state is not st.node:
            raise Reject("an output reads a state other than the one its step produced")
        rletter = _read_letters(an, rd, st, letters)
        res["q"] = _group(rd.q, 1.0, rletter, ctx, allow_empty=False)
        if any(letters.role_of.get(c, c) == "v" for lf in res["q"][1].factors for c in lf.letters):
            raise Reject("the query is indexed by the value axis")
        res["scale"] = rd.coef
        res["read_groups"] = letters.groups(rd.av.out, rletter)
    taus = ctx["taus"]
    if len(taus) > 1:
        raise Reject(f"one step reads several time indices {sorted(taus)}")
    res["tau"] = next(iter(taus)) if taus else None
    res["time_axes"] = ctx["time_axes"]
    return res


def _group(factors, coef, letter, ctx, allow_empty=True):
    """(signature, Group) of a product of atoms."""
    lfs = []
    for f in factors:
        if f.kind in ("const", "scalar"):
            lfs.append(_lfactor(f.node, (), [_axis(e, letter, ctx) for e in f.idx]))
            continue
        if f.kind != "atom":
            raise Reject(f"an input factor is a {f.kind}, expected a tensor")
        lfs.append(_atom_lfactor(f, letter, ctx))
    if not lfs and not allow_empty:
        raise Reject("an output has no query factor")
    sig = (coef, tuple(sorted((_lf_key(lf) for lf in lfs), key=_sort_key)))
    return sig, Group(coef, tuple(lfs))


def _lf_key(lf: LFactor) -> tuple:
    """What the factor is: its node, or for a per-step tensor the function every step computes."""
    return (lf.node.name if lf.lifted is None else lf.lifted.sig, lf.letters, lf.select, lf.unflatten)


def _sort_key(key: tuple) -> tuple:
    """An order of factor keys (products commute); a per-step function's key holds nodes,
    which do not compare: equal keys have equal hashes."""
    return (0, key) if isinstance(key[0], str) else (1, hash(key))


def _axis(entry, letter, ctx) -> tuple:
    """(letters, sizes) of one axis: '1' for size 1, several letters for an axis the code
    merged from roles (with the size of each)."""
    if entry is None:
        return "1", (1,)
    cs = comps(entry)
    if any(c not in letter for c in cs):
        raise Reject("an input is indexed by an axis the state does not have")
    return "".join(letter[c] for c in cs), tuple(ctx["an"].sizes[c] for c in cs)


def _atom_lfactor(f: Factor, letter, ctx) -> LFactor:
    atom = f.atom
    axes = [_axis(e, letter, ctx) for e in f.idx]  # per free axis of the atom
    walk = step_walk(ctx["an"], atom.node)
    if walk is not None:
        varies, sig, lift = lift_step_tensor(walk, ctx)
        if varies:  # the whole sequence, time first; the atom's own fixed axes are constant
            per_axis = [("t", None)] + axes
            shape = (lift.steps,) + tuple(example_value(atom.node).shape)
            return _lfactor(atom.node, tuple((a + 1, i) for a, i in atom.fixed), per_axis, lift, shape)
        # the same tensor every step, computed anew: the first step's
        atom = Atom(ctx["shared"]["invariants"].setdefault(sig, atom.node), atom.fixed)
    select, time = [], []
    for axis, index in atom.fixed:
        if _fixed_key(atom.node, axis, walk) in ctx["is_time"]:
            ctx["taus"].add(index)
            ctx["time_axes"].add((atom.node, axis))
            time.append(axis)
        else:
            select.append((axis, index))
    if len(time) > 1:
        raise Reject("an input is indexed by the step at more than one position")
    free = atom.free_axes()
    selected = {a for a, _ in select}
    # letters name the axes left after every fixed non-time axis; 't' back among them
    per_axis = [("t", None) if a in time else axes[free.index(a)] for a in range(_rank(atom.node)) if a not in selected]
    return _lfactor(atom.node, tuple(select), per_axis)


def _lfactor(node: fx.Node, select: tuple, per_axis: list, lifted=None, shape=None) -> LFactor:
    """An LFactor, unflattening the axes that carry several letters."""
    letters = "".join(ls for ls, _ in per_axis)
    if all(len(ls) == 1 for ls, _ in per_axis):
        return LFactor(node, letters, select, lifted=lifted)
    shape = example_value(node).shape if shape is None else shape
    axes = [a for a in range(len(shape)) if a not in {a for a, _ in select}]
    sizes = []
    for a, (ls, sz) in zip(axes, per_axis):
        sizes += [shape[a]] if len(ls) == 1 else list(sz)
    if not all(isinstance(s, int) for s in sizes):
        raise Reject("an input's merged axis has a symbolic size")
    return LFactor(node, letters, select, tuple(sizes), lifted)


def _decay(st: Step, letter, vvars, ctx):
    """(signature, gate description) of the decay monomial of a step."""
    if st.decay is None:
        return None
    coef, fs = st.decay
    if coef <= 0:
        raise Reject("the decay factor is not positive")
    terms = []  # (coef, LFactor list, is_log) : log-gate = sum of terms
    for f in fs:
        if vvars & factor_vars(f):
            raise Reject("the gate is broadcast over V, expected over K")
        if f.kind == "exp":
            for c, inner in f.inner:
                if any(g.kind != "atom" for g in inner):
                    raise Reject("the exponent of the decay is not a product of tensors")
                terms.append((c, tuple(_atom_lfactor(g, letter, ctx) for g in inner), False))
        elif f.kind == "atom" and _step_exp_input(ctx["an"], f.atom.node) is not None:
            # exp(x) each step computes, x no linear form (exp(dt_t * -exp(A_log))): x is the log-gate
            x = Factor("atom", f.idx, atom=Atom(_step_exp_input(ctx["an"], f.atom.node), f.atom.fixed))
            terms.append((1.0, (_atom_lfactor(x, letter, ctx),), False))
        elif f.kind == "atom" and _positive(f.atom.node):
            terms.append((1.0, (_atom_lfactor(f, letter, ctx),), True))
        else:
            raise Reject("the decay is not exp(...) of a log-gate or a positive constant")
    keys = [(c, tuple(_sort_key(_lf_key(lf)) for lf in lfs), lg) for c, lfs, lg in terms]
    sig = (coef, tuple(sorted(keys)))
    return sig, (coef, terms)


def _step_exp_input(an: Analyzer, node: fx.Node) -> Optional[fx.Node]:
    """x of a node exp(x) (same shape) that a step computes from its time slices. (An exp computed
    outside the loop stays a positive atom, read as log(exp(x)).)"""
    if step_walk(an, node) is None:
        return None
    if not (node.op == "call_function" and node.target is torch.exp or node.op == "call_method" and node.target == "exp"):
        return None
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    xv, nv = example_value(x), example_value(node)
    if an.versions.get((node, x), x) is not x or not isinstance(xv, torch.Tensor) or xv.shape != nv.shape:
        return None
    return an.canon.get(x, x)


def _positive(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (torch.sigmoid, torch.exp):
        return True
    return node.op == "call_method" and node.target in ("sigmoid", "exp")


# ---- building the replacement -------------------------------------------------------------
def _build_match(an, chain, reads, asm, last, reverse) -> Match:
    st_last = chain[-1]
    head = chain[0]
    single = asm.kind == "read"
    letters = last["letters"]
    decay = last["decay"]
    gate_kind, gate_letters = _gate_kind(decay, letters)
    out_groups = _assembly_groups(asm, last["read_groups"])
    scale = last["scale"]
    sizes = _role_sizes(last, letters, single)
    shapes = {c.upper(): _shape(sizes, letters, c) for c in "bthkv"}
    q_layout = last["q"][1].factors[0].letters if last["q"][1].factors else ""
    plan = placement.plan(an, [s.node for s in chain], reads, asm, _dependencies(last, head), head.prev)

    def apply(txn) -> None:
        em = Emitter(txn, plan.anchor, sizes, letters.splits)
        inputs = _emit_inputs(em, last, decay, gate_kind, gate_letters)
        wb = plan.fused_write_back()
        if wb is not None:
            o = placement.emit_fused(em, inputs, wb, last["state_groups"], scale, reverse)
            placement.rewire(txn, asm, _cast(em, em.relayout(o, "bthv", out_groups), asm.result), None, None)
            return
        op, o, ht = _emit_op(em, inputs, head, last["state_groups"], scale, reverse)
        o_user = _cast(em, em.relayout(o, "bthv", out_groups), asm.result)
        ht_user = _cast(em, em.relayout(ht, "bhkv", last["state_groups"]), st_last.node)
        placement.rewire(txn, asm, o_user, st_last.node, ht_user)
        if not ht_user.users:  # nobody reads the final state: the kernel need not store it
            op.update_arg(7, False)

    return Match(
        form="decode" if single else "loop",
        gate=gate_kind,
        layout=q_layout,
        shapes=shapes,
        nodes=[s.node for s in chain] + [r.node for r in reads.values()],
        apply=apply,
        options={"reverse": reverse, "initial_state": head.prev is not None, "scale": scale},
    )


def _gate_kind(decay, letters: Letters):
    if decay is None:
        return "none", ""
    coef, terms = decay[1]
    roles = set()
    for _, lfs, _ in terms:
        for lf in lfs:
            roles |= {letters.role_of.get(c, c) for c in lf.letters} - {"1"}
    if not terms and coef == 1.0:
        return "none", ""
    if "k" in roles:
        return "vector", "bthk"
    if "t" in roles or "b" in roles:
        return "scalar", "bth"
    return "constant", "h"


def _assembly_groups(asm: Assembly, elem: list) -> list:
    """The role letters of each axis of the user's output."""
    if any("k" in g for g in elem):
        raise Reject("the output keeps the key axis")
    if asm.kind == "read":
        return elem
    if asm.kind == "stack":
        return elem[: asm.dim] + ["t"] + elem[asm.dim :]
    if asm.kind == "cat":
        if elem[asm.dim] != "1":
            raise Reject("the concatenated outputs are not one step long")
        return elem[: asm.dim] + ["t"] + elem[asm.dim + 1 :]
    # setitem: the value broadcasts into the slot (the buffer without its time axis, or with
    # it at size 1 for a one-step slice)
    slot = _rank(asm.result) - (not asm.keeps_time)
    while len(elem) > slot and elem[0] == "1":
        elem = elem[1:]
    if len(elem) != slot:
        raise Reject("the written output does not fill the buffer slot")
    if not asm.keeps_time:
        return elem[: asm.dim] + ["t"] + elem[asm.dim :]
    if elem[asm.dim] != "1":
        raise Reject("the written outputs are not one step long")
    return elem[: asm.dim] + ["t"] + elem[asm.dim + 1 :]


def _role_sizes(last, letters: Letters, single: bool) -> dict:
    factors = [lf for key in ("q", "k", "v") for lf in last[key][1].factors]
    sizes = sizes_from(factors)
    sizes.update(letters.sizes)
    for c in "kv":  # a role of size 1, which no factor need have
        if c not in "".join(last["state_groups"]):
            sizes[c] = 1
    if single:
        sizes["t"] = 1
    return sizes


def _shape(sizes: dict, letters: Letters, c: str):
    if c in letters.splits:
        return math.prod(letters.sizes[s] for s in letters.splits[c])
    s = sizes.get(c, 1)
    return _size(*s) if isinstance(s, tuple) else s


@dataclass
class Inputs:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    g: Optional[fx.Node]
    g_gamma: Optional[fx.Node]


def _emit_inputs(em: Emitter, last, decay, gate_kind, gate_letters) -> Inputs:
    q = em.lift(last["q"][1], "bthk")
    k = _lift_or_ones(em, last["k"][1], "bthk", q)
    v = _lift_or_ones(em, last["v"][1], "bthv", q)
    g, g_gamma = None, None
    if gate_kind != "none":
        gate = _emit_gate(em, decay[1], gate_letters, q)
        if gate_kind == "constant":
            g_gamma = gate
        else:
            g = gate
    return Inputs(q, k, v, g, g_gamma)


def _lift_or_ones(em: Emitter, group: Group, out: str, like: fx.Node) -> fx.Node:
    """The group as a tensor; a group with no tensor is the keys (values) of an update
    k^T v whose K (V) has size 1 and that holds only the other side: its numbers times ones."""
    if any(isinstance(example_value(lf.node), torch.Tensor) for lf in group.factors):
        return em.lift(group, out)
    node = em.call("new_ones", like, [em.size(c) for c in out], op="call_method")
    for lf in group.factors:
        node = em.call(torch.mul, node, lf.node)
    return em.call(torch.mul, node, group.coef) if group.coef != 1.0 else node


def _emit_op(em: Emitter, x: Inputs, head, state_groups, scale, reverse):
    h0 = None
    if head.prev is not None:
        h0 = em.as_float32(em.relayout(head.prev, state_groups, "bhkv"))
    op = em.call(
        torch.ops.gla_inductor.chunk_fwd.default, x.q, x.k, x.v, x.g, x.g_gamma, h0, float(scale), True, reverse
    )
    o = em.call(operator.getitem, op, 0)
    ht = em.call(operator.getitem, op, 1)
    return op, o, ht


def _emit_gate(em: Emitter, decay, letters: str, like: fx.Node) -> fx.Node:
    coef, terms = decay
    total = None
    for c, lfs, is_log in terms:
        node = em.lift(Group(c if not is_log else 1.0, tuple(lfs)), letters, full=False)
        if is_log:
            node = em.call(torch.log, node)
            if c != 1.0:
                node = em.call(torch.mul, node, c)
        total = node if total is None else em.call(torch.add, total, node)
    shape = [em.size(ch) for ch in letters]
    if total is None:
        total = em.call("new_zeros", like, shape, dtype=torch.float32, op="call_method")
    if coef != 1.0:
        total = em.call(torch.add, total, math.log(coef))
    return em.expand_to(em.as_float32(total), letters)


def _cast(em: Emitter, node: fx.Node, like: fx.Node) -> fx.Node:
    want = example_value(like).dtype
    if example_value(node).dtype != want:
        node = em.call("to", node, want, op="call_method")
    return node


def _dependencies(last, head) -> list:
    lfs = [lf for key in ("q", "k", "v") for lf in last[key][1].factors]
    if last["decay"] is not None:
        lfs += [lf for _, terms, _ in last["decay"][1][1] for lf in terms]
    deps = [d for lf in lfs for d in (lf.lifted.deps() if lf.lifted is not None else [lf.node])]
    if head.prev is not None:
        deps.append(head.prev)
    return list(dict.fromkeys(deps))
# ---- tensors each step computes from its own time slices ------------------------------------
# Dynamo unrolls `dt = F.softplus(dt_raw[:, t] + dt_bias)` into one node per step, each an
# opaque atom to the algebra, so the steps' decays (or keys, values) name different nodes.
# `step_walk` reads such a node as a function of slices of tensors computed outside the
# steps; steps whose walks agree but for the time index compute the same function, and the
# emitted op reads it once over the whole sequence: replayed on the un-sliced tensors (time
# first), or, for an op this replay does not know, the steps' own nodes stacked over time.
MAX_STEP_NODES = 48  # ops in one step's computation of one tensor


class _Unknown(Exception):
    """Arguments `step_walk` cannot key (symbolic, tensors, unhashable)."""


@dataclass(frozen=True, eq=False)
class StepWalk:
    """One step's computation of `node`. kind "in": an input of the walk, the same tensor
    whichever step reads it (`node` is the canonical node); "slice": `node` reads `base` at
    fixed indices and is otherwise a view of it; "op": `node` applied to its inputs' walks
    (`children`). A slice of a base that is not an input has the base's walk as its child."""

    kind: str
    node: fx.Node
    key: tuple  # the structure with the slice indices left out, inputs' walks by their ids
    id: int  # equal for equal keys (so a key hashes in the time of its own arguments)
    # per slice read, in a fixed order: ((ident, axis, index, base), ...); ident names the
    # sliced tensor the same way in every step (the key of its walk), base is the node
    params: tuple
    size: int
    children: dict = field(default_factory=dict)  # input node -> its walk
    base: Optional[fx.Node] = None  # "slice": the tensor sliced
    how: tuple = ()  # "slice": ("getitem", items) | ("select" | "unbind" | "narrow", dim)


def _slice_of(an: Analyzer, n: fx.Node) -> Optional[tuple]:
    """(base, how, [(axis, index, item position)]) for a node that reads fixed indices of a
    tensor: x[..., i, ...] (ints or one-element slices), x.select(d, i), x.unbind(d)[i],
    x.narrow(d, i, 1). Other slices are kept as they are (part of the structure)."""
    name = op_name(n)
    if name not in ("getitem", "select", "narrow") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src = n.args[0]
    if name == "getitem" and op_name(src) == "unbind":
        base, dim, index, how = src.args[0], _arg(src, 1, "dim", 0), n.args[1], "unbind"
        if an.versions.get((src, base), base) is not base:
            return None
    elif name == "getitem":
        return _getitem_slices(an, n)
    elif name == "select":
        base, dim, index, how = src, _arg(n, 1, "dim", None), _arg(n, 2, "index", None), "select"
    else:
        base, dim, index, how = src, _arg(n, 1, "dim", None), _arg(n, 2, "start", None), "narrow"
        if _arg(n, 3, "length", None) != 1:
            return None
    if not isinstance(base, fx.Node) or not _plain_int(dim) or not _plain_int(index):
        return None
    if an.versions.get((n, src), src) is not src:
        return None
    rank = _rank(base)
    if not rank:
        return None
    dim %= rank
    index = _normal_index(index, _size(base, dim))
    if index is None:
        return None
    return base, (how, dim), [(dim, index, None)]


def _getitem_slices(an: Analyzer, n: fx.Node) -> Optional[tuple]:
    base, index = n.args[0], n.args[1]
    if an.versions.get((n, base), base) is not base:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, slice) or _plain_int(i) for i in index):
        return None  # tensor or symbolic indices
    rank = _rank(base)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if index.count(Ellipsis) > 1 or n_real > rank:
        return None
    items: list = []
    for i in index:
        items += [slice(None)] * (rank - n_real) if i is Ellipsis else [i]
    items += [slice(None)] * (rank - sum(1 for i in items if i is not None))
    found, axis = [], 0
    for pos, i in enumerate(items):
        if i is None:
            continue
        size = _size(base, axis)
        if isinstance(i, slice):
            unit = _unit_slice(i, size) if all(x is None or _plain_int(x) for x in (i.start, i.stop, i.step)) else None
            i = unit if isinstance(unit, int) and not isinstance(unit, bool) else None
        if i is not None:
            index = _normal_index(i, size)
            if index is None:
                return None
            found.append((axis, index, pos))
        axis += 1
    if not found:
        return None
    return base, ("getitem", tuple(items)), found


def _arg(n: fx.Node, pos: int, name: str, default):
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)


def _plain_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _normal_index(index: int, size) -> Optional[int]:
    if isinstance(size, int):
        return index % size if -size <= index < size else None
    return index if index >= 0 else None


def _sliced(an: Analyzer) -> set:
    """The nodes that read a slice at fixed indices, or are computed from one."""
    if "sliced" not in an.memo:
        sliced: set = set()
        for n in an.nodes:
            if any(x in sliced for x in n.all_input_nodes) or _slice_of(an, n) is not None:
                sliced.add(n)
        an.memo["sliced"] = sliced
    return an.memo["sliced"]


def step_walk(an: Analyzer, node: fx.Node) -> Optional[StepWalk]:
    """How `node` is computed from slices of tensors computed outside the steps; None for a
    node that reads no slice, or that is an input itself (memoized per graph)."""
    if node.op not in ("call_function", "call_method") or node not in _sliced(an):
        return None
    w = _walk_of(an, node)
    return None if w.kind == "in" else w


def _walk_of(an: Analyzer, node: fx.Node) -> StepWalk:
    """node's walk, inputs first. Each node's walk depends on its inputs' walks only (not on
    who asks), so the steps' walks are comparable; a node past a long loop reaches back
    through every step, hence a stack rather than recursion."""
    memo = an.memo.setdefault("walks", {})
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        todo = [x for x in _walk_inputs(an, n) if x not in memo]
        if todo:
            stack += todo
            continue
        memo[stack.pop()] = _make_walk(an, n, memo)
    return memo[node]


def _is_input(an: Analyzer, n: fx.Node) -> bool:
    """Nodes the walk does not look into. A node that reads no slice is named by value
    numbering, which leaves getitem alone: `w[None]` taken anew each step is walked."""
    if n not in _sliced(an) and n.target is not operator.getitem:
        return True
    return n.op not in ("call_function", "call_method") or bool(written_args(n))


def _walk_inputs(an: Analyzer, n: fx.Node) -> list:
    if _is_input(an, n):
        return []
    sl = _slice_of(an, n)
    return [sl[0]] if sl is not None else n.all_input_nodes


def _make_walk(an: Analyzer, n: fx.Node, memo: dict) -> StepWalk:
    """n's walk from its inputs' (in memo). Where n cannot be read as a step's computation
    (too large, reads a value written in place, arguments with no key), n is an input: a
    tensor named by its node, equal between steps only where they read the same one."""
    if _is_input(an, n):
        return _input_walk(an, n)
    try:
        sl = _slice_of(an, n)
        return _slice_walk(an, n, sl, memo[sl[0]]) if sl is not None else _op_walk(an, n, memo)
    except _Unknown:
        return _input_walk(an, n)


def _op_walk(an: Analyzer, n: fx.Node, memo: dict) -> StepWalk:
    children = {}
    for x in n.all_input_nodes:
        if an.versions.get((n, x), x) is not x:
            return _input_walk(an, n)  # reads a value written in place: n is what it read
        children[x] = memo[x]
    size = 1 + sum(c.size for c in children.values())
    if size > MAX_STEP_NODES:
        return _input_walk(an, n)  # too large to be one step's
    key = ("op", n.op, _frozen(n.target, {}), _frozen((n.args, n.kwargs), {x: c.id for x, c in children.items()}))
    params = tuple(p for c in children.values() for p in c.params)
    return StepWalk("op", n, key, _key_id(an, key), params, size, children)


def _input_walk(an: Analyzer, n: fx.Node) -> StepWalk:
    c = an.canon.get(n, n)
    return StepWalk("in", c, ("in", c), _key_id(an, ("in", c)), (), 0)


def _key_id(an: Analyzer, key: tuple) -> int:
    ids = an.memo.setdefault("walk_ids", {})
    return ids.setdefault(key, len(ids))


def _slice_walk(an: Analyzer, n: fx.Node, sl: tuple, bw: StepWalk) -> StepWalk:
    """Fixed indices are the walk's params, not its structure, whether the base is an input
    (x[:, t]) or itself computed from slices (`g[:, t]` of g = qkvg.unbind(2)[3], which
    reads no time slice of the loop: the same tensor every step)."""
    base, how, found = sl
    if bw.kind == "in":
        base = bw.node
    size = 1 + bw.size
    if size > MAX_STEP_NODES:
        return _input_walk(an, n)
    positions = tuple(pos for _, _, pos in found)
    if how[0] == "getitem":
        template = tuple("#" if p in positions else _frozen(i, {}) for p, i in enumerate(how[1]))
    else:
        template = how[1]
    ident = bw.id
    key = ("slice", ident, how[0], template, positions)
    own = tuple((ident, a, i, base) for a, i, _ in found)
    children = {} if bw.kind == "in" else {base: bw}
    return StepWalk("slice", n, key, _key_id(an, key), bw.params + (own,), size, children, base=base, how=how)


def _frozen(x, keys: dict):
    """A hashable structure of node arguments, nodes replaced by their walks' keys."""
    if isinstance(x, fx.Node):
        return keys[x]
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_frozen(i, keys) for i in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, _frozen(v, keys)) for k, v in sorted(x.items()))
    if isinstance(x, slice):
        return ("slice", _frozen(x.start, keys), _frozen(x.stop, keys), _frozen(x.step, keys))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise _Unknown
    try:
        hash(x)
    except TypeError:
        raise _Unknown from None
    return x


@dataclass(eq=False)
class StepLift:
    """A per-step tensor lifted to the whole sequence (the `lifted` of an LFactor)."""

    walk: StepWalk  # the step's own walk (the last step's is emitted)
    sig: tuple  # the walk's key and its slice indices, 't' for the time index
    varies: dict  # walk -> whether it reads a time slice
    is_time: set
    steps: int
    stacks: Optional[dict]  # sig -> {tau: node} when the replay does not know an op

    def deps(self) -> list:
        if self.stacks is not None:
            return list(self.stacks[self.sig].values())
        found: dict = {}
        self._deps(self.walk, found)
        return [n for n in found if isinstance(n, fx.Node)]

    def _deps(self, w: StepWalk, found: dict) -> None:
        if not self.varies[w] or w.kind == "in":
            found[w.node] = None
        elif w.kind == "slice" and not self.varies_of(w):
            found[w.base] = None
        else:
            for c in w.children.values():
                self._deps(c, found)

    def emit(self, em: Emitter) -> fx.Node:
        if self.stacks is not None:
            nodes = self.stacks[self.sig]
            key = ("stack", self.sig)
            if key not in em.memo:
                em.memo[key] = em.call(torch.stack, [nodes[t] for t in range(self.steps)], 0)
            return em.memo[key]
        return self._emit(em, self.walk)

    def _emit(self, em: Emitter, w: StepWalk) -> fx.Node:
        if not self.varies[w]:
            return w.node
        key = ("replay", w.node)
        if key not in em.memo:
            if w.kind == "slice" and not self.varies_of(w):
                em.memo[key] = self._emit_slice(em, w)
            else:
                target, args, kwargs, pads = _replay_call(w.node, self.varies_of(w), self.steps)
                new = {}
                for x, c in w.children.items():
                    node = self._emit(em, c)
                    if pads.get(x):
                        node = em.call(operator.getitem, node, (slice(None),) + (None,) * pads[x])
                    new[x] = node
                args, kwargs = fx.node.map_arg((args, kwargs), new.__getitem__)
                em.memo[key] = em.call(target, *args, op=w.node.op, **kwargs)
        return em.memo[key]

    def varies_of(self, w: StepWalk) -> set:
        return {x for x, c in w.children.items() if self.varies[c]}

    def _emit_slice(self, em: Emitter, w: StepWalk) -> fx.Node:
        """The base with the time axis first, the other fixed indices selected."""
        params = w.params[-1]  # the slice's own indices (its base's come first)
        how, arg = w.how
        if how != "getitem":
            node = em.call(torch.movedim, w.base, arg, 0)
            return em.call(torch.unsqueeze, node, arg + 1) if how == "narrow" else node
        time = [p for (b, a, _, _), p in zip(params, w.key[4]) if (b, a) in self.is_time][0]
        items = list(arg)
        unit = isinstance(items[time], slice)
        items[time] = slice(None)
        node = w.base
        if any(i != slice(None) for i in items):
            node = em.call(operator.getitem, node, tuple(items))
        pos = sum(1 for i in items[:time] if not _plain_int(i))  # the time axis in the result
        if pos:
            node = em.call(torch.movedim, node, pos, 0)
        return em.call(torch.unsqueeze, node, pos + 1) if unit else node


def lift_step_tensor(w: StepWalk, ctx: dict) -> tuple:
    """(varies, sig, StepLift or None) of a step's walk: records the time indices it reads
    in ctx; the lift is None when the walk reads no time slice (the same tensor every step)."""
    is_time = ctx["is_time"]
    sig = (w.key, tuple(tuple("t" if (b, a) in is_time else i for b, a, i, _ in leaf) for leaf in w.params))
    for leaf in w.params:
        time = [(a, i, node) for b, a, i, node in leaf if (b, a) in is_time]
        if len(time) > 1:
            raise Reject("an input is indexed by the step at more than one position")
        for a, i, node in time:
            ctx["taus"].add(i)
            ctx["time_axes"].add((node, a))
    if not any((b, a) in is_time for leaf in w.params for b, a, _, _ in leaf):
        return False, sig, None  # (the params hold every slice the walk reads)
    varies: dict = {}
    _mark_varying(w, is_time, varies)
    shared = ctx["shared"]
    stacks = None
    if not _replayable(w, varies, is_time, shared["steps"]):
        stacks = shared["stacks"]
        taus = {i for leaf in w.params for b, a, i, _ in leaf if (b, a) in is_time}
        stacks.setdefault(sig, {})[next(iter(taus))] = w.node
    return True, sig, StepLift(w, sig, varies, is_time, shared["steps"], stacks)


def _mark_varying(w: StepWalk, is_time: set, varies: dict) -> bool:
    if w not in varies:
        own = w.params[-1] if w.kind == "slice" else ()
        varies[w] = any((b, a) in is_time for b, a, _, _ in own)
        for c in w.children.values():
            varies[w] |= _mark_varying(c, is_time, varies)
    return varies[w]


def _replayable(w: StepWalk, varies: dict, is_time: set, steps: int) -> bool:
    vary = {x for x, c in w.children.items() if varies[c]}
    if not vary:  # an input, or a slice of a tensor that is the same every step
        return True
    if w.kind == "slice" and any((b, a) in is_time for b, a, _, _ in w.params[-1]):
        return False  # a time slice of a tensor that varies: stacked
    if _replay_call(w.node, vary, steps) is None:
        return False
    return all(_replayable(c, varies, is_time, steps) for c in w.children.values())


_REDUCTIONS = {"sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax", "cumsum"}
_DIM_SLOTS = {"unsqueeze": ((1, "dim"),), "squeeze": ((1, "dim"),), "transpose": ((1, "dim0"), (2, "dim1"))}


def _replay_call(n: fx.Node, vary: set, steps: int) -> Optional[tuple]:
    """(target, args, kwargs, pads) that compute n over inputs with a leading time axis of
    `steps` (the inputs in `vary`), pads[x] size-1 axes to insert after x's time axis; None
    where not known. Dims counted from the start shift by one, negative dims stay."""
    args, kwargs = list(n.args), dict(n.kwargs)
    direct = [x for x in args + list(kwargs.values()) if isinstance(x, fx.Node)]
    if any(x not in direct for x in vary):
        return None  # a varying tensor inside a list argument
    if is_pointwise(n):  # broadcasting: the per-step axes align to the right of time
        if any(_rank(x) == 0 and example_value(x).dtype != example_value(n).dtype for x in vary):
            return None  # a 0-dim tensor does not promote dtypes; with a time axis it would
        return n.target, args, kwargs, {x: _rank(n) - _rank(x) for x in vary}
    if not args or vary != {args[0]}:
        return None
    name = op_name(n)
    fn = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name == "identity":
        return n.target, args, kwargs, {}
    if name == "matmul" or fn == "linear":  # batch axes broadcast: the others' must not exist
        others = [x for x in direct if x is not args[0]]
        return (n.target, args, kwargs, {}) if all(_rank(x) <= 2 for x in others) else None
    slots = _DIM_SLOTS.get(name, ((1, "dim"),) if fn in _REDUCTIONS else None)
    if slots is not None:
        for pos, key in slots:
            if len(args) > pos:
                holder, where = args, pos
            elif key in kwargs:
                holder, where = kwargs, key
            elif name == "squeeze":
                continue  # every size-1 axis (time has the loop's length, at least 2)
            else:
                return None
            shifted = _shift_dims(holder[where])
            if shifted is None:
                return None
            holder[where] = shifted
        return n.target, args, kwargs, {}
    if name == "permute" and not kwargs:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if not all(_plain_int(d) for d in dims):
            return None
        return n.target, [args[0], [0] + [d % _rank(args[0]) + 1 for d in dims]], {}, {}
    if name == "getitem" and isinstance(example_value(args[0]), torch.Tensor) and op_name(args[0]) != "unbind":
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if not all(i is None or i is Ellipsis or isinstance(i, slice) or _plain_int(i) for i in index):
            return None
        return n.target, [args[0], (slice(None),) + index], {}, {}
    if n.op == "call_method" and n.target in ("expand", "view", "reshape") and not kwargs:
        sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if not all(_plain_int(s) for s in sizes):
            return None
        if n.target == "expand":
            return "expand", [args[0], -1, *sizes], {}, {}
        return "reshape", [args[0], steps, *sizes], {}, {}  # time first is no view of the step's layout
    return None


def _shift_dims(dims):
    """Dims of a per-step tensor in the same tensor with time first."""
    if _plain_int(dims):
        return dims + 1 if dims >= 0 else dims
    if isinstance(dims, (list, tuple)) and dims and all(_plain_int(d) for d in dims):
        return type(dims)(d + 1 if d >= 0 else d for d in dims)
    return None
