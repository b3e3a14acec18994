"""Parallel forms whose decay mask is a buffer filled once: a module registers
``mask = gamma ** (i - j)`` under a causal mask in ``__init__`` and its forward computes
``(q @ k^T * self.mask) @ v``.

Such a decay is GLA for the buffer's values at compile time (``static_decay.read``), but not
for values perturbed one by one (the diagonal leaves 1): nothing in the code makes a later
value a decay. So the rewrite is proven for the values of the tables *as functions of the
gate*, and guarded:

- each module-state tensor the decay reads is fitted as a table of the gate
  (``table_gate._fit``: X = exp(g_h * P) under the causal mask, X = g_h * P, or a
  fingerprint), and the decay is evaluated again from tables regenerated for another gate:
  it must still be GLA, so tables recomputed from new slopes are a decay the op runs right;
- the op's gate is read from the buffers in the graph (log D[h, 1, 0]), and every table is
  checked against it at run time; where a check fails (a mask no longer causal, a table edited
  alone) the graph computes the user's own attention instead (``fallback.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..certify.subgraph import subgraph
from ..core.analyzer import Analyzer
from ..core.emit import Emitter
from ..core.match import Match, Reject
from . import fallback, static_decay, table_gate

FOLLOW_SPREAD = 0.2  # the other gate of the proof: each head's log gate scaled by a factor in [0.9, 1.1]


def read(an: Analyzer, decay: list, i: int, j: int, batch: list, letter: dict) -> tuple:
    """(StaticGate, tables): the decay read as static_decay does; where it holds for the buffers'
    values at compile time only, with the tables to guard at run time (else None)."""
    try:
        return static_decay.read(an, decay, i, j, batch, letter), None
    except Reject as e:
        perturbed = e
    st = static_decay.read(an, decay, i, j, batch, letter, perturb=False)  # (raises where it fails now)
    heads = [x for x in batch if letter.get(x) == "h" or letter.get(x, "").isupper()]
    if any(letter.get(x, "").isupper() for x in heads):  # heads of two parts: a flat gate only
        raise perturbed
    g0 = st.gammas.log()
    tables = table_gate.fit_all(static_decay._state_nodes(an, decay), g0)
    if not _follows(an, decay, heads + [i, j], tables, g0, st.reverse):
        raise perturbed
    return st, tables


def _follows(an: Analyzer, decay: list, axes: list, tables: list, g0: torch.Tensor, reverse: bool) -> bool:
    """Whether the decay is GLA again for the tables regenerated from another gate."""
    fitted = [t for t in tables if t.kind != "same"]
    if not fitted:
        return True  # every table fingerprinted: any change of them falls back
    gen = torch.Generator().manual_seed(0)
    g1 = g0 * (1 - FOLLOW_SPREAD / 2 + FOLLOW_SPREAD * torch.rand(g0.shape, generator=gen, dtype=torch.float64))
    state = {t.node: table_gate.table_value(t, g1) for t in fitted}
    try:
        checked = static_decay.checked_decay(an, decay, axes, state)
    except Reject:
        return False
    return checked is not None and checked[0] == reverse


class GuardedGate:
    """The log gate read from the decay in the graph (``static_decay.emit_log_gate``), with the
    run-time checks of the tables (none where the decay was proven for any buffer values)."""

    def __init__(self, an: Analyzer, decay: list, i: int, j: int, letter: dict, reverse: bool,
                 tables: Optional[list]):
        self.an, self.decay, self.i, self.j, self.letter, self.reverse = an, decay, i, j, letter, reverse
        self.tables = tables
        self.checks = fallback.Checks()

    def __call__(self, em: Emitter) -> fx.Node:
        g = static_decay.emit_log_gate(em, self.an, self.decay, self.i, self.j, self.letter, self.reverse)
        if self.tables:
            table_gate.check_tables(em, em.call(torch.reshape, em.as_float32(g), (-1,)), self.tables, self.checks)
        return g


def guarded(an: Analyzer, m: Match, emit, leaves: list) -> Match:
    """`m`, where its gate is a GuardedGate with tables, behind their checks: the user's nodes
    from `leaves` (q, k, v) to the outputs are the fallback."""
    if not isinstance(emit, GuardedGate) or not emit.tables:
        return m
    nodes, _, consts = subgraph(an, list(m.nodes), set(leaves), static=True)
    if not nodes:
        raise Reject("the attention's own nodes could not be found for the fallback")
    return fallback.guarded(m, list(m.nodes), nodes | set(consts), emit.checks)
