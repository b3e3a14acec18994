"""Packed sequences written as a loop over spans: N GLA calls on time slices of the same
tensors become one call with ``cu_seqlens``.

    for s, e in spans:
        o[:, s:e] = gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])

Each span's body is rewritten to its own ``chunk_fwd`` by the other forms first; this post-pass
then reads every ``chunk_fwd``'s inputs as index maps of whole tensors (``span_views``). Calls
whose q, k, v and g are the same expression of the same tensors, read at time offsets s_i for
T_i steps, are *spans*. They merge when:

  * they share every option (scale, reverse, g_gamma, the fused gate) and the shapes of their
    initial states;
  * their spans do not overlap (gaps are fine: a gap runs as a sequence of its own whose
    output nobody reads);
  * everything the merged call reads is computed before the first span's call, and nothing
    writes those tensors in place before the last span's call.

Then, as the op runs each packed sequence as if alone, the merged output read at [s_i, s_i + T_i)
is span i's output and its final state is span i's: every reader of span i's call is re-pointed
there, so the user's own code still assembles the output (a setitem into a buffer, a ``cat``),
and positions no span covers keep whatever that code puts there. With a batch B > 1 the batch
is packed too: sequence (b, i) starts at b * T + s_i.

One exception to "the same expression": a span of 2 steps from a zero state reads its first
gate only to multiply a zero state, and the loop form passes the second step's gate for both
steps; such a gate is accepted when it is the merged gate at the step that counts.
(A span of one step from a zero state reads no gate at all.)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...contract import GLACall
from ..core.consts import example_value, storage_key, written_args
from ..core.emit import Emitter, Transaction, emit_op
from ..core.match import NearMiss
from . import span_views as sv
from .span_views import Leaf, NotAView

FORM = "packed"
_READ_ERRORS = (NotAView, IndexError, ValueError, TypeError)


@dataclass
class Span:
    op: fx.Node  # the chunk_fwd call
    call: GLACall
    exprs: dict  # "q", "k", "v", "g" -> span_views.Expr (g absent without a gate tensor)
    start: int
    length: int
    steps: int  # the time size of the tensors it slices
    visited: set = field(default_factory=set)

    @property
    def stop(self) -> int:
        return self.start + self.length


def chunk_fwd_nodes(graph: fx.Graph) -> list:
    ops = torch.ops.gla_inductor
    if not hasattr(ops, "chunk_fwd"):
        return []
    return [n for n in graph.nodes if n.op == "call_function" and n.target is ops.chunk_fwd.default]


def merge_spans(graph: fx.Graph, txn: Transaction, owner: dict) -> list:
    """Merge every group of span calls in `graph` (see the module's docstring), through `txn`.
    `owner`: chunk_fwd node -> the Match that emitted it, whose options then say ``packed``: N.
    Returns the near misses."""
    groups: dict = {}
    for op in chunk_fwd_nodes(graph):
        span = read_span(op)
        if span is not None:
            groups.setdefault(sv.key(span.exprs["q"]), []).append(span)
    near = []
    for spans in groups.values():
        if len(spans) < 2 or all(sp.length == sp.steps for sp in spans):
            continue  # calls on whole tensors are not spans of anything
        kept, why = _compatible(spans)
        near += [NearMiss(FORM, reason, _nodes(sp, owner)) for sp, reason in why]
        reason = _unmergeable(kept, graph) if len(kept) > 1 else "fewer than two spans agree"
        if reason is not None:
            near.append(NearMiss(FORM, f"{len(spans)} calls on spans of the same tensors left as they are: {reason}",
                                 [n for sp in spans for n in _nodes(sp, owner)]))
            continue
        mark = txn.mark()
        try:
            _emit(txn, kept)
        except Exception as e:  # noqa: BLE001 - any failure leaves the calls as they were
            txn.rollback_to(mark)
            near.append(NearMiss(FORM, f"merging the spans failed: {e}", [n for sp in kept for n in _nodes(sp, owner)]))
            continue
        for sp in kept:
            if sp.op in owner:
                owner[sp.op].options["packed"] = len(kept)
    return near


def _nodes(sp: Span, owner: dict) -> list:
    m = owner.get(sp.op)
    return list(m.nodes) if m is not None else [sp.op]


# ---- reading one call ----------------------------------------------------------------------
def read_span(op: fx.Node):
    """The call `op` as a span of the tensors its inputs slice, or None."""
    try:
        call = GLACall.from_op_args(op.args, op.kwargs)
        if call.varlen or call.state_indices is not None:
            return None
        visited: set = set()
        exprs = {n: sv.trace(getattr(call, n), visited) for n in ("q", "k", "v", "g") if getattr(call, n) is not None}
        length = sv.static_shape(call.q)[1]
        reads = [r for n in ("q", "k", "v") for r in sv.time_reads(exprs[n])]
    except _READ_ERRORS:
        return None
    if not reads or sv.static_shape(call.k)[1] != length or sv.static_shape(call.v)[1] != length:
        return None
    starts = {off for _, _, off in reads}
    steps = {sv.static_shape(base)[axis] for base, axis, _ in reads}
    if len(starts) != 1 or len(steps) != 1:
        return None
    return Span(op, call, exprs, starts.pop(), length, steps.pop(), visited)


# ---- which spans agree ---------------------------------------------------------------------
def _compatible(spans: list) -> tuple[list, list]:
    """(the spans that agree with the longest one whose gate reads its own steps, [(span, why)
    for the others])."""
    axes = _gate_time_axes(spans)
    for sp in spans:
        if axes and _gate_counts_once(sp):
            sp.exprs["g"] = _second_step_gate(sp.exprs["g"], axes)
    ref = max(spans, key=lambda sp: (_gate_mismatch(sp, sp) is None, sp.length))
    if _gate_mismatch(ref, ref) is not None:
        return [], [(ref, "no span's gate is read at its own steps")]
    kept, why = [], []
    for sp in spans:
        reason = None if sp is ref else _disagreement(sp, ref)
        if reason is None:
            kept.append(sp)
        else:
            why.append((sp, f"a span at [{sp.start}, {sp.stop}) is not merged with the others: {reason}"))
    return kept, why


def _disagreement(sp: Span, ref: Span):
    for name in ("k", "v"):
        if sv.key(sp.exprs[name]) != sv.key(ref.exprs[name]):
            return f"its {name} is not the same slice of the same tensor"
    a, b = sp.call, ref.call
    for name in ("g_gamma", "gate_a", "gate_bias"):
        if getattr(a, name) is not getattr(b, name):
            return f"a different {name}"
    if a.gate != b.gate:
        return "a different fused gate"
    if a.reverse != b.reverse or not _same_number(a.scale, b.scale):
        return "a different scale or direction"
    if a.initial_state is not None and b.initial_state is not None and \
            _value_kind(a.initial_state) != _value_kind(b.initial_state):
        return "initial states of different shapes or dtypes"
    return _gate_mismatch(sp, ref)


def _same_number(x, y) -> bool:
    return x is y or isinstance(x, (int, float)) and isinstance(y, (int, float)) and float(x) == float(y)


def _value_kind(node) -> tuple:
    val = example_value(node)
    return tuple(val.shape), val.dtype


def _zero_start(sp: Span) -> bool:
    """Whether the span starts from a zero state, forward: its first gate multiplies zeros."""
    return sp.call.initial_state is None and not sp.call.reverse


def _gate_counts_once(sp: Span) -> bool:
    """A 2-step span from zeros: only its second gate counts."""
    return _zero_start(sp) and sp.length == 2 and sp.exprs.get("g") is not None


def _gate_mismatch(sp: Span, ref: Span):
    """Why span `sp`'s gate is not the merged gate (ref's, read at sp's steps) where it counts."""
    g, g_ref = sp.exprs.get("g"), ref.exprs.get("g")
    if _zero_start(sp) and sp.length == 1:
        return None  # its one gate multiplies a zero state
    if (g is None) != (g_ref is None):
        return "a gate where the others have none, or none where they have one"
    if g is None:
        return None
    if sv.key(g) != sv.key(g_ref):
        return "its gate is not the same slice of the same tensor"
    reads = sv.time_reads(g)
    if not reads or any(off != sp.start for _, _, off in reads):
        return "its gate is read at other steps than its q, k and v"
    return None


def _gate_time_axes(spans: list):
    """{base: its time axis} of the gate's tensors: where a span's gate reads its own steps, or
    else the one axis at which every 2-step span's gate reads its second step."""
    for sp in spans:
        g = sp.exprs.get("g")
        reads = sv.time_reads(g) if g is not None else []
        if reads and all(off == sp.start for _, _, off in reads):
            return {base: axis for base, axis, _ in reads}
    pairs = [sp for sp in spans if _gate_counts_once(sp)]
    if not pairs:
        return None
    axes = {}
    for i, lf in enumerate(sv.leaves(pairs[0].exprs["g"])):
        found = [a for a, e in enumerate(lf.entries) if e[0] == "c" and all(
            _entry(sp, i, a) == ("c", sp.start + 1) for sp in pairs)]
        if len(found) == 1:
            axes[lf.base] = found[0]
    return axes


def _entry(sp: Span, leaf: int, axis: int):
    leaves = sv.leaves(sp.exprs["g"])
    return leaves[leaf].entries[axis] if leaf < len(leaves) and axis < len(leaves[leaf].entries) else None


def _second_step_gate(g, axes: dict):
    """A 2-step span's gate that is one step's gate broadcast over both (at index c of its time
    axis), as the gate read from step c - 1 on: equal to it at the second step, the one that
    counts."""
    if isinstance(g, Leaf):
        a = axes.get(g.base)
        if a is None or a >= len(g.entries) or g.entries[a][0] != "c" or \
                any(e[0] == "o" and e[1] == 1 for e in g.entries):
            return g
        entries = list(g.entries)
        entries[a] = ("o", 1, g.entries[a][1] - 1)
        return Leaf(g.base, tuple(entries), g.shape)
    args = tuple(_second_step_gate(x, axes) if isinstance(x, (Leaf, sv.Point)) else x for x in g.args)
    kwargs = tuple((k, _second_step_gate(x, axes) if isinstance(x, (Leaf, sv.Point)) else x) for k, x in g.kwargs)
    return sv.Point(g.node, args, kwargs, g.shape)


# ---- whether the group can be one call -----------------------------------------------------
def _unmergeable(spans: list, graph: fx.Graph):
    spans = sorted(spans, key=lambda sp: (sp.start, sp.stop))
    for a, b in zip(spans, spans[1:]):
        if b.start < a.stop:
            return f"the spans [{a.start}, {a.stop}) and [{b.start}, {b.stop}) overlap"
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(order[sp.op] for sp in spans)
    last = max(order[sp.op] for sp in spans)
    ref = max(spans, key=lambda sp: sp.length)
    needed = [n for e in ref.exprs.values() for n in sv.nodes_read(e)]
    needed += [x for x in (ref.call.g_gamma, ref.call.gate_a, ref.call.gate_bias) if isinstance(x, fx.Node)]
    for sp in spans:
        if sp.call.initial_state is not None:
            try:
                needed += sv.nodes_read(sv.trace(sp.call.initial_state))
            except _READ_ERRORS:
                needed.append(sp.call.initial_state)
    if any(order[n] >= anchor for n in needed):
        return "an input of a later span is computed after the first span's call"
    first = min([anchor] + [order[n] for sp in spans for n in sp.visited])
    # what the calls read, and every tensor read through to it (a clone written in place later)
    read = needed + [n for sp in spans for n in sp.visited]
    keys = {storage_key(n) for n in read if isinstance(example_value(n), torch.Tensor)}
    for n in list(graph.nodes)[first:last]:
        if any(storage_key(t) in keys for t in written_args(n)):
            return f"an input of the spans is written in place ({n.name}) between their calls"
    for sp in spans:
        if any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1)
               for u in sp.op.users):
            return "a span's result is read other than by its output and final state"
    return None


# ---- the merged call -----------------------------------------------------------------------
def _sequences(spans: list, steps: int) -> list:
    """(start, stop, span or None) covering [0, steps): the spans, and the gaps between them."""
    seqs, pos = [], 0
    for sp in sorted(spans, key=lambda sp: (sp.start, sp.stop)):
        if sp.start > pos:
            seqs.append((pos, sp.start, None))
        seqs.append((sp.start, sp.stop, sp))
        pos = sp.stop
    if pos < steps:
        seqs.append((pos, steps, None))
    return seqs


def _emit(txn: Transaction, spans: list) -> None:
    order = {n: i for i, n in enumerate(txn.graph.nodes)}
    anchor = min((sp.op for sp in spans), key=order.__getitem__)
    em = Emitter(txn, anchor, {})
    ref = max(spans, key=lambda sp: sp.length)
    T = ref.steps
    B = sv.static_shape(ref.call.q)[0]
    seqs = _sequences(spans, T)
    x = {}
    for name, expr in ref.exprs.items():
        node = sv.emit(em, sv.at_time(expr, 0, T))
        x[name] = node if B == 1 else em.call("reshape", node, 1, B * T, *sv.static_shape(node)[2:], op="call_method")
    device = example_value(ref.call.q).device
    offsets = [0] + [b * T + stop for b in range(B) for _, stop, _ in seqs]
    cu = em.call(torch.tensor, offsets, dtype=torch.int32, device=device)
    with_state = any(sp.call.output_final_state for sp in spans)
    call = ref.call.replace(q=x["q"], k=x["k"], v=x["v"], g=x.get("g"), initial_state=_initial_states(em, seqs, B),
                            output_final_state=with_state, cu_seqlens=cu)
    op = emit_op(em, call)
    out = em.call(operator.getitem, op, 0)
    if B != 1:
        out = em.call("reshape", out, B, T, *sv.static_shape(out)[2:], op="call_method")
    states = None
    if with_state:
        states = em.call(operator.getitem, op, 1)
        states = em.call("reshape", states, B, len(seqs), *sv.static_shape(states)[1:], op="call_method")
    for j, (start, stop, sp) in enumerate(seqs):
        if sp is not None:
            _repoint(em, sp, out, states, j)


def _initial_states(em: Emitter, seqs: list, B: int):
    """[B * N, H, K, V]: each span's initial state, zeros for the others; None when no span has one."""
    given = [sp.call.initial_state for _, _, sp in seqs if sp is not None and sp.call.initial_state is not None]
    if not given:
        return None
    zeros = None
    parts = []
    for _, _, sp in seqs:
        if sp is not None and sp.call.initial_state is not None:
            parts.append(sv.emit(em, sv.trace(sp.call.initial_state)))
            continue
        if zeros is None:
            zeros = em.call(torch.zeros_like, sv.emit(em, sv.trace(given[0])))
        parts.append(zeros)
    stacked = em.call(torch.stack, parts, 1)
    return em.call("reshape", stacked, B * len(parts), *sv.static_shape(stacked)[2:], op="call_method")


def _repoint(em: Emitter, sp: Span, out: fx.Node, states, j: int) -> None:
    """Every reader of span `sp`'s output and final state reads them from the merged call."""
    for user in list(sp.op.users):
        if not user.users or user.args[1] == 1 and states is None:
            continue  # left by the emission (a state nobody stores), erased with the call
        if user.args[1] == 0:
            new = em.call(operator.getitem, out, (slice(None), slice(sp.start, sp.stop)))
        else:
            new = em.call(torch.select, states, 1, j)
        want, got = example_value(user), example_value(new)
        if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
            raise RuntimeError(f"a span's result {tuple(want.shape)} {want.dtype} would be read as "
                               f"{tuple(got.shape)} {got.dtype}")
        em.txn.replace_all_uses(user, new)
