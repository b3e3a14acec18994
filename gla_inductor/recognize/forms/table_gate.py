"""Decay tables in module state: the constant gate of a chunked computation that reads them,
computed in the graph, and a run-time guard on the tables.

Lightning attention (MiniMax) and chunkwise retention keep their decays as buffers computed
once in ``__init__`` from a per-head slope: a query decay gamma ** (i + 1), a key decay
gamma ** (C - 1 - j), a diagonal decay gamma ** (i - j) under a causal mask, and the slope
itself. The certificate proves the chunk loop equal to GLA with the constant gate that one probe
run reads off (``certify/probe.py``), for the buffers' values at compile time. Two things keep
the rewrite right when a buffer changes after compiling (a checkpoint loaded, slopes retuned):

- *the gate follows the buffers*: g_gamma[h] = log D[h, 1, 0] is computed in the graph from the
  intra-chunk decay's own factors (``static_decay.emit_log_gate``), so tables recomputed from
  new slopes reach the op;
- *every table is guarded*: each module-state tensor the computation reads is fitted at
  compile time as X = exp(g_h * P) (0 where P < 0: the causal mask) or X = g_h * P, with P
  affine in the positions and shared by the heads (query decays P = i + 1, key decays
  P = C - 1 - j, diagonal decays P = i - j, the slope itself P = -1), else fingerprinted (a fixed
  weighted sum of its values). On every call the graph rebuilds each table from the gate it
  computed (or takes the fingerprint) and checks it: where a table changed into values the
  certificate did not cover, the graph runs the user's own loop instead of the op
  (``fallback.py``: a ``torch.cond`` on the checks). The check is elementwise over the tables,
  H·C·C numbers at most, next to a chunk loop over B·H·T·K·V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import factor_vars
from ..core.analyzer import Analyzer
from ..core.consts import example_value, module_state
from ..core.emit import Emitter
from ..core.match import Reject
from . import static_decay
from .fallback import Checks
from .intra_chunk import Roles

GAMMA_RTOL = 1e-5  # the table's gate against the certified one (float32 tables)
FIT_TOL = 1e-4  # an exponent table shared by the heads, up to the tables' float32 rounding
GUARD_RTOL, GUARD_ATOL = 1e-4, 1e-6  # the run-time check of a table against the gate


@dataclass
class Table:
    node: fx.Node  # a module-state placeholder the computation reads
    kind: str  # "exp": X = exp(g_h * P) (0 where P < 0); "lin": X = g_h * P; "same": X unchanged
    head_axis: Optional[int]  # X's head axis (None: the gate is the same for every head)
    coefs: tuple  # P = coefs[0] + sum_a coefs[1 + a] * index_a: affine in the positions
    fingerprint: float = 0.0  # "same": sum(X * w) at compile time (w: ``_weights``)
    spread: float = 0.0  # "same": sum(|X * w|), the scale of the fingerprint's rounding


@dataclass
class TableGate:
    factors: list  # the intra-chunk decay factors of one chunk
    i: int
    j: int
    letter: dict  # index variable -> "h"
    reverse: bool
    tables: list


def read(an: Analyzer, term, r: Roles, gamma: tuple, reads: list) -> TableGate:
    """The in-graph gate of a chunked computation certified with the constant log gate
    `gamma` whose subgraph reads module state (`reads`: its constants that do); Reject where
    the intra-chunk decay is not such a table, or gives another gate."""
    data = {id(f) for f in (r.q, r.k, r.v)}
    factors = [f for f in term[1] if id(f) not in data]
    if not factors or not static_decay.all_static(an, factors):
        raise Reject("the chunked computation reads module state, but its intra-chunk decay is not a table of "
                     "positions and module state to read the gate from in the graph")
    extra = set().union(*[factor_vars(f) for f in factors]) - {r.i, r.j}
    if not extra <= set(r.batch) or len(extra) > 1:
        raise Reject("the intra-chunk decay is indexed by an axis other than the head and the two times")
    letter = {x: "h" for x in extra}
    st = static_decay.read(an, factors, r.i, r.j, sorted(extra), letter, perturb=False)
    found = st.gammas.log()
    want = torch.tensor(gamma, dtype=torch.float64)
    if found.numel() == 1:
        found = found.expand_as(want)
    if found.shape != want.shape or not torch.allclose(found, want, rtol=GAMMA_RTOL, atol=1e-9):
        raise Reject(f"the intra-chunk decay table gives log gamma {_nums(found)}, expected the chunks' "
                     f"state decay {_nums(want)}")
    tables = fit_all(static_decay.state_roots(an, reads), want)
    return TableGate(factors, r.i, r.j, letter, st.reverse, tables)


def fit_all(nodes: list, g0: torch.Tensor) -> list:
    """The tables of module state `nodes` for the log gate `g0`; Reject where one is trained:
    the op's gradient reaches a table only through the gate read from it, not elementwise as
    the user's code does."""
    trained = [static_decay._state_name(n) for n in nodes if getattr(example_value(n), "requires_grad", False)]
    if trained:
        raise Reject(f"the decay tables {', '.join(trained)} are trained (require grad): the op's gradient would "
                     "reach them only through the gate read from them")
    return [_fit(n, g0) for n in nodes]


def _nums(x: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in x.reshape(-1)[:4]) + (", ...]" if x.numel() > 4 else "]")


def _fit(node: fx.Node, g0: torch.Tensor) -> Table:
    """X = exp(g_h * P) or g_h * P with P affine in the positions and shared by the heads,
    else X itself (fingerprinted)."""
    x0 = module_state(node).detach().cpu()
    if x0.is_floating_point() and x0.dim() and not bool((g0 == 0).any()):
        x = x0.double()
        uniform = bool((g0 == g0[0]).all())
        axes = [None] if uniform else [a for a, s in enumerate(x.shape) if s == len(g0)]
        for axis in axes:
            g = g0[0] if axis is None else g0.reshape([-1 if a == axis else 1 for a in range(x.dim())])
            if not bool((x < 0).any()):
                zero = x == 0
                coefs = _affine(torch.where(zero, torch.nan, x.clamp_min(1e-300).log() / g), axis)
                if coefs is not None and bool((zero == (_grid(coefs, x.shape, axis) < -MASK_AT)).all()):
                    return Table(node, "exp", axis, coefs)
            coefs = _affine(x / g, axis)
            if coefs is not None:
                return Table(node, "lin", axis, coefs)
    w = _weights(x0.numel()).double()
    xw = x0.double().reshape(-1) * w
    return Table(node, "same", None, (), float(xw.sum()), float(xw.abs().sum()))


MASK_AT = 1e-3  # an exponent table's zeros: where the affine exponent is negative (j > i)


def _affine(p: torch.Tensor, axis: Optional[int]) -> Optional[tuple]:
    """(c0, c_0, ..., c_{d-1}) with p = c0 + sum_a c_a * index_a wherever p is not NaN (the
    head axis has coefficient 0: the exponent table is shared by the heads), or None."""
    idx = torch.meshgrid(*[torch.arange(s, dtype=torch.float64) for s in p.shape], indexing="ij")
    free = [a for a, s in enumerate(p.shape) if a != axis and s > 1]  # size-1 axes: coefficient 0
    feats = torch.stack([torch.ones_like(p)] + [idx[a] for a in free], -1).reshape(-1, 1 + len(free))
    vals = p.reshape(-1)
    keep = ~torch.isnan(vals)
    if not bool(keep.any()) or not bool(torch.isfinite(vals[keep]).all()):
        return None
    sol = torch.linalg.lstsq(feats[keep], vals[keep, None], driver="gelsd").solution[:, 0]
    if ((feats[keep] @ sol - vals[keep]).abs() > FIT_TOL * (1 + vals[keep].abs())).any():
        return None
    coefs = [float(sol[0])] + [0.0] * p.dim()
    for a, c in zip(free, sol[1:]):
        coefs[1 + a] = float(c)
    return tuple(coefs)


def _grid(coefs: tuple, shape, axis: Optional[int]) -> torch.Tensor:
    p = torch.full(tuple(shape), coefs[0], dtype=torch.float64)
    for a, s in enumerate(shape):
        view = [1] * len(shape)
        view[a] = -1
        p = p + coefs[1 + a] * torch.arange(s, dtype=torch.float64).reshape(view)
    return p


def _weights(n: int) -> torch.Tensor:
    """Fixed pseudo-random weights of a fingerprint, the same in the graph and here."""
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.7548776662 + 0.5)


# ---- emission ------------------------------------------------------------------------------
def emit(em: Emitter, an: Analyzer, tg: TableGate, checks: Checks) -> fx.Node:
    """g_gamma (over the head, or one value for all) computed from the tables in the graph;
    the run-time check of every table against it goes to `checks` (``fallback.py``)."""
    g = em.as_float32(static_decay.emit_log_gate(em, an, tg.factors, tg.i, tg.j, tg.letter, tg.reverse))
    g = em.call(torch.reshape, g, (-1,))
    if example_value(g).shape[0] != em.sizes["h"]:  # one gate for all heads
        g = em.call("expand", g, em.sizes["h"], op="call_method")
    check_tables(em, g, tg.tables, checks)
    return g


def check_tables(em: Emitter, g: fx.Node, tables: list, checks: Checks) -> None:
    """The run-time check of each table against the gate `g` (over the heads, flat), to `checks`."""
    for t in tables:
        checks.add(em, _guard(em, g, t))


def table_value(t: Table, g: torch.Tensor) -> torch.Tensor:
    """What the table holds for the log gate `g` (float64, over the heads) by its fit; "same"
    tables are not functions of the gate (their compile-time value is kept)."""
    x0 = module_state(t.node).detach().cpu().double()
    if t.kind == "same":
        return x0
    p = _grid(t.coefs, x0.shape, t.head_axis)
    gh = g[:1].reshape([1] * x0.dim()) if t.head_axis is None else g.reshape(
        [-1 if a == t.head_axis else 1 for a in range(x0.dim())])
    if t.kind == "lin":
        return gh * p
    return torch.exp(gh * p).masked_fill(p < -MASK_AT, 0.0)


def _guard(em: Emitter, g: fx.Node, t: Table) -> fx.Node:
    """A 0-d bool tensor: whether the table holds what the fit says, for the gate `g`."""
    x = t.node
    val = example_value(x)
    if t.kind == "same":
        w = em.call(torch.sin, em.call(torch.add, em.call(torch.mul, em.call(
            torch.arange, val.numel(), dtype=torch.float32, device=val.device), 0.7548776662), 0.5))
        f = em.call(torch.sum, em.call(torch.mul, em.call(torch.reshape, em.as_float32(x), (-1,)), w))
        err = em.call(torch.abs, em.call(torch.sub, f, t.fingerprint))
        return em.call(torch.le, err, GUARD_RTOL * t.spread + GUARD_ATOL)
    shape = tuple(val.shape)
    p = None
    for a, s in enumerate(shape):
        if t.coefs[1 + a] == 0.0:
            continue
        view = [1] * len(shape)
        view[a] = -1
        term = em.call(torch.reshape, em.call(torch.mul, em.call(
            torch.arange, s, dtype=torch.float32, device=val.device), t.coefs[1 + a]), tuple(view))
        p = term if p is None else em.call(torch.add, p, term)
    p = t.coefs[0] if p is None else em.call(torch.add, p, t.coefs[0])
    view = [1] * len(shape)
    if t.head_axis is not None:
        view[t.head_axis] = -1
    else:  # one gate for all heads: the first head's
        g = em.call(torch.narrow, g, 0, 0, 1)
    want = em.call(torch.mul, em.call(torch.reshape, g, tuple(view)), p)
    if t.kind == "exp":
        want = em.call(torch.exp, want)
        if not isinstance(p, float):
            want = em.call(torch.masked_fill, want, em.call(torch.lt, p, -MASK_AT), 0.0)
    err = em.call(torch.abs, em.call(torch.sub, em.as_float32(x), want))
    bound = em.call(torch.add, em.call(torch.mul, em.call(torch.abs, want), GUARD_RTOL), GUARD_ATOL)
    return em.call(torch.all, em.call(torch.le, err, bound))
