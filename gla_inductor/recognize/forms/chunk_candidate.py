"""A chunked computation read as GLA, given its q, k, v with role letters and its output: the
gate, initial state and final state, found by shape among the data it reads and the values it
computes, in the first reading that the certificate proves (``complete``); then the ``Match``
that inserts the op (``match_of``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from ..certify.certificate import CertificateTooLarge, certify, first_too_large
from ..certify.probe import fitted_gamma
from ..certify.spec import Spec, emit_replacement
from ..certify.subgraph import is_analytic, reads_module_state, subgraph
from ..core import placement
from ..core.analyzer import Analyzer
from ..core.consts import example_value, is_inplace, written_args
from ..core.emit import Emitter, LFactor
from ..core.match import Match, Reject
from . import positive_gate
from .cumsum_chunks import cumulative
from .grouped_heads import shared_qk

MAX_CANDIDATES = 8  # readings tried per gate candidate: more means its shape is too ambiguous
MAX_READINGS = 16  # readings tried in all, each a float64 evaluation of the subgraph
FINAL_STATE_REACH = 64  # nodes searched past the last one computed from the subgraph


def complete(an: Analyzer, base: Spec, tables_gate: bool = False) -> Spec:
    """The gate, initial state and final state: the first reading that certifies. `tables_gate`:
    the caller computes a constant gate in the graph from decay tables in module state
    (``table_gate.py``), so where the code reads such tables the fitted gate is tried first."""
    tried, too_large, per_gate = 0, None, {}
    for spec in readings(an, base, tables_gate):
        spec = fitted_gamma(an, spec) if spec.gate == "fit" else spec
        if spec is None:
            continue
        # the limits count per gate node: where sizes coincide (an [H] gate input also reads as an
        # initial state at K = V = 1), one node's many letterings must not use up another's turn
        gate = spec.g.node if spec.g is not None else None
        per_gate[gate] = per_gate.get(gate, 0) + 1
        if per_gate[gate] > MAX_CANDIDATES:
            continue
        tried += 1
        if tried > MAX_READINGS:
            raise too_large or Reject("too many ways to read the gate and states by shape")
        try:
            if certify(an, spec):
                return spec
        except CertificateTooLarge as e:
            too_large = first_too_large(too_large, e)
    if any(n > MAX_CANDIDATES for n in per_gate.values()):
        raise too_large or Reject("too many ways to read the gate and states by shape")
    raise too_large or Reject("no reading of the chunked computation as GLA was certified")


def readings(an: Analyzer, base: Spec, tables_gate: bool = False):
    """Specs with a gate, initial state and final state whose inputs explain all the data the
    computation reads, in the order they are tried (uncertified; a constant gate to fit is
    left as gate "fit")."""
    core = {base.q.node, base.k.node, base.v.node}
    nodes, frontier, _ = subgraph(an, base.outputs(), core)  # buffers may be gates
    tables = tables_gate and reads_module_state(an, subgraph(an, base.outputs(), core, static=True)[2])
    base = replace(base, static_tables=bool(tables))
    for gate in _gate_options(an, base, nodes | frontier, fit_first=bool(tables)):
        cut = core | ({gate.g.node} if gate.g is not None else set())
        nodes, frontier, consts = subgraph(an, [base.out], cut, static=base.static_tables)
        for h0, h0_groups in _state_options(base, frontier):
            if frontier - {h0}:
                continue  # data the computation reads is left unexplained
            leaves = cut | ({h0} if h0 is not None else set())
            for final, final_groups in _final_options(an, base, nodes, leaves):
                yield replace(gate, h0=h0, h0_groups=h0_groups, final=final, final_groups=final_groups)


def _gate_options(an: Analyzer, base: Spec, nodes: set, fit_first: bool = False):
    """Specs with a gate: none; each slice node shaped like a log gate (or, for a constant
    gate, like a decay per head); last, a constant decay read off the code itself. That one
    first where the code reads decay tables from module state (buffers computed once from
    per-head slopes): a gate input would leave the tables fixed while the certificate varies it."""
    if fit_first:
        yield replace(base, gate="fit")
    yield base
    # nearest the output first; cumulative log decays (a gate's cumsum) after every gate-shaped node,
    # and values computed from q, k or v (the output, its partial sums: rarely a gate) after both, so
    # that where sizes coincide their many letterings do not use up the tries before a gate's turn
    mixed = _computed_from(an, nodes, {base.q.node, base.k.node, base.v.node})
    cands = sorted(nodes, key=lambda n: (n in mixed, cumulative(n), -an.order[n]))
    for n in cands:
        val = example_value(n)
        if not isinstance(val, torch.Tensor) or an.consts.is_const(n) or not val.is_floating_point():
            continue
        for roles, kind in (("bth", "scalar"), ("bthk", "vector"), ("h", "constant")):
            for letters in letterings(tuple(val.shape), roles, base.sizes):
                yield replace(base, g=LFactor(n, letters), gate=kind)
                if kind == "constant":
                    yield replace(base, g=LFactor(n, letters), gate=kind, gate_is_log=False)
    if not fit_first:
        yield replace(base, gate="fit")


def _computed_from(an: Analyzer, nodes: set, sources: set) -> set:
    """The nodes of `nodes` computed (within them) from one of `sources`."""
    found = set()
    for n in sorted(nodes, key=an.order.__getitem__):
        if any(x in sources or x in found for x in n.all_input_nodes):
            found.add(n)
    return found


def _state_options(base: Spec, frontier: set) -> list:
    """[(h0, groups)]: no initial state, or a data input left besides q, k, v, g that is
    shaped [B, H, K, V] (in any axis order)."""
    res = [(None, [])]
    for n in frontier:
        val = example_value(n)
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            res += [(n, list(ls)) for ls in letterings(tuple(val.shape), "bhkv", base.sizes)]
    return res


def _final_options(an: Analyzer, base: Spec, nodes: set, leaves: set):
    """(final, groups) for each state-shaped value computed from the subgraph's inputs by
    analytic ops outside it (the last state of a chunk loop, the last chunk state of a scan),
    latest first; then (None, []): the final state is not used."""
    derived, cands = set(nodes) | leaves, []
    if not nodes:  # nothing of the subgraph to follow: only "unused"
        yield None, []
        return
    last = max(an.order[x] for x in nodes)
    for n in an.nodes[min(an.order[x] for x in nodes) :]:
        if an.order[n] > last + FINAL_STATE_REACH:
            break  # nothing computed from the subgraph lately: the search is over (and linear)
        if n in derived or not n.all_input_nodes or not is_analytic(an, n) or is_inplace(n):
            continue
        ins = n.all_input_nodes  # from the subgraph, and constants or module state (a block decay)
        if any(x in derived for x in ins) and all(x in derived or an.consts.is_static(x) for x in ins):
            derived.add(n)
            last = max(last, an.order[n])
            val = example_value(n)
            if isinstance(val, torch.Tensor) and val.is_floating_point() and n.users:
                cands.append(n)
    for n in reversed(cands):
        if all(u in derived or an.consts.is_const(u) for u in n.users):
            continue  # read only by the computation itself (or for its shape, as zeros_like): not returned
        for ls in letterings(tuple(example_value(n).shape), "bhkv", base.sizes):
            yield n, list(ls)
    yield None, []


def letterings(shape: tuple, roles: str, sizes: dict) -> list:
    """Ways to name the axes of `shape` by `roles` (each used once; size-1 roles may be
    absent, size-1 axes are '1')."""
    axes = [i for i, s in enumerate(shape) if s != 1]
    must = [c for c in roles if sizes[c] != 1]
    if len(axes) < len(must) or len(axes) > len(roles):
        return []
    res = []
    for perm in itertools.permutations(roles, len(axes)):
        if not set(must) <= set(perm):
            continue
        if all(sizes[c] == shape[a] for c, a in zip(perm, axes)):
            letters = ["1"] * len(shape)
            for c, a in zip(perm, axes):
                letters[a] = c
            res.append("".join(letters))
    return res


def _local_writes(an: Analyzer, nodes: set, consts: dict, outputs: list) -> list:
    """The in-place writes of the computation; each into memory that only it sees (the outputs
    aside, whose users the rewrite points at the op's)."""
    writes = [n for n in nodes if is_inplace(n)]
    inside = nodes | set(consts)
    for w in writes:
        for a in (a for t in written_args(w) for a in an.aliases(t)):
            if a not in inside or a not in outputs and any(u not in inside for u in a.users):
                raise Reject("the chunked computation writes into a tensor read elsewhere")
    return writes


def module_state_reads(an: Analyzer, spec: Spec) -> list:
    """The constants of the certified subgraph that hold module state (decay tables)."""
    return reads_module_state(an, subgraph(an, spec.outputs(), set(spec.leaves().values()), static=True)[2])


def match_of(an: Analyzer, spec: Spec, in_graph_gate=None) -> Match:
    """`in_graph_gate(emitter)`: the constant log gate computed in the graph from the module
    state the subgraph reads (``table_gate.py``); required where it reads any."""
    deps = list(spec.leaves().values())
    anchor = min(spec.outputs(), key=an.order.__getitem__)
    late = [d.name for d in deps if an.order[d] >= an.order[anchor]]
    if late:
        raise Reject(f"inputs {late} are computed after the output")
    nodes, _, consts = subgraph(an, spec.outputs(), set(deps), static=spec.static_tables)
    state = reads_module_state(an, consts)
    if state and in_graph_gate is None:
        names = sorted({n.name for n in state})[:3]
        raise Reject(f"the chunked computation reads module state ({', '.join(names)}) that the op's gate "
                     "would not follow after compiling")
    writes = _local_writes(an, nodes, consts, spec.outputs())
    if any(an.order[w] > an.order[anchor] for w in writes):
        raise Reject("the chunked computation writes into its output after computing it")
    placement.check_unmodified(an, deps, an.order[anchor])
    if spec.h0 is not None and placement.written_after(an, spec.h0, anchor):
        if any(placement.requires_grad(d) for d in deps) and torch.is_grad_enabled():
            raise Reject("the initial state is overwritten in place while gradients are needed")

    shared = shared_qk(an, spec, anchor)
    guard = in_graph_gate is None and positive_gate.needs_guard(an, spec)

    def apply(txn) -> None:
        em = Emitter(txn, anchor, spec.sizes, spec.splits)
        emitted = spec
        if guard:
            positive_gate.emit_guard(em, spec.g.node)
        if in_graph_gate is not None:
            g = in_graph_gate(em)
            letters = "h" if spec.sizes["h"] != 1 else "1"
            emitted = replace(spec, g=LFactor(g, letters), gate="constant", gate_is_log=True, gamma=None)
        o, ht = emit_replacement(em, emitted, emitted.leaves(), shared)
        txn.replace_all_uses(spec.out, o)
        if ht is not None:
            txn.replace_all_uses(spec.final, ht)
        txn.erase += writes  # the buffers the naive code filled are dead now

    shapes = {c.upper(): spec.sizes.get(c, 1) for c in "bthkv"}
    match = Match("chunked", spec.gate, spec.q.letters, shapes, spec.outputs(), apply,
                  {"initial_state": spec.h0 is not None, "scale": spec.scale})
    match.covers = nodes
    return match
