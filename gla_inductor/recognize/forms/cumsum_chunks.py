"""Chunked forms whose chunk states are cumulative sums over the chunk axis, and why a chunked
look-alike is not GLA.

Loop-free chunked code often carries the state entering chunk n as an *exclusive* cumulative
sum of the chunks' key-value products: ``kv.cumsum(2)`` shifted by one chunk (a zero chunk
concatenated in front, ``F.pad``, or ``cumsum - kv``), with gates folded in as cumulative log
decays (``k * exp(-G)``, ``q * exp(G)``, ``G = g.cumsum``) or, for a constant decay, as
powers of gamma per chunk. Nothing here enumerates those spellings: ``chunked.py`` finds the
intra-chunk monomial, ``chunk_candidate.py`` reads the gate and states by shape, and the
float64 certificate decides. Two things are specific to this family:

- *Which tensor is the gate.* A cumulative log decay ``G = g.cumsum(t)`` has the shape of a
  log gate, and so do its views; read as the gate it never certifies, and trying it first
  exhausts the readings tried before ``g`` itself. ``cumulative`` tells them apart, so that
  they are tried last.
- *Why a look-alike fails.* An inclusive cumulative sum (the state entering a chunk includes
  that chunk), a shift by two chunks, a decay missing between chunks: each computes a
  different weight of some key position j at some query position i. ``diagnose`` measures
  those weights by running the user's subgraph in float64 on one-hot inputs with the gate
  held at one known decay per step, compares them with GLA's (``scale * d ** (i - j)`` for
  j <= i, 0 after), and names the first pair that differs, expected against found.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Optional

import torch
import torch.fx as fx

from ..certify.certificate import CertificateTooLarge, Float64Interpreter, one_thread, plan_certificate
from ..certify.probe import _unlift, fitted_gamma
from ..certify.spec import Spec
from ..certify.subgraph import evaluate_consts, subgraph
from ..core.algebra import comps, mono_vars, out_vars
from ..core.analyzer import Analyzer
from ..core.match import NearMiss
from ..core.op_names import VIEW_OPS, op_name

PROBE_CHUNK_DECAY = 0.5  # the decay over one chunk the gate is held at while diagnosing
PROBE_CHUNKS = 4  # chunks whose pairwise weights are measured (enough to see a shift by one)
PROBE_RUNS = 8  # runs of the subgraph a diagnosis may take (each fills V key positions)
PROBE_TOL = 1e-5  # relative; the code's float32 constants carry their rounding
MAX_DIAGNOSED = 8  # readings a diagnosis probes, to find the one nearest GLA


def cumulative(n: fx.Node) -> bool:
    """Whether n is a cumulative sum, or a view of one: a cumulative log decay, not a gate."""
    while op_name(n) in VIEW_OPS and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return op_name(n) == "cumsum"


def unread_states(an: Analyzer) -> list:
    """Near misses for chunk states that are cumulative sums of k^T v per chunk where no
    intra-chunk term was found to go with them (a factor of that term is opaque to the normal
    form): discovery saw the candidate, so the report says why it stopped."""
    near = []
    for n in an.nodes:
        if not cumulative(n) or op_name(n) in VIEW_OPS or not n.all_input_nodes:
            continue
        if _sums_products(an, n.all_input_nodes[0]):
            near.append(NearMiss("chunked", UNREAD, [n]))
    return near


def _sums_products(an: Analyzer, x: fx.Node, depth: int = 3) -> bool:
    """x is k^T v per chunk, or is computed from it within `depth` ops (scaled by decays)."""
    av = an.value(x)
    if av is not None and any(_per_chunk_product(av, term) for term in av.terms):
        return True
    return depth > 0 and any(_sums_products(an, y, depth - 1) for y in x.all_input_nodes)


UNREAD = ("a chunk state is a cumulative sum over chunks of k^T v per chunk, but no output was found that reads "
          "q, k and v under a decay or mask: expected an intra-chunk term q k^T D v whose decay D is built "
          "from exp, powers, masks and constants; found none (a decay computed with an op the recognizer does "
          "not expand, such as cumprod, is opaque to it)")


def _per_chunk_product(av, term) -> bool:
    """Two inputs contracted over the positions of a chunk, the chunk axis kept: k^T v per chunk."""
    ov = out_vars(av.out)
    summed = mono_vars(term) - ov
    atoms = [f for f in term[1] if f.kind == "atom"]

    def chunked(f):
        return {cs[1]: cs[0] for cs in map(comps, f.idx) if len(cs) == 2}

    for a, b in itertools.combinations(atoms, 2):
        pa, pb = chunked(a), chunked(b)
        if any(p in summed and pa[p] == pb[p] and pa[p] in ov for p in pa.keys() & pb.keys()):
            return True
    return False


def diagnose(an: Analyzer, readings, chunk: int) -> Optional[str]:
    """Why the computation is not GLA, as the first pair of positions whose weight differs from
    GLA's, under the probed reading (of the first MAX_DIAGNOSED) whose weights differ at the
    fewest pairs: a decay gamma read as a log gate differs everywhere, read as the decay itself
    only where the code is wrong. None when no reading can be probed or one agrees everywhere
    (the failure lies elsewhere, e.g. in how q or v enter)."""
    best = None
    for spec in itertools.islice(readings, MAX_DIAGNOSED):
        if spec.gate == "fit":
            spec = fitted_gamma(an, spec)
            if spec is None:
                continue
        weights = _weights(an, spec, chunk)
        if weights is None:
            continue
        found = _first_difference(*weights, chunk)
        if found is None:
            return None
        if best is None or found[0] < best[0]:
            best = found
    return None if best is None else best[1]


def _weights(an: Analyzer, spec: Spec, chunk: int):
    """(found, expected): [H, Tp, Tp] weights of key position j at query position i over the
    first Tp positions, from probe runs of the subgraph at the plan's sizes; None if the
    reading cannot be probed."""
    if any(lf.select or lf.unflatten for lf in (spec.q, spec.k, spec.v)) or any(len(g) > 1 for g in spec.out_groups):
        return None
    leaves = spec.leaves()
    nodes, frontier, consts = subgraph(an, [spec.out], set(leaves.values()))
    if frontier or not evaluate_consts(an, consts):
        return None
    try:
        plan = plan_certificate(an, replace(spec, final=None, final_groups=[]), nodes, consts, [spec.out])
    except CertificateTooLarge:
        return None
    sizes = plan.spec.sizes
    b, t, h, vv = sizes["b"], sizes["t"], sizes["h"], sizes["v"]
    tp = min(t, PROBE_CHUNKS * chunk)
    if math.ceil(tp / vv) > PROBE_RUNS:
        return None
    found = torch.zeros(h, tp, tp, dtype=torch.float64)
    for start in range(0, tp, vv):
        cols = range(start, min(start + vv, tp))
        o = _probe_run(plan, spec, leaves, cols, chunk)
        if o is None:
            return None
        for d, j in enumerate(cols):
            found[:, :, j] = o[0, :tp, :, d].T
    return found, _expected(plan.spec, h, tp, chunk)


def _probe_run(plan, spec: Spec, leaves: dict, cols, chunk: int) -> Optional[torch.Tensor]:
    """The output [b, t, h, v] for q = k = e_0 at every position and v = e_d at position cols[d]."""
    sizes = plan.spec.sizes
    b, t, h = sizes["b"], sizes["t"], sizes["h"]
    q = torch.zeros(b, t, h, sizes["k"], dtype=torch.float64)
    q[..., 0] = 1.0
    v = torch.zeros(b, t, h, sizes["v"], dtype=torch.float64)
    for d, j in enumerate(cols):
        v[:, j, :, d] = 1.0
    given = {"q": q, "k": q.clone(), "v": v}
    fill = math.log(PROBE_CHUNK_DECAY) / chunk
    fill = fill if spec.gate_is_log else math.exp(fill)
    args = []
    for role in leaves:
        lf = {"q": spec.q, "k": spec.k, "v": spec.v}.get(role)
        if lf is not None:
            args.append(_unlift(given[role], lf.letters))
        else:  # the gate at one decay per step (half per chunk); no initial state
            args.append(torch.full(plan.shapes[role], fill if role == "g" else 0.0, dtype=torch.float64))
    try:
        with one_thread(plan.reduced):
            (o,) = Float64Interpreter(plan.original).run(*args)
    except Exception:  # noqa: BLE001 - a probe that does not run diagnoses nothing
        return None
    letters = "".join(spec.out_groups).replace("1", "")
    present = "".join(c for c in "bthv" if c in letters)
    o = torch.einsum(f"{letters}->{present}", o.reshape([s for s in o.shape if s != 1] or [1]))
    for axis, c in enumerate("bthv"):
        if c not in letters:
            o = o.unsqueeze(axis)
    return o


def _expected(spec: Spec, h: int, tp: int, chunk: int) -> torch.Tensor:
    """GLA's weights: scale * d_h ** (i - j) on the causal triangle, 0 above it."""
    if spec.gate == "none":
        decay = torch.ones(h, dtype=torch.float64)
    elif spec.gamma is not None:
        decay = torch.tensor(spec.gamma, dtype=torch.float64)[:h].exp()
    else:
        decay = torch.full((h,), PROBE_CHUNK_DECAY ** (1 / chunk), dtype=torch.float64)
    i = torch.arange(tp, dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    w = decay[:, None, None] ** dist.clamp_min(0) * spec.scale
    return torch.where(dist >= 0, w, torch.zeros((), dtype=torch.float64))


def _first_difference(found: torch.Tensor, expected: torch.Tensor, chunk: int) -> Optional[tuple]:
    """(pairs that differ, the first difference said in words); None where none does."""
    bad = ~torch.isclose(found, expected, rtol=PROBE_TOL, atol=PROBE_TOL * expected.abs().max().item())
    if not bool(bad.any()):
        return None
    later = bad & torch.ones_like(bad[0]).triu(1)  # reads of later keys say the most: first
    hh, i, j = (int(x) for x in (later if bool(later.any()) else bad).nonzero()[0])
    got, want = found[hh, i, j].item(), expected[hh, i, j].item()
    ci, cj = i // chunk, j // chunk
    where = (f"the output at position {i} (chunk {ci}) weighs the key at position {j} (chunk {cj}) "
             f"by {got:.4g}, expected {want:.4g}")
    return int(bad.sum()), f"{where}: {_why(i, j, ci, cj, got, want)}"


def _why(i: int, j: int, ci: int, cj: int, got: float, want: float) -> str:
    if j > i and cj == ci:
        return ("a later key of its own chunk: the state entering a chunk must sum the chunks before "
                "it only (an exclusive cumulative sum, not one that includes the chunk)")
    if j > i:
        return "a later chunk: the chunk states are not causal"
    if cj == ci:
        return "the intra-chunk decay or mask is not GLA's"
    if got == 0:
        return (f"chunk {cj} does not reach chunk {ci}: the state entering each chunk must be the sum "
                "of the chunks before it (shifted by exactly one chunk)")
    return f"the decay carried from chunk {cj} to chunk {ci} is not GLA's (found / expected = {got / want:.4g})"
