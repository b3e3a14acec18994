"""Decay exponents of the parallel form, read as sums of cumulative log gates.

A decay exp(E) of the parallel form's monomials is read term by term (``_exponent``): each term
is coef * X[pos], X the cumulative sum of a log-gate source s (forward cumsum, reverse cumsum
as flip-cumsum-flip, or s itself) at a time position (i, j, or the first or last step); each
term then weighs s_u by an indicator of u (u <= t, u >= t, u == t). GLA needs, for each
source, the weights c_s on exactly the steps the recurrence decays over (the *window*): u in
(j, i] (forward) or [i, j) (reverse) between a query and a key, u <= i or u >= i for the
initial state, u > j or u < j to the end for the final state. The weights depend only on
where u lies against i, j and the ends, so checking every point of a short sequence
(``ORDER_STEPS``) proves them for every length. Constant gates, exp(C[i, j] * gamma[h]) with C
built from aranges, are evaluated: C must be lambda times the number of steps decayed over.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..core.algebra import Factor, comps, factor_vars, mono_vars, rank_of, sub_mono
from ..core.analyzer import Analyzer
from ..core.consts import size_hint
from ..core.emit import LFactor, lfactor
from ..core.match import Reject
from ..core.rules import cumsum_dim, flip_dim

# Weights are checked on a sequence of this many steps: the indicators a weight sums depend
# only on where u lies against i, against j and against the two ends, and every such case
# occurs in it (u strictly between j and i, both away from the ends, takes five steps).
ORDER_STEPS = 5
COEF_RTOL = 1e-9  # coefficients are Python floats multiplied in different orders


@dataclass(frozen=True)
class Use:
    """One term of a decay exponent: coef * X[pos], X the cumulative sum of a log-gate source
    (`kind` fwd: X_t = sum_{u <= t} s_u, rev: sum_{u >= t}, raw: X = s)."""

    coef: float
    # s with role letters ('t' for time); an axis the code merged from roles (g reshaped to
    # [B * H, T] for bmm) carries several letters and is unflattened when the gate is emitted
    source: LFactor
    kind: str
    pos: str  # "i" | "j" | "first" | "last"


@dataclass
class Exponent:
    uses: list = field(default_factory=list)
    consts: list = field(default_factory=list)  # (coef, const factor, gamma atom factor)


@dataclass
class Gate:
    kind: str  # none | scalar | vector | constant
    terms: list  # (coef, LFactor) whose weighted sum is g (or g_gamma)
    weights: dict = field(default_factory=dict)  # source -> c (data gates); gamma key -> c * lambda
    reads: list = field(default_factory=list)  # the nodes the exponent reads (to check for writes)
    # emit(emitter) -> the log gate, for a gate read from the user's decay in the graph
    # (static_decay.py) rather than from its terms
    emit: Optional[Callable] = None
    # row(emitter) -> c[h, t], a factor of each query's row that q is multiplied by (a decay
    # from positions and buffers scaled per row: ``row_factor.py``); None for none
    row: Optional[Callable] = None


def _exponent(an: Analyzer, factors: list, times: dict, letter: dict, T: int) -> Exponent:
    """The exponent of a product of exp factors, term by term. times: var -> position. A term
    without a time axis (T * gamma[h]) is a constant-gate term with C = 1."""
    ex = Exponent()
    for c, fs in _expanded(an, [m for f in factors for m in f.inner]):
        atoms = [f for f in fs if f.kind == "atom"]
        consts = [f for f in fs if f.kind == "const"]
        if len(fs) == 1 and atoms and not atoms[0].atom.fixed and not set(times) & factor_vars(atoms[0]):
            ex.consts.append((c, None, atoms[0]))
        elif len(fs) == 1 and atoms:
            ex.uses.append(_use(an, c, atoms[0], times, letter, T))
        elif len(consts) == 1 and len(atoms) <= 1 and len(fs) == len(consts) + len(atoms):
            ex.consts.append((c, consts[0], atoms[0] if atoms else None))
        else:
            raise Reject("the decay exponent is not a difference of cumulative log-gates")
    if ex.uses and ex.consts:
        raise Reject("the decay mixes data-dependent and constant gates")
    return ex


def _expanded(an: Analyzer, inner: list, depth: int = 0):
    """The terms of an exponent, reading through sums it holds as atoms: the algebra cuts a
    sum that is multiplied or subtracted (E = G - g in exp(E_j - E_i)) into one atom."""
    for c, fs in inner:
        sub = _sum_terms(an, fs[0]) if depth < 3 and len(fs) == 1 and fs[0].kind == "atom" else None
        if sub is None:
            yield c, fs
        else:
            yield from _expanded(an, [(c * c2, fs2) for c2, fs2 in sub], depth + 1)


def _sum_terms(an: Analyzer, f: Factor) -> Optional[list]:
    """The monomials of the sum an atom stands for, in the atom's variables; None unless it is
    a linear form (no contraction, no exp) of its own output."""
    av = an.value(f.atom.node)
    if f.atom.fixed or av is None or av.keep is not None or len(av.terms) < 2 or len(av.out) != len(f.idx):
        return None
    mp = {}
    for e, x in zip(av.out, f.idx):
        if (e is None) != (x is None) or type(e) is tuple or type(x) is tuple:
            return None
        if e is not None:
            mp[e] = x
    if any(not mono_vars(m) <= set(mp) or any(g.kind == "exp" for g in m[1]) for m in av.terms):
        return None
    return [sub_mono(m, mp) for m in av.terms]


def _use(an: Analyzer, c: float, f: Factor, times: dict, letter: dict, T: int) -> Use:
    node = f.atom.node
    src, dim, kind = _cumulative(an, node)
    rank = rank_of(node)
    free, fixed = f.atom.free_axes(), dict(f.atom.fixed)
    pos, per_axis = None, []
    for axis in range(rank):
        if axis in fixed:
            if kind == "raw" or axis != dim:
                raise Reject("the decay exponent indexes a gate at an integer position")
            pos = _end(fixed[axis], T)
            per_axis.append(("t", None))
            continue
        x = f.idx[free.index(axis)]
        if x in times:
            if pos is not None:
                raise Reject("a decay exponent term is not indexed by exactly one time axis")
            if kind != "raw" and axis != dim:
                raise Reject("the decay is not built from a cumulative sum over time")
            pos = times[x]
            per_axis.append(("t", None))
        elif x is None:
            per_axis.append(("1", (1,)))
        elif all(p in letter for p in comps(x)):  # a role, or roles merged by a reshape
            per_axis.append(("".join(letter[p] for p in comps(x)), tuple(an.sizes[p] for p in comps(x))))
        else:
            raise Reject("the gate is indexed by an unknown axis")
    if pos is None:
        raise Reject("a decay exponent term is not indexed by a time axis")
    if len(set("".join(ls for ls, _ in per_axis)) - {"1"}) != sum(len(ls) for ls, _ in per_axis if ls != "1"):
        raise Reject("the gate repeats a role axis")
    return Use(c, lfactor(src, (), per_axis), kind, pos)


def _end(index: int, T: int) -> str:
    if T >= 2 and index == T - 1:
        return "last"
    if T >= 2 and index == 0:
        return "first"
    raise Reject("the decay exponent reads the gate at a step other than the first or last")


def _cumulative(an: Analyzer, node: fx.Node) -> tuple:
    """(s, time axis, "fwd") for cumsum(s), (s, axis, "rev") for flip(cumsum(flip(s))) along
    one axis, else (node, None, "raw"); each step reading its input unmodified."""
    d = cumsum_dim(node)
    if d is not None and _fresh(an, node):
        return node.args[0], d, "fwd"
    d = flip_dim(node)
    cs = node.args[0] if d is not None else None
    if isinstance(cs, fx.Node) and cumsum_dim(cs) == d and _fresh(an, node) and _fresh(an, cs):
        inner = cs.args[0]
        if flip_dim(inner) == d and isinstance(inner.args[0], fx.Node) and _fresh(an, inner):
            return inner.args[0], d, "rev"
    return node, None, "raw"


def _fresh(an: Analyzer, node: fx.Node) -> bool:
    """Whether `node` reads its first argument as that argument was computed."""
    x = node.args[0]
    return isinstance(x, fx.Node) and an.versions.get((node, x), x) is x


# Which steps u the recurrence decays over, for each kind of exponent.
def _pair_window(reverse: bool):
    """The decay from step j to step i (with i >= j, or j >= i reversed)."""
    if reverse:
        return lambda at, u: at["i"] <= u < at["j"]
    return lambda at, u: at["j"] < u <= at["i"]


def start_window(reverse: bool):
    """The decay of the initial state to step i."""
    return (lambda at, u: u >= at["i"]) if reverse else (lambda at, u: u <= at["i"])


def final_window(reverse: bool):
    """The decay from step j to the end of the sequence (its first step, reversed)."""
    return (lambda at, u: u < at["j"]) if reverse else (lambda at, u: u > at["j"])


def all_steps(at, u) -> bool:
    return True


def _points(positions: set, reverse: bool, pair: bool):
    """Every assignment of the positions on ORDER_STEPS steps (i, j on the mask's triangle)."""
    n = ORDER_STEPS
    free = sorted(p for p in positions if p in ("i", "j"))
    for values in itertools.product(range(n), repeat=len(free)):
        at = dict(zip(free, values), first=0, last=n - 1)
        if pair and (at["j"] < at["i"] if reverse else at["i"] < at["j"]):
            continue
        yield at


def _indicator(use: Use, at: dict, u: int) -> bool:
    t = at[use.pos]
    return {"fwd": u <= t, "rev": u >= t, "raw": u == t}[use.kind]


def _weights_hold(uses: list, weights: dict, window, positions: set, reverse: bool, pair: bool) -> bool:
    """Whether sum over uses of coef * X[pos] = sum_{u in window} weights[source] * s_u."""
    sources = set(weights) | {x.source for x in uses}
    for at in _points(positions, reverse, pair):
        for u in range(ORDER_STEPS):
            for s in sources:
                got = sum(x.coef for x in uses if x.source == s and _indicator(x, at, u))
                want = weights.get(s, 0.0) if window(at, u) else 0.0
                if not math.isclose(got, want, rel_tol=COEF_RTOL, abs_tol=COEF_RTOL):
                    return False
    return True


def read_gate(an: Analyzer, exps: list, i: int, j: int, batch: list, letter: dict, reverse: bool, T: int) -> Gate:
    """The gate of the decay exp(sum of `exps`) between query time i and key time j (index
    variables); raises Reject unless it is G_i - G_j of cumulative log gates (or constant)."""
    ex = _exponent(an, exps, {i: "i", j: "j"}, letter, T)
    if ex.consts:
        return _constant_gate(an, ex.consts, i, j, batch, letter, reverse)
    if not ex.uses:
        return Gate("none", [])
    # each source's weight, read where the window holds exactly one step
    at = {"i": 0, "j": 1} if reverse else {"i": 1, "j": 0}
    at.update(first=0, last=ORDER_STEPS - 1)
    u = 0 if reverse else 1
    weights = {}
    for x in ex.uses:
        weights[x.source] = weights.get(x.source, 0.0) + (x.coef if _indicator(x, at, u) else 0.0)
    if not _weights_hold(ex.uses, weights, _pair_window(reverse), {"i", "j"}, reverse, pair=True):
        raise Reject("the decay exponent is not of the form G_i - G_j of a cumulative sum over time")
    weights = {s: c for s, c in weights.items() if abs(c) > COEF_RTOL}
    if not weights:
        return Gate("none", [])
    terms = [(c, source) for source, c in weights.items()]
    kind = "vector" if any("k" in source.letters for source in weights) else "scalar"
    reads = [x.source.node for x in ex.uses] + [f.atom.node for f in _atoms(exps)]
    return Gate(kind, terms, weights, reads)


def _atoms(factors: list) -> list:
    return [g for f in factors for _, gs in f.inner for g in gs if g.kind == "atom"]


def _constant_gate(an: Analyzer, const_terms: list, i: int, j: int, batch: list, letter: dict, reverse: bool) -> Gate:
    """exp(c * C[i, j] * gamma[h]) with C = lambda (i - j) on the triangle (j - i reversed)."""
    totals = _constant_totals(an, const_terms, batch, letter, [i, j])
    weights = {}
    for key, C in totals.items():
        if C.shape[0] < 2:
            raise Reject("the constant decay exponent is not a [T, T] matrix")
        n = torch.arange(C.shape[0], dtype=torch.float64)
        steps = (n[None, :] - n[:, None]) if reverse else (n[:, None] - n[None, :])
        lam = float(C[0, 1] if reverse else C[1, 0])
        tri = steps >= 0
        if not torch.allclose(C[tri], steps[tri] * lam, rtol=1e-6, atol=1e-6):
            raise Reject("the constant decay exponent is not proportional to i - j")
        weights[key] = lam
    terms = [(lam, lfactor(node, (), list(per_axis))) for (node, per_axis), lam in weights.items()]
    return Gate("constant", terms, weights, [node for node, _ in weights])


def _constant_totals(an: Analyzer, const_terms: list, batch: list, letter: dict, axes: list) -> dict:
    """(gamma node, letters) -> the sum of c * C over its terms, as a float64 tensor over `axes`
    (C = 1 where a term has no constant)."""
    totals: dict = {}
    for c, cf, atom in const_terms:
        if atom is None:
            raise Reject("a decay fixed at trace time is not supported yet")
        if atom.atom.fixed or not set(factor_vars(atom)) <= set(batch):
            raise Reject("the constant gate depends on more than the head")
        letters = tuple(_axis_letters(an, x, letter) for x in atom.idx)
        if "b" in "".join(ls for ls, _ in letters):
            raise Reject("the constant gate depends on the batch")
        val = an.consts.evaluate(cf.node) if cf is not None else torch.ones(())
        if val is None or cf is not None and not factor_vars(cf) <= set(axes):
            raise Reject("the constant decay exponent could not be evaluated")
        C = _const_over(val.double(), cf.idx if cf is not None else (), axes, an)
        key = (atom.atom.node, letters)
        totals[key] = totals[key] + c * C if key in totals else c * C
    return totals


def _axis_letters(an: Analyzer, x, letter: dict) -> tuple:
    """(letters, sizes) of one axis of a constant gate, as ``lfactor`` takes it: a head axis the
    code repeated (grouped q and k) has both parts of the heads, with their sizes."""
    if x is None:
        return "1", (1,)
    if len(comps(x)) == 1:
        return letter[x], None
    sizes = tuple(an.sizes[p] for p in comps(x))
    if not all(isinstance(n, int) for n in sizes):
        raise Reject("the constant gate's merged head axis has a symbolic size")
    return "".join(letter[p] for p in comps(x)), sizes


def _const_over(val: torch.Tensor, idx: tuple, axes: list, an: Analyzer) -> torch.Tensor:
    """A constant indexed by some of `axes` (vars), as a tensor over all of them."""
    present = [x for x in idx if x is not None]
    val = val.reshape([s for s, x in zip(val.shape, idx) if x is not None])
    val = val.permute([present.index(x) for x in axes if x in present]) if present else val
    shape = [int(size_hint(an.sizes[x])) for x in axes]
    for p, x in enumerate(axes):
        if x not in present:
            val = val.unsqueeze(p)
    return val.expand(shape)


def check_decay(an: Analyzer, exps: list, times: dict, letter: dict, gate: Gate, window, reverse: bool,
                 T: int, axes: list, steps) -> None:
    """The exponent of `exps` is the gate summed over `window`; for a constant gate, C * gamma
    with C = lambda * steps(arange over the one time axis)."""
    ex = _exponent(an, exps, times, letter, T)
    if gate.kind == "constant":
        batch = [x for x in letter if letter[x] in ("b", "h") or letter[x].isupper()]  # (parts of h)
        totals = _constant_totals(an, ex.consts, batch, letter, axes) if ex.consts else {}
        if ex.uses or set(totals) != set(gate.weights):
            raise Reject("the decay of the state does not match the attention's")
        for key, C in totals.items():
            n = torch.arange(C.shape[0] if C.dim() else 1, dtype=torch.float64)
            if not torch.allclose(C, gate.weights[key] * steps(n), rtol=1e-6, atol=1e-6):
                raise Reject("the decay of the state does not match the attention's")
        return
    if ex.consts or not _weights_hold(ex.uses, gate.weights, window, set(times.values()), reverse, pair=False):
        raise Reject("the decay of the state does not match the attention's")
