"""The chunked form: GLA computed chunk by chunk with no Python loop, as Mamba2's SSD scan is
written in transformers (``mamba2_chunk_scan``, ``torch_forward`` <= 5.0) and in mamba_ssm's
``ssd_minimal_discrete``: an intra-chunk term (a decay mask over positions of a chunk), plus
an inter-chunk term read from chunk states that a segment-sum over chunks decays and carries,
with an initial state concatenated in and a final state out; and chunk loops (``chunk_loop.py``),
the same computation with a Python loop over the chunks.

Recognition has two halves.

*Roles, structurally.* The output is a sum with one intra-chunk monomial
(``intra_chunk.py``): q, k, v. The gate and the initial state are the other data the
computation reads: candidates by shape ([B, T, H] or [B, T, H, K] for the log gate,
[B, H, K, V] in any axis order for the states) among the nodes between the inputs and the
output; the final state, a state-shaped value computed from them (``chunk_candidate.py``).

*Equality, by certificate.* The subgraph from those inputs to the output and the final state
is run in float64 against the exact replacement the rewrite would insert
(``certify/certificate.py``, where the argument is written).
"""

from __future__ import annotations

import itertools

import torch.fx as fx

from ..core.algebra import AV, Factor, comps, factor_vars, mono_vars, out_vars
from ..core.analyzer import Analyzer
from ..core.emit import LFactor
from ..core.match import Match, NearMiss, Reject
from ..core.op_names import op_name
from ..certify.certificate import CertificateTooLarge
from ..certify.spec import Spec
from . import chunk_loop, parallel, symbolic_chunks
from .chunk_candidate import complete, match_of, readings
from .cumsum_chunks import diagnose, unread_states
from .intra_chunk import Roles, batch_letters, may_hold_chunks, role_sizes, seeds


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    matches, near = [], []
    if not may_hold_chunks(an.graph):
        return matches, near
    near += _normalized_scores(an)
    found = seeds(an)
    loops = [(asm, elems) for asm, elems in chunk_loop.find(an, found) if len(elems) > 1 or _lone_chunk(an, elems[0])]
    in_loops = {e for asm, _ in loops for e in asm.elements}
    for asm, elems in loops:
        try:
            matches.append(chunk_loop.analyze(an, asm, [(e, *found[e]) for e in elems]))
        except Reject as e:
            near.append(NearMiss("chunked", str(e), [asm.result]))
    inner = _inner(found)
    for out, (term, roles) in found.items():
        if out in in_loops or out in inner or len(an.value(out).terms) < 2:
            continue  # one chunk alone, without a state read, is a parallel form
        if roles.c is None and parallel.proven(an, out):
            continue  # one chunk with a state read that the parallel form proves, at any size
        try:
            matches.append(_analyze(an, out, term, roles))
        except Reject as e:
            if roles.c is None and parallel.judged(an, out):
                continue  # no chunks: the parallel form's rewrites or reason say more than a failed certificate
            near.append(NearMiss("chunked", str(e), [out]))
    if not matches and not near:
        near += unread_states(an) or symbolic_chunks.time_cuts(an)
    return matches, near


def _lone_chunk(an: Analyzer, out: fx.Node) -> bool:
    """A loop that ran once, as a loop: its state read folded away with the zero state (one
    term left) and no parallel form proves it (a gate input the chunked certificate reads)."""
    return len(an.value(out).terms) < 2 and not parallel.proven(an, out)


NORMALIZED = ("the intra-chunk scores q k^T D are divided by a value computed from them before the product "
              "with v (a data-dependent normalization, as torchscale's qk / |qk|.sum(-1).clamp(min=1)), not GLA")


def _normalized_scores(an: Analyzer) -> list:
    """Near misses for chunked code that normalizes its intra-chunk scores by the data: a
    quotient, read by a matrix product, of a q k^T product within chunks by a value computed
    from it. (Its quotient is opaque to the normal form, so no intra-chunk monomial is seen.)"""
    found = []
    for n in an.nodes:
        if op_name(n) != "div" or len(n.args) < 2 or not all(isinstance(a, fx.Node) for a in n.args[:2]):
            continue
        scores, norm = n.args[:2]
        av = an.value(scores)
        if av is None or len(av.terms) != 1 or not _scores_within_chunks(av):
            continue
        if any(op_name(u) in ("matmul", "bmm", "einsum") for u in n.users) and parallel.depends_on(an, norm, {scores}):
            found.append(NearMiss("chunked", NORMALIZED, [n]))
    return found


def _scores_within_chunks(av: AV) -> bool:
    """Two inputs contracted over a feature axis, at two positions of one chunk: q k^T per chunk."""
    ov = out_vars(av.out)
    term = av.terms[0]
    summed = mono_vars(term) - ov
    atoms = [f for f in term[1] if f.kind == "atom"]

    def chunked(f):
        return {cs[0]: cs[1] for cs in map(comps, f.idx) if len(cs) == 2}

    for a, b in itertools.combinations(atoms, 2):
        ca, cb = chunked(a), chunked(b)
        if (factor_vars(a) & factor_vars(b) & summed
                and any(ca[c] != cb[c] and {ca[c], cb[c]} <= ov for c in ca.keys() & cb.keys())):
            return True
    return False


def _inner(found: dict) -> set:
    """Seeds whose value a user scales or shifts into another seed of the same q, k, v (the
    chunked output, then times a scale): only the outermost is the candidate."""
    def inputs(r: Roles):
        return r.q.atom.node, r.k.atom.node, r.v.atom.node

    return {n for n, (_, r) in found.items()
            if any(u in found and inputs(found[u][1]) == inputs(r) for u in n.users)}


def _analyze(an: Analyzer, out: fx.Node, term, r: Roles) -> Match:
    """The first naming of the batch variables that certifies (``batch_letters``); else the
    first one's Reject."""
    first = None
    for batch in batch_letters(r):
        try:
            return _analyze_as(an, out, term, r, batch)
        except CertificateTooLarge:
            raise
        except Reject as e:
            first = first or e
    raise first


def _analyze_as(an: Analyzer, out: fx.Node, term, r: Roles, batch: str) -> Match:
    letter = {x: batch[n] for n, x in enumerate(r.batch)}
    letter.update({x: c for x, c in ((r.kk, "k"), (r.vv, "v")) if x is not None})
    q, k, v = (_leaf(f, pos, r, letter) for f, pos in ((r.q, r.i), (r.k, r.j), (r.v, r.j)))
    sizes = role_sizes(an, r, batch)
    out_groups = _out_groups(an.value(out), r, letter)
    scalars = [f for f in term[1] if f.kind == "scalar"]
    if scalars:
        raise Reject("the chunked form scales by a number computed in the graph")
    base = Spec(q, k, v, None, "none", None, [], out, out_groups, None, [], term[0], sizes)
    try:
        spec = complete(an, base)
    except CertificateTooLarge:
        raise
    except Reject as e:
        why = diagnose(an, readings(an, base), an.sizes[r.i]) if r.c is not None else None
        if why is None:
            raise
        raise Reject(f"{e}: {why}") from e
    return match_of(an, spec)


def _leaf(f: Factor, pos: int, r: Roles, letter: dict) -> LFactor:
    letters = ""
    for e in f.idx:
        cs = comps(e)
        if cs == r.time(pos):
            letters += "t"
        elif len(cs) == 1 and cs[0] in letter:
            letters += letter[cs[0]]
        elif not cs:
            letters += "1"
        else:
            raise Reject("an input of the chunked form has an axis that is not one role")
    if f.atom.fixed:
        raise Reject("an input of the chunked form is indexed at an integer position")
    return LFactor(f.atom.node, letters)


def _out_groups(av: AV, r: Roles, letter: dict) -> list:
    groups = []
    for e in av.out:
        cs = comps(e)
        if cs == r.time(r.i):
            groups.append("t")
        elif not cs:
            groups.append("1")
        elif len(cs) == 1 and cs[0] in letter and letter[cs[0]] != "k":
            groups.append(letter[cs[0]])
        else:
            raise Reject("the output keeps the chunk axis apart from the position (take its view)")
    return groups
