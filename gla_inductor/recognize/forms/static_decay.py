"""Decays of the parallel form that depend only on positions, constants and module state.

RetNet writes its decay mask in many ways (``masked_fill(i - j, ~tril, inf)`` then ``exp`` and
``nan_to_num``, ``gamma ** (i - j)`` with the upper triangle filled with zeros, ``exp2`` of
``log2(gamma)``, a mask from a cached helper), most of which the normal form cannot read
term by term. They need not be read: the product D[h, i, j] of the decay factors depends on
no input that changes from call to call, so it is evaluated (in float64, from the buffers'
values at compile time) and checked against GLA's constant gate:

    D[h, i, j] = gamma_h ** (i - j)  for j <= i,   0 for j > i       (reversed: i and j swapped)

The op's log gate is then read from the user's own factors *inside the graph*,
g_gamma[h] = log D[h, 1, 0], so a buffer changed after compiling reaches the op. The form is
proven for the buffer values at compile time and, as a check that it does not hinge on them,
for values perturbed by up to 10% each; a buffer later set to values for which the mask is no
longer causal (a positive log-decay under an infinite fill) is not guarded at run time. A decay
that is GLA for the buffers' values only (a whole mask precomputed into a buffer) is read
without the perturbation (``perturb=False``) and rewritten with its tables checked at run time
and the user's code as the fallback (``buffer_mask.py``, ``fallback.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import Factor, comps, factor_vars
from ..core.analyzer import Analyzer
from ..core.consts import module_state, size_hint
from ..core.emit import Emitter, Group, lfactor
from ..core.match import Reject
from . import toeplitz_decay
from .toeplitz_decay import _num  # (the decay checks' number format, shared)

RTOL = 1e-5  # fp32 intermediates of the user's mask (the buffer is read in float64)
ATOL = 1e-7  # relative to a decay of 1 on the diagonal


def is_static_atom(an: Analyzer, f: Factor) -> bool:
    return f.kind == "atom" and an.consts.is_static(f.atom.node)


def all_static(an: Analyzer, factors: list) -> bool:
    """Whether every decay factor depends on positions, constants and module state only."""
    for f in factors:
        if f.kind == "atom" and not is_static_atom(an, f):
            return False
        if f.kind == "exp" and not all(g.kind in ("const", "tri") or is_static_atom(an, g)
                                       for _, gs in f.inner for g in gs):
            return False
        if f.kind not in ("atom", "exp", "const", "tri"):
            return False
    return True


@dataclass
class StaticGate:
    kind: str  # "constant" or "none"
    reverse: bool
    reads: list  # the graph nodes the log gate is computed from
    gammas: Optional[torch.Tensor] = None  # D[1, 0] per head (float64), at compile time


def read(an: Analyzer, factors: list, i: int, j: int, batch: list, letter: dict, perturb: bool = True) -> StaticGate:
    """The constant gate of the decay (the product of `factors`), or Reject saying which fact
    about D failed, as expected against found. Without `perturb`, for values of the module
    state at compile time only (the caller guards them at run time: ``table_gate.py``)."""
    heads = [x for x in batch if letter.get(x) == "h" or letter.get(x, "").isupper()]  # (parts of the heads)
    for f in factors:
        extra = factor_vars(f) - {i, j} - set(heads)
        if extra:
            raise Reject("the decay depends on the batch" if extra <= set(batch)
                         else "the decay is indexed by an axis other than the head and the two times")
    axes = heads + [i, j]
    checked = checked_decay(an, factors, axes)
    if checked is None:
        raise Reject("the decay depends only on positions and buffers but could not be evaluated")
    reverse, gammas = checked
    state = _perturbed_state(an, factors) if perturb else {}
    if state:
        try:
            again = checked_decay(an, factors, axes, state)
            if again is None or again[0] != reverse:
                raise Reject("the decay's direction changes with the buffer values")
        except Reject as e:
            names = ", ".join(sorted(_state_name(n) for n in state))
            raise Reject(f"the decay is of GLA form for the values of {names} at compile time only (with them "
                         f"perturbed by up to 10%: {e}): a change after compiling could break it unseen") from None
    buffered = any(_reads_state(an, f) for f in factors)
    kind = "constant" if buffered or not torch.all(gammas == 1) else "none"
    return StaticGate(kind, reverse, _nodes(factors), gammas)


def checked_decay(an: Analyzer, factors: list, axes: list, state: Optional[dict] = None) -> Optional[tuple]:
    """(reverse, gammas) of the decay over `axes` (heads, i, j), checked to be GLA's constant-gate
    decay (Reject saying which fact failed otherwise); None where it cannot be evaluated. Along its
    diagonals where every [T, T] tensor of it is proven Toeplitz (``toeplitz_decay.py``: O(H T),
    every entry still covered), else whole."""
    diagonals = toeplitz_decay.evaluate(an, factors, axes, state, rows=True)
    if diagonals is not None:
        v, r = diagonals
        T = (v.shape[-1] + 1) // 2
        if r is None:
            v = v.reshape(-1, v.shape[-1])
            reverse = toeplitz_decay.check(v, T)
            return reverse, toeplitz_decay.gammas(v, T, reverse)
        # (scaled per row: rejected here, saying so, unless its diagonal is 1 after all)
        toeplitz_decay.check_scaled(v.reshape(-1, v.shape[-1]), r.expand(v.shape[:-1] + (T,)).reshape(-1, T), T)
    D = _evaluate(an, factors, axes, state)
    if D is None:
        return None
    D = D.reshape(-1, D.shape[-2], D.shape[-1])
    reverse = _check(D)
    return reverse, _gammas(D, reverse)


def _check(D: torch.Tensor) -> bool:
    """Whether D (heads x T x T) is GLA's constant-gate decay reversed; Reject otherwise."""
    T = D.shape[-1]
    if T < 2 or D.shape[-2] != T:
        raise Reject(f"the decay is a {D.shape[-2]} x {T} matrix, expected T x T with T >= 2")
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    reverse = bool(torch.all(D[:, upper.T] == 0)) and not bool(torch.all(D[:, upper] == 0))
    off = upper.T if reverse else upper
    bad = (D != 0) & off
    if bad.any():
        h, r, c = (int(x) for x in bad.nonzero()[0])
        raise Reject(f"decay D[i, j] for {'j < i' if reverse else 'j > i'} is {_num(D[h, r, c])} (at i={r}, j={c}), "
                     "expected 0")
    if not torch.isfinite(D).all():
        h, r, c = (int(x) for x in (~torch.isfinite(D)).nonzero()[0])
        raise Reject(f"decay D[i, j] is {_num(D[h, r, c])} (at i={r}, j={c}), expected a finite number")
    diag = D.diagonal(dim1=-2, dim2=-1)
    gammas = _gammas(D, reverse)
    bad_diag = (diag - 1).abs() > RTOL
    if bad_diag.any():
        h, n = (int(x) for x in bad_diag.nonzero()[0])
        found = f"decay D[i, i] is {_num(diag[h, n])} (at i={n}), expected 1"
        row = D / diag[..., :, None]
        if not torch.isfinite(row).all() or _separable(row, _gammas(row, reverse), reverse) is not None:
            raise Reject(found)
        if torch.allclose(diag, diag[:, :1].expand_as(diag), rtol=RTOL, atol=ATOL):
            raise Reject(f"{found}: the decay is c * gamma ** (i - j) with c = {_num(diag[h, 0])} (a shifted "
                         "decay, or one scaled per head), not GLA")
        raise Reject(f"{found}: the decay is scaled per query (a row normalization), not GLA")
    if not torch.all(gammas > 0):
        raise Reject(f"decay D[1, 0] is {_num(gammas.min())}, expected a gamma > 0 (D = gamma ** (i - j))")
    worst = _separable(D, gammas, reverse)
    if worst is not None:
        h, r, c, want = worst
        raise Reject(f"decay D[i, j] is {_num(D[h, r, c])} at i={r}, j={c}, expected D[1, 0] ** (i - j) = "
                     f"{_num(want)}: not of the form gamma ** (i - j)")
    return reverse


def _gammas(D: torch.Tensor, reverse: bool) -> torch.Tensor:
    return D[:, 0, 1] if reverse else D[:, 1, 0]


def _separable(D: torch.Tensor, gammas: torch.Tensor, reverse: bool) -> Optional[tuple]:
    """None where D = gamma ** (i - j) on its triangle, else (h, i, j, expected) of the worst."""
    T = D.shape[-1]
    n = torch.arange(T, dtype=torch.float64)
    steps = (n[None, :] - n[:, None]) if reverse else (n[:, None] - n[None, :])
    tri = steps >= 0
    want = torch.where(tri, gammas[:, None, None].double() ** steps.clamp(min=0), torch.zeros((), dtype=torch.float64))
    err = ((D.double() - want).abs() - RTOL * want.abs() - ATOL).masked_fill(~tri, 0)
    if not (err > 0).any():
        return None
    h, r, c = (int(x) for x in (err == err.max()).nonzero()[0])
    return h, r, c, want[h, r, c]


# ---- evaluation ----------------------------------------------------------------------------
def _evaluate(an: Analyzer, factors: list, axes: list, state: Optional[dict] = None) -> Optional[torch.Tensor]:
    total = torch.ones([int(size_hint(an.sizes[x])) for x in axes], dtype=torch.float64)
    for f in factors:
        val = _factor_value(an, f, axes, state)
        if val is None:
            return None
        total = total * val
    return total


def _factor_value(an: Analyzer, f: Factor, axes: list, state) -> Optional[torch.Tensor]:
    """A factor as a float64 tensor over `axes` (broadcast where it has no variable)."""
    if f.kind == "exp":
        exponent = torch.zeros((), dtype=torch.float64)
        for c, gs in f.inner:
            term = torch.full((), c, dtype=torch.float64)
            for g in gs:
                val = _factor_value(an, g, axes, state)
                if val is None:
                    return None
                term = term * val
            exponent = exponent + term
        return exponent.exp()
    if f.kind == "tri":
        return _tri(an, f, axes)
    if f.kind == "const":
        val = an.consts.evaluate(f.node)
        if val is not None and f.negate:
            val = ~val.bool()
    else:
        val = an.consts.evaluate_static(f.atom.node, state)
        for axis, index in sorted(f.atom.fixed, reverse=True):
            val = val.select(axis, index) if val is not None else None
    if val is None:
        return None
    return _over(val.double(), f.idx, axes, an)


def _over(val: torch.Tensor, idx: tuple, axes: list, an: Optional[Analyzer] = None) -> Optional[torch.Tensor]:
    if val.dim() != len(idx):
        return None
    if any(type(e) is tuple for e in idx):  # an axis of merged variables (the heads of grouped q, k)
        if an is None:
            return None
        val = val.reshape([n for s, e in zip(val.shape, idx)
                           for n in ([int(size_hint(an.sizes[c])) for c in e] if type(e) is tuple else [s])])
        idx = tuple(c for e in idx for c in (e if type(e) is tuple else (e,)))
    val = val.reshape([s for s, x in zip(val.shape, idx) if x is not None])
    present = [x for x in idx if x is not None]
    if any(x not in axes for x in present):
        return None
    val = val.permute([present.index(x) for x in axes if x in present])
    for p, x in enumerate(axes):
        if x not in present:
            val = val.unsqueeze(p)
    return val


def _tri(an: Analyzer, f: Factor, axes: list) -> Optional[torch.Tensor]:
    r, c = f.idx
    if r not in axes or c not in axes:
        return None
    nr, nc = int(size_hint(an.sizes[r])), int(size_hint(an.sizes[c]))
    rows, cols = torch.arange(nr)[:, None], torch.arange(nc)[None, :]
    keep = (cols - rows <= f.diagonal) if f.lower else (cols - rows >= f.diagonal)
    return _over(keep.double(), (r, c), axes)


def _state_nodes(an: Analyzer, factors: list) -> list:
    """The module-state placeholders the factors are computed from."""
    return state_roots(an, [g.atom.node for f in factors for g in _atoms_of(f)])


def state_roots(an: Analyzer, nodes) -> list:
    """The module-state placeholders the nodes are computed from, in graph order."""
    found, frontier, seen = set(), list(nodes), set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and module_state(n) is not None:
            found.add(n)
        frontier += n.all_input_nodes
    return sorted(found, key=an.order.__getitem__)


def _state_name(node: fx.Node) -> str:
    """L['self']._modules['rel']._buffers['decay'] -> rel.decay; L['self']._masks[10] -> _masks[10]."""
    name = node.meta["grapharg"].source.name
    name = name() if callable(name) else name
    name = re.sub(r"^[LG]\['[^']*'\]", "", name)  # the frame's own name for the module
    for holder in ("._modules['", "._buffers['", "._parameters['"):
        name = name.replace(holder, ".")
    return name.replace("']", "").lstrip(".") or node.name


def _reads_state(an: Analyzer, f: Factor) -> bool:
    return bool(_state_nodes(an, [f]))


def _perturbed_state(an: Analyzer, factors: list) -> dict:
    """Each floating buffer the decay reads, scaled elementwise by a factor in [0.9, 1.1]."""
    gen = torch.Generator().manual_seed(0)
    state = {}
    for n in _state_nodes(an, factors):
        val = module_state(n).detach().cpu().double()
        if val.is_floating_point():
            state[n] = val * (0.9 + 0.2 * torch.rand(val.shape, generator=gen, dtype=torch.float64))
    return state


def _atoms_of(f: Factor) -> list:
    if f.kind == "atom":
        return [f]
    return [g for _, gs in f.inner for g in gs if g.kind == "atom"]


def _nodes(factors: list) -> list:
    return [g.atom.node for f in factors for g in _atoms_of(f)] + [f.node for f in factors if f.kind == "const"]


# ---- the log gate in the graph ----------------------------------------------------------------
def emit_log_gate(em: Emitter, an: Analyzer, factors: list, i: int, j: int, letter: dict, reverse: bool) -> fx.Node:
    """g_gamma[h] = log D[h, 1, 0] (D[h, 0, 1] reversed), computed from the user's factors in
    the graph: the log of each factor at that point, an exponent read there directly."""
    return emit_log_at(em, an, factors, {i: 0, j: 1} if reverse else {i: 1, j: 0}, letter)


def emit_log_at(em: Emitter, an: Analyzer, factors: list, at: dict, letter: dict) -> fx.Node:
    """log D[h, at] from the user's factors in the graph, at the positions `at` (axis -> index)."""
    total, constant = None, 0.0
    for f in factors:
        if f.kind == "tri" or f.kind == "const" and _unit_at(an, f, at):
            continue  # a mask: 1 where the gate is read (checked with the whole decay)
        if f.kind == "exp":
            for c, gs in f.inner:
                node = _lift_at(em, an, gs, at, letter, c)
                if isinstance(node, float):
                    constant += node
                elif node is not None:
                    total = node if total is None else em.call(torch.add, total, node)
            continue
        node = em.call(torch.log, _lift_at(em, an, (f,), at, letter, 1.0))
        total = node if total is None else em.call(torch.add, total, node)
    if total is None:
        raise Reject("the decay's gate could not be read from the graph")
    return em.call(torch.add, total, constant) if constant else total


def _unit_at(an: Analyzer, f: Factor, at: dict) -> bool:
    val = an.consts.evaluate(f.node)
    if val is None:
        return False
    if f.negate:
        val = ~val.bool()
    if val.dim() != len(f.idx):
        return False
    return bool(torch.all(val[tuple(at.get(x, slice(None)) for x in f.idx)] == 1))


def _lift_at(em: Emitter, an: Analyzer, fs: tuple, at: dict, letter: dict, coef: float) -> Optional[fx.Node]:
    """The product coef * prod(fs) at the times `at`, over the head (letters "h"); None where a
    mask factor is 0 there (the term vanishes), the number coef where no tensor is left."""
    lfs = []
    for f in fs:
        if f.kind == "tri":
            r, c = (at[x] for x in f.idx)
            keep = (c - r <= f.diagonal) if f.lower else (c - r >= f.diagonal)
            if not keep:
                return None
            continue
        node = f.node if f.kind == "const" else f.atom.node
        fixed = tuple(f.atom.fixed) if f.kind == "atom" else ()
        free = f.atom.free_axes() if f.kind == "atom" else list(range(len(f.idx)))
        if f.kind == "const" and f.negate:
            node = em.call(torch.logical_not, node)
        select, per_axis = list(fixed), []
        for axis, x in zip(free, f.idx):
            if x in at:
                select.append((axis, at[x]))
            elif x is None:
                per_axis.append(("1", (1,)))
            elif len(comps(x)) == 1 and letter.get(x) == "h":
                per_axis.append(("h", None))
            elif all(letter.get(p, "").isupper() for p in comps(x)):  # the heads, of two parts
                per_axis.append(("".join(letter[p] for p in comps(x)), tuple(an.sizes[p] for p in comps(x))))
            else:
                raise Reject("the decay is indexed by an axis other than the head and the two times")
        lfs.append(lfactor(node, tuple(sorted(select)), per_axis))
    if not lfs:
        return coef
    return em.lift(Group(coef, tuple(lfs)), "h", full=False)
