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
Anything unproven is a near miss.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .algebra import _VIEW_OPS, AV, Analyzer, Factor, Mono, _rank, comps, factor_vars, mono_vars, op_name, out_vars, storage_root
from .consts import example_value
from .emit import Emitter, Group, LFactor, sizes_from
from .match import Match, NearMiss, Reject
from . import placement

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


@dataclass
class Read:
    node: fx.Node  # the element of the assembly
    av: AV
    state: fx.Node
    state_factor: Factor
    kvar: int
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


# ---- reading nodes ---------------------------------------------------------------------
def parse_step(an: Analyzer, node: fx.Node) -> Optional[Step]:
    if op_name(node) in _VIEW_OPS:
        return None  # a view or cast of a state is that state, not a further step
    av = an.value(node)
    if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2 or len(av.out) < 2:
        return None
    out_set = out_vars(av.out)
    decay = outer = None
    prev = None
    for coef, fs in av.terms:
        if not mono_vars((coef, fs)) <= out_set:
            return None
        pf = [f for f in fs if _is_full_atom(f, av.out)]
        if len(pf) == 1 and decay is None:
            prev = pf[0].atom.node
            decay = (coef, tuple(f for f in fs if f is not pf[0]))
        elif not pf and outer is None:
            outer = (coef, fs)
        else:
            return None
    if outer is None or not _is_outer_product(outer, out_set):
        return None
    return Step(node, av, prev, decay, outer)


def _is_outer_product(m: Mono, out_set: set) -> bool:
    """Some two axes of the update are never indexed by one factor together (k^T v),
    unlike an elementwise product k * x."""
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
    return f.kind == "atom" and not f.atom.fixed and f.idx == out and _rank(f.atom.node) == len(out)


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
    if others and not _is_outer_product(others[0], out_set):
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
    if len(summed) != 1:
        return None
    kvar = next(iter(summed))
    if sf.idx.count(kvar) != 1:
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
        axes = {a for _, (a, _), _ in writes}
        if len(axes) != 1:
            continue
        a = axes.pop()
        asm = Assembly("setitem", buf, [w[2] for w in writes], a)
        asm.positions = [w[1][1] for w in writes]
        asm.setitems = [w[0] for w in writes]
        found.append(asm)
    return found


def _fresh(an: Analyzer, consumer: fx.Node, x: fx.Node) -> bool:
    return an.versions.get((consumer, x), x) is x


def _time_index(buf, index) -> Optional[tuple]:
    """(axis, t) for an index that is full slices except one integer."""
    if not isinstance(buf, fx.Node):
        return None
    rank = _rank(buf)
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        i = index.index(Ellipsis)
        index = index[:i] + (slice(None),) * (rank - len(index) + 1) + index[i + 1 :]
    index = index + (slice(None),) * (rank - len(index))
    ints = [(a, i) for a, i in enumerate(index) if isinstance(i, int) and not isinstance(i, bool)]
    full = all(i == slice(None) for i in index if not isinstance(i, int))
    if len(ints) != 1 or not full or len(index) != rank:
        return None
    a, t = ints[0]
    size = _size(buf, a)
    return a, (t % size if isinstance(size, int) else t)


def _size(node: fx.Node, axis: int):
    return example_value(node).shape[axis]


# ---- the recognizers ---------------------------------------------------------------------
def find_steps(an: Analyzer) -> tuple[dict, list]:
    """Every state update of the graph, and near misses for updates that are not GLA steps
    (computed once per graph: the loop and decode recognizers share them)."""
    if "steps" not in an.memo:
        steps, near = {}, []
        for n in an.graph.nodes:
            st = parse_step(an, n)
            if st is not None:
                steps[n] = st
            else:
                why = diagnose_update(an, n)
                if why:
                    near.append(NearMiss("loop", why, [n]))
        an.memo["steps"] = (steps, near)
    return an.memo["steps"]


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
    found, frontier, seen = [], [st.node], {st.node}
    for _ in range(MAX_READ_DEPTH):
        nxt = []
        for n in frontier:
            for u in an.users(n):  # also a read of the cache the new state was copied into
                if u in seen:
                    continue
                seen.add(u)
                if parse_read(an, u, states) is not None:
                    found.append(u)
                elif op_name(u) in _VIEW_OPS or op_name(u) == "mul":
                    nxt.append(u)
        frontier = nxt
    if not found:
        raise Reject("a one-step state update (decode) whose new state is not read by a query")
    if len(found) > 1:
        raise Reject("the new state is read by more than one query")
    return Assembly("read", found[0], found, -1)


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


def _read_letters(rd: Read, st: Step, letters: Letters) -> dict:
    """The read's variables named by the letters of the step's (position by position)."""
    res = {}
    for e_read, e_state in zip(rd.state_factor.idx, st.av.out):
        cr, cs = comps(e_read), comps(e_state)
        if len(cr) != len(cs):
            raise Reject("the read splits the state's axes differently from its update")
        for r, s in zip(cr, cs):
            res[r] = letters.of_var[s]
    res[rd.kvar] = "k"
    return res


def analyze_chain(an: Analyzer, chain: list[Step], outputs: list[Assembly], single: bool = False) -> Match:
    states = {st.node: i for i, st in enumerate(chain)}
    if single:
        asm = _read_of_step(an, chain[0])
        reads = {chain[0].node: parse_read(an, asm.result, states)}
    else:
        asm, reads = _assembly_of(an, chain, states, outputs)
    roles = _roles(chain, reads)
    n = len(chain)
    _check_state_free(chain, reads)
    time_axes = _time_axes(chain, reads)
    lifted = [_lift_step(an, st, reads.get(st.node), roles, time_axes) for st in chain]
    taus = [lf["tau"] for lf in lifted]
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
    _check_same_structure(chain, lifted)
    time_sizes = {(node, axis) for lf in lifted for node, axis in lf["time_axes"]}
    for node, axis in time_sizes:
        size = _size(node, axis)
        if size != n:
            raise Reject(f"the loop runs {n} steps over a time axis of size {size}")
    return _build_match(an, chain, reads, asm, lifted[-1], reverse)


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


def _check_state_free(chain: list[Step], reads: dict) -> None:
    """The inputs of an update or of a read must not be computed from the states (a delta
    rule reads S_{t-1} to form its value; RWKV-style bonuses read it before the update).
    The initial state counts: a decode step's value must not be computed from the cache."""
    states = {st.node for st in chain} | ({chain[0].prev} if chain[0].prev is not None else set())
    derived: set = set()
    frontier = list(states)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in derived and u not in states:
                derived.add(u)
                frontier.append(u)
    factors = [f for st in chain for _, fs in st.av.terms for f in fs]
    factors += [f for rd in reads.values() for f in rd.q]
    for f in factors:
        if f.kind == "atom" and f.atom.node in derived:
            raise Reject("the update reads the state it updates (delta-rule style)")


def _time_axes(chain: list[Step], reads: dict) -> set:
    """(node, axis) pairs whose integer indices change from step to step: the time axes.
    Constant selections (q, k, v of `qkv.unbind(2)`) index the same set in every step."""
    per_step = []
    for st in chain:
        values: dict = {}

        def visit(factors):
            for f in factors:
                if f.kind == "atom":
                    for axis, index in f.atom.fixed:
                        values.setdefault((f.atom.node, axis), set()).add(index)
                for _, inner in f.inner:
                    visit(inner)

        for _, fs in st.av.terms:
            visit(fs)
        if st.node in reads:
            visit(reads[st.node].q)
        per_step.append(values)
    keys = set().union(*[v.keys() for v in per_step])
    return {key for key in keys if len({frozenset(v.get(key, ())) for v in per_step}) > 1}


def _assembly_of(an: Analyzer, chain, states, outputs):
    for asm in outputs:
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


def _roles(chain, reads) -> Roles:
    st = chain[-1]
    rd = reads[st.node]
    kpos = rd.state_factor.idx.index(rd.kvar)
    out = st.av.out
    kvars = set(comps(out[kpos]))
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
    if not cands:
        cands = [p for p in range(len(out)) if free(p, kgroup_vars)]
    if not cands:
        raise Reject("cannot tell the value axis of the state")
    vpos = cands[-1]
    batch = [p for p in range(len(out)) if p not in (kpos, vpos)]
    if len(batch) > 2:
        raise Reject(f"the state has {len(batch)} batch axes; at most 2 (batch, head) are supported")
    return Roles(kpos, vpos, batch)


def _lift_step(an: Analyzer, st: Step, rd: Optional[Read], roles: Roles, time_axes: set) -> dict:
    """Per-step structure with index vars replaced by role letters and time slices by 't'."""
    letters = _state_letters(an, st.av.out, roles)
    vvars, kvars = set(comps(st.av.out[roles.vpos])), set(comps(st.av.out[roles.kpos]))
    ctx = {"taus": set(), "time_axes": set(), "is_time": time_axes, "an": an}
    kf = [f for f in st.outer[1] if kvars & factor_vars(f)]
    vf = [f for f in st.outer[1] if not kvars & factor_vars(f)]
    if any(vvars & factor_vars(f) for f in kf):
        raise Reject("a factor of the outer product spans both K and V")
    if not any(vvars & factor_vars(f) for f in vf):
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
        rletter = _read_letters(rd, st, letters)
        res["q"] = _group(rd.q, 1.0, rletter, ctx, allow_empty=False)
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
    sig = (coef, tuple(sorted(_lf_key(lf) for lf in lfs)))
    return sig, Group(coef, tuple(lfs))


def _lf_key(lf: LFactor) -> tuple:
    return (lf.node.name, lf.letters, lf.select, lf.unflatten)


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
    select, time = [], []
    for axis, index in atom.fixed:
        if (atom.node, axis) in ctx["is_time"]:
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


def _lfactor(node: fx.Node, select: tuple, per_axis: list) -> LFactor:
    """An LFactor, unflattening the axes that carry several letters."""
    letters = "".join(ls for ls, _ in per_axis)
    if all(len(ls) == 1 for ls, _ in per_axis):
        return LFactor(node, letters, select)
    shape = example_value(node).shape
    axes = [a for a in range(len(shape)) if a not in {a for a, _ in select}]
    sizes = []
    for a, (ls, sz) in zip(axes, per_axis):
        sizes += [shape[a]] if len(ls) == 1 else list(sz)
    if not all(isinstance(s, int) for s in sizes):
        raise Reject("an input's merged axis has a symbolic size")
    return LFactor(node, letters, select, tuple(sizes))


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
        elif f.kind == "atom" and _positive(f.atom.node):
            terms.append((1.0, (_atom_lfactor(f, letter, ctx),), True))
        else:
            raise Reject("the decay is not exp(...) of a log-gate or a positive constant")
    sig = (coef, tuple(sorted((c, tuple(_lf_key(lf) for lf in lfs), lg) for c, lfs, lg in terms)))
    return sig, (coef, terms)


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
    # setitem: the value broadcasts into the slot (the buffer without its time axis)
    slot = _rank(asm.result) - 1
    while len(elem) > slot and elem[0] == "1":
        elem = elem[1:]
    if len(elem) != slot:
        raise Reject("the written output does not fill the buffer slot")
    return elem[: asm.dim] + ["t"] + elem[asm.dim :]


def _role_sizes(last, letters: Letters, single: bool) -> dict:
    factors = [lf for key in ("q", "k", "v") for lf in last[key][1].factors]
    sizes = sizes_from(factors)
    sizes.update(letters.sizes)
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
    k = em.lift(last["k"][1], "bthk")
    v = em.lift(last["v"][1], "bthv")
    g, g_gamma = None, None
    if gate_kind != "none":
        gate = _emit_gate(em, decay[1], gate_letters, q)
        if gate_kind == "constant":
            g_gamma = gate
        else:
            g = gate
    return Inputs(q, k, v, g, g_gamma)


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
    deps = [lf.node for key in ("q", "k", "v") for lf in last[key][1].factors]
    if last["decay"] is not None:
        deps += [lf.node for _, lfs, _ in last["decay"][1][1] for lf in lfs]
    if head.prev is not None:
        deps.append(head.prev)
    return deps
