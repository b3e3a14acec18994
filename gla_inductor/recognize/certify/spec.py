"""A chunked computation's proposed replacement (``Spec``) and the GLA op it inserts.

The certificate runs exactly this replacement against the user's subgraph, and the rewrite
inserts it: ``emit_replacement`` is both.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx

from ...contract import GLACall
from ..core.consts import example_value
from ..core.emit import Emitter, Group, LFactor, emit_op


@dataclass
class Spec:
    """A proposed replacement: the inputs with role letters, the outputs with theirs."""

    q: LFactor
    k: LFactor
    v: LFactor
    g: Optional[LFactor]
    gate: str  # none | scalar | vector | constant
    h0: Optional[fx.Node]
    h0_groups: list
    out: fx.Node
    out_groups: list
    final: Optional[fx.Node]
    final_groups: list
    scale: float
    sizes: dict  # role letter -> int
    splits: dict = field(default_factory=dict)
    gate_is_log: bool = True  # the gate input is the log decay (else the decay itself)
    gamma: Optional[tuple] = None  # a constant log decay per head, read off the code
    # module state (buffers) read at its compile-time values, as constants of the certificate;
    # only where the rewrite computes its gate from that state and guards it (``table_gate.py``)
    static_tables: bool = False

    def leaves(self) -> dict:
        res = {"q": self.q.node, "k": self.k.node, "v": self.v.node}
        if self.g is not None:
            res["g"] = self.g.node
        if self.h0 is not None:
            res["h0"] = self.h0
        return res

    def outputs(self) -> list:
        return [self.out] + ([self.final] if self.final is not None else [])


def emit_replacement(em: Emitter, spec: Spec, nodes: dict, shared: Optional[dict] = None) -> tuple:
    """Insert the GLA op for `spec` on `nodes` (role -> node); (o, final state) as the user's.
    `shared` (``forms.grouped_heads.shared_qk``): q and k given as the tensors their leaves
    repeat over the heads."""

    def lift(lf: LFactor, role: str, letters: str, full: bool = True, node=None):
        return em.lift(Group(1.0, (replace(lf, node=nodes[role] if node is None else node),)), letters, full=full)

    if shared:  # [B, T, G, K]: the op reads head h's q and k at h // (H // G)
        q, k = (lift(getattr(spec, r), r, "bthk", node=_unrepeated(em, shared[r])) for r in ("q", "k"))
    else:
        q, k = lift(spec.q, "q", "bthk"), lift(spec.k, "k", "bthk")
    v = lift(spec.v, "v", "bthv")
    g = g_gamma = None
    if spec.g is not None:
        letters = {"scalar": "bth", "vector": "bthk", "constant": "h"}[spec.gate]
        gate = em.as_float32(lift(spec.g, "g", letters, full=False))
        gate = em.expand_to(gate if spec.gate_is_log else em.call(torch.log, gate), letters)
        g, g_gamma = (None, gate) if spec.gate == "constant" else (gate, None)
    elif spec.gamma is not None:
        device = example_value(q).device
        g_gamma = em.call(torch.tensor, list(spec.gamma), dtype=torch.float32, device=device)
    h0 = None
    if spec.h0 is not None:
        h0 = em.as_float32(em.relayout(nodes["h0"], spec.h0_groups, "bhkv"))
    call = GLACall(q, k, v, g, g_gamma, h0, scale=spec.scale, output_final_state=spec.final is not None)
    op = emit_op(em, call)
    o = em.cast_like(em.relayout(em.call(operator.getitem, op, 0), "bthv", spec.out_groups), spec.out)
    o = em.layout_like(o, spec.out)
    ht = None
    if spec.final is not None:
        ht = em.cast_like(em.relayout(em.call(operator.getitem, op, 1), "bhkv", spec.final_groups), spec.final)
        ht = em.layout_like(ht, spec.final)
    return o, ht

# ---- grouped heads ------------------------------------------------------------------------------
# Mamba2 shares C and B (q and k) across groups of heads and repeats them over the heads before the
# scan: x.repeat_interleave(r, dim=heads), or x[..., None, :].expand(.., r, ..).reshape(..), then pads
# and casts. The op reads q and k shared ([B, T, G, K], head h reads h // r), so the emission passes
# x instead of the repeated leaf (``forms/grouped_heads.py`` finds them). Values are unchanged: the
# certificate proved the subgraph equal to the op on the repeated leaves (it runs the emission on
# them), and the op on x is by definition the op on x repeated; only the repeat is no longer
# materialized.


@dataclass(frozen=True)
class SharedLeaf:
    """A q or k leaf as `steps` applied to `x` repeated `repeats` times over the head axis."""

    x: fx.Node
    squeeze: Optional[int]  # expand + reshape: x's size-1 axis after the head axis, dropped
    steps: tuple  # nodes acting alike on every head (casts, pads of other axes), innermost first
    repeats: int


def _unrepeated(em: Emitter, s: SharedLeaf) -> fx.Node:
    """The leaf's computation without the repeat: x, then the same casts and pads."""
    node = s.x if s.squeeze is None else em.call(torch.squeeze, s.x, s.squeeze)
    for n in s.steps:
        node = em.call(n.target, node, *n.args[1:], op=n.op, **n.kwargs)
    return node
