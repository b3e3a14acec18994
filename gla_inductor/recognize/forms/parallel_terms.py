"""The terms the parallel form looks for, and why a value that holds one is no candidate.

A parallel term is a product of three inputs (q, k, v) under a decay, contracted over time and
K (``is_parallel``); a tensor computed from positions and module state only is part of the
decay, not an input (``data_atoms``). Values that discovery finds but that are no candidate of
``parallel.py`` are left alone with the first fact that failed (``not_candidates``): several
attention terms, four inputs, extra terms beside the attention, or scores q k^T D (or prefix
sums of k^T v) summed with other terms before their product with v (or q).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..core.algebra import AV, mono_vars, out_vars
from ..core.analyzer import Analyzer
from ..core.match import NearMiss
from . import static_decay


def is_parallel(an: Analyzer, m, ov: set) -> bool:
    """Three inputs under a decay, contracted over time and K (over time alone where K has
    size 1). A tensor computed from positions and module state only (RetNet's decay mask from a
    per-head buffer) is part of the decay, not an input."""
    return len(data_atoms(an, m[1])) in (3, 4) and len(mono_vars(m) - ov) >= 1 and len(m[1]) > 3


def data_atoms(an: Analyzer, fs) -> list:
    return [f for f in fs if f.kind == "atom" and not static_decay.is_static_atom(an, f)]


def input_name(node: fx.Node) -> str:
    """The user's name of a graph input (L['gamma'] -> gamma), else the node's."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    if isinstance(name, str) and name.startswith("L['") and name.endswith("']"):
        return name[3:-2]
    return name if isinstance(name, str) else node.name


def input_leaves(node: fx.Node) -> list:
    seen, frontier, found = set(), [node], []
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.append(n)
        frontier += n.all_input_nodes
    return found


def not_candidates(an: Analyzer, cands: dict, reported: set) -> list:
    """Near misses for the values discovery finds that are no candidate, each with the first fact
    that failed: an attention term (three or four inputs under a decay, contracted over time), or
    scores q k^T D summed with other terms and then contracted with v over time (the sum is one
    input of the product: the analysis does not distribute it). A value computed from a
    candidate or from such a value is skipped: it is reported once."""
    found, seen = [], set(cands) | reported
    for n in an.nodes:
        av = an.value(n)
        if n in seen or av is None or av.keep is not None or any(a in seen for a in n.all_input_nodes):
            continue
        ov = out_vars(av.out)
        par = [m for m in av.terms if is_parallel(an, m, ov) and _has_decay(an, m)]
        why = _why_not_candidate(an, av, par) if par else _scores_summed(an, av, ov)
        if why is not None:
            seen.add(n)
            found.append(NearMiss("parallel", why, [n]))
    return found


def _scores_summed(an: Analyzer, av: AV, ov: set) -> Optional[str]:
    """Why a product of two inputs contracted over one axis, one of them scores q k^T D plus other
    terms, is not GLA; None where it is no such product."""
    for m in av.terms:
        atoms = data_atoms(an, m[1])
        if len(atoms) != 2 or len(mono_vars(m) - ov) != 1:
            continue
        for f in atoms:
            sv = an.value(f.atom.node)
            if sv is None or sv.keep is not None or len(sv.terms) < 2:
                continue
            sov = out_vars(sv.out)
            scores = [t for t in sv.terms if len(data_atoms(an, t[1])) == 2 and _has_decay(an, t)
                      and len(mono_vars(t) - sov) == 1]
            if len(scores) == 1:
                others = sorted({input_name(g.atom.node) for t in sv.terms if t is not scores[0]
                                 for g in t[1] if g.kind == "atom"})
                n, names = len(sv.terms) - 1, ", ".join(others) or "constants"
                # k^T v summed over time under the causal triangle (a cumsum's prefix sums), not q k^T over K
                if any(f.kind == "tri" and (mono_vars(scores[0]) - sov) & set(f.idx) for f in scores[0][1]):
                    return (f"the prefix sums of k^T v over time are summed with {n} other term(s) ({names}) before "
                            "the product with q, expected them alone or with one initial state (one tensor without "
                            "the time axis)")
                return (f"the scores q k^T D are summed with {n} other term(s) ({names}) before the product with v, "
                        "expected the scores alone: a bonus on the diagonal (RWKV's u) or an added bias is not GLA")
    return None


def _has_decay(an: Analyzer, m) -> bool:
    """Whether a monomial has a factor that may be a decay or a mask (not an input, not a number):
    without one, a product of matrices is no attention that discovery looks for."""
    return any(f.kind not in ("atom", "scalar") or static_decay.is_static_atom(an, f) for f in m[1])


def _why_not_candidate(an: Analyzer, av: AV, par: list) -> str:
    if len(par) > 1:
        return (f"the output sums {len(par)} attention terms (products of three inputs under a decay, "
                "contracted over time), expected one: a second attention or a bonus on the diagonal is not GLA")
    names = sorted(input_name(f.atom.node) for f in data_atoms(an, par[0][1]))
    if len(names) == 4:
        return (f"the attention term multiplies four inputs ({', '.join(names)}), expected three (q, k, v) "
                "and a decay computed from positions, constants, gates or module buffers")
    rest = [m for m in av.terms if m is not par[0]]
    others = sorted({input_name(f.atom.node) for m in rest for f in m[1] if f.kind == "atom"})
    return (f"the output adds {len(rest)} term(s) of {', '.join(others) or 'constants'} to the attention, "
            "expected at most one: q times an initial state, contracted over K")
