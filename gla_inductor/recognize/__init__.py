"""Recognition of naive GLA in a Dynamo graph, as a pipeline of stages:

    analyze   core.analyzer.Analyzer     the normal form of every node, memory facts
    recognize forms.*.recognize          each form's proven instances (Match) and near misses
    replace   Match.apply                the GLA op (core.emit), through a core.emit.Transaction
    pack      forms.packed_spans         calls on spans of the same tensors merged into one
    clean     core.clean                 the nodes the replacement left unused

Analysis only reads the graph. Replacement goes through a `Transaction` that records every
node it inserts and every input it re-points, so a failure is undone exactly and the graph
compiles as if the pass were off. Gate fusion (``gate.py``) runs after, on the rewritten graph.

The package's imports point one way, down this list:

    __init__, gate.py   the pipeline and gate fusion; measure.py, the cost rule's timings
    forms/              one module per form (loop, decode, parallel, chunked, chunk loop) and
                        their parts (steps, step walks, periodic proofs, decay exponents,
                        decays evaluated from positions and buffers, the
                        intra-chunk monomial, a chunked candidate's reading, grouped heads)
    certify/            the float64 certificate of chunked candidates: the subgraph, the
                        replacement it is compared with (spec), its reduction (shrink)
    core/               the normal form (algebra, rules, analyzer), the graph's memory facts,
                        constants, matches, placement and emission of the op

Forms sit above the certificate because the chunked forms use it, and the certificate above
core because it runs the emission of a candidate (``certify/spec.py``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.fx as fx

from .core.analyzer import Analyzer
from .core.clean import dead_code_elimination
from .core.emit import Transaction
from .core.local_updates import functionalize
from .core.match import Match, NearMiss
from .forms import chunk_states, chunked, decode, loop, parallel
from .forms.packed_spans import merge_spans

log = logging.getLogger("gla_inductor")

# In order of precedence: a later match that overlaps an earlier one's nodes is dropped (the
# chunked form holds intra-chunk pieces that read like a parallel form).
RECOGNIZERS = {
    "chunked": chunked.recognize,
    "loop": loop.recognize,
    "decode": decode.recognize,
    "parallel": parallel.recognize,
    "chunk_states": chunk_states.recognize,  # last: only the states of loops no form above reads as GLA
}


@dataclass
class RewriteResult:
    matches: list = field(default_factory=list)  # Match, applied
    near_misses: list = field(default_factory=list)  # NearMiss
    seconds: float = 0.0


def rewrite_graph(gm: fx.GraphModule, forms=("chunked", "loop", "decode", "parallel", "chunk_states", "packed"),
                  unprofitable_reason: Optional[Callable[[Match, Analyzer], Optional[str]]] = None) -> RewriteResult:
    """Replace every proven GLA instance in `gm` by the GLA op. A match whose replacement
    fails is undone and reported as a near miss; an internal error undoes everything and
    raises (the backend logs it and compiles the graph unchanged). A match for which
    ``unprofitable_reason`` gives a reason is left alone with that reason (the cost rule)."""
    start = time.perf_counter()
    with _no_gc():  # the analysis allocates many small objects and keeps them: collecting is waste
        return _rewrite(gm, forms, start, unprofitable_reason)


@contextlib.contextmanager
def _no_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _rewrite(gm: fx.GraphModule, forms, start: float, unprofitable_reason) -> RewriteResult:
    graph = gm.graph
    # in-place updates of the program's own tensors as the values they compute (core/local_updates.py)
    functionalized = functionalize(graph)
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
    owner: dict = {}  # each inserted node -> the match that inserted it
    for m in found:
        why = unprofitable_reason(m, an) if unprofitable_reason is not None else None
        if why is not None:
            result.near_misses.append(NearMiss(m.form, why, m.nodes))
            continue
        mark = txn.mark()
        try:
            m.apply(txn)
        except Exception as e:  # noqa: BLE001 - any failure leaves this match out
            txn.rollback_to(mark)
            log.info("gla_inductor: could not replace a %s-form GLA", m.form, exc_info=True)
            result.near_misses.append(NearMiss(m.form, f"replacement failed: {e}", m.nodes))
            continue
        result.matches.append(m)
        owner.update(dict.fromkeys(txn.created[mark[0]:], m))
    if "packed" in forms and len(result.matches) > 1:
        result.near_misses += merge_spans(graph, txn, owner)
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
    if result.matches or functionalized:
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
