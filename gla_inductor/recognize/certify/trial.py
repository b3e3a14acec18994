"""A certificate by trial: a match applied in a scratch transaction, the rewritten subgraph run in
float64 against the user's on random inputs, then undone.

For rewrites that keep some of the user's nodes between the op and the outputs (normalized
retention: the user's abs / clamp / detach of the row sums now read the op's last column), the
replacement is not the op alone, so ``certificate.py``'s comparison with an emitted ``Spec``
does not cover it. Here both sides are the graph itself: the nodes from the leaves to the
outputs as the user wrote them, and, with the match applied, the nodes from the same leaves to
what the outputs' readers now read (the inserted nodes and the user's nodes between them). The
GLA op runs as the naive float64 recurrence (``certificate.reference_op``); module state and
constants at their compile-time values. Comparisons and clamps are evaluated as written: the
analytic parts are proven by the recognizer's algebra, this checks that the glue around them (the
row sums, the divisor, the layouts) is the user's at two random points.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import Transaction
from ..core.match import Match
from .certificate import CERT_BUDGET_BYTES, CERT_RTOL, Float64Interpreter, _digest

CERTIFIED: dict = {}  # structure of a trial (both modules, the leaves' shapes) -> None or why not


def certify(an: Analyzer, match: Match, leaves: list, outputs: list) -> Optional[str]:
    """None where the match's rewrite equals the user's subgraph from `leaves` to `outputs` at
    two random float64 points; else why not."""
    nodes = _between(an, leaves, outputs)
    if isinstance(nodes, str):
        return nodes
    need = 8 * sum(_numel(n) for n in nodes)
    if need > CERT_BUDGET_BYTES:
        return (f"its float64 certificate needs ~{need / 2**30:.1f} GiB (budget {CERT_BUDGET_BYTES / 2**30:.1f} "
                "GiB): left alone unproven")
    original = _module(an, [n for n in an.nodes if n in nodes], leaves, outputs)
    txn = Transaction(an.graph)
    try:  # (the user's nodes are copied as they read after the rewrite: the normalizer reads the op)
        match.apply(txn)
        new = {old: n for _, old, n in txn.rewires}
        if any(o not in new for o in outputs):
            return "the rewrite does not replace every output it covers"
        after = set(txn.created) | nodes
        rewritten = _module(an, [n for n in an.graph.nodes if n in after], leaves, [new[o] for o in outputs])
    finally:
        txn.rollback_to((0, 0, 0))
    if isinstance(rewritten, str) or isinstance(original, str):
        return rewritten if isinstance(rewritten, str) else original
    key = (_key(original), _key(rewritten), tuple(tuple(example_value(x).shape) for x in leaves))
    if key not in CERTIFIED:  # (the layers of a model: each the same computation on its own inputs)
        if len(CERTIFIED) > 256:
            CERTIFIED.clear()
        counters["gla_inductor"]["certificates_trial"] += 1
        CERTIFIED[key] = next((why for why in (_agree(original, rewritten, leaves, s) for s in (0, 1)) if why), None)
    return CERTIFIED[key]


def _key(gm: fx.GraphModule) -> tuple:
    """Equal for modules that compute the same thing: ops and arguments up to node names, and the
    constants' values."""
    index, rows = {}, []
    for n in gm.graph.nodes:
        index[n] = len(rows)
        args = fx.node.map_arg((n.args, n.kwargs), lambda x: ("node", index[x]))
        rows.append((n.op, str(n.target), repr(args)))
    return tuple(rows), tuple(_digest(b) for b in gm.buffers())


def _between(an: Analyzer, leaves: list, outputs: list):
    """The nodes from the leaves to the outputs, or why they are not a function of the leaves
    and constants alone."""
    found, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in found or n in leaves or _constant(an, n):
            continue
        if n.op not in ("call_function", "call_method"):
            return f"the subgraph reads {n.name}, neither an input of the op nor a constant"
        if _numel(n) is None:
            return f"{n.name} has symbolic sizes (the float64 certificate runs at static sizes)"
        found.add(n)
        stack += n.all_input_nodes
    return found


def _constant(an: Analyzer, n: fx.Node) -> bool:
    return an.consts.is_const(n) or an.consts.is_static(n)


def _numel(n: fx.Node):
    val = example_value(n)
    if isinstance(val, torch.Tensor):
        return val.numel() if all(isinstance(s, int) for s in val.shape) else None
    return 0 if isinstance(val, (int, float, bool, torch.dtype, torch.device, tuple, list)) else None


def _module(an: Analyzer, order: list, leaves: list, outputs: list):
    """The nodes `order` as a module of the leaves, the constants they read as buffers."""
    g, root, env = fx.Graph(), torch.nn.Module(), {}
    for p, leaf in enumerate(leaves):
        env[leaf] = g.placeholder(f"leaf{p}")

    def arg(x: fx.Node):
        if x not in env:
            val = an.consts.evaluate(x) if an.consts.is_const(x) else an.consts.evaluate_static(x)
            if val is None:
                raise LookupError(x.name)
            name = f"c{len(root._buffers)}"
            root.register_buffer(name, val.double() if val.is_floating_point() else val)
            env[x] = g.get_attr(name)
        return env[x]

    try:
        for n in order:
            env[n] = g.node_copy(n, arg)
    except LookupError as e:
        return f"the constant {e} could not be evaluated"
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, g)


def _agree(original, rewritten, leaves: list, seed: int) -> Optional[str]:
    gen = torch.Generator().manual_seed(seed)
    args = [torch.randn(tuple(example_value(x).shape), generator=gen, dtype=torch.float64) for x in leaves]
    try:
        want = Float64Interpreter(original).run(*args)
        got = Float64Interpreter(rewritten).run(*args)
    except Exception as e:  # noqa: BLE001 - a rewrite that does not even run is not certified
        return f"its float64 certificate did not run ({type(e).__name__}: {e})"
    for p, (w, x) in enumerate(zip(want, got)):
        if not isinstance(w, torch.Tensor) or w.shape != x.shape or not torch.isfinite(w).all():
            return f"its float64 certificate's output {p} has another shape or is not finite"
        err = ((x.double() - w.double()).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        if not err <= CERT_RTOL:
            return f"its float64 certificate differs from the code by {err:.2g} (relative) in output {p}"
    return None
