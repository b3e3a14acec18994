"""The rewrite pipeline on a Dynamo graph: copy -> analyze -> recognize -> replace -> clean.

Everything happens on a copy of the graph; the user's GraphModule is only swapped to the
rewritten graph once every stage succeeded, so a failure leaves it untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch.fx as fx

from . import loop, parallel
from .algebra import Analyzer
from .consts import is_inplace
from .match import Match, NearMiss

log = logging.getLogger("gla_inductor")

RECOGNIZERS = {"loop": loop.recognize, "parallel": parallel.recognize}


@dataclass
class RewriteResult:
    matches: list = field(default_factory=list)  # Match, applied
    near_misses: list = field(default_factory=list)  # NearMiss
    seconds: float = 0.0


def rewrite_graph(gm: fx.GraphModule, forms=("loop", "parallel")) -> RewriteResult:
    """Replace every proven GLA instance in `gm` by the GLA op. Raises on internal errors
    (the caller logs them and compiles the graph unchanged)."""
    start = time.perf_counter()
    graph = _copy_graph(gm)
    an = Analyzer(graph)
    result = RewriteResult()
    for form in forms:
        matches, near = RECOGNIZERS[form](an)
        result.near_misses += near
        result.matches += matches
    for m in result.matches:
        m.apply(graph)
        log.info("gla_inductor: replaced a %s-form GLA (%s gate, %s)", m.form, m.gate, m.shapes)
    for nm in result.near_misses:
        log.info("gla_inductor: left a %s-form candidate alone: %s", nm.form, nm.reason)
    if result.matches:
        dead_code_elimination(graph)
        graph.lint()
        gm.graph = graph
        gm.recompile()
    result.seconds = time.perf_counter() - start
    return result


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    new = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    val_map: dict = {}
    out, old_output = new.graph_copy(gm.graph, val_map, return_output_node=True)
    new.output(out).meta = dict(old_output.meta)
    for old, copied in val_map.items():
        # Dynamo keeps the input's source on the placeholder object itself, not in meta.
        if hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source
    return new


def dead_code_elimination(graph: fx.Graph) -> None:
    """Drop unused pure nodes. fx's own DCE treats every call_method as pure, which would
    drop a user's in-place `cache.copy_(...)`; here in-place ops are always kept."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or is_inplace(node):
            continue
        if node.op == "call_function" and node.is_impure():
            continue
        graph.erase_node(node)
