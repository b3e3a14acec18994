"""A rewrite proven for module state at compile time, kept right when that state changes.

A decay held in buffers (lightning attention's tables, a retention mask registered in
``__init__``) is certified for its values at compile time; the op's gate is computed from the
buffers in the graph, so tables recomputed from new slopes reach it. Values that are no longer
one gate's tables (one table edited alone, a mask no longer causal) are not GLA at all: there
the graph must compute what the user wrote. The rewrite is therefore a branch in the graph,

    torch.cond(tables_ok, the GLA op, the user's own subgraph, operands)

with `tables_ok` computed in the graph from the buffers (``table_gate.py``: elementwise over
the tables, no host synchronization in the check itself). The pass runs on Dynamo's graph,
before AOTAutograd, so the branch is built there as Dynamo builds a traced ``torch.cond``:
two GraphModules read by ``get_attr`` and a ``higher_order.cond`` node; AOTAutograd then
differentiates both branches and Inductor compiles them as subgraphs. Inductor reads the
predicate on the host where it branches (one ``.item()`` per call on CUDA).

Where this torch's ``torch.cond`` cannot be differentiated (``COND_AUTOGRAD``), or
``config.table_guard`` is "raise" (no host synchronization), the check raises instead
(``torch._assert_async``) and the op runs unbranched.
"""

from __future__ import annotations

import importlib
import logging
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from ... import config
from ..core.consts import example_value, is_inplace, written_args
from ..core.match import Match
from ..core.op_names import VIEW_OPS, op_name

log = logging.getLogger("gla_inductor")

# torch.cond takes gradients through both branches from torch 2.5 on (CondAutogradOp).
COND_AUTOGRAD = hasattr(importlib.import_module("torch._higher_order_ops.cond"), "CondAutogradOp")
GUARD_MESSAGE = ("gla_inductor: a decay buffer of a rewritten GLA changed after compiling to values that are not "
                 "the gate's tables the rewrite was proven for; call torch._dynamo.reset() and compile again")


class Checks:
    """The predicate nodes a gate emission adds (each a 0-d bool tensor): all must hold for the
    op's branch to run."""

    def __init__(self):
        self.nodes: list = []

    def add(self, em, ok: fx.Node) -> None:
        if config.table_guard not in ("fallback", "raise"):
            raise ValueError(f"gla_inductor.config.table_guard is {config.table_guard!r}, expected 'fallback' or 'raise'")
        if COND_AUTOGRAD and config.table_guard == "fallback":
            self.nodes.append(ok)
        else:
            em.call(torch._assert_async, ok, GUARD_MESSAGE)


def guarded(m: Match, outputs: list, body: set, checks: Checks) -> Match:
    """`m` with its replacement behind the checks its gate emission adds to `checks`: the
    outputs (the user's nodes the op replaces) are computed by `body` (the user's nodes of the
    computation and its constants) where a check fails."""
    inner = m.apply

    def apply(txn) -> None:
        mark = txn.mark()
        checks.nodes.clear()
        inner(txn)
        if checks.nodes:
            branch(txn, mark, checks.nodes, outputs, body)

    m.apply = apply
    m.options["tables_checked"] = True  # (explain's report: the rewrite has a run-time fallback)
    return m


def branch(txn, mark: tuple, oks: list, outputs: list, body: set) -> None:
    """Put the replacement emitted since `mark` behind `oks`: a cond whose true branch is the
    replacement and whose false branch is `body` copied, its outputs taking the users the
    replacement took from `outputs`. Where the branches cannot be cut cleanly (operands that
    alias each other, a write into one), the checks raise instead."""
    graph = txn.graph
    new = [_replacement(txn, mark, o) for o in outputs]
    keep = [(o, n) for o, n in zip(outputs, new) if n is not None]
    made = set(txn.created[mark[0]:])
    at = txn.created[-1].next  # the emitter's anchor: everything emitted sits right before it
    # the replacement again from the user's nodes (its gate recomputed inside: a few numbers),
    # through views on both sides, so that no two operands share memory
    true_nodes = _closure([n for _, n in keep], lambda x: x in made or _is_view(x))
    false_nodes = _closure([o for o, _ in keep] + [x for x in body if is_inplace(x)],
                           lambda x: x in body and x.op != "placeholder" or _is_view(x))
    true_outs, false_outs = [n for _, n in keep], [o for o, _ in keep]
    operands = _reads(true_nodes, true_outs)
    operands += [x for x in _reads(false_nodes, false_outs) if x not in operands]
    why = _unclean(operands, false_nodes, at)
    if why is not None:
        log.info("gla_inductor: the decay tables' checks raise instead of falling back: %s", why)
        with graph.inserting_before(at):
            for ok in oks:
                txn.created.append(graph.call_function(torch._assert_async, (ok, GUARD_MESSAGE)))
        return
    dense = [_same_strides(example_value(o), example_value(n)) for o, n in keep]
    gm = graph.owning_module
    true_gm = _outline(gm, true_nodes, true_outs, operands, dense)
    false_gm = _outline(gm, false_nodes, false_outs, operands, dense)
    with graph.inserting_before(at):
        pred = _all(txn, graph, oks)
        t_attr = graph.get_attr(_register(gm, "gla_cond_true", true_gm))
        f_attr = graph.get_attr(_register(gm, "gla_cond_false", false_gm))
        cond = graph.call_function(torch.ops.higher_order.cond, (pred, t_attr, f_attr, tuple(operands)))
        vals = [example_value(n) if same else example_value(n).contiguous() for (_, n), same in zip(keep, dense)]
        cond.meta["example_value"] = tuple(vals)
        txn.created += [t_attr, f_attr, cond]
        for idx, (o, n) in enumerate(keep):
            item = graph.call_function(operator.getitem, (cond, idx))
            item.meta["example_value"] = vals[idx]
            item.meta.update({k: v for k, v in o.meta.items() if k in ("stack_trace", "nn_module_stack")})
            txn.created.append(item)
            for user in list(n.users):
                if user not in made:
                    txn.replace_input(user, n, item)


def _is_view(node: fx.Node) -> bool:
    """An op that only views its input (free to repeat in a branch)."""
    name = op_name(node)
    return name in VIEW_OPS or getattr(node.target, "__name__", node.target) in ("split", "chunk", "unbind", "view")


def _unclean(operands: list, false_nodes: list, at: fx.Node) -> Optional[str]:
    """Why the branches cannot take these operands (torch.cond wants operands defined before it,
    none sharing memory with another, none written by a branch), or None."""
    before = set()
    for n in at.graph.nodes:
        if n is at:
            break
        before.add(n)
    if any(x not in before for x in operands):
        return "the user's computation reads a value computed after its output"
    storages = [_storage(example_value(x)) for x in operands]
    storages = [s for s in storages if s is not None]
    if len(set(storages)) != len(storages):
        return "two inputs of the computation share memory"
    inside = set(false_nodes)
    if any(t not in inside for n in false_nodes for t in written_args(n)):
        return "the user's computation writes into its inputs"
    return None


def _storage(val):
    if not isinstance(val, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(val.untyped_storage())


def _replacement(txn, mark: tuple, old: fx.Node):
    """The node `old`'s users were re-pointed to since `mark` (None: it had none)."""
    for user, was, new in txn.rewires[mark[1]:]:
        if was is old:
            return new
    return None


def _closure(roots: list, inside: Callable) -> list:
    """The nodes `inside` that the roots are computed from (through nodes inside), roots
    included, in graph order."""
    seen, stack = set(), [r for r in roots if inside(r)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack += [x for x in n.all_input_nodes if inside(x)]
    order = {n: i for i, n in enumerate(next(iter(seen)).graph.nodes)} if seen else {}
    return sorted(seen, key=order.__getitem__)


def _reads(nodes: list, outs: list) -> list:
    """The nodes outside `nodes` that they (or the outputs) read, once each, in order of use."""
    inside, found = set(nodes), []
    for x in [x for n in nodes for x in n.all_input_nodes] + list(outs):
        if x not in inside and x not in found:
            found.append(x)
    return found


def _same_strides(a, b) -> bool:
    """Whether the two branches' outputs agree in memory layout (torch.cond requires it)."""
    return not isinstance(a, torch.Tensor) or tuple(a.stride()) == tuple(b.stride())


def _outline(gm: fx.GraphModule, nodes: list, outs: list, operands: list, dense: list) -> fx.GraphModule:
    """`nodes` copied into a GraphModule that returns `outs`, with one placeholder per operand
    (both branches take all of them, in the same order); the outputs whose layouts differ
    between the branches (``dense`` False) made contiguous in both."""
    g = fx.Graph()
    env = {}
    for x in operands:
        ph = g.placeholder(f"arg{len(env)}")
        ph.meta["example_value"] = val = example_value(x)
        env[x] = _dense_grad(g, ph) if isinstance(val, torch.Tensor) and val.requires_grad and val.dim() > 1 else ph
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    res = [env[o] if same else g.call_method("contiguous", (env[o],)) for o, same in zip(outs, dense)]
    g.output(tuple(res))
    return fx.GraphModule(gm, g)


def _dense_grad(g: fx.Graph, ph: fx.Node) -> fx.Node:
    """The operand through a flattening and back: a view forward, and backward a contiguous
    gradient whatever the branch gives (the op's gradients come in its own layout, permuted
    back; both branches' gradients must agree in layout)."""
    return g.call_method("reshape", (g.call_method("reshape", (ph, -1)), g.call_method("size", (ph,))))


def _all(txn, graph: fx.Graph, oks: list) -> fx.Node:
    pred = oks[0]
    for ok in oks[1:]:
        pred = graph.call_function(torch.logical_and, (pred, ok))
        pred.meta["example_value"] = example_value(ok)
        txn.created.append(pred)
    return pred


def _register(gm: fx.GraphModule, prefix: str, sub: fx.GraphModule) -> str:
    i = 0
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    gm.add_submodule(f"{prefix}_{i}", sub)
    return f"{prefix}_{i}"
