"""The rewrite pipeline on a Dynamo graph: analyze -> recognize -> replace -> clean.

Analysis only reads the graph. Replacement goes through a `Transaction` that records every
node it inserts and every input it re-points, so a failure is undone exactly and the graph
compiles as if the pass were off.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import torch.fx as fx

from . import chunked, loop, parallel
from .algebra import Analyzer, op_name
from .consts import is_inplace
from .emit import Transaction
from .match import NearMiss

log = logging.getLogger("gla_inductor")

# In order of precedence: a later match that overlaps an earlier one's nodes is dropped (the
# chunked form holds intra-chunk pieces that read like a parallel form).
RECOGNIZERS = {
    "chunked": chunked.recognize,
    "loop": loop.recognize,
    "decode": loop.recognize_decode,
    "parallel": parallel.recognize,
}


@dataclass
class RewriteResult:
    matches: list = field(default_factory=list)  # Match, applied
    near_misses: list = field(default_factory=list)  # NearMiss
    seconds: float = 0.0


def rewrite_graph(gm: fx.GraphModule, forms=("chunked", "loop", "decode", "parallel")) -> RewriteResult:
    """Replace every proven GLA instance in `gm` by the GLA op. A match whose replacement
    fails is undone and reported as a near miss; an internal error undoes everything and
    raises (the backend logs it and compiles the graph unchanged)."""
    start = time.perf_counter()
    with _no_gc():  # the analysis allocates many small objects and keeps them: collecting is waste
        return _rewrite(gm, forms, start)


@contextlib.contextmanager
def _no_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _rewrite(gm: fx.GraphModule, forms, start: float) -> RewriteResult:
    graph = gm.graph
    an = Analyzer(graph)
    result = RewriteResult()
    found, covered, near_misses = [], set(), []
    for form in (f for f in RECOGNIZERS if f in forms):
        matches, near = RECOGNIZERS[form](an)
        near_misses += near
        for m in matches:
            if not covered.intersection(m.nodes):
                found.append(m)
                covered |= set(m.covers) | set(m.nodes)
    # a candidate inside a match (the final state a later form folds in) was not left alone
    result.near_misses = [nm for nm in near_misses if not covered.intersection(nm.nodes)]
    txn = Transaction(graph)
    for m in found:
        mark = txn.mark()
        try:
            m.apply(txn)
        except Exception as e:  # noqa: BLE001 - any failure leaves this match out
            txn.rollback_to(mark)
            log.info("gla_inductor: could not replace a %s-form GLA", m.form, exc_info=True)
            result.near_misses.append(NearMiss(m.form, f"replacement failed: {e}", m.nodes))
            continue
        result.matches.append(m)
    try:
        graph.lint()
    except Exception:
        txn.rollback_to((0, 0, 0))
        raise
    result.near_misses = _merge(result.near_misses)
    for m in result.matches:
        log.info("gla_inductor: replaced a %s-form GLA (%s gate, %s)", m.form, m.gate, m.shapes)
    for nm in result.near_misses:
        log.info("gla_inductor: left a %s-form candidate alone: %s", nm.form, nm.reason)
    if result.matches:
        txn.commit()
        dead_code_elimination(graph)
        gm.recompile()
    result.seconds = time.perf_counter() - start
    return result


def _merge(near: list) -> list:
    """One entry per (form, reason): a T-step loop repeats its reason T times."""
    merged: dict = {}
    for nm in near:
        key = (nm.form, nm.reason)
        if key in merged:
            merged[key].nodes += nm.nodes
        else:
            merged[key] = NearMiss(nm.form, nm.reason, list(nm.nodes))
    return list(merged.values())


def dead_code_elimination(graph: fx.Graph) -> None:
    """Drop unused pure nodes. fx's own DCE treats every call_method as pure, which would
    drop a user's in-place `cache.copy_(...)`; here in-place ops are always kept."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or is_inplace(node):
            continue
        if node.op == "call_function" and op_name(node) is None and node.is_impure():
            continue
        graph.erase_node(node)
