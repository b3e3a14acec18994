"""Chunk loops: a Python loop over chunks of the sequence, unrolled by Dynamo, that carries a
state S across chunks; each chunk's output is its intra-chunk attention under a decay mask
plus the read of S, and the outputs are assembled (list + cat or stack, or written into a
buffer). FLA's naive chunk references, RetNet's chunkwise retention, and the like.

The chunks' outputs are found as intra-chunk monomials (``intra_chunk.py``) that an assembly
collects; q, k and v are the tensors all chunks slice theirs from; the whole loop, from those
tensors to the assembled output and the last state, is then certified like any chunked
computation (``chunk_candidate.complete``), so the chunk boundaries, a partial last chunk, the
order of the outputs and the decay are all checked at once, by value.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..certify.certificate import CertificateTooLarge, first_too_large
from ..certify.spec import Spec
from ..certify.subgraph import subgraph
from ..core.analyzer import Analyzer
from ..core.assembly import find_outputs
from ..core.consts import example_value
from ..core.emit import LFactor
from ..core.match import Match, Reject
from ..core.op_names import VIEW_OPS, op_name
from . import fallback, table_gate
from .chunk_candidate import MAX_CANDIDATES, complete, letterings, match_of, module_state_reads
from .intra_chunk import batch_letters, role_sizes

MAX_SOURCE_DEPTH = 6  # views between a chunk's slice and the tensor it is cut from


def find(an: Analyzer, seeds: dict) -> list:
    """(assembly, chunk outputs read as intra-chunk monomials) for each assembly of two or
    more such outputs (a last chunk of one step has no decay mask to read: the certificate
    covers it all the same), or of one alone: a loop that ran once (T = C), whose zero state
    read left a parallel form with a gate input the parallel forms cannot prove."""
    loops = []
    for asm in find_outputs(an):
        found = [e for e in asm.elements if e in seeds]
        if len(found) >= 2 or len(found) == len(asm.elements) == 1 and asm.kind in ("cat", "stack"):
            loops.append((asm, found))
    return loops


def analyze(an: Analyzer, asm, elems: list) -> Match:
    """elems: (node, term, roles) per chunk read as a monomial, in assembly order."""
    _, term, r = elems[0]
    sources = {role: _source(an, [getattr(e[2], role).atom.node for e in elems]) for role in "qkv"}
    out = _output(an, asm)
    too_large = None
    for batch in batch_letters(r):
        sizes = role_sizes(an, r, batch)
        sizes["t"] = _length(sources["q"][-1], sizes)
        for q, k, v in _leaf_options(sources, sizes):
            for out_letters in letterings(tuple(example_value(out).shape), "bthv", sizes):
                base = Spec(q, k, v, None, "none", None, [], out, list(out_letters), None, [], term[0], sizes)
                try:
                    return _match(an, complete(an, base, tables_gate=True), elems[0])
                except CertificateTooLarge as e:
                    too_large = first_too_large(too_large, e)
                except Reject:
                    continue
    raise too_large or Reject("no reading of the chunk loop as GLA was certified")


def _match(an: Analyzer, spec: Spec, first) -> Match:
    """The rewrite of a certified loop; where it reads decay tables from module state, with the
    gate computed from them in the graph and the tables guarded (``table_gate.py``)."""
    reads = module_state_reads(an, spec)
    if not reads:
        return match_of(an, spec)
    if spec.gamma is None:
        raise Reject("the chunk loop reads module state besides its gate input: a change after compiling "
                     "would not reach the op")
    _, term, roles = first
    tg = table_gate.read(an, term, roles, spec.gamma, reads)
    checks = fallback.Checks()
    m = match_of(an, spec, lambda em: table_gate.emit(em, an, tg, checks))
    nodes, _, consts = subgraph(an, spec.outputs(), set(spec.leaves().values()), static=True)
    return fallback.guarded(m, spec.outputs(), nodes | set(consts), checks)


def _length(q: fx.Node, sizes: dict) -> int:
    """The sequence length: what the tensor the chunks cut q from (the nearest; a fused
    projection further up holds k and v too) holds besides B, H, K."""
    value = example_value(q)
    if not isinstance(value, torch.Tensor):  # the chunks come out of a split()'s tuple
        raise Reject("the chunks' source of q is not one [B, T, H, K] tensor")
    numel = value.numel()
    rest = sizes["b"] * sizes["h"] * sizes["k"]
    if not isinstance(numel, int) or numel % rest:
        raise Reject("the chunks' source of q is not [B, T, H, K]")
    return numel // rest


def _output(an: Analyzer, asm) -> fx.Node:
    """The assembled output over the whole time axis: the cat, or the one view that
    flattens the stacked or written chunks."""
    if asm.kind == "cat":
        return asm.result
    last = max(asm.setitems, key=an.order.__getitem__) if asm.kind == "setitem" else asm.result
    writes = set(asm.setitems)
    users = [u for u in asm.result.users if u not in writes]
    if len(users) != 1 or op_name(users[0]) != "reshape" or an.order[users[0]] < an.order[last]:
        raise Reject("the chunk outputs are not flattened back into one sequence")
    return users[0]


def _source(an: Analyzer, atoms: list) -> list:
    """The tensors every chunk's input is cut from (through views), outermost first."""
    chains = [_ancestors(a) for a in atoms]
    common = [n for n in chains[0] if all(n in c for c in chains[1:])]
    if not common:
        raise Reject("the chunks do not slice their inputs from one tensor")
    return common[::-1]


def _ancestors(node: fx.Node) -> list:
    res = [node]
    for _ in range(MAX_SOURCE_DEPTH):
        x = res[-1]
        if not (op_name(x) in VIEW_OPS or _is_split(x)) or not x.args or not isinstance(x.args[0], fx.Node):
            break
        res.append(x.args[0])
    return res


def _is_split(n: fx.Node) -> bool:
    """x.split(...) or torch's x.chunk(...) (an op of that name): pieces the loop may slice."""
    return n.op in ("call_function", "call_method") and getattr(n.target, "__name__", n.target) in ("split", "chunk")


def _leaf_options(sources: dict, sizes: dict):
    """(q, k, v) LFactors: the outermost sources whose shapes read as [B, T, H, D]."""
    options = {}
    for role, d in (("q", "k"), ("k", "k"), ("v", "v")):
        options[role] = [
            LFactor(n, ls)
            for n in sources[role]
            if isinstance(example_value(n), torch.Tensor)
            for ls in letterings(tuple(example_value(n).shape), "bht" + d, sizes)
        ]
        if not options[role]:
            raise Reject(f"no tensor the chunks cut their {role} from reads as [B, T, H, D]")
    n = 0
    for q in options["q"]:
        for k in options["k"]:
            for v in options["v"]:
                n += 1
                if n > MAX_CANDIDATES:
                    return
                yield q, k, v
