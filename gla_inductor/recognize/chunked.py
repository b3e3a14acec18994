"""The chunked form: GLA computed chunk by chunk with no Python loop, as Mamba2's SSD scan is
written in transformers (``mamba2_chunk_scan``, ``torch_forward`` <= 5.0) and in mamba_ssm's
``ssd_minimal_discrete``: an intra-chunk term (a decay mask over positions of a chunk), plus
an inter-chunk term read from chunk states that a segment-sum over chunks decays and carries,
with an initial state concatenated in and a final state out.

Recognition has two halves.

*Roles, structurally.* The output is a sum with one intra-chunk monomial
``q[c, i] k[c, j] v[c, j] * decay(c, i, j)``: three atoms, whose time axes are a chunk index c
and a position merged (the reshape into chunks split the time variable). They are q, k, v.
The gate and the initial state are the other data the computation reads: candidates by shape
([B, T, H] or [B, T, H, K] for the log gate, [B, H, K, V] in any axis order for the states)
among the nodes between the inputs and the output; the final state, a state-shaped value
computed from them.

*Equality, by certificate.* The subgraph from those inputs to the output and the final state
must be a pure function of them, built only from analytic ops (sums, products, contractions,
exp, cumsum, views, pads, concatenation, masks that are constants): no comparison, clamp or
other branch on data. It runs in float64 on random inputs, and so does the exact replacement
the rewrite would insert, with the GLA op replaced by the naive reference recurrence. Both
are exponential polynomials of the inputs on fixed masks: if they differ, they differ on all
but a measure-zero set of inputs, so agreement (to the float32 rounding of the code's own
constants, CERT_RTOL) at two random points certifies that they are equal. Sizes must be
static (Dynamo specializes them, and the certificate holds at those sizes). A certificate is
kept per subgraph structure (sizes included), so the layers of a model pay once.

*Its cost.* At model sizes the user's subgraph materializes [b, c, l, l, h] tensors and
larger: gigabytes in float64. Where the subgraph is proven to treat every batch and head
alike (``shrink.py``: a table of ops, tags on the batch and head axes, constants checked by
value; the argument is written there), both sides run at 2 batches and 2 heads instead,
which certifies the full sizes. Otherwise the full-size certificate runs if its estimated
float64 memory is within CERT_BUDGET_BYTES, and the candidate is rejected if not. (One
transformers Mamba2Mixer at 1.3B sizes, B=4, T=4096, 64 heads of 64, state 128: ~13.5 GiB
estimated at full size; 0.2 GiB and a few seconds on a CPU core at 2 batches and 2 heads.)
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from .algebra import _VIEW_OPS, AV, Analyzer, Factor, comps, factor_vars, mono_vars, op_name, out_vars
from .consts import example_value, is_inplace, written_args
from .emit import Emitter, Group, LFactor, Transaction, _fake_mode
from .match import Match, NearMiss, Reject
from . import placement, shrink, summed_products

log = logging.getLogger("gla_inductor")

# Agreement required of the certificate (relative, float64). Not tighter: the code's own
# constants (decay tables from a float32 arange) carry float32 rounding into the comparison;
# a function that is not GLA differs by far more at random inputs.
CERT_RTOL = 1e-6
MAX_CANDIDATES = 8  # letterings tried per input: more means the shapes are too ambiguous
FINAL_STATE_REACH = 64  # nodes searched past the last one computed from the subgraph
_CERTIFIED: dict = {}  # structure of a certified subgraph -> True (bounded below)
# Estimated float64 memory a certificate may take (the original subgraph's live intermediates,
# its inputs and constants). Past it at full size and at reduced sizes, no rewrite.
CERT_BUDGET_BYTES = 2 << 30


class CertificateTooLarge(Reject):
    """The certificate would exceed CERT_BUDGET_BYTES: the candidate is left alone, unproven."""

    def __init__(self, message: str, reducible: bool):
        super().__init__(message)
        self.reducible = reducible  # the reduction admitted the subgraph: too large even so


def first_too_large(seen: Optional[CertificateTooLarge], e: CertificateTooLarge) -> CertificateTooLarge:
    """The reason to report of several readings' CertificateTooLarge: the first one that the
    reduction admitted (the others were refused, often by letters that do not fit)."""
    return e if seen is None or e.reducible and not seen.reducible else seen


@dataclass
class Spec:
    """A proposed replacement: the inputs with role letters, the outputs with theirs."""

    q: LFactor
    k: LFactor
    v: LFactor
    g: Optional[LFactor]
    gate: str  # none | scalar | vector | constant
    h0: Optional[fx.Node]
    h0_groups: list
    out: fx.Node
    out_groups: list
    final: Optional[fx.Node]
    final_groups: list
    scale: float
    sizes: dict  # role letter -> int
    splits: dict = field(default_factory=dict)
    gate_is_log: bool = True  # the gate input is the log decay (else the decay itself)
    gamma: Optional[tuple] = None  # a constant log decay per head, read off the code

    def leaves(self) -> dict:
        res = {"q": self.q.node, "k": self.k.node, "v": self.v.node}
        if self.g is not None:
            res["g"] = self.g.node
        if self.h0 is not None:
            res["h0"] = self.h0
        return res

    def outputs(self) -> list:
        return [self.out] + ([self.final] if self.final is not None else [])


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    from . import chunk_loop, parallel

    matches, near = [], []
    if not _may_hold_chunks(an.graph):
        return matches, near
    seeds = _seeds(an)
    loops = chunk_loop.find(an, seeds)
    in_loops = {e for asm, _ in loops for e in asm.elements}
    for asm, elems in loops:
        try:
            matches.append(chunk_loop.analyze(an, asm, [(e, *seeds[e]) for e in elems]))
        except Reject as e:
            near.append(NearMiss("chunked", str(e), [asm.result]))
    for out, (term, roles) in seeds.items():
        if out in in_loops or len(an.value(out).terms) < 2:
            continue  # one chunk alone, without a state read, is a parallel form
        if roles.c is None and parallel.proven(an, out):
            continue  # one chunk with a state read that the parallel form proves, at any size
        try:
            matches.append(_analyze(an, out, term, roles))
        except Reject as e:
            near.append(NearMiss("chunked", str(e), [out]))
    return matches, near


# ---- the intra-chunk monomial ------------------------------------------------------------------
@dataclass
class Roles:
    q: Factor
    k: Factor
    v: Factor
    i: int  # position of the query within its chunk
    j: int  # position of the key
    c: Optional[int]  # the chunk (None when there is one)
    kk: int
    vv: int
    batch: list

    def time(self, pos: int) -> tuple:
        """The variables of a time axis at chunk position `pos`."""
        return (pos,) if self.c is None else (self.c, pos)


# Ops that relate positions within a chunk: masks, segment sums, decay tables from positions.
_POSITION_OPS = {"tril", "triu", "tril_", "triu_", "cumsum", "masked_fill", "masked_fill_", "where", "arange",
                 "lt", "le", "gt", "ge", "logcumsumexp", "tril_indices", "triu_indices"}


def _may_hold_chunks(graph: fx.Graph) -> bool:
    """A cheap precondition: the intra-chunk term decays or masks pairs of positions, so the graph
    builds such a relation (a mask, a cumulative sum, positions from arange) or reads a table of it
    ([..., C, C] input or attribute). Graphs without one (a time loop unrolled by Dynamo) skip the
    normal form of every node that finding the intra-chunk monomials takes (~1 s at T = 1024)."""
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            val = example_value(n)
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2] >= 2:
                return True
        elif n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            if name in _POSITION_OPS:
                return True
    return False


def _seeds(an: Analyzer) -> dict:
    """node -> (term, roles) for values with an intra-chunk monomial, the last of a chain of
    views (a chunk loop's first chunk, read from a zero state, has no other term)."""
    found = {}
    for n in an.graph.nodes:
        av = an.value(n)
        if av is None or av.keep is not None or op_name(n) in ("getitem", "select"):
            continue
        for term in av.terms:
            roles = _roles(av, term)
            if roles is not None:
                found[n] = (term, roles)
                break
    return {n: x for n, x in found.items() if not any(u in found and op_name(u) in _VIEW_OPS for u in n.users)}


def _roles(av: AV, term) -> Optional[Roles]:
    coef, fs = term
    atoms = [f for f in fs if f.kind == "atom"]
    if len(atoms) != 3 or not any(f.kind in ("exp", "const", "tri") for f in fs):
        return None  # three inputs under a decay or mask
    ov = out_vars(av.out)
    summed = mono_vars(term) - ov
    other_vars = set().union(*[factor_vars(f) for f in fs if f.kind != "atom"])

    def holders(x):
        return [f for f in atoms if x in factor_vars(f)]

    vvs = [x for x in ov if len(holders(x)) == 1 and x not in other_vars and factor_vars(holders(x)[0]) & summed]
    if len(vvs) != 1:
        return None
    vv, v = vvs[0], holders(vvs[0])[0]
    js = factor_vars(v) & summed
    kks = summed - js
    if len(js) != 1 or len(kks) != 1:
        return None
    j, kk = next(iter(js)), next(iter(kks))
    ks = [f for f in atoms if f is not v and {j, kk} <= factor_vars(f)]
    qs = [f for f in atoms if f is not v and kk in factor_vars(f) and j not in factor_vars(f)]
    if len(ks) != 1 or len(qs) != 1:
        return None
    q, k = qs[0], ks[0]
    i_s = [x for x in ov if x in factor_vars(q) and x not in factor_vars(k) | factor_vars(v)]
    if len(i_s) != 1:
        return None
    i = i_s[0]
    c = _chunk_var(q, i)  # None: a single chunk (its axis has size 1)
    if _chunk_var(k, j) != c or _chunk_var(v, j) != c or c is None and (i not in q.idx or j not in k.idx):
        return None
    batch = [x for e in av.out for x in comps(e) if x not in (i, vv, c)]
    if len(batch) > 2:
        return None
    return Roles(q, k, v, i, j, c, kk, vv, batch)


def _chunk_var(f: Factor, pos: int) -> Optional[int]:
    """c where f's time axis is the merged (c, pos): chunk c, position pos within it."""
    for e in f.idx:
        cs = comps(e)
        if len(cs) == 2 and cs[1] == pos:
            return cs[0]
    return None


# ---- the candidate ------------------------------------------------------------------------------
def _analyze(an: Analyzer, out: fx.Node, term, r: Roles) -> Match:
    letter = {x: "bh"[n] for n, x in enumerate(r.batch)}
    letter.update({r.kk: "k", r.vv: "v"})
    q, k, v = (_leaf(f, pos, r, letter) for f, pos in ((r.q, r.i), (r.k, r.j), (r.v, r.j)))
    sizes = _sizes(an, r)
    out_groups = _out_groups(an.value(out), r, letter)
    scalars = [f for f in term[1] if f.kind == "scalar"]
    if scalars:
        raise Reject("the chunked form scales by a number computed in the graph")
    base = Spec(q, k, v, None, "none", None, [], out, out_groups, None, [], term[0], sizes)
    spec = _complete(an, base)
    return _match(an, spec)


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


def _sizes(an: Analyzer, r: Roles) -> dict:
    def size(x):
        s = an.sizes[x]
        if not isinstance(s, int):
            raise Reject("the chunked form has symbolic sizes (it is certified at static sizes)")
        return s

    sizes = {"b": 1, "h": 1, "k": size(r.kk), "v": size(r.vv), "t": size(r.i) * (size(r.c) if r.c is not None else 1)}
    for n, x in enumerate(r.batch):
        sizes["bh"[n]] = size(x)
    return sizes


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


def _complete(an: Analyzer, base: Spec) -> Spec:
    """The gate, initial state and final state: the first reading that certifies."""
    core = {base.q.node, base.k.node, base.v.node}
    nodes, frontier, _ = _slice(an, base.outputs(), core)
    tried, too_large = 0, None
    for gate in _gate_options(an, base, nodes | frontier):
        cut = core | ({gate.g.node} if gate.g is not None else set())
        nodes, frontier, consts = _slice(an, [base.out], cut)
        for h0, h0_groups in _state_options(base, frontier):
            if frontier - {h0}:
                continue  # data the computation reads is left unexplained
            leaves = cut | ({h0} if h0 is not None else set())
            for final, final_groups in _final_options(an, base, nodes, leaves):
                spec = replace(gate, h0=h0, h0_groups=h0_groups, final=final, final_groups=final_groups)
                spec = _with_fitted_gamma(an, spec) if spec.gate == "fit" else spec
                if spec is None:
                    continue
                tried += 1
                if tried > MAX_CANDIDATES:
                    raise too_large or Reject("too many ways to read the gate and states by shape")
                try:
                    if certify(an, spec):
                        return spec
                except CertificateTooLarge as e:
                    too_large = first_too_large(too_large, e)
    raise too_large or Reject("no reading of the chunked computation as GLA was certified")


def _gate_options(an: Analyzer, base: Spec, nodes: set):
    """Specs with a gate: none; each slice node shaped like a log gate (or, for a constant
    gate, like a decay per head); last, a constant decay read off the code itself."""
    yield base
    cands = sorted(nodes, key=lambda n: -an.order[n])  # nearest the output first
    for n in cands:
        val = example_value(n)
        if not isinstance(val, torch.Tensor) or an.consts.is_const(n) or not val.is_floating_point():
            continue
        for roles, kind in (("bth", "scalar"), ("bthk", "vector"), ("h", "constant")):
            for letters in _letterings(tuple(val.shape), roles, base.sizes):
                yield replace(base, g=LFactor(n, letters), gate=kind)
                if kind == "constant":
                    yield replace(base, g=LFactor(n, letters), gate=kind, gate_is_log=False)
    yield replace(base, gate="fit")


def _with_fitted_gamma(an: Analyzer, spec: Spec) -> Optional[Spec]:
    """A constant decay per head that the code holds as numbers (0.9 ** distance), read off
    one probe run: q at step 1 reading k, v of step 0 gives scale * exp(gamma[h]). Only a
    guess: the certificate then checks it."""
    if spec.sizes["t"] < 2 or any(lf.select or lf.unflatten for lf in (spec.q, spec.k, spec.v)):
        return None
    leaves = spec.leaves()
    nodes, frontier, consts = _slice(an, [spec.out], set(leaves.values()))
    if frontier or not _evaluate(an, consts) or any(len(g) > 1 for g in spec.out_groups):
        return None
    try:
        plan = _plan(an, spec, nodes, consts, [spec.out])
    except CertificateTooLarge:
        return None
    sizes = plan.spec.sizes
    probe = {r: torch.zeros(sizes["b"], sizes["t"], sizes["h"], sizes[d]) for r, d in (("q", "k"), ("k", "k"), ("v", "v"))}
    probe["q"][:, 1, :, 0] = probe["k"][:, 0, :, 0] = probe["v"][:, 0, :, 0] = 1.0
    args = []
    for role in leaves:
        lf = {"q": spec.q, "k": spec.k, "v": spec.v}.get(role)
        args.append(_unlift(probe[role], lf.letters) if lf else torch.zeros(plan.shapes[role]))
    try:
        with _one_thread(plan.reduced):
            (o,) = _F64(plan.original).run(*[a.double() for a in args])
    except Exception:  # noqa: BLE001 - no reading: no candidate
        return None
    letters = "".join(spec.out_groups).replace("1", "")
    present = "".join(c for c in "bthv" if c in letters)  # size-1 roles have no letter
    o = torch.einsum(f"{letters}->{present}", o.reshape([s for s in o.shape if s != 1] or [1]))
    for axis, c in enumerate("bthv"):
        if c not in letters:
            o = o.unsqueeze(axis)
    decay = o[:, 1, :, 0] / spec.scale
    if not bool((decay > 0).all()) or not torch.allclose(decay, decay[:1].expand_as(decay)):
        return None
    gamma = decay[0].log().tolist()
    if len(gamma) != spec.sizes["h"]:  # read at fewer heads, proven alike: the same for all
        if len(set(gamma)) != 1:
            return None
        gamma = gamma[:1] * spec.sizes["h"]
    return replace(spec, gate="constant", gamma=tuple(gamma))


def _unlift(x: torch.Tensor, letters: str) -> torch.Tensor:
    """A [B, T, H, D] tensor laid out as a leaf lettered `letters`."""
    d = "v" if "v" in letters else "k"
    y = torch.einsum(f"bth{d}->{letters.replace('1', '')}", x)
    it = iter(y.shape)
    return y.reshape([1 if c == "1" else next(it) for c in letters])


def _state_options(base: Spec, frontier: set) -> list:
    """[(h0, groups)]: no initial state, or a data input left besides q, k, v, g that is
    shaped [B, H, K, V] (in any axis order)."""
    res = [(None, [])]
    for n in frontier:
        val = example_value(n)
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            res += [(n, list(ls)) for ls in _letterings(tuple(val.shape), "bhkv", base.sizes)]
    return res


def _final_options(an: Analyzer, base: Spec, nodes: set, leaves: set):
    """(final, groups) for each state-shaped value computed from the subgraph's inputs by
    analytic ops outside it (the last state of a chunk loop, the last chunk state of a scan),
    latest first; then (None, []): the final state is not used."""
    derived, cands = set(nodes) | leaves, []
    if not nodes:  # nothing of the subgraph to follow: only "unused"
        yield None, []
        return
    last = max(an.order[x] for x in nodes)
    for n in an.nodes[min(an.order[x] for x in nodes) :]:
        if an.order[n] > last + FINAL_STATE_REACH:
            break  # nothing computed from the subgraph lately: the search is over (and linear)
        if n in derived or not n.all_input_nodes or not _analytic(an, n) or is_inplace(n):
            continue
        if all(x in derived or an.consts.is_const(x) for x in n.all_input_nodes):
            derived.add(n)
            last = max(last, an.order[n])
            val = example_value(n)
            if isinstance(val, torch.Tensor) and val.is_floating_point() and n.users:
                cands.append(n)
    for n in reversed(cands):
        for ls in _letterings(tuple(example_value(n).shape), "bhkv", base.sizes):
            yield n, list(ls)
    yield None, []


def _letterings(shape: tuple, roles: str, sizes: dict) -> list:
    """Ways to name the axes of `shape` by `roles` (each used once; size-1 roles may be
    absent, size-1 axes are '1')."""
    axes = [i for i, s in enumerate(shape) if s != 1]
    must = [c for c in roles if sizes[c] != 1]
    if len(axes) < len(must) or len(axes) > len(roles):
        return []
    res = []
    for perm in itertools.permutations(roles, len(axes)):
        if not set(must) <= set(perm):
            continue
        if all(sizes[c] == shape[a] for c, a in zip(perm, axes)):
            letters = ["1"] * len(shape)
            for c, a in zip(perm, axes):
                letters[a] = c
            res.append("".join(letters))
    return res


# ---- the subgraph -------------------------------------------------------------------------------
def _slice(an: Analyzer, outputs: list, cut: set) -> tuple[set, set, dict]:
    """(nodes, frontier, consts): the nodes between `cut` and `outputs`, the data they read
    that is neither cut nor analytic (placeholders, other ops), and their constants. The
    in-place writes into their memory (through any alias) before the last output belong to
    the computation; later ones (a cache the final state is copied into) do not."""
    stop = max(an.order[o] for o in outputs)

    def writes(n):
        return an.written_between(n, 0, stop)

    nodes, frontier, consts = set(), set(), {}
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in nodes or n in cut or n in frontier or n in consts:
            continue
        if _uninitialized(n):
            consts[n] = "empty"
            stack += writes(n)
            continue
        if an.consts.is_const(n) or _factory(n):
            consts[n] = None
            if _factory(n):  # a buffer the code fills in place
                stack += writes(n)
            continue
        if not _analytic(an, n):
            frontier.add(n)
            continue
        nodes.add(n)
        stack += [x for x in n.all_input_nodes]
        stack += writes(n)
    return nodes, frontier, consts


def _factory(n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in (torch.zeros, torch.ones, torch.full, torch.zeros_like, torch.ones_like, torch.full_like)
    return n.op == "call_method" and n.target in ("new_zeros", "new_ones", "new_full")


def _uninitialized(n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in (torch.empty, torch.empty_like)
    return n.op == "call_method" and n.target in ("new_empty", "empty_like")


_ANALYTIC = {
    "mul", "div", "add", "sub", "rsub", "neg", "matmul", "bmm", "mm", "einsum", "exp", "exp2", "sum",
    "unsqueeze", "squeeze", "permute", "transpose", "reshape", "t", "identity", "expand", "select",
    "narrow", "unbind", "repeat_interleave", "repeat", "getitem", "tril", "triu",
}
_ANALYTIC_FNS = {torch.cumsum, torch.cat, torch.stack, torch.split, torch.chunk, F.pad, torch._C._nn.pad, torch.flip}
_ANALYTIC_METHODS = {"cumsum", "split", "chunk", "flip"}


def _analytic(an: Analyzer, n: fx.Node) -> bool:
    """Ops whose value is an analytic function of their data inputs: no data-dependent branch."""
    if n.op == "call_method" and n.target in _ANALYTIC_METHODS:
        return True
    if n.op == "call_function" and n.target in _ANALYTIC_FNS:
        return n.target not in (F.pad, torch._C._nn.pad) or _constant_pad(n)
    if n.op == "call_function" and n.target is operator.setitem:
        return not any(isinstance(x, fx.Node) for x in _flat(n.args[1]))
    name = op_name(n)
    if name == "getitem":
        return not any(isinstance(x, fx.Node) for x in _flat(n.args[1:]))
    if name in ("masked_fill", "where"):
        mask = n.args[1] if name == "masked_fill" else n.args[0]
        return isinstance(mask, fx.Node) and an.consts.is_const(mask)
    return name in _ANALYTIC


def _constant_pad(n: fx.Node) -> bool:
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    return mode == "constant"


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for i in x for y in _flat(i)]
    if isinstance(x, slice):
        return [x.start, x.stop, x.step]
    return [x]


# ---- the certificate ----------------------------------------------------------------------------
def certify(an: Analyzer, spec: Spec) -> bool:
    """Whether the subgraph from the spec's inputs to its outputs equals the replacement."""
    leaves = spec.leaves()
    cut = set(leaves.values())
    nodes, frontier, consts = _slice(an, spec.outputs(), cut)
    if frontier or any(_symbolic(n) for n in list(nodes) + list(cut)):
        return False
    if not _evaluate(an, consts):
        return False
    key = _structure(an, spec, nodes, consts, leaves)
    if key in _CERTIFIED:
        return _CERTIFIED[key]
    plan = _plan(an, spec, nodes, consts, spec.outputs())
    rewritten = _emission_module(an, plan.spec, plan.shapes)
    counters["gla_inductor"]["certificates_reduced" if plan.reduced else "certificates_full"] += 1
    with _one_thread(plan.reduced):
        ok = all(_agree(plan.original, rewritten, plan.shapes, seed, spec.gate_is_log) for seed in (0, 1))
    if len(_CERTIFIED) > 256:
        _CERTIFIED.clear()
    _CERTIFIED[key] = ok
    return ok


@dataclass
class _Plan:
    """What the certificate runs: the original subgraph, the spec and the inputs' shapes, at
    reduced sizes or at full size."""

    original: fx.GraphModule
    spec: Spec
    shapes: dict  # leaf role -> shape
    reduced: bool


def _plan(an: Analyzer, spec: Spec, nodes: set, consts: dict, outputs: list) -> _Plan:
    """At 2 batches and 2 heads where the subgraph is proven to treat them all alike, else at
    full size; CertificateTooLarge past the memory budget."""
    leaves = spec.leaves()
    reducible = False
    try:
        red = shrink.reduce(spec, nodes, consts, outputs, an.order)
    except shrink.Refuse as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - a reduction not made is only a costlier certificate
        log.info("gla_inductor: the certificate's reduction failed", exc_info=True)
        why = f"the reduction failed ({type(e).__name__})"
    else:
        reducible = True
        need = _bytes(an, nodes, outputs, lambda n: red.numel.get(n, 0), red.shapes, red.consts)
        if need <= CERT_BUDGET_BYTES:
            module = _slice_module(an, nodes, red.consts, leaves, outputs, red.remake)
            return _Plan(module, replace(spec, sizes=red.sizes, gamma=red.gamma), red.shapes, True)
        why = f"even at {shrink.KEEP} batches and heads it needs ~{need / 2**30:.1f} GiB"
    shapes = {r: tuple(example_value(n).shape) for r, n in leaves.items()}
    need = _bytes(an, nodes, outputs, lambda n: _numel(example_value(n)), shapes, consts)
    if need > CERT_BUDGET_BYTES:
        raise CertificateTooLarge(
            f"the float64 certificate needs ~{need / 2**30:.1f} GiB at full size (budget "
            f"{CERT_BUDGET_BYTES / 2**30:.1f} GiB), and fewer batches and heads will not do: {why}", reducible)
    return _Plan(_slice_module(an, nodes, consts, leaves, outputs), spec, shapes, False)


@contextlib.contextmanager
def _one_thread(on: bool):
    """At reduced sizes the certificate is thousands of small ops (the reference recurrence
    steps through time): intra-op threads only synchronize, and on a busy host that made it
    ~50x slower (3 s -> 200 s at Mamba2 1.3B sizes, 2 threads, load 3 on 2 cores)."""
    saved = torch.get_num_threads()
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if on:
            torch.set_num_threads(saved)


def _bytes(an: Analyzer, nodes: set, outputs: list, numel, shapes: dict, consts: dict) -> int:
    """Estimated float64 memory of a certificate: the inputs (twice: the replacement lifts
    them), the constants and the original's live intermediates at their peak."""
    inputs = 2 * sum(math.prod(s) for s in shapes.values())
    fixed = sum(c.numel() for c in consts.values() if isinstance(c, torch.Tensor))
    order = sorted(nodes, key=an.order.__getitem__)
    fused = {n for n in order if summed_products.summed_product(n) and n not in outputs and set(n.users) <= nodes}
    held = lambda n: 0 if n in fused else numel(n)  # noqa: E731 - the product is never materialized
    return 8 * (inputs + fixed) + shrink.peak_bytes(order, held, outputs)


def _numel(val) -> int:
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _evaluate(an: Analyzer, consts: dict) -> bool:
    """Fill in the constants' values; memory the code allocates without initializing is NaN,
    so that a computation reading it cannot be certified."""
    for n in consts:
        val = example_value(n)
        if consts[n] == "empty" or n.op == "call_function" and n.target is torch.empty:
            consts[n] = torch.full(tuple(val.shape), float("nan"), dtype=val.dtype)
        else:
            consts[n] = an.consts.evaluate(n)
        if consts[n] is None and isinstance(val, torch.Tensor):
            return False
    return True


def _symbolic(n: fx.Node) -> bool:
    val = example_value(n)
    if isinstance(val, torch.Tensor):
        return any(not isinstance(s, int) for s in val.shape)
    return isinstance(val, (torch.SymInt, torch.SymFloat))


def _structure(an: Analyzer, spec: Spec, nodes: set, consts: dict, leaves: dict) -> tuple:
    """A key equal for subgraphs that compute the same thing on same-shaped inputs (the
    layers of a model): ops, arguments and constants' values, up to node names."""
    index = {n: ("leaf", role) for role, n in leaves.items()}
    for n, val in consts.items():
        index[n] = ("const", _digest(val))
    rows = []
    for n in sorted(nodes, key=an.order.__getitem__):
        index[n] = ("node", len(rows))
        val = example_value(n)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        args = fx.node.map_arg((n.args, n.kwargs), lambda x: index.get(x, ("ext", x.name)))
        rows.append((n.op, str(n.target), repr(args), shape))
    lf = [(r, x.letters, x.select, x.unflatten) for r, x in (("q", spec.q), ("k", spec.k), ("v", spec.v), ("g", spec.g)) if x]
    shapes = tuple((r, tuple(example_value(n).shape)) for r, n in leaves.items())
    outs = (index.get(spec.out), tuple(spec.out_groups), index.get(spec.final), tuple(spec.final_groups))
    gate = (spec.gate, spec.gate_is_log, spec.gamma)
    return (tuple(rows), tuple(lf), shapes, outs, tuple(spec.h0_groups), gate, spec.scale)


def _digest(val) -> tuple:
    if isinstance(val, torch.Tensor):
        data = val.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return (tuple(val.shape), str(val.dtype), hashlib.sha1(data).hexdigest())
    return (repr(val),)


def _slice_module(an: Analyzer, nodes: set, consts: dict, leaves: dict, outputs: list,
                  remake: Optional[dict] = None) -> fx.GraphModule:
    """The subgraph as a module of the leaves; `remake`: nodes rebuilt with other arguments
    (op, target, args, kwargs), the sizes of the reduced certificate."""
    g = fx.Graph()
    root = torch.nn.Module()
    env: dict = {}
    for role, n in leaves.items():
        env[n] = g.placeholder(role)
    for i, (n, val) in enumerate(consts.items()):
        if isinstance(val, torch.Tensor):
            root.register_buffer(f"c{i}", val.double() if val.is_floating_point() else val)
            env[n] = g.get_attr(f"c{i}")
        else:
            env[n] = val
    for n in sorted(nodes, key=an.order.__getitem__):
        if remake and n in remake:
            op, target, args, kwargs = fx.node.map_arg(remake[n], env.__getitem__)
            env[n] = g.create_node(op, target, args, kwargs)
        else:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    return summed_products.fuse(fx.GraphModule(root, g))


def _emission_module(an: Analyzer, spec: Spec, shapes: dict) -> fx.GraphModule:
    """The replacement alone, on placeholders for the spec's inputs of the given shapes."""
    g = fx.Graph()
    nodes = {}
    for role, n in spec.leaves().items():
        nodes[role] = g.placeholder(role)
        val = example_value(n)
        if tuple(val.shape) != shapes[role]:
            with _fake_mode(an.graph):
                val = torch.empty(shapes[role], dtype=val.dtype, device=val.device)
        nodes[role].meta["example_value"] = val
    out = g.output(None)
    em = Emitter(Transaction(g), out, spec.sizes, spec.splits)
    outs = emit(em, spec, nodes)
    out.args = (tuple(x for x in outs if x is not None),)
    return fx.GraphModule(torch.nn.Module(), g)


def _agree(original, rewritten, shapes: dict, seed: int, gate_is_log: bool = True) -> bool:
    gen = torch.Generator().manual_seed(seed)
    args = []
    for role, shape in shapes.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if role == "g":  # a log decay per step: negative, away from 0 and from -inf
            x = -(torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
            x = x if gate_is_log else x.exp()
        args.append(x)
    try:
        want = _F64(original).run(*args)
        got = _F64(rewritten).run(*args)
    except Exception:  # noqa: BLE001 - a reading that does not even run is not certified
        return False
    for w, x in zip(want, got):
        if not isinstance(w, torch.Tensor) or w.shape != x.shape or not torch.isfinite(w).all():
            return False
        scale = w.abs().max().clamp_min(1e-30)
        if not ((x.double() - w.double()).abs().max() / scale).item() <= CERT_RTOL:
            return False
    return True


def _f64(x):
    return torch.float64 if isinstance(x, torch.dtype) and x.is_floating_point else x


class _F64(fx.Interpreter):
    """Runs a graph in float64: casts and factories to other float types go to float64, and
    the GLA op is the naive reference recurrence."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.gla_inductor.chunk_fwd.default:
            return _reference(*args)
        return super().call_function(target, tuple(map(_f64, args)), {k: _f64(v) for k, v in kwargs.items()})

    def call_method(self, target, args, kwargs):
        if target in ("float", "half", "bfloat16"):
            target = "double"
        return super().call_method(target, tuple(map(_f64, args)), {k: _f64(v) for k, v in kwargs.items()})


def _reference(q, k, v, g, g_gamma, h0, scale, output_final_state, reverse):
    from ..reference import naive_recurrent_gla

    return naive_recurrent_gla(
        q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=h0, output_final_state=True, reverse=reverse
    )


# ---- the replacement ----------------------------------------------------------------------------
def emit(em: Emitter, spec: Spec, nodes: dict, shared: Optional[dict] = None) -> tuple:
    """Insert the GLA op for `spec` on `nodes` (role -> node); (o, final state) as the user's.
    `shared` (``_shared_qk``): q and k given as the tensors their leaves repeat over the heads."""

    def lift(lf: LFactor, role: str, letters: str, full: bool = True, node=None):
        return em.lift(Group(1.0, (replace(lf, node=nodes[role] if node is None else node),)), letters, full=full)

    if shared:  # [B, T, G, K]: the op reads head h's q and k at h // (H // G)
        q, k = (lift(getattr(spec, r), r, "bthk", node=_unrepeated(em, shared[r])) for r in ("q", "k"))
    else:
        q, k = lift(spec.q, "q", "bthk"), lift(spec.k, "k", "bthk")
    v = lift(spec.v, "v", "bthv")
    g = g_gamma = None
    if spec.g is not None:
        letters = {"scalar": "bth", "vector": "bthk", "constant": "h"}[spec.gate]
        gate = em.as_float32(lift(spec.g, "g", letters, full=False))
        gate = em.expand_to(gate if spec.gate_is_log else em.call(torch.log, gate), letters)
        g, g_gamma = (None, gate) if spec.gate == "constant" else (gate, None)
    elif spec.gamma is not None:
        device = example_value(q).device
        g_gamma = em.call(torch.tensor, list(spec.gamma), dtype=torch.float32, device=device)
    h0 = None
    if spec.h0 is not None:
        h0 = em.as_float32(em.relayout(nodes["h0"], spec.h0_groups, "bhkv"))
    op = em.call(torch.ops.gla_inductor.chunk_fwd.default, q, k, v, g, g_gamma, h0, float(spec.scale), True, False)
    o = _as(em, em.relayout(em.call(operator.getitem, op, 0), "bthv", spec.out_groups), spec.out)
    ht = None
    if spec.final is not None:
        ht = _as(em, em.relayout(em.call(operator.getitem, op, 1), "bhkv", spec.final_groups), spec.final)
    else:
        op.update_arg(7, False)
    return o, ht


# ---- grouped heads ------------------------------------------------------------------------------
# Mamba2 shares C and B (q and k) across groups of heads and repeats them over the heads before the
# scan: x.repeat_interleave(r, dim=heads), or x[..., None, :].expand(.., r, ..).reshape(..), then pads
# and casts. The op reads q and k shared ([B, T, G, K], head h reads h // r), so the emission passes
# x instead of the repeated leaf. Values are unchanged: the certificate proved the subgraph equal to
# the op on the repeated leaves (it runs the emission on them), and the op on x is by definition the
# op on x repeated; only the repeat is no longer materialized.


@dataclass(frozen=True)
class _Shared:
    """A q or k leaf as `steps` applied to `x` repeated `repeats` times over the head axis."""

    x: fx.Node
    squeeze: Optional[int]  # expand + reshape: x's size-1 axis after the head axis, dropped
    steps: tuple  # nodes acting alike on every head (casts, pads of other axes), innermost first
    repeats: int


def _shared_qk(an: Analyzer, spec: Spec, anchor: fx.Node) -> Optional[dict]:
    """{"q": _Shared, "k": _Shared} when both leaves repeat tensors over the heads alike, and
    nothing writes into those tensors before the op reads them (at `anchor`); else None."""
    found = {r: _shared(getattr(spec, r)) for r in ("q", "k")}
    if any(s is None for s in found.values()) or found["q"].repeats != found["k"].repeats:
        return None
    for s in found.values():
        if any(an.written_between(n, an.order[n] + 1, an.order[anchor]) for n in (s.x, *s.steps)):
            return None
    return found


def _shared(lf: LFactor) -> Optional[_Shared]:
    if lf.select or lf.unflatten or lf.letters.count("h") != 1:
        return None
    axis, node, steps = lf.letters.index("h"), lf.node, []
    while True:
        if _repeat_args(node)[1] == 1:  # x.repeat_interleave(1) is x: nothing to redo
            node = node.args[0]
        elif _per_head(node, axis):
            steps.append(node)
            node = node.args[0]
        else:
            break
    found = _repeat_of(node, axis)
    if found is None:
        return None
    x, squeeze, repeats = found
    return _Shared(x, squeeze, tuple(reversed(steps)), repeats)


_CASTS = {"to", "float", "double", "half", "bfloat16", "contiguous", "clone"}


def _per_head(n: fx.Node, axis: int) -> bool:
    """Whether n maps its first input alike on every index of `axis` (so it commutes with a repeat
    over it): a cast or copy, or a constant pad that leaves that axis alone."""
    if not (n.args and isinstance(n.args[0], fx.Node)) or any(isinstance(a, fx.Node) for a in _flat(
            list(n.args[1:]) + list(n.kwargs.values()))):
        return False
    if n.op == "call_method":
        return n.target in _CASTS
    if n.op != "call_function" or n.target not in (F.pad, torch._C._nn.pad) or not _constant_pad(n):
        return False
    pads, val = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad"), example_value(n)
    if not isinstance(val, torch.Tensor):
        return False
    j = val.dim() - 1 - axis  # F.pad lists the last axis first
    return isinstance(pads, (list, tuple)) and all(p == 0 for p in pads[2 * j : 2 * j + 2])


def _repeat_of(n: fx.Node, axis: int) -> Optional[tuple]:
    """(x, squeeze, r) where n is x repeated r > 1 times over `axis`, each head r times in a row."""
    out = example_value(n)
    if not isinstance(out, torch.Tensor):
        return None
    if op_name(n) == "repeat_interleave":
        x, r, dim = _repeat_args(n)
        if not (r > 1 and type(dim) is int and isinstance(example_value(x), torch.Tensor)) or dim % out.dim() != axis:
            return None
        want = out.shape[:axis] + (out.shape[axis] // r,) + out.shape[axis + 1 :]
        return (x, None, r) if tuple(example_value(x).shape) == tuple(want) else None
    return _expand_merge(n, axis)


def _repeat_args(n: fx.Node) -> tuple:
    """(x, repeats, dim) of x.repeat_interleave(repeats, dim), repeats 0 unless a Python int; else
    (None, 0, None)."""
    if op_name(n) != "repeat_interleave" or not n.args or not isinstance(n.args[0], fx.Node):
        return None, 0, None
    r = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
    return n.args[0], r if type(r) is int else 0, dim


def _expand_merge(n: fx.Node, axis: int) -> Optional[tuple]:
    """(y, axis + 1, r) where n is y [.., G, 1, ..] expanded to [.., G, r, ..] and reshaped to
    [.., G * r, ..]: the reshape merges exactly those two axes, so head h is y's h // r."""
    if op_name(n) != "reshape" or not isinstance(n.args[0], fx.Node):
        return None
    m = n.args[0]
    while op_name(m) == "identity" and m.args and isinstance(m.args[0], fx.Node):
        m = m.args[0]
    if op_name(m) != "expand" or not m.args or not isinstance(m.args[0], fx.Node):
        return None
    if not all(isinstance(example_value(x), torch.Tensor) for x in (n, m, m.args[0])):
        return None
    y, out = m.args[0], tuple(example_value(n).shape)
    ys, es = tuple(example_value(y).shape), tuple(example_value(m).shape)
    r = es[axis + 1] if len(es) == len(ys) == len(out) + 1 else 0
    merged = es[:axis] + (es[axis] * r,) + es[axis + 2 :] == out
    if not (merged and r > 1 and ys[axis + 1] == 1 and ys[:axis + 1] + ys[axis + 2 :] == es[:axis + 1] + es[axis + 2 :]):
        return None
    return y, axis + 1, r


def _unrepeated(em: Emitter, s: _Shared) -> fx.Node:
    """The leaf's computation without the repeat: x, then the same casts and pads."""
    node = s.x if s.squeeze is None else em.call(torch.squeeze, s.x, s.squeeze)
    for n in s.steps:
        node = em.call(n.target, node, *n.args[1:], op=n.op, **n.kwargs)
    return node


def _local_writes(an: Analyzer, nodes: set, consts: dict, outputs: list) -> list:
    """The in-place writes of the computation; each into memory that only it sees (the outputs
    aside, whose users the rewrite points at the op's)."""
    writes = [n for n in nodes if is_inplace(n)]
    inside = nodes | set(consts)
    for w in writes:
        for a in (a for t in written_args(w) for a in an.aliases(t)):
            if a not in inside or a not in outputs and any(u not in inside for u in a.users):
                raise Reject("the chunked computation writes into a tensor read elsewhere")
    return writes


def _as(em: Emitter, node: fx.Node, like: fx.Node) -> fx.Node:
    want = example_value(like).dtype
    return em.call("to", node, want, op="call_method") if example_value(node).dtype != want else node


def _match(an: Analyzer, spec: Spec) -> Match:
    deps = list(spec.leaves().values())
    anchor = min(spec.outputs(), key=an.order.__getitem__)
    late = [d.name for d in deps if an.order[d] >= an.order[anchor]]
    if late:
        raise Reject(f"inputs {late} are computed after the output")
    nodes, _, consts = _slice(an, spec.outputs(), set(deps))
    writes = _local_writes(an, nodes, consts, spec.outputs())
    if any(an.order[w] > an.order[anchor] for w in writes):
        raise Reject("the chunked computation writes into its output after computing it")
    placement.check_unmodified(an, deps, an.order[anchor])
    if spec.h0 is not None and placement.written_after(an, spec.h0, anchor):
        if any(placement.requires_grad(d) for d in deps) and torch.is_grad_enabled():
            raise Reject("the initial state is overwritten in place while gradients are needed")

    shared = _shared_qk(an, spec, anchor)

    def apply(txn) -> None:
        em = Emitter(txn, anchor, spec.sizes, spec.splits)
        o, ht = emit(em, spec, spec.leaves(), shared)
        txn.replace_all_uses(spec.out, o)
        if ht is not None:
            txn.replace_all_uses(spec.final, ht)
        txn.erase += writes  # the buffers the naive code filled are dead now

    shapes = {c.upper(): spec.sizes.get(c, 1) for c in "bthkv"}
    match = Match("chunked", spec.gate, spec.q.letters, shapes, spec.outputs(), apply,
                  {"initial_state": spec.h0 is not None, "scale": spec.scale})
    match.covers = nodes
    return match

