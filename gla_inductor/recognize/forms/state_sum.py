"""The parallel form's initial state added to the prefix sums before the read:

    o[.., t, v] = sum_k q[.., t, k] * (cumsum_t(k (x) v)[.., t, k, v] + h0[.., k, v])

The algebra cuts a sum that is multiplied with something else (``core/analyzer.py``), so the
product reads the bracket as one atom. Here that one product is distributed over the bracket,
q (prefix sums) + q h0: the parallel term and the initial-state term the parallel form reads
(``parallel._candidate``). Gated prefix sums distribute alike (q e^G times e^-G k (x) v and h0:
the initial state decayed to each step). Only a bracket of the prefix sums and one more term,
one tensor without the time axis, is opened; whether that term is GLA's initial state (indexed
by K and V, decayed as GLA decays it, scaled as the attention) the parallel form decides.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ..core.algebra import AV, merge_exps, mono_vars, out_vars
from ..core.analyzer import Analyzer
from .steps import aligned


def value(an: Analyzer, node: fx.Node) -> Optional[AV]:
    """The node's value, with a product of a bracket (prefix sums + one tensor) distributed
    over the bracket; the node's own value where there is no such product."""
    av = an.value(node)
    if av is None or av.keep is not None or len(av.terms) != 1:
        return av
    coef, fs = av.terms[0]
    for f in fs:
        if f.kind == "atom" and not f.atom.fixed:
            opened = _opened(an, f)
            if opened is not None:
                rest = tuple(g for g in fs if g is not f)
                terms = tuple(merge_exps((coef * c, rest + tfs)) for c, tfs in opened[0])
                return AV(av.out, terms, None, av.origin | opened[1])
    return av


def _opened(an: Analyzer, f) -> Optional[tuple]:
    """(terms, origin) of the bracket the factor f reads, on f's own variables; None where f
    reads no bracket of one prefix-sum term and one tensor (times numbers or decays) without the
    time axis."""
    sv = an.value(f.atom.node)
    if sv is None or sv.keep is not None or len(sv.terms) != 2 or len(sv.out) != len(f.idx):
        return None
    prefix = [t for t in sv.terms if _is_prefix_sum(t, out_vars(sv.out))]
    other = [t for t in sv.terms if t not in prefix]
    if len(prefix) != 1 or len(other) != 1 or [g.kind for g in other[0][1]].count("atom") != 1:
        return None
    steps = {v for g in prefix[0][1] if g.kind == "tri" for v in _vars_of(g)} & out_vars(sv.out)
    if mono_vars(other[0]) & steps:
        return None  # a tensor over time: no initial state (the parallel form names it as a term)
    # the bracket's variables fresh (its summed ones cannot meet the product's), its axes on f's
    inst = an.instantiate(sv)
    terms = tuple((c, aligned(an, f.idx, inst.out, fs)) for c, fs in inst.terms)
    if any(fs is None for _, fs in terms):
        return None
    return terms, inst.origin


def _is_prefix_sum(term, ov: set) -> bool:
    """Two or more tensors under a triangle over a summed axis: sum_{j <= t} of a product."""
    summed = mono_vars(term) - ov
    atoms = [g for g in term[1] if g.kind == "atom"]
    return len(atoms) >= 2 and any(g.kind == "tri" and set(_vars_of(g)) & summed for g in term[1])


def _vars_of(g) -> set:
    return mono_vars((1.0, (g,)))
