"""Chunk state loops: a Python loop over chunks (unrolled by Dynamo) that carries a matrix state
``S = S * d + X_i``, each ``X_i`` a sum over the chunk's positions of k^T v products, where the
rest of the loop reads the states through code that is not GLA (torchscale's chunkwise
retention divides each state by a clamped maximum of its absolute column sums and aligns the
intra-chunk scores with it by ``torch.maximum``).

The outputs are no GLA output then, but the states are GLA's states at the chunk boundaries,
whatever reads them: the state recurrence is linear, and its n links are one computation over
the chunk axis. The rewrite computes the states entering every chunk at once and leaves every
read of them as the user wrote it. With Y = stack(S_0, X_0, ..., X_(n-1)) and one decay d for
every chunk, S_m = sum_(j <= m) d ** (m - j) Y_j: batched matmuls with matrices of powers of d,
within blocks of about sqrt(n) chunks and then over the blocks (``_decay_matrix``); with a decay
per chunk, a Hillis-Steele scan (log2(n) shifted multiply-adds); without a decay, a cumsum. Only
running products of the decays (no division by them, no log), every op differentiable. What the
states look like is checked by structure (the links, the increments computed before and apart
from the states), the rewrite itself by a float64 trial against the user's links
(``certify/trial.py``), as the other rewrites that keep user code around them.

Only loops whose states are read through code that is not linear in them (abs, clamps, maxima,
a division by a value computed from the state) are candidates: where every read is linear, the
loop is GLA as a whole or not at all, and the chunked form decides (with its reasons).

Near misses: an increment computed from the states (``k^T (v - k S)``, a delta rule), a decay
computed from the state, decays of different shapes per chunk, a state carried by another op of
it (``A @ S``), in-place writes. Chains whose
increments are not sums of products over a chunk's positions (a time loop's k_t^T v_t, any
other linear recurrence) are not candidates here: the time-loop form reads those.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ..certify import trial
from ..core.algebra import comps, factor_vars, mono_vars, out_vars
from ..core.analyzer import Analyzer
from ..core.consts import example_value, written_args
from ..core.emit import Emitter
from ..core.match import Match, NearMiss, Reject
from ..core.op_names import VIEW_OPS, is_pointwise, op_name

FORM = "chunk_states"
MIN_LINKS = 2  # a loop of one chunk carries nothing into a later chunk
MAX_HOIST_DEPTH = 6  # ops between an increment computed late in the graph and what it reads
_HOISTABLE = VIEW_OPS | {"matmul", "bmm", "mm", "einsum", "sum"}  # (and pointwise ops): deterministic

DELTA_RULE = ("the chunk state's increment X_i of S = S * d + X_i is computed from the state itself "
              "(a delta-rule correction such as k^T (v - k S)): the states are no GLA states")
DECAY_READS_STATE = "the decay of the chunk state S = S * d + X_i is computed from the state itself: not GLA"
DECAY_SHAPES = ("the decays of the chunk state S = S * d_i + X_i differ in shape or kind between chunks: "
                "no one decay per chunk to carry")


@dataclass(frozen=True)
class Link:
    """S_next = carried * decay + inc; decay None where the state is carried undecayed."""

    node: fx.Node
    carried: fx.Node
    decay: Any
    inc: fx.Node
    mul: Optional[fx.Node]


def recognize(an: Analyzer) -> tuple[list[Match], list[NearMiss]]:
    matches, near = [], []
    readings = {n: r for n in an.nodes for r in (_readings(n),) if r}
    for chain in _chains(readings):
        after = _descendants(chain[0].node)
        chunked = [link.inc in after or _sums_products(an, link.inc, after) for link in chain]
        if not all(chunked) or all(link.inc in after for link in chain):
            continue  # not a chunk state (a time loop's outer product, a residual stream, ...)
        if not any(_read_nonlinearly(link.node, after) for link in chain):
            continue  # GLA as a whole or not at all: the chunked form's (and its reasons)
        try:
            matches.append(_analyze(an, chain, after))
        except Reject as e:
            near.append(NearMiss(FORM, str(e), [link.node for link in chain]))
    return matches, near + _carried_otherwise(an, readings)


# ---- the links ------------------------------------------------------------------------------------
def _shape(x) -> Optional[tuple]:
    """x's static shape; None for symbolic sizes (the certificate proves one size: no candidate)."""
    val = example_value(x)
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return tuple(val.shape)


def _readings(n: fx.Node) -> list:
    """The ways the add node n reads as a link S_next = S * d + X (several where the operands'
    shapes allow; the chain decides)."""
    if op_name(n) != "add" or n.kwargs or len(n.args) != 2 or not all(isinstance(a, fx.Node) for a in n.args):
        return []
    shape = _shape(n)
    if shape is None or len(shape) < 2:
        return []
    found = []
    for c, x in (n.args, n.args[::-1]):
        if _shape(x) != shape or _shape(c) != shape:
            continue
        if op_name(c) == "mul" and len(c.args) == 2 and not c.kwargs:
            found += [Link(n, _uncast(p), d, x, c) for p, d in (c.args, c.args[::-1])
                      if isinstance(p, fx.Node) and _shape(p) == shape]
        found.append(Link(n, _uncast(c), None, x, None))
    return found


def _uncast(x: fx.Node) -> fx.Node:
    """x through casts and copies that keep its value (``S.float()`` of a float32 S, ``clone``)."""
    while op_name(x) == "identity" and x.args and isinstance(x.args[0], fx.Node) and _same_value(x, x.args[0]):
        x = x.args[0]
    return x


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    va, vb = example_value(a), example_value(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


def _chains(readings: dict) -> list:
    """Maximal chains of links, each carrying the one before it, of MIN_LINKS or more."""
    pred = {}
    for n, rs in readings.items():
        linked = sorted((r for r in rs if r.carried in readings), key=lambda r: r.decay is None)
        if linked:  # (a decayed reading first: in X + S * d, X may be a sum too)
            pred[n] = linked[0]
    succ: dict = {}
    for n, link in pred.items():
        succ.setdefault(link.carried, []).append(n)
    chains = []
    for start in readings:
        if start in pred and len(succ.get(pred[start].carried, ())) == 1:
            continue  # inside a chain
        nodes = [start]
        while len(succ.get(nodes[-1], ())) == 1:
            nodes.append(succ[nodes[-1]][0])
        if len(nodes) >= MIN_LINKS:  # (a start carrying a state that two updates read: from that state)
            first = pred.get(start) or _first_link(readings[start], pred[nodes[1]])
            chains.append([first] + [pred[n] for n in nodes[1:]])
    return chains


def _first_link(readings: list, second: Link) -> Link:
    """The reading of the chain's first link that decays as the second does."""
    def like(r: Link) -> bool:
        if second.decay is None or r.decay is None:
            return second.decay is None and r.decay is None
        return r.decay is second.decay or _shape(r.decay) == _shape(second.decay)
    return next((r for r in readings if like(r)), readings[0])


def _descendants(start: fx.Node) -> set:
    """Every node computed from `start`."""
    found, stack = {start}, [start]
    while stack:
        for u in stack.pop().users:
            if u not in found:
                found.add(u)
                stack.append(u)
    return found


_NONLINEAR = {"abs", "clamp", "clamp_min", "clamp_max", "max", "amax", "min", "amin", "maximum", "minimum", "norm",
              "sqrt", "rsqrt", "exp", "log", "tanh", "sigmoid", "softmax", "relu", "reciprocal", "square", "pow",
              "sign", "where", "gelu", "silu", "softplus"}
READ_DEPTH = 3  # ops from a state to the normalization that reads it (a detach or a view between)


def _read_nonlinearly(state: fx.Node, after: set) -> bool:
    """Whether code after the state reads it through a function that is not linear in it (abs, a
    clamp, a maximum, a product or quotient of two values computed from it): a normalization no
    other form reads, which leaves the states as the only GLA in the loop."""
    frontier, seen = [state], {state}
    for _ in range(READ_DEPTH):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                name = getattr(u.target, "__name__", u.target) if u.op in ("call_function", "call_method") else None
                both = op_name(u) in ("mul", "div") and all(isinstance(a, fx.Node) and a in after for a in u.args[:2])
                if name in _NONLINEAR or both:
                    return True
                nxt.append(u)
        frontier = nxt
    return False


def _carried_otherwise(an: Analyzer, readings: dict) -> list:
    """Near misses for chunk states carried by another op of the state than a product with a
    decay (``S = A @ S + X_i``, ``S = tanh(S) + X_i``): MIN_LINKS or more such updates whose
    increments are chunk products."""
    found = []
    for n, rs in readings.items():
        for r in rs:
            c = r.carried
            if r.decay is not None or c in readings or op_name(c) == "mul" or c.op not in ("call_function",
                                                                                           "call_method"):
                continue
            prev = [p for p in c.all_input_nodes if p in readings and _shape(p) == _shape(n)]
            if prev and _sums_products(an, r.inc, _descendants(prev[0])):
                found.append((n, c))
                break
    after = _descendants(found[0][0]) if found else set()
    if len(found) < MIN_LINKS or not any(_read_nonlinearly(n, after) for n, _ in found):
        return []
    op = getattr(found[0][1].target, "__name__", found[0][1].target)
    return [NearMiss(FORM, f"the chunk state is carried to the next chunk by {op} of the state ({found[0][1].name}), "
                     "not multiplied by a decay: S = f(S) + X_i is no GLA state update", [n for n, _ in found])]


def _sums_products(an: Analyzer, x: fx.Node, after: set) -> bool:
    """x is (a term of) sum_c k[c, K] v[c, V] over positions c of a chunk (more than one): two
    inputs computed before the states, contracted over an axis, one holding the state's K axis
    and the other its V axis; the axis a chunk's positions (``_positions``), or every axis of x
    one of the factors' (a sum over the heads broadcast back over them is one update shared by
    the heads, no chunk's)."""
    av = an.value(x)
    if av is None or len(av.out) < 2:
        return False
    if _opaque(av, x) and op_name(x) in VIEW_OPS and x.args and isinstance(x.args[0], fx.Node):
        src = x.args[0]  # a chunk cut from all chunks' products (kv[:, i]): read the products
        return _shape(src) is not None and _shape(src)[-2:] == _shape(x)[-2:] and _sums_products(an, src, after)
    ka, va = set(comps(av.out[-2])), set(comps(av.out[-1]))
    out = out_vars(av.out)
    for term in av.terms:
        summed = mono_vars(term) - out
        whole = out <= mono_vars(term)  # (no axis broadcast after the sum: one update per head)
        atoms = [f for f in term[1] if f.kind == "atom" and f.atom.node not in after]
        for a, b in itertools.permutations(atoms, 2):
            shared = factor_vars(a) & factor_vars(b) & summed
            if (ka and va and ka <= factor_vars(a) and va <= factor_vars(b)
                    and any(isinstance(an.sizes.get(v), int) and an.sizes[v] > 1
                            and (whole or _positions(a, v, out) or _positions(b, v, out))
                            for v in shared)):
                return True
    return False


def _positions(f, var: int, out: set) -> bool:
    """The summed variable `var` runs over the positions of one chunk in factor f: the inner part
    of an axis split into (chunk, position) whose chunk is kept (all chunks' products at once), or
    an axis f is sliced along (one chunk cut from the sequence). A sum over heads or features is
    neither (a time loop's update shared by the heads)."""
    for axis, entry in zip(f.atom.free_axes(), f.idx):
        cs = comps(entry)
        if var not in cs:
            continue
        if len(cs) > 1 and any(c in out for c in cs[:cs.index(var)]):
            return True
        return axis in _sliced_axes(f.atom.node)
    return False


def _sliced_axes(node: fx.Node) -> set:
    """The axes of node that cut a range of its source's axis (x[:, s:e], narrow, split pieces)."""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None:
        return set()
    if op_name(node) == "narrow":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return {dim % len(_shape(node))} if isinstance(dim, int) and _shape(node) else set()
    if op_name(node) != "getitem":
        return set()
    if src.op in ("call_function", "call_method") and getattr(src.target, "__name__", src.target) in ("split", "chunk"):
        dim = src.kwargs.get("dim", src.args[2] if len(src.args) > 2 else 0)
        return {dim % len(_shape(node))} if isinstance(dim, int) and _shape(node) else set()
    return _getitem_sliced(node, src)


def _getitem_sliced(node: fx.Node, src: fx.Node) -> set:
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    shape, base = _shape(node), _shape(src)
    if shape is None or base is None or any(not isinstance(i, (int, slice, type(None), type(...))) for i in index):
        return set()
    consumed = sum(1 for i in index if i is not None and i is not ...)
    found, a_in, a_out = set(), 0, 0
    for i in index:
        if i is ...:
            a_in, a_out = a_in + len(base) - consumed, a_out + len(base) - consumed
        elif i is None:
            a_out += 1
        elif isinstance(i, int):
            a_in += 1
        else:
            if shape[a_out] < base[a_in]:
                found.add(a_out)
            a_in, a_out = a_in + 1, a_out + 1
    return found


def _opaque(av, x: fx.Node) -> bool:
    """The value read as the node itself (the normal form does not expand it)."""
    return len(av.terms) == 1 and len(av.terms[0][1]) == 1 and av.terms[0][1][0].kind == "atom" \
        and av.terms[0][1][0].atom.node is x


# ---- the candidate --------------------------------------------------------------------------------
def _analyze(an: Analyzer, chain: list, after: set) -> Match:
    if any(link.inc in after for link in chain):
        raise Reject(DELTA_RULE)
    decays = [link.decay for link in chain]
    if any(isinstance(d, fx.Node) and d in after for d in decays):
        raise Reject(DECAY_READS_STATE)
    uniform = all(d is decays[0] or _same_number(d, decays[0]) for d in decays)
    if not uniform and not _stackable(decays):
        raise Reject(DECAY_SHAPES)
    _check_types(chain)
    anchor = chain[0].node
    outputs = [link.node for link in chain if _read_outside(link.node, chain)]
    if not outputs:
        raise Reject("no state of the chunk loop is read outside the loop's own updates")
    roots: dict = {}
    _hoist_plan(an, [chain[0].carried] + [link.inc for link in chain] + [d for d in decays if isinstance(d, fx.Node)],
                anchor, roots)
    match = _match(an, chain, outputs, uniform, anchor)
    _check_writes(an, chain, roots)
    # (constants, the zero first state among them, stay constants: the user's links fold them too)
    leaves = [r for r in roots if not (an.consts.is_const(r) or an.consts.is_static(r))]
    why = trial.certify(an, match, leaves, outputs)
    if why is not None:
        raise Reject(f"the chunk states' scan was not certified: {why}")
    return match


def _same_number(a, b) -> bool:
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b


def _stackable(decays: list) -> bool:
    """Decays that differ per chunk, stacked along the chunk axis: tensors of one shape and dtype."""
    if not all(isinstance(d, fx.Node) for d in decays):
        return False
    vals = [example_value(d) for d in decays]
    return all(isinstance(v, torch.Tensor) and v.shape == vals[0].shape and v.dtype == vals[0].dtype for v in vals)


def _check_types(chain: list) -> None:
    """One dtype for the states, the increments and tensor decays (no promotion along the chain)."""
    dtypes = {example_value(x).dtype for link in chain for x in (link.node, link.carried, link.inc)}
    dtypes |= {example_value(link.decay).dtype for link in chain if isinstance(link.decay, fx.Node)}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise Reject(f"the chunk states, increments and decays mix dtypes ({sorted(map(str, dtypes))})")
    for link in chain:
        if isinstance(link.decay, fx.Node):
            shape = _shape(link.node)
            if _shape(link.decay) is None or torch.broadcast_shapes(_shape(link.decay), shape) != shape:
                raise Reject("the decay of the chunk state does not broadcast to the state")
        elif link.decay is not None and not isinstance(link.decay, (int, float)):
            raise Reject("the decay of the chunk state is neither a tensor nor a number")


def _check_writes(an: Analyzer, chain: list, roots: dict) -> None:
    """No in-place write into the links or what the scan reads (a copy made earlier would read
    the memory before the write)."""
    nodes = [x for link in chain for x in (link.node, link.carried, link.inc, link.mul, link.decay)
             if isinstance(x, fx.Node)]
    if any(an.writes_into(n) for n in nodes + list(roots)):
        raise Reject("a chunk state, increment or decay, or a tensor they are computed from, is written in place")


def _read_outside(node: fx.Node, chain: list) -> bool:
    inside = {link.mul or link.node for link in chain}
    return any(u not in inside for u in node.users)


def _hoist_plan(an: Analyzer, values: list, anchor: fx.Node, roots: dict, depth: int = 0) -> None:
    """The nodes computed before `anchor` that the scan reads (directly, or through copies of the
    deterministic ops between them and a value computed after it): the certificate's leaves."""
    for x in values:
        if not isinstance(x, fx.Node) or x in roots:
            continue
        if an.order[x] < an.order[anchor]:
            roots[x] = None
            continue
        if depth >= MAX_HOIST_DEPTH or not _hoistable(x):
            raise Reject(f"an increment of the chunk state ({x.name}) is computed after the first state is read, "
                         "by an op that is not copied earlier")
        _hoist_plan(an, x.all_input_nodes, anchor, roots, depth + 1)


def _hoistable(x: fx.Node) -> bool:
    return (x.op in ("call_function", "call_method") and not written_args(x)
            and (op_name(x) in _HOISTABLE or is_pointwise(x)))


# ---- the rewrite ----------------------------------------------------------------------------------
def _match(an: Analyzer, chain: list, outputs: list, uniform: bool, anchor: fx.Node) -> Match:
    shape = _shape(chain[0].node)
    decay = chain[0].decay
    gate = "none" if decay is None else ("constant" if uniform else "per-chunk")

    def apply(txn) -> None:
        em = Emitter(txn, anchor, {})
        copies: dict = {}
        early = lambda x: _early(an, em, x, anchor, copies)  # noqa: E731
        states = _scan(em, early(chain[0].carried), [early(link.inc) for link in chain],
                       [early(link.decay) for link in chain], uniform, len(shape))
        inside = {link.mul or link.node for link in chain}
        for link, s in zip(chain, states):
            for u in [u for u in link.node.users if u not in inside]:
                txn.replace_input(u, link.node, s)

    nodes = [x for link in chain for x in (link.node, link.mul) if x is not None]
    shapes = dict(zip("BHKV", shape)) if len(shape) == 4 else {"K": shape[-2], "V": shape[-1]}
    return Match(FORM, gate, "bhkv" if len(shape) == 4 else "", shapes, nodes, apply,
                 {"chunks": len(chain), "outputs": len(outputs)})


def _early(an: Analyzer, em: Emitter, x, anchor: fx.Node, copies: dict):
    """x as a value available at `anchor`: itself, or a copy of its ops inserted there."""
    if not isinstance(x, fx.Node) or an.order[x] < an.order[anchor]:
        return x
    if x not in copies:
        with em.graph.inserting_before(anchor):
            node = em.graph.node_copy(x, lambda y: _early(an, em, y, anchor, copies))
        node.meta = dict(x.meta)
        em.txn.created.append(node)
        copies[x] = node
    return copies[x]


def _scan(em: Emitter, s0: fx.Node, incs: list, decays: list, uniform: bool, rank: int) -> list:
    """[S_1, ..., S_n] of S_m = S_(m-1) * decay_(m-1) + inc_(m-1) from S_0, as nodes."""
    y = em.call(torch.stack, [s0] + incs, 0)
    length = len(incs) + 1
    if decays[0] is None:
        acc = em.call(torch.cumsum, y, 0)
    elif uniform:
        acc = _decay_matrix(em, y, decays[0], length, rank)
    else:
        acc = _scan_per_chunk(em, y, decays, length, rank)
    return [em.call(torch.select, acc, 0, m) for m in range(1, length)]


def _decay_matrix(em: Emitter, y: fx.Node, decay, length: int, rank: int) -> fx.Node:
    """One decay d for every chunk: S_m = sum_(j <= m) d ** (m - j) Y_j, as batched matmuls with
    matrices of powers of d (one per entry of d: per head, per key) in two levels: within blocks of
    about sqrt(L) chunks, then over the blocks' sums (decay d ** block), each block's entering state
    added decayed. About L * sqrt(L) products per state entry, no sequential steps; the powers are
    running products (no division by d, no log: any sign, zeros included)."""
    shape = tuple(example_value(y).shape[1:])
    if not isinstance(decay, fx.Node):
        decay = em.call("new_full", y, (1,), float(decay), op="call_method")
    dshape = (1,) * (rank - example_value(decay).dim()) + tuple(example_value(decay).shape)
    vary = [i for i in range(rank) if dshape[i] != 1]
    rest = [i for i in range(rank) if dshape[i] == 1]
    groups, free = math.prod(shape[i] for i in vary), math.prod(shape[i] for i in rest)
    block = math.isqrt(length - 1) + 1
    blocks = -(-length // block)
    perm = [1 + i for i in vary] + [0] + [1 + i for i in rest]
    ys = em.call(torch.reshape, em.call(torch.permute, y, perm), (groups, length, free))
    if blocks * block > length:
        pad = em.call("new_zeros", ys, (groups, blocks * block - length, free), op="call_method")
        ys = em.call(torch.cat, [ys, pad], 1)
    ys = em.call(torch.reshape, ys, (groups, blocks, block, free))
    powers = _powers(em, em.call(torch.reshape, decay, (1, groups)), block + 1)  # [block + 1, G]
    inner = em.call(torch.matmul, em.call(torch.unsqueeze, _power_matrix(em, powers, block), 1), ys)
    if blocks > 1:
        sums = em.call(torch.select, inner, 2, block - 1)  # [G, blocks, F]: each block alone
        over = _power_matrix(em, _powers(em, em.call(torch.narrow, powers, 0, block, 1), blocks), blocks)
        ends = em.call(torch.matmul, over, sums)  # the state after each block
        zero = em.call("new_zeros", ends, (groups, 1, free), op="call_method")
        entering = em.call(torch.cat, [zero, em.call(torch.narrow, ends, 1, 0, blocks - 1)], 1)
        into = em.call(torch.reshape, em.call(torch.t, em.call(torch.narrow, powers, 0, 1, block)),
                       (groups, 1, block, 1))  # d ** (r + 1) from the block's start to its position r
        inner = em.call(operator.add, inner, em.call(operator.mul, into, em.call(torch.unsqueeze, entering, 2)))
    out = em.call(torch.narrow, em.call(torch.reshape, inner, (groups, blocks * block, free)), 1, 0, length)
    out = em.call(torch.reshape, out, tuple(shape[i] for i in vary) + (length,) + tuple(shape[i] for i in rest))
    return em.call(torch.permute, out, [perm.index(a) for a in range(rank + 1)])


def _powers(em: Emitter, flat: fx.Node, count: int) -> fx.Node:
    """[count, G]: row e is flat ** e (flat [1, G]), by running products."""
    if count == 1:
        return em.call(torch.ones_like, flat)
    run = em.call(torch.cumprod, em.call(torch.Tensor.expand, flat, count - 1, -1), 0)
    return em.call(torch.cat, [em.call(torch.ones_like, flat), run], 0)


def _power_matrix(em: Emitter, powers: fx.Node, size: int) -> fx.Node:
    """[G, size, size]: entry (m, j) is powers[m - j] for j <= m, else 0."""
    pos = em.call(torch.arange, size, device=example_value(powers).device)
    dist = em.call(operator.sub, em.call(torch.unsqueeze, pos, 1), em.call(torch.unsqueeze, pos, 0))
    w = em.call(operator.getitem, powers, em.call(torch.clamp, dist, 0))  # [size, size, G]
    w = em.call(torch.where, em.call(torch.unsqueeze, em.call(operator.ge, dist, 0), -1), w, 0.0)
    return em.call(torch.permute, w, (2, 0, 1))


def _shifted_add(em: Emitter, acc: fx.Node, coef, s: int, length: int) -> fx.Node:
    """acc with acc[m] + coef * acc[m - s] at every m >= s (coef broadcast over m >= s)."""
    head = em.call(torch.narrow, acc, 0, 0, s)
    tail = em.call(torch.narrow, acc, 0, s, length - s)
    prev = em.call(torch.narrow, acc, 0, 0, length - s)
    tail = em.call(operator.add, tail, em.call(operator.mul, coef, prev))
    return em.call(torch.cat, [head, tail], 0)


def _scan_per_chunk(em: Emitter, y: fx.Node, decays: list, length: int, rank: int) -> fx.Node:
    """A decay per chunk: the window's decay is the running product of the chunks' decays,
    scanned along with the states (C_0 = 1 enters before S_0)."""
    shape = (1,) * (rank - example_value(decays[0]).dim()) + tuple(example_value(decays[0]).shape)
    parts = [em.call(torch.reshape, d, shape) for d in decays]
    coef = em.call(torch.stack, [em.call(torch.ones_like, parts[0])] + parts, 0)
    acc, s = y, 1
    while s < length:
        acc = _shifted_add(em, acc, em.call(torch.narrow, coef, 0, s, length - s), s, length)
        if 2 * s < length:
            head = em.call(torch.narrow, coef, 0, 0, s)
            tail = em.call(operator.mul, em.call(torch.narrow, coef, 0, s, length - s),
                           em.call(torch.narrow, coef, 0, 0, length - s))
            coef = em.call(torch.cat, [head, tail], 0)
        s *= 2
    return acc
