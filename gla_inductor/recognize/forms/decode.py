"""The decode form: one step of the recurrence on a state read from a cache,

    S = S_cache * d + k (x) v,   o = scale * q S

where d is exp(g) or a factor computed in the graph that ``decay_sign.py`` proves nonnegative
(torchscale RetNet's sqrt(s_prev) * d / sqrt(s), whose update adds k (x) v / sqrt(s)); the op
gets the gate log(d).

with no time axis, the cache a graph input, usually written back (``cache.copy_(S)``). It is
the time loop's one-step case (``loop.analyze_chain``); where the write-back goes into the cache
the state came from, the op updates the cache in place (``core/placement.py``).
"""

from __future__ import annotations

from ..core.analyzer import Analyzer
from ..core.match import Match, NearMiss, Reject
from ..core.op_names import op_name
from ..core.versions import storage_root
from .loop import analyze_chain
from .steps import accumulates_outer, chains_of, find_steps, is_full_atom


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    """One-token decode steps: a single update of a state that comes from outside the graph
    (a cache), read by a query. Other single updates are left alone: `q (k^T v)` from a zero
    state, or a bonus term `S + u k^T v` inside a loop, is not a recurrence worth a kernel."""
    steps, _ = find_steps(an)
    matches, near = [], []
    for chain in chains_of(steps):
        st = chain[0]
        if len(chain) != 1 or st.prev is None:
            continue
        if storage_root(st.prev).op not in ("placeholder", "get_attr"):
            continue
        if _updates(an).get(st.prev, 0) > 1:  # RWKV-6 reads S + u k^T v beside the update S * d + k^T v
            near.append(NearMiss("decode", "the cached state is updated twice (a bonus read, not a recurrence)", [st.node]))
            continue
        try:
            matches.append(analyze_chain(an, chain, [], single=True))
        except Reject as e:
            if accumulates_outer(st):  # else no GLA candidate: a residual add at batch size 1
                near.append(NearMiss("decode", str(e), [st.node]))
    return matches, near


def _updates(an: Analyzer) -> dict:
    """state -> how many sums add something to it (whole, decayed or not): GLA steps and
    updates of other shapes (a shared k^T v is one atom to the algebra)."""
    if "updates" in an.memo:
        return an.memo["updates"]
    counts = an.memo["updates"] = {}
    for n in an.graph.nodes:
        av = an.value(n) if op_name(n) in ("add", "sub") else None
        if av is None or len(av.terms) < 2:
            continue
        for x in {f.atom.node for _, fs in av.terms for f in fs if is_full_atom(f, av.out)}:
            counts[x] = counts.get(x, 0) + 1
    return counts
