"""Decays from positions and buffers scaled per query row: D[h, i, j] = c[h, i] * gamma_h ** (i - j).

torchscale's RetNet divides its decay mask by the root of its row sums,
c[h, i] = 1 / sqrt(sum_j gamma_h ** (i - j)): a factor of each query's row that depends only on
positions and buffers. Such a factor is separable,

    sum_j q_i k_j v_j c_i gamma ** (i - j) = sum_j (c_i q_i) k_j v_j gamma ** (i - j),

so it is folded into q and the rest is GLA's constant gate. ``static_decay.read`` rejects the
decay (its diagonal is not 1); here it is evaluated again (float64, at the buffers' values and
perturbed as there) and divided by its diagonal, c[h, i] = D[h, i, i], which must leave
gamma ** (i - j) on the triangle. A factor of the key's column only (D[i, j] = c_j gamma ** (i - j))
or anything else is left alone with the reason. In the graph the rewrite computes c as the
diagonal of the user's own mask tensors and g_gamma = (log D[h, s, 0] - log D[h, s, s]) / s over
a span s of steps (``_span``), so a buffer changed after compiling reaches the op, as for
unscaled static decays.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import Factor, factor_vars
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import Emitter, Group, lfactor
from ..core.match import Reject
from . import static_decay, toeplitz_decay
# the evaluation and the GLA check of a static decay, shared (not copied) with static_decay.py
from .static_decay import RTOL, _check, _evaluate, _factor_value, _perturbed_state
from .parallel_decay import Gate


def gate(an: Analyzer, factors: list, i: int, j: int, batch: list, letter: dict, unscaled: Reject) -> tuple:
    """(Gate, reverse) of a static decay with a row factor; re-raises `unscaled`, static_decay's
    reason, where the decay has no row factor (its diagonal is 1, or it cannot be evaluated)."""
    heads = [x for x in batch if letter.get(x) == "h"]
    if any(letter.get(x, "").isupper() for x in batch):
        raise unscaled  # (q and k shared by groups of heads: a factor per head would ungroup them)
    if any(factor_vars(f) - {i, j} - set(heads) for f in factors):
        raise unscaled
    axes = heads + [i, j]
    facts = _from_diagonals(an, factors, axes, i, j, letter, unscaled)
    if facts is None:  # (not proven Toeplitz times a row factor: the decay evaluated whole)
        D = _evaluate(an, factors, axes)
        if D is None:
            raise unscaled
        reverse = _scaled_rows(_as_3d(D), unscaled)
        _check_perturbed(an, factors, axes, reverse)
        atoms = _row_atoms(an, factors, axes, i, j, letter, unscaled, _whole_diagonal(an, axes, D.shape))
        span = _span(an, D, i, atoms, reverse)
    else:
        reverse, atoms, span = facts

    def emit_row(em: Emitter) -> fx.Node:  # c[h, i], emitted once for q and the gate
        key = ("row_factor", tuple(id(a) for a in atoms))
        if key not in em.memo:
            em.memo[key] = em.lift(Group(1.0, tuple(atoms)), "ht", full=False)
        return em.memo[key]


    def emit_gamma(em: Emitter) -> fx.Node:  # (log D[h, s, 0] - log D[h, s, s]) / s (rows 0 reversed)
        log_d = static_decay.emit_log_at(em, an, factors, {i: 0, j: span} if reverse else {i: span, j: 0}, letter)
        row = em.call(torch.select, emit_row(em), 1, 0 if reverse else span)
        return em.call(torch.div, em.call(torch.sub, log_d, em.call(torch.log, row)), float(span))

    reads = [g.atom.node for f in factors for g in static_decay._atoms_of(f)]
    return Gate("constant", [], reads=reads, emit=emit_gamma, row=emit_row), reverse


def _span(an: Analyzer, D: torch.Tensor, i: int, carriers: list, reverse: bool) -> int:
    """The steps s the gate is read over, gamma ** s = D[s, 0] / D[s, s]: a scaled mask holds
    gamma ** n only to its dtype's rounding, so reading one step (s = 1) would put that rounding
    into every step of the op's decay (a relative error growing with T); over s steps it is divided
    by s. The longest span whose entries stay well inside the mask's dtype (all heads), and 1 where
    the length is symbolic (the graph serves other lengths)."""
    D3 = _as_3d(D)
    entries = D3[:, 0, :] if reverse else D3[:, :, 0]  # D[0, n] (D[n, 0]): c * gamma ** n
    powers = entries / (D3[:, 0, :1] if reverse else D3.diagonal(dim1=-2, dim2=-1))  # gamma ** n
    return _span_of(an, i, carriers, entries, powers)


def _span_of(an: Analyzer, i: int, carriers: list, entries: torch.Tensor, powers: torch.Tensor) -> int:
    """_span from D[n, 0] (D[0, n] reversed) and gamma ** n, [heads, T]."""
    if not isinstance(an.sizes[i], int):
        return 1
    dtype = example_value(carriers[0].node).dtype
    # (a quarter of the dtype's exponent range: room for decays a changed buffer makes faster)
    bound = torch.finfo(dtype).tiny ** 0.25 if dtype.is_floating_point else 1e-9
    ok = ((powers > bound) & (powers < 1 / bound) & (entries > bound)).all(0)
    ok[0] = True
    bad = (~ok).nonzero()
    return max(1, (int(bad[0]) if len(bad) else entries.shape[-1]) - 1)


def _from_diagonals(an: Analyzer, factors: list, axes: list, i: int, j: int, letter: dict,
                    unscaled: Reject) -> Optional[tuple]:
    """(reverse, row atoms, span) where the decay is proven a Toeplitz matrix times a factor per row
    (``toeplitz_decay.py``: D[h, i, j] = c[h, i] v[h, i - j], O(H T)); the same facts as the whole
    evaluation's: D / diag(D) = v / v_0 must be GLA's decay, at the buffers' values and perturbed.
    None where the decay is not proven of that form."""
    got = toeplitz_decay.evaluate(an, factors, axes, rows=True)
    if got is None or got[1] is None:
        return None
    v, c, T = _flat_rows(got)
    diag = c * v[:, T - 1:T]
    if bool(((diag - 1).abs() <= RTOL).all()) or not bool((torch.isfinite(diag) & (diag > 0)).all()):
        raise unscaled
    try:
        reverse = toeplitz_decay.check(v / v[:, T - 1:T], T)
    except Reject as by_rows:
        raise Reject(f"{unscaled}; divided by its diagonal per query row, {by_rows}") from None
    state = _perturbed_state(an, factors)
    if state:
        again = toeplitz_decay.evaluate(an, factors, axes, state, rows=True)
        try:
            if again is None or again[1] is None:
                raise Reject("the decay could not be evaluated")
            v2, c2, _ = _flat_rows(again)
            if not bool((torch.isfinite(c2 * v2[:, T - 1:T]) & (c2 * v2[:, T - 1:T] > 0)).all()) or \
                    toeplitz_decay.check(v2 / v2[:, T - 1:T], T) != reverse:
                raise Reject("its direction changes")
        except Reject as e:
            raise Reject(f"the decay is a row factor times GLA's decay for the buffers' values at compile time "
                         f"only (with them perturbed by up to 10%: {e})") from None
    atoms = _row_atoms(an, factors, axes, i, j, letter, unscaled,
                       lambda f, st: toeplitz_decay.factor_diagonal(an, f, axes, st))
    entries = c[:, :1] * v[:, :T].flip(-1) if reverse else c * v[:, T - 1:]  # D[0, n] (D[n, 0])
    powers = (v[:, :T].flip(-1) if reverse else v[:, T - 1:]) / v[:, T - 1:T]
    return reverse, atoms, _span_of(an, i, atoms, entries, powers)


def _flat_rows(got: tuple) -> tuple:
    """(diagonals [heads, 2T - 1], row factor [heads, T], T) of toeplitz_decay.evaluate(rows=True)."""
    v, c = got
    T = (v.shape[-1] + 1) // 2
    return v.reshape(-1, v.shape[-1]), c.expand(v.shape[:-1] + (T,)).reshape(-1, T), T


def _as_3d(D: torch.Tensor) -> torch.Tensor:
    return D.reshape(-1, D.shape[-2], D.shape[-1])


def _scaled_rows(D: torch.Tensor, unscaled: Reject) -> bool:
    """Whether D / diag(D) (per row) is GLA's constant-gate decay reversed; Reject otherwise,
    with a reason for a factor per key column."""
    diag = D.diagonal(dim1=-2, dim2=-1)
    if bool(((diag - 1).abs() <= RTOL).all()) or not bool((torch.isfinite(diag) & (diag > 0)).all()):
        raise unscaled  # no row factor (or none that can scale q): static_decay's reason stands
    try:
        return _check(D / diag[..., :, None])
    except Reject as by_rows:
        try:
            _check(D / diag[..., None, :])
        except Reject:
            raise Reject(f"{unscaled}; divided by its diagonal per query row, {by_rows}") from None
        raise Reject(f"{unscaled}: the decay is gamma ** (i - j) times a factor of the key's column c_j "
                     "(D[i, j] / D[j, j] is GLA, D[i, j] / D[i, i] is not), expected a factor of the query's "
                     "row c_i only") from None


def _check_perturbed(an: Analyzer, factors: list, axes: list, reverse: bool) -> None:
    """The row-scaled form must not hinge on the buffers' values at compile time (as in
    ``static_decay.read``): it is checked again with each buffer perturbed by up to 10%."""
    state = _perturbed_state(an, factors)
    if not state:
        return
    D = _evaluate(an, factors, axes, state)
    try:
        if D is None or _scaled_rows(_as_3d(D), Reject("the decay could not be evaluated")) != reverse:
            raise Reject("its direction changes")
    except Reject as e:
        raise Reject(f"the decay is a row factor times GLA's decay for the buffers' values at compile time "
                     f"only (with them perturbed by up to 10%: {e})") from None


def _row_atoms(an: Analyzer, factors: list, axes: list, i: int, j: int, letter: dict, unscaled: Reject,
               diagonal) -> list:
    """The factors that carry the row factor (tensors of the graph: module state or constants), as
    LFactors over the diagonal ("htt": einsum reads the diagonal of a repeated letter). The others
    (exp, triangles, negated masks) must be 1 on the diagonal, at the buffers' values and
    perturbed, so that c is the diagonal of the tensors alone. `diagonal(f, state)`: a factor's
    diagonal (None where it cannot be evaluated)."""
    states = [None, _perturbed_state(an, factors) or None]
    for f in factors:
        if _carrier(f):
            continue
        for state in states:
            diag = diagonal(f, state)
            if diag is None or not bool(((diag - 1).abs() <= RTOL).all()):
                raise Reject(f"{unscaled}; as a row factor times GLA's decay it is not read yet: the row "
                             "factor is not carried by the decay's tensors alone (an exp or mask computed "
                             "inline is not 1 on the diagonal)")
    atoms = [f for f in factors if _carrier(f)]
    if not atoms:
        raise Reject(f"{unscaled}; as a row factor times GLA's decay it is not read yet: no tensor of the "
                     "graph carries the row factor")
    return [_diagonal_lfactor(an, f, i, j, letter) for f in atoms]


def _whole_diagonal(an: Analyzer, axes: list, shape):
    """diagonal(f, state) for _row_atoms: a factor evaluated whole over the decay's `shape`."""
    def diagonal(f: Factor, state):
        val = _factor_value(an, f, axes, state)
        return _as_3d(val.expand(shape)).diagonal(dim1=-2, dim2=-1) if val is not None else None

    return diagonal


def _carrier(f: Factor) -> bool:
    return f.kind == "atom" or f.kind == "const" and not f.negate


def _diagonal_lfactor(an: Analyzer, f: Factor, i: int, j: int, letter: dict):
    per_axis = []
    for x in f.idx:
        if x is None:
            per_axis.append(("1", (1,)))
        elif type(x) is tuple:
            raise Reject("the decay's row factor is indexed by a merged axis: not read yet")
        elif x in (i, j):
            per_axis.append(("t", None))
        else:
            per_axis.append((letter[x], None))
    if f.kind == "const":
        return lfactor(f.node, (), per_axis)
    return lfactor(f.atom.node, tuple(f.atom.fixed), per_axis)


def scale_q(em: Emitter, q: fx.Node, row: Optional[callable], q_letters: str) -> fx.Node:
    """q * c[h, i] in the op's layout (q unchanged without a row factor)."""
    if row is None:
        return q
    c = em.relayout(row(em), "ht", q_letters)
    return em.call(torch.mul, q, em.cast_like(c, q))
