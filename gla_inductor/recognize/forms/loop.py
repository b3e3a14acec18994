"""The time-loop form: a Dynamo-unrolled recurrence

    S_t = S_{t-1} * d_t + k_t (x) v_t        (decay d_t = exp(g_t) over K, or absent)
    o_t = scale * sum_K q_t * S_t             (assembled by stack / cat / o[:, t] = ...)

and its one-step case, the decode step (``decode.py``).

Stages: ``steps.find_steps`` reads every node as a possible state update, ``steps.chains_of``
links the updates S_{t-1} -> S_t, ``core.assembly.find_outputs`` finds the assembly whose
elements read the states (a single step's read is found among the users of its state);
``analyze_chain`` proves that every step has the same structure with its time index t
(consecutive, or reversed), maps index variables to roles (batch b/h, key k, value v) and
returns a ``Match`` whose ``apply`` inserts the GLA op (``core/placement.py`` says where, and
how the state is written back). Anything unproven is a near miss. A long loop whose steps
``periodic.py`` proves alike by their structure is parsed at three steps only; every check
holds for the others as for them.

A gate (or key, value, query) the loop body computes, `dA = exp(A * softplus(dt[:, t] + b))`,
is one node per step after unrolling. ``step_walk`` reads each as a function of slices of
tensors computed outside the steps; when every step's is the same function of its own slice t,
the op takes that function over the whole sequence (replayed on the un-sliced tensors, or the
steps' values stacked), and an `exp(x)` decay gives x itself as the log-gate.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from ...contract import GLACall
from ..core import placement
from ..core.algebra import Atom, Factor, axis_size, comps, factor_vars, rank_of
from ..core.analyzer import Analyzer
from ..core.assembly import Assembly, find_outputs
from ..core.consts import example_value
from ..core.emit import Emitter, Group, LFactor, drop_final_state, emit_op, lfactor, sizes_from
from ..core.match import Match, NearMiss, Reject
from . import periodic
from .decay_sign import POSITIVE, UNKNOWN, describe, sign_level
from .step_walk import StepWalk, lift_step_tensor, step_walk
from .steps import (
    Letters, Read, Roles, Step, accumulates_outer, chains_of, find_steps, parse_read, parse_step, read_letters,
    read_of_step, state_letters, state_roles,
)


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    """Time loops: chains of two or more steps."""
    steps, near = find_steps(an)
    near = list(near)
    outputs = find_outputs(an)
    matches = []
    for chain in chains_of(steps):
        if len(chain) < 2:
            continue
        try:
            matches.append(analyze_chain(an, chain, outputs))
        except Reject as e:
            if any(st.av is not None and accumulates_outer(st) for st in chain):
                near.append(NearMiss("loop", str(e), [s.node for s in chain]))
            # else no k^T v is accumulated (a residual stream at batch size 1): no GLA candidate
    return matches, near


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
        asm = read_of_step(an, chain[0])
        reads = {chain[0].node: parse_read(an, asm.result, states)}
    else:
        asm, reads = _assembly_of(an, chain, states, outputs, proof)
    n = len(chain)
    seen = chain if proof is None else [chain[i] for i in proof.analyzed]
    roles = state_roles(seen[-1], reads[seen[-1].node])
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
        size = axis_size(node, axis)
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
    for key in ("k_inv", "v_inv"):  # the divisors of the outer product, where there are
        if len({lf[key][0] if lf[key] is not None else None for lf in lifted}) > 1:
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
    if asm.kind == "setitem" and axis_size(asm.result, asm.dim) != len(positions):
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
        if f.kind in ("atom", "inv") and f.atom.node in derived:
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
        atom = f.kind in ("atom", "inv")
        walk = step_walk(an, f.atom.node) if atom and f.atom.node not in states else None
        if walk is not None:
            for leaf in walk.params:
                for ident, axis, index, _ in leaf:
                    values.setdefault((part, ident, axis), set()).add(index)
        if atom:  # `k[:, t]` of a walked k = qkv.unbind(2)[1] reads t here
            for axis, index in f.atom.fixed:
                values.setdefault((part,) + _fixed_key(f.atom.node, axis, walk), set()).add(index)
        for _, inner in f.inner:
            _fixed_indices(an, inner, states, part, values)


def _fixed_key(node: fx.Node, axis: int, walk: Optional[StepWalk]) -> tuple:
    """What a fixed index of an atom indexes, named alike in every step: the node, or for a
    node with a walk (one node per step, or q = qkv.unbind(2)[0] shared by all) the walk's
    structure, as slices of it name it (see step_walk._slice_walk)."""
    return (node, axis) if walk is None else (walk.id, axis)


def _assembly_of(an: Analyzer, chain, states, outputs, proof=None):
    for asm in outputs:
        if proof is not None and asm is proof.assembly:
            return asm, _proven_reads(an, chain, states, proof)
        reads = [parse_read(an, e, states) for e in asm.elements]
        if not reads or any(r is None for r in reads):
            if _reads_before_update(chain, reads):
                raise Reject("each output reads the state its step starts from, before the step's update "
                             "(o_t = q_t S_{t-1}, an exclusive read; GLA's o_t reads S_t)")
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


def _reads_before_update(chain, reads: list) -> bool:
    """Whether output t reads the state of step t - 1 for every t >= 1, the first output reading no
    step's state (the initial state, or a zero start): a loop that reads its state before updating it."""
    if len(reads) != len(chain) or len(chain) < 2 or reads[0] is not None:
        return False
    return all(r is not None and r.state is st.node for r, st in zip(reads[1:], chain))


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


def _lift_step(an: Analyzer, st: Step, rd: Optional[Read], roles: Roles, time_axes: set, shared: dict) -> dict:
    """Per-step structure with index vars replaced by role letters and time slices by 't'."""
    letters = state_letters(an, st.av.out, roles)
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
    (kf, k_inv), (vf, v_inv) = _divisors(kf), _divisors(vf)
    res = {
        "k": _group(kf, 1.0, letters.of_var, ctx, role="keys"),
        "v": _group(vf, st.outer[0], letters.of_var, ctx, role="values"),
        "k_inv": _group(k_inv, 1.0, letters.of_var, ctx, role="keys") if k_inv else None,
        "v_inv": _group(v_inv, 1.0, letters.of_var, ctx, role="values") if v_inv else None,
        "decay": _decay(st, letters.of_var, vvars, ctx),
        "q": None,
        "letters": letters,
        "state_groups": letters.groups(st.av.out),
    }
    if rd is not None:
        if rd.state is not st.node:
            raise Reject("an output reads a state other than the one its step produced")
        rletter = read_letters(an, rd, st, letters)
        res["q"] = _group(rd.q, 1.0, rletter, ctx, role="queries", allow_empty=False)
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


def _divisors(factors: list) -> tuple:
    """(the factors, the divisors): a factor 1 / y of the outer product (a quotient the update
    adds, see steps.expand_quotients) divides the keys (indexed along K) or else the values:
    b * (k (x) v) = (b k) (x) v = k (x) (b v), per head, batch or key alike."""
    return [f for f in factors if f.kind != "inv"], [f for f in factors if f.kind == "inv"]


# why a factor of the keys, values or queries is not a tensor the op can take, by its kind
_NOT_A_TENSOR = {"exp": "an exponential of the step's inputs (a decay factor)", "tri": "a triangular mask"}


def _group(factors, coef, letter, ctx, *, role: str, allow_empty=True):
    """(signature, Group) of a product of atoms: the ``role`` (keys, values, queries) of a step."""
    lfs = []
    for f in factors:
        if f.kind in ("const", "scalar"):
            lfs.append(lfactor(f.node, (), [_axis(e, letter, ctx) for e in f.idx]))
            continue
        if f.kind not in ("atom", "inv"):
            what = _NOT_A_TENSOR.get(f.kind, f"a {f.kind} factor")
            raise Reject(f"the {role} carry {what}: expected tensors")
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
            return lfactor(atom.node, tuple((a + 1, i) for a, i in atom.fixed), per_axis, lift, shape)
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
    per_axis = [("t", None) if a in time else axes[free.index(a)] for a in range(rank_of(atom.node)) if a not in selected]
    return lfactor(atom.node, tuple(select), per_axis)


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
        elif f.kind in ("atom", "inv", "const") and not f.negate:
            terms.append(_log_term(f, letter, ctx))
        else:
            raise Reject("the decay is not exp(...) of a log-gate or a positive constant")
    keys = [(c, tuple(_sort_key(_lf_key(lf)) for lf in lfs), lg) for c, lfs, lg in terms]
    sig = (coef, tuple(sorted(keys)))
    return sig, (coef, terms)


def _log_term(f: Factor, letter, ctx) -> tuple:
    """The gate term log(a) of a decay factor a >= 0 the graph computes (or -log(a) for 1 / a, a
    divisor): exact, as exp(log(a)) = a; a factor not proven nonnegative is refused (a
    negative a has no real log)."""
    node = f.node if f.kind == "const" else f.atom.node
    level = sign_level(ctx["an"], node)
    if level == UNKNOWN:
        raise Reject(f"decay factor {describe(node)} may be negative: expected exp(g) or a provably nonnegative factor")
    if level < POSITIVE and _requires_grad(node):
        # d/da log(a) = 1 / a: at a = 0 the gate's gradient is 0 / 0, not the code's
        raise Reject(f"decay factor {describe(node)} may be zero where its gradient is needed: expected exp(g) "
                     "or a provably positive factor")
    if f.kind == "const":
        lf = lfactor(node, (), [_axis(e, letter, ctx) for e in f.idx])
    else:
        lf = _atom_lfactor(f, letter, ctx)
    return (-1.0 if f.kind == "inv" else 1.0, (lf,), True)


def _requires_grad(node: fx.Node) -> bool:
    val = example_value(node)
    return isinstance(val, torch.Tensor) and val.requires_grad


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
        wb = plan.fused_write_back()
        # both ops read q/k shared by groups of heads: a repeat over the heads is not materialized
        call = _emit_inputs(em, last, decay, gate_kind, gate_letters)
        call = call.replace(scale=scale, reverse=reverse)
        if wb is not None:
            o = placement.emit_fused(em, call, wb, last["state_groups"])
            placement.rewire(txn, asm, em.cast_like(em.relayout(o, "bthv", out_groups), asm.result), None, None)
            return
        call, op, o, ht = _emit_op(em, call, head, last["state_groups"])
        o_user = em.cast_like(em.relayout(o, "bthv", out_groups), asm.result)
        ht_user = em.cast_like(em.relayout(ht, "bhkv", last["state_groups"]), st_last.node)
        placement.rewire(txn, asm, o_user, st_last.node, ht_user)
        if not ht_user.users:  # nobody reads the final state: the kernel need not store it
            drop_final_state(op, call)

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
    slot = rank_of(asm.result) - (not asm.keeps_time)
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
    return axis_size(*s) if isinstance(s, tuple) else s


def _emit_inputs(em: Emitter, last, decay, gate_kind, gate_letters, grouped: bool = True) -> GLACall:
    """The op's q, k, v and gate, lifted to the whole sequence; q and k with their own heads
    where they are grouped and `grouped` allows."""
    grouped = _grouped_letters(em, last["q"][1], last["k"][1]) if grouped else "bthk"
    if last["k_inv"] is not None:
        grouped = "bthk"  # the divisor may vary over every head
    q = em.lift(last["q"][1], grouped)
    k = _divided(em, _lift_or_ones(em, last["k"][1], grouped, q), last["k_inv"], grouped)
    v = _divided(em, _lift_or_ones(em, last["v"][1], "bthv", q), last["v_inv"], "bthv")
    g, g_gamma = None, None
    if gate_kind != "none":
        gate = _emit_gate(em, decay[1], gate_letters, q)
        if gate_kind == "constant":
            g_gamma = gate
        else:
            g = gate
    return GLACall(q, k, v, g, g_gamma)


def _grouped_letters(em: Emitter, q: Group, k: Group) -> str:
    """q and k's letters for the op: "bt" + the outer part of a split head axis + "k" where
    both vary only over that part (the user repeated them over the heads by
    repeat_interleave or expand + reshape: head h reads h // r, which the op reads shared, so
    the repeat is not materialized); "bthk" otherwise (also for `repeat`, whose head h reads
    h % G: the inner part)."""
    subs = em.splits.get("h", "")
    if len(subs) < 2:
        return "bthk"
    for group in (q, k):
        tensors = [f for f in group.factors if isinstance(example_value(f.node), torch.Tensor)]
        if not tensors or {c for f in tensors for c in f.letters} & set(subs) != {subs[0]}:
            return "bthk"
    return "bt" + subs[0] + "k"


def _lift_or_ones(em: Emitter, group: Group, out: str, like: fx.Node) -> fx.Node:
    """The group as a tensor; a group with no tensor is the keys (values) of an update
    k^T v whose K (V) has size 1 and that holds only the other side: its numbers times ones."""
    if any(isinstance(example_value(lf.node), torch.Tensor) for lf in group.factors):
        return em.lift(group, out)
    node = em.call("new_ones", like, [em.size(c) for c in out], op="call_method")
    for lf in group.factors:
        node = em.call(torch.mul, node, lf.node)
    return em.call(torch.mul, node, group.coef) if group.coef != 1.0 else node


def _divided(em: Emitter, node: fx.Node, inv, out: str) -> fx.Node:
    """node / the product of the divisors `inv` (a (sig, Group) or None), broadcast."""
    if inv is None:
        return node
    return em.call(torch.div, node, em.lift(inv[1], out, full=False))


def _emit_op(em: Emitter, call: GLACall, head: Step, state_groups: list) -> tuple:
    """(call, op, o, final state): chunk_fwd from the initial state the head step decays (if any)."""
    h0 = None
    if head.prev is not None:
        h0 = em.as_float32(em.relayout(head.prev, state_groups, "bhkv"))
    call = call.replace(initial_state=h0, output_final_state=True)
    op = emit_op(em, call)
    o = em.call(operator.getitem, op, 0)
    ht = em.call(operator.getitem, op, 1)
    return call, op, o, ht


def _emit_gate(em: Emitter, decay, letters: str, like: fx.Node) -> fx.Node:
    coef, terms = decay
    total = None
    for c, lfs, is_log in terms:
        node = em.lift(Group(c if not is_log else 1.0, tuple(lfs)), letters, full=False)
        if is_log:  # in fp32: a bf16 log would round the gate more than the code rounds a
            node = em.call(torch.log, em.as_float32(node))
            if c != 1.0:
                node = em.call(torch.mul, node, c)
        total = node if total is None else em.call(torch.add, total, node)
    shape = [em.size(ch) for ch in letters]
    if total is None:
        total = em.call("new_zeros", like, shape, dtype=torch.float32, op="call_method")
    if coef != 1.0:
        total = em.call(torch.add, total, math.log(coef))
    return em.expand_to(em.as_float32(total), letters)


def _dependencies(last, head) -> list:
    lfs = [lf for key in ("q", "k", "v", "k_inv", "v_inv") if last[key] is not None for lf in last[key][1].factors]
    if last["decay"] is not None:
        lfs += [lf for _, terms, _ in last["decay"][1][1] for lf in terms]
    deps = [d for lf in lfs for d in (lf.lifted.deps() if lf.lifted is not None else [lf.node])]
    if head.prev is not None:
        deps.append(head.prev)
    return list(dict.fromkeys(deps))
