"""Where the GLA op goes, and how the final state reaches the cache it came from.

The op replaces a computation spread over the graph (T steps, their reads, the assembly of
the outputs). It is inserted once, before the first node that consumes one of its results:
the assembled output, or any use of the final state outside the recurrence, such as a
write-back ``cache.copy_(S)`` that a decode step performs before reading its output.

Moving the computation is sound only if its inputs have the same values at the new place:
every input must already be computed there, and nothing between the first step and that
place may modify an input in place (a cache is both the initial state and the target of
the write-back).

When the final state is written back into the very tensor that supplied the initial state
and nothing needs gradients, the pair ``chunk_fwd`` + ``copy_`` becomes one in-place
``gla_inductor::fused_recurrent`` on the cache.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ...contract import GLACall
from .analyzer import Analyzer
from .consts import example_value
from .emit import Emitter, emit_op, fused_recurrent_op
from .match import Reject
from .op_names import op_name


@dataclass
class WriteBack:
    node: fx.Node  # cache.copy_(S) or cache[...] = S
    target: fx.Node  # the cache: a graph tensor that supplied the initial state


@dataclass
class Plan:
    anchor: fx.Node  # the op goes right before this node
    write_back: Optional[WriteBack]
    needs_grad: bool  # an input requires grad (the in-place op is inference only)

    def fused_write_back(self) -> Optional[WriteBack]:
        """The write-back to fold into fused_recurrent, when the op exists and may run."""
        if self.write_back is None or fused_recurrent_op() is None:
            return None
        if self.needs_grad and torch.is_grad_enabled():
            return None
        return self.write_back


def plan(an: Analyzer, states: list, reads: dict, asm, deps: list, prev: Optional[fx.Node]) -> Plan:
    """Choose the op's place and prove it keeps the inputs' values; raises Reject."""
    last = states[-1]
    internal = _read_path(an, reads[last].node, last)
    cands = [u for u in last.users if u not in internal]
    if asm.kind == "setitem":
        cands.append(max(asm.setitems, key=an.order.__getitem__).next)
    else:
        cands.append(asm.result)
    anchor = min(cands, key=an.order.__getitem__)
    late = [d.name for d in deps if an.order[d] >= an.order[anchor]]
    if late:
        raise Reject(f"inputs {late} are computed after the output is used")
    check_unmodified(an, deps, an.order[anchor])
    if asm.kind == "setitem":
        check_buffer(an, asm.result, asm.setitems, anchor)
    wb = _write_back(an, last, internal, prev, anchor)
    needs_grad = any(requires_grad(d) for d in deps)
    overwritten = prev is not None and written_after(an, prev, anchor)
    if overwritten and needs_grad and torch.is_grad_enabled():
        # The op saves its initial state for backward; AOTAutograd saves the cache itself,
        # which the write-back then overwrites. Decoding is inference: run it under no_grad.
        raise Reject("the initial state is overwritten in place while gradients are needed")
    return Plan(anchor, wb, needs_grad)


def check_buffer(an: Analyzer, buf: fx.Node, setitems: list, anchor: fx.Node) -> None:
    """The rewrite drops the writes that fill `buf` and points the users of `buf` after the op
    at the op's output. So nothing else may see the buffer's memory: no read of it before the
    op, and no alias of it (a view it was taken from, a view taken before) but `buf` itself,
    its writes, and what is computed from `buf` after the op."""
    writes = set(setitems)
    if any(u not in writes and an.order[u] < an.order[anchor] for u in buf.users):
        raise Reject("the output buffer is read before it is filled")
    k = an.key(buf)
    private = _private_sources(an, buf, k)
    for n in an.aliases(buf):
        if n is buf or n in writes or n in private:
            continue
        if an.order[n] < an.order[anchor] or not _derived_from(an, n, buf, k):
            raise Reject("the output buffer shares its memory with another tensor")


def _private_sources(an: Analyzer, buf: fx.Node, k) -> set:
    """The tensors `buf` is a view of that nothing else reads (`torch.zeros(...).transpose(1, 2)`)."""
    res, node = set(), buf
    while True:
        parents = [x for x in node.all_input_nodes if an.key(x) == k]
        if len(parents) != 1 or list(parents[0].users) != [node]:
            return res
        node = parents[0]
        res.add(node)


def _derived_from(an: Analyzer, node: fx.Node, buf: fx.Node, k) -> bool:
    """Whether `node` is computed from `buf` through nodes that alias it (views, in-place ops)."""
    while node is not buf:
        parents = [x for x in node.all_input_nodes if an.key(x) == k]
        if len(parents) != 1:
            return False
        node = parents[0]
    return True


def _read_path(an: Analyzer, read: fx.Node, state: fx.Node) -> set:
    """The nodes between the final state and its read (views, the read's own products)."""
    path, frontier = {read}, [read]
    while frontier:
        n = frontier.pop()
        for x in n.all_input_nodes:
            if x not in path and x is not state and an.order[x] > an.order[state]:
                path.add(x)
                frontier.append(x)
    return path


def check_unmodified(an: Analyzer, deps: list, stop: int) -> None:
    """The op reads its inputs at position `stop`; the code read each where it was computed
    (a read after an in-place write is opaque to the algebra, and a value copied into a cache
    is read through the copy). No input may be written in place in between, through any alias."""
    for d in deps:
        if an.written_between(d, an.order[d] + 1, stop):
            raise Reject("an input of the recurrence is modified in place before its result is used")


def written_after(an: Analyzer, node: fx.Node, anchor: fx.Node) -> bool:
    return bool(an.written_between(node, an.order[anchor], len(an.nodes)))


def requires_grad(node: fx.Node) -> bool:
    val = example_value(node)
    return isinstance(val, torch.Tensor) and val.requires_grad


# ---- the write-back ------------------------------------------------------------------------
def _write_back(an: Analyzer, last: fx.Node, internal: set, prev: Optional[fx.Node], anchor) -> Optional[WriteBack]:
    """`prev.copy_(S)` or `prev[...] = S` for the final state S (through casts), when S has
    no other use outside the recurrence and nothing reads the cache between the op and it."""
    if prev is None or prev.op != "placeholder":
        return None
    casts, writes = {last}, []
    frontier = [last]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in internal:
                continue
            if op_name(u) == "identity" and u not in casts:
                casts.add(u)
                frontier.append(u)
            elif _writes_whole(u, prev, n):
                writes.append(u)
            else:
                return None  # another use of the final state: it must be materialized
    if len(writes) != 1 or writes[0].users:
        return None
    w = writes[0]
    if any(_reads(an, n, prev) for n in _between(an, anchor, w) if n not in casts):
        return None
    return WriteBack(w, prev)


def _writes_whole(node: fx.Node, target: fx.Node, value: fx.Node) -> bool:
    if node.op == "call_method" and node.target == "copy_":
        return node.args[0] is target and node.args[1] is value
    if node.op == "call_function" and node.target is operator.setitem:
        buf, index, val = node.args
        full = index in (slice(None), Ellipsis) or (
            isinstance(index, tuple) and all(i in (slice(None), Ellipsis) for i in index)
        )
        return buf is target and val is value and full
    return False


def _between(an: Analyzer, a: fx.Node, b: fx.Node) -> list:
    return an.nodes[an.order[a] : an.order[b]]


def _reads(an: Analyzer, node: fx.Node, target: fx.Node) -> bool:
    k = an.key(target)
    return any(an.key(x) == k for x in node.all_input_nodes)


def emit_fused(em: Emitter, call: GLACall, wb: WriteBack, state_groups: list) -> fx.Node:
    """o of fused_recurrent on the cache itself (a permuted view of it); the user's write-back
    is dropped: the op leaves the final state in the cache."""
    state = em.relayout(wb.target, state_groups, "bhkv")
    o = emit_op(em, call, in_place_state=state)
    em.txn.erase.append(wb.node)
    return o


def rewire(txn, asm, o_user: fx.Node, state: Optional[fx.Node], ht_user: Optional[fx.Node]) -> None:
    """Point the users of the assembled output (and of the final state) at the op's."""
    order = {n: i for i, n in enumerate(txn.graph.nodes)}
    pos = order[o_user]
    if asm.kind == "setitem":
        txn.erase += asm.setitems
        for u in list(asm.result.users):
            if order[u] > pos:
                txn.replace_input(u, asm.result, o_user)
    else:
        txn.replace_all_uses(asm.result, o_user)
    if state is None:
        return
    for u in list(state.users):
        if order.get(u, -1) > pos:
            txn.replace_input(u, state, ht_user)
