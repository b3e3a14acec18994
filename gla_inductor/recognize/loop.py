"""The time-loop form: a Dynamo-unrolled recurrence

    S_t = S_{t-1} * d_t + k_t (x) v_t        (decay d_t = exp(g_t) over K, or absent)
    o_t = scale * sum_K q_t * S_t             (assembled by stack / cat / o[:, t] = ...)

Stages: ``find_steps`` reads every node as a possible state update; ``chains`` links the
updates S_{t-1} -> S_t; ``find_outputs`` finds the assembly whose elements read the states;
``analyze_chain`` proves that every step has the same structure with its time index t
(consecutive, or reversed), maps index variables to roles (batch b/h, key k, value v) and
returns a ``Match`` whose ``apply`` inserts the GLA op. Anything unproven is a near miss.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .algebra import AV, Analyzer, Factor, Mono, _rank, factor_vars, mono_vars, op_name
from .emit import Emitter, Group, LFactor, sizes_from
from .match import Match, NearMiss

BATCH_LETTERS = ("b", "h")


class Reject(Exception):
    """A candidate that is not proven GLA; the message says why."""


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
    kind: str  # "stack" | "cat" | "setitem"
    result: fx.Node  # stack/cat node, or the buffer for setitem
    elements: list  # value nodes, in assembly order (time positions)
    dim: int  # the time axis of the result
    positions: list = field(default_factory=list)  # setitem: the time index of each element
    setitems: list = field(default_factory=list)


# ---- reading nodes ---------------------------------------------------------------------
def parse_step(an: Analyzer, node: fx.Node) -> Optional[Step]:
    av = an.value(node)
    if av is None or av.keep is not None or not 1 <= len(av.terms) <= 2 or len(av.out) < 2:
        return None
    out_set = {v for v in av.out if v is not None}
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
    out_set = {v for v in av.out if v is not None}
    selfish = [m for m in av.terms if any(_is_full_atom(f, av.out) for f in m[1])]
    if not selfish:
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


def parse_read(an: Analyzer, node: fx.Node, states: dict) -> Optional[Read]:
    av = an.value(node)
    if av is None or av.keep is not None or len(av.terms) != 1:
        return None
    coef, fs = av.terms[0]
    sf = [f for f in fs if f.kind == "atom" and f.atom.node in states and not f.atom.fixed]
    if len(sf) != 1:
        return None
    sf = sf[0]
    summed = mono_vars(av.terms[0]) - {v for v in av.out if v is not None}
    if len(summed) != 1:
        return None
    kvar = next(iter(summed))
    if sf.idx.count(kvar) != 1:
        return None
    return Read(node, av, sf.atom.node, sf, kvar, [f for f in fs if f is not sf], coef)


def find_outputs(graph: fx.Graph) -> list[Assembly]:
    """Stacks, cats, and buffers filled by `buf[..., t, ...] = value` along one axis."""
    found = []
    buffers: dict = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in (torch.stack, torch.cat) and n.args:
            elems = n.args[0]
            if isinstance(elems, (list, tuple)) and all(isinstance(e, fx.Node) for e in elems):
                dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
                rank = _rank(n)
                kind = "stack" if n.target is torch.stack else "cat"
                found.append(Assembly(kind, n, list(elems), dim % rank))
        elif n.op == "call_function" and n.target is operator.setitem:
            buf, index, value = n.args
            axis_pos = _time_index(buf, index)
            if axis_pos is None or not isinstance(value, fx.Node):
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
    from .consts import example_value

    return example_value(node).shape[axis]


# ---- the recognizer --------------------------------------------------------------------
def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    graph = an.graph
    steps = {}
    near: list[NearMiss] = []
    for n in graph.nodes:
        st = parse_step(an, n)
        if st is not None:
            steps[n] = st
        else:
            why = diagnose_update(an, n)
            if why:
                near.append(NearMiss("loop", why, [n]))
    chains = _chains(steps)
    outputs = find_outputs(graph)
    matches = []
    for chain in chains:
        if len(chain) < 2:
            continue
        try:
            matches.append(analyze_chain(an, chain, outputs))
        except Reject as e:
            near.append(NearMiss("loop", str(e), [s.node for s in chain]))
    return matches, near


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


def analyze_chain(an: Analyzer, chain: list[Step], outputs: list[Assembly]) -> Match:
    states = {st.node: i for i, st in enumerate(chain)}
    asm, reads = _assembly_of(an, chain, states, outputs)
    roles = _roles(chain, reads)
    n = len(chain)
    _check_state_free(chain)
    time_axes = _time_axes(chain, reads)
    lifted = [_lift_step(an, st, reads.get(st.node), roles, time_axes) for st in chain]
    taus = [lf["tau"] for lf in lifted]
    if any(t is None for t in taus):
        raise Reject("a step reads no time slice of its inputs")
    if taus == list(range(n)):
        reverse = False
    elif taus == list(range(n - 1, -1, -1)):
        reverse = True
    else:
        raise Reject(f"steps read time indices {taus[:6]}..., not consecutive")
    _check_time_order(asm, reads, {st.node: tau for st, tau in zip(chain, taus)})
    for key in ("q", "k", "v"):
        sigs = {lf[key][0] for lf in lifted if lf[key] is not None}
        if len(sigs) != 1:
            raise Reject(f"the {key} of the steps differ in structure")
    decays = [lf["decay"] for lf in lifted[1:]] + ([lifted[0]["decay"]] if chain[0].prev is not None else [])
    if len({d[0] for d in decays}) != 1:
        raise Reject("the decay differs in structure between steps")
    time_sizes = {(node, axis) for lf in lifted for node, axis in lf["time_axes"]}
    for node, axis in time_sizes:
        size = _size(node, axis)
        if size != n:
            raise Reject(f"the loop runs {n} steps over a time axis of size {size}")
    return _build_match(an, chain, reads, asm, roles, lifted[-1], reverse)


def _check_time_order(asm: Assembly, reads: dict, tau_of: dict) -> None:
    """Output position i along the assembled time axis must hold the read of step time i."""
    by_element = {r.node: tau_of[r.state] for r in reads.values()}
    taus = [by_element[e] for e in asm.elements]
    positions = asm.positions if asm.kind == "setitem" else list(range(len(asm.elements)))
    if taus != list(positions):
        raise Reject("the outputs are not assembled in time order (o[t] must hold step t)")


def _check_state_free(chain: list[Step]) -> None:
    """The inputs of an update must not be computed from the states (a delta rule reads
    S_{t-1} to form its value; RWKV-style bonuses read it before the update)."""
    states = {st.node for st in chain}
    derived: set = set()
    frontier = list(states)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in derived and u not in states:
                derived.add(u)
                frontier.append(u)
    for st in chain:
        for _, fs in st.av.terms:
            for f in fs:
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
    kvar_state = out[kpos]
    kgroup_vars = set()
    for f in st.outer[1]:
        if kvar_state in factor_vars(f):
            kgroup_vars |= factor_vars(f)
    q_vars_state = set()
    read_to_state = {v: out[p] for p, v in enumerate(rd.state_factor.idx) if v is not None}
    for f in rd.q:
        q_vars_state |= {read_to_state.get(v) for v in factor_vars(f)}
    cands = [p for p, v in enumerate(out) if p != kpos and v is not None and v not in kgroup_vars and v not in q_vars_state]
    if not cands:
        cands = [p for p, v in enumerate(out) if p != kpos and v is not None and v not in kgroup_vars]
    if not cands:
        raise Reject("cannot tell the value axis of the state")
    vpos = cands[-1]
    batch = [p for p in range(len(out)) if p not in (kpos, vpos)]
    if len(batch) > 2:
        raise Reject(f"the state has {len(batch)} batch axes; at most 2 (batch, head) are supported")
    return Roles(kpos, vpos, batch)


def _lift_step(an: Analyzer, st: Step, rd: Optional[Read], roles: Roles, time_axes: set) -> dict:
    """Per-step structure with index vars replaced by role letters and time slices by 't'."""
    letter = {v: roles.letter(p) for p, v in enumerate(st.av.out) if v is not None}
    vvar = st.av.out[roles.vpos]
    kvar = st.av.out[roles.kpos]
    ctx = {"taus": set(), "time_axes": set(), "is_time": time_axes}
    kf = [f for f in st.outer[1] if kvar in factor_vars(f)]
    vf = [f for f in st.outer[1] if kvar not in factor_vars(f)]
    if any(vvar in factor_vars(f) for f in kf):
        raise Reject("a factor of the outer product spans both K and V")
    if not any(vvar in factor_vars(f) for f in vf):
        raise Reject("the update has no value factor along V")
    res = {
        "k": _group(kf, 1.0, letter, ctx),
        "v": _group(vf, st.outer[0], letter, ctx),
        "decay": _decay(an, st, letter, vvar, kvar, ctx),
        "q": None,
    }
    if rd is not None:
        rletter = {v: letter[st.av.out[p]] for p, v in enumerate(rd.state_factor.idx) if v is not None}
        rletter[rd.kvar] = "k"
        if rd.state is not st.node:
            raise Reject("an output reads a state other than the one its step produced")
        res["q"] = _group(rd.q, 1.0, rletter, ctx, allow_empty=False)
        res["scale"] = rd.coef
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
            lfs.append(LFactor(f.node, _letters(f.idx, letter)))
            continue
        if f.kind != "atom":
            raise Reject(f"an input factor is a {f.kind}, expected a tensor")
        lfs.append(_atom_lfactor(f, letter, ctx))
    if not lfs and not allow_empty:
        raise Reject("an output has no query factor")
    sig = (coef, tuple(sorted((lf.node.name, lf.letters, lf.select) for lf in lfs)))
    return sig, Group(coef, tuple(lfs))


def _letters(idx, letter) -> str:
    out = ""
    for v in idx:
        if v is None:
            out += "1"
        elif v in letter:
            out += letter[v]
        else:
            raise Reject("an input is indexed by an axis the state does not have")
    return out


def _atom_lfactor(f: Factor, letter, ctx) -> LFactor:
    atom = f.atom
    letters = list(_letters(f.idx, letter))
    select = []
    for axis, index in atom.fixed:
        if (atom.node, axis) in ctx["is_time"]:
            ctx["taus"].add(index)
            ctx["time_axes"].add((atom.node, axis))
        else:
            select.append((axis, index))
    time = [a for a, _ in atom.fixed if (atom.node, a) in ctx["is_time"]]
    if len(time) > 1:
        raise Reject("an input is indexed by the step at more than one position")
    if time:
        # letters name the axes left after every fixed axis; put 't' back among them
        remaining = [a for a in range(_rank(atom.node)) if a not in {a for a, _ in select}]
        letters.insert(remaining.index(time[0]), "t")
    return LFactor(atom.node, "".join(letters), tuple(select))


def _decay(an: Analyzer, st: Step, letter, vvar, kvar, ctx):
    """(signature, gate description) of the decay monomial of a step."""
    if st.decay is None:
        return None
    coef, fs = st.decay
    if coef <= 0:
        raise Reject("the decay factor is not positive")
    terms = []  # (coef, LFactor list, is_log) : log-gate = sum of terms
    for f in fs:
        if vvar in factor_vars(f):
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
    sig = (coef, tuple(sorted((c, tuple((lf.node.name, lf.letters, lf.select) for lf in lfs), lg) for c, lfs, lg in terms)))
    return sig, (coef, terms)


def _positive(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (torch.sigmoid, torch.exp):
        return True
    return node.op == "call_method" and node.target in ("sigmoid", "exp")


# ---- building the replacement -------------------------------------------------------------
def _build_match(an, chain, reads, asm, roles, last, reverse) -> Match:
    st_last = chain[-1]
    head = chain[0]
    decay = last["decay"]
    gate_kind, gate_letters = _gate_kind(decay)
    out_letters = _assembly_letters(asm, reads, st_last, roles)
    state_letters = "".join(roles.letter(p) if v is not None else "1" for p, v in enumerate(st_last.av.out))
    scale = last["scale"]
    sizes = _role_sizes(last)
    shapes = {c.upper(): _size(*sizes[c]) if isinstance(sizes[c], tuple) else sizes[c] for c in "bthkv" if c in sizes}
    q_layout = last["q"][1].factors[0].letters if last["q"][1].factors else ""

    def apply(txn) -> None:
        _check_before(an, asm, _dependencies(last, head))
        anchor = _anchor(an, asm)
        em = Emitter(txn, anchor, sizes)
        op, o, ht = _emit_op(em, last, decay, gate_kind, gate_letters, head, state_letters, scale, reverse)
        o_user = _cast(em, em.relayout(o, "bthv", out_letters), asm.result)
        ht_user = _cast(em, em.relayout(ht, "bhkv", state_letters), st_last.node)
        _rewire(txn, asm, o_user, st_last.node, ht_user)
        if not ht_user.users:  # nobody reads the final state: the kernel need not store it
            op.update_arg(7, False)

    return Match(
        form="loop",
        gate=gate_kind,
        layout=q_layout,
        shapes=shapes,
        nodes=[s.node for s in chain] + [r.node for r in reads.values()],
        apply=apply,
        options={"reverse": reverse, "initial_state": head.prev is not None, "scale": scale},
    )


def _gate_kind(decay):
    if decay is None:
        return "none", ""
    coef, terms = decay[1]
    letters = set()
    for _, lfs, _ in terms:
        for lf in lfs:
            letters |= set(lf.letters) - {"1"}
    if not terms and coef == 1.0:
        return "none", ""
    if "k" in letters:
        return "vector", "bthk"
    if "t" in letters or "b" in letters:
        return "scalar", "bth"
    return "constant", "h"


def _assembly_letters(asm: Assembly, reads: dict, st_last: Step, roles: Roles) -> str:
    rd = reads[st_last.node]
    state_letter = {v: roles.letter(p) for p, v in enumerate(rd.state_factor.idx) if v is not None}
    elem = "".join(state_letter.get(v, "?") if v is not None else "1" for v in rd.av.out)
    if "?" in elem or "k" in elem:
        raise Reject("the output keeps an axis that is not batch or V")
    if asm.kind == "stack":
        return elem[: asm.dim] + "t" + elem[asm.dim :]
    if asm.kind == "cat":
        if elem[asm.dim] != "1":
            raise Reject("the concatenated outputs are not one step long")
        return elem[: asm.dim] + "t" + elem[asm.dim + 1 :]
    # setitem: the value broadcasts into the slot (the buffer without its time axis)
    rank = _rank(asm.result)
    slot = rank - 1
    if len(elem) > slot:
        elem = elem.lstrip("1")
    if len(elem) != slot:
        raise Reject("the written output does not fill the buffer slot")
    return elem[: asm.dim] + "t" + elem[asm.dim :]


def _role_sizes(last) -> dict:
    factors = [lf for key in ("q", "k", "v") for lf in last[key][1].factors]
    return sizes_from(factors)


def _emit_op(em: Emitter, last, decay, gate_kind, gate_letters, head, state_letters, scale, reverse):
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
    h0 = None
    if head.prev is not None:
        h0 = em.as_float32(em.relayout(head.prev, state_letters, "bhkv"))
    op = em.call(
        torch.ops.gla_inductor.chunk_fwd.default, q, k, v, g, g_gamma, h0, float(scale), True, reverse
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
    from .consts import example_value

    want = example_value(like).dtype
    if example_value(node).dtype != want:
        node = em.call("to", node, want, op="call_method")
    return node


def _anchor(an: Analyzer, asm: Assembly) -> fx.Node:
    """Insert the op right before the first node that consumes the assembled output."""
    if asm.kind == "setitem":
        return max(asm.setitems, key=lambda n: an.order[n]).next
    return asm.result


def _dependencies(last, head) -> list:
    deps = [lf.node for key in ("q", "k", "v") for lf in last[key][1].factors]
    if last["decay"] is not None:
        deps += [lf.node for _, lfs, _ in last["decay"][1][1] for lf in lfs]
    if head.prev is not None:
        deps.append(head.prev)
    return deps


def _check_before(an: Analyzer, asm: Assembly, deps: list) -> None:
    """Every input of the op precedes the assembled output (positions of the analyzed graph;
    inserting other matches' nodes does not reorder these)."""
    last = max(asm.setitems, key=lambda n: an.order[n]) if asm.kind == "setitem" else asm.result
    late = [d.name for d in deps if an.order[d] >= an.order[last]]
    if late:
        raise Reject(f"inputs {late} are computed after the output is used")


def _rewire(txn, asm: Assembly, o_user: fx.Node, state: fx.Node, ht_user: fx.Node) -> None:
    order = {n: i for i, n in enumerate(txn.graph.nodes)}
    pos = order[o_user]
    if asm.kind == "setitem":
        txn.erase += asm.setitems
        for u in list(asm.result.users):
            if order[u] > pos:
                txn.replace_input(u, asm.result, o_user)
    else:
        txn.replace_all_uses(asm.result, o_user)
    for u in list(state.users):
        if order.get(u, -1) > pos:
            txn.replace_input(u, state, ht_user)
