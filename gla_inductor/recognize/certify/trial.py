"""A certificate by trial: a match applied in a scratch transaction, the rewritten subgraph run in
float64 against the user's on random inputs, then undone.

For rewrites that keep some of the user's nodes between the op and the outputs (normalized
retention: the user's abs / clamp / detach of the row sums now read the op's last column), the
replacement is not the op alone, so ``certificate.py``'s comparison with an emitted ``Spec``
does not cover it. Here both sides are the graph itself: the nodes from the leaves to the
outputs as the user wrote them, and, with the match applied, the nodes from the same leaves to
what the outputs' readers now read (the inserted nodes and the user's nodes between them). The
GLA op runs as its map in float64 (the naive recurrence, ``certificate.reference_op``, or the
same map by chunks for a constant gate); module state and constants at their compile-time
values. Comparisons and clamps are evaluated as written: the analytic parts are proven by the
recognizer's algebra, this checks that the glue around them (the row sums, the divisor, the
layouts) is the user's at two random points.

*Its cost.* Both modules are run at shrink.KEEP batches and heads where ``shrink.py``'s table
proves that each treats every (batch, head) slice alike (the GLA op is a row of it there) and
puts it at the same place of its outputs; that certifies the full sizes by shrink's argument.
A decay that differs between heads (RetNet's [H, T, T] mask) makes each head its own function:
then every head is run, KEEP at a time, each group with its own slice of the constants. The
user's nodes the rewrite bypasses (the [.., T, T] scores' product with v) are not run again, and
the op of a constant gate is evaluated by chunks, not step by step. The time axis is not
reduced: each query row is its own function (its row factor, its positions), and a prefix of T
would certify only the rows it keeps.

*Another use.* ``sides`` reads the same two modules off a match, in the code's own dtypes, for
timing the choice between them (``recognize/measure.py``, the cost rule under max-autotune).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ...contract import GLACall
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import Transaction
from ..core.match import Match
from . import shrink
from .certificate import CERT_BUDGET_BYTES, CERT_RTOL, Float64Interpreter, _digest, one_thread, reference_op

log = logging.getLogger("gla_inductor")

CERTIFIED: dict = {}  # structure of a trial (both modules, the leaves' shapes) -> None or why not


def certify(an: Analyzer, match: Match, leaves: list, outputs: list) -> Optional[str]:
    """None where the match's rewrite equals the user's subgraph from `leaves` to `outputs` at
    two random float64 points; else why not."""
    nodes = _between(an, leaves, outputs)
    if isinstance(nodes, str):
        return nodes
    consts: dict = {}  # (one float64 copy of each constant for both modules, digested once)
    original = _module(an, [n for n in an.nodes if n in nodes], leaves, outputs, consts)
    # (the user's nodes are copied as they read after the rewrite: the normalizer reads the op)
    with _applied(an, match) as (txn, new):
        if any(o not in new for o in outputs):
            return "the rewrite does not replace every output it covers"
        outs = [new[o] for o in outputs]
        after = _read_by(outs, set(txn.created) | nodes)
        rewritten = _module(an, [n for n in an.graph.nodes if n in after], leaves, outs, consts)
    if isinstance(rewritten, str) or isinstance(original, str):
        return rewritten if isinstance(rewritten, str) else original
    key = (*pair_key(original, rewritten), tuple(tuple(example_value(x).shape) for x in leaves))
    if key not in CERTIFIED:  # (the layers of a model: each the same computation on its own inputs)
        if len(CERTIFIED) > 256:
            CERTIFIED.clear()
        CERTIFIED[key] = _run(original, rewritten, leaves, match.layout)
    return CERTIFIED[key]


def sides(an: Analyzer, match: Match):
    """(original, rewritten, leaves): the user's nodes and the match's replacement as modules of
    the same leaves, constants in their own dtypes, for timing both (``recognize/measure.py``);
    else why not. Both are read off the match applied in a scratch transaction, as ``certify``
    does: the leaves are the graph's values the replacement reads (``_sources``), the outputs the
    values it replaces, and the user's side keeps the writes the rewrite drops (a cache's
    write-back, which the fused op makes itself), so that both sides do the same work. Sizes may
    be symbolic: the modules are compiled at their hints."""
    consts: dict = {}
    with _applied(an, match) as (txn, new):
        olds = list(new)
        outs = [new[o] for o in olds]
        after = _read_by(outs, set(txn.created))
        reads = [x for n in an.graph.nodes if n in after for x in n.all_input_nodes if x not in after]
        leaves, broadcasts = _sources(an, reads)
        order = [n for n in an.graph.nodes if n in after or n in broadcasts]
        rewritten = _module(an, order, leaves, outs, consts, float64=False)
        writes = list(txn.erase)
    nodes = _between(an, leaves, olds + writes, static=False)
    if isinstance(nodes, str) or isinstance(rewritten, str):
        return nodes if isinstance(nodes, str) else rewritten
    original = _module(an, [n for n in an.nodes if n in nodes], leaves, olds, consts, float64=False)
    return original if isinstance(original, str) else (original, rewritten, leaves)


@contextlib.contextmanager
def _applied(an: Analyzer, match: Match):
    """(the transaction, {replaced value: its replacement} in rewiring order) of the match applied
    to the graph in a scratch transaction, rolled back on leaving: both trial modules are read off
    the rewritten graph."""
    txn = Transaction(an.graph)
    try:
        match.apply(txn)
        yield txn, {old: n for _, old, n in txn.rewires}
    finally:
        txn.rollback_to((0, 0, 0))


def _sources(an: Analyzer, reads: list) -> tuple:
    """(leaves, broadcasts): the values `reads` (the graph's nodes a replacement reads), each
    that is a broadcast of smaller values (a decay [B, H] over the state [B, H, K, V]) replaced by
    those values and the nodes between, which both sides then compute: the user's code gets such
    a value fused into its kernels, and a leaf would make it read a materialized copy."""
    leaves, broadcasts = [], set()
    for r in dict.fromkeys(x for x in reads if not _constant(an, x)):
        walked = _broadcast_of(an, r)
        if walked is None:
            leaves.append(r)
        else:
            broadcasts |= walked[1]
            leaves += walked[0]
    leaves = [x for x in dict.fromkeys(leaves) if x not in broadcasts]
    return leaves, broadcasts


def _broadcast_of(an: Analyzer, read: fx.Node, most: int = 32):
    """(sources, nodes): the values `read` is computed from by nodes none of whose inputs is larger
    than the node (views, broadcasts, elementwise ops; at most `most` nodes), where every source
    is smaller than `read`; else None."""
    def numel(n: fx.Node):  # (None for other values and symbolic sizes: those stop the walk)
        return _numel(n) if isinstance(example_value(n), torch.Tensor) else None

    size, nodes, sources, stack = numel(read), set(), [], [read]
    while stack and size:
        x = stack.pop()
        ins = [i for i in x.all_input_nodes if not _constant(an, i)]
        sizes = [numel(i) for i in ins]
        if x.op in ("call_function", "call_method") and ins and None not in sizes and max(sizes) <= numel(x):
            if len(nodes) == most:
                return None
            nodes.add(x)
            stack += [i for i in ins if i not in nodes]
        elif numel(x) is None or numel(x) >= size:
            return None
        else:
            sources.append(x)
    return (sources, nodes) if sources and size else None


def _run(original: fx.GraphModule, rewritten: fx.GraphModule, leaves: list, layout: str) -> Optional[str]:
    """The certificate at fewer batches and heads where both modules are proven to treat them
    alike (``shrink.py``'s table), else at full size; None where it holds."""
    shapes = [tuple(example_value(x).shape) for x in leaves]
    reduced, why = _reduced(original, rewritten, leaves, layout), None
    if isinstance(reduced, str):
        why, pairs = reduced, [(original, rewritten)]
        need = max(_bytes(m, shapes, _full_numel) for m in (original, rewritten))
    else:
        pairs, shapes, need = reduced
    if need > CERT_BUDGET_BYTES:
        return (f"its float64 certificate needs ~{need / 2**30:.1f} GiB (budget {CERT_BUDGET_BYTES / 2**30:.1f} "
                f"GiB){'' if why is None else f' and fewer batches and heads will not do ({why})'}: left alone "
                "unproven")
    counters["gla_inductor"]["certificates_trial" if why else "certificates_trial_reduced"] += 1
    runs = ((o, r, 2 * p + s) for p, (o, r) in enumerate(pairs) for s in (0, 1))
    with one_thread(why is None):  # (at two batches and heads its ops are small: threads only synchronize)
        return next((w for w in (_agree(o, r, shapes, seed) for o, r, seed in runs) if w), None)


def _read_by(outputs: list, among: set) -> set:
    """The nodes of `among` that the outputs read (the user's nodes the rewrite bypassed are not
    run again)."""
    found, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in among and n not in found:
            found.add(n)
            stack += n.all_input_nodes
    return found


def pair_key(original: fx.GraphModule, rewritten: fx.GraphModule) -> tuple:
    """Equal for pairs of modules that compute the same things (``_key``): what the certificate's and
    the measured choice's caches are keyed by. Each constant is digested once, also where both
    modules hold it."""
    buffers = {id(b): b for m in (original, rewritten) for b in m.buffers()}
    digests = {i: _digest(b) for i, b in buffers.items()}
    return _key(original, digests), _key(rewritten, digests)


def _key(gm: fx.GraphModule, digests: dict) -> tuple:
    """Equal for modules that compute the same thing: ops and arguments up to node names, and the
    constants' values."""
    index, rows = {}, []
    for n in gm.graph.nodes:
        index[n] = len(rows)
        args = fx.node.map_arg((n.args, n.kwargs), lambda x: ("node", index[x]))
        rows.append((n.op, str(n.target), repr(args)))
    return tuple(rows), tuple(digests[id(b)] for b in gm.buffers())


def _between(an: Analyzer, leaves: list, outputs: list, static: bool = True):
    """The nodes from the leaves to the outputs, or why they are not a function of the leaves
    and constants alone (or, with `static`, not all of static sizes)."""
    found, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n in found or n in leaves or _constant(an, n):
            continue
        if n.op not in ("call_function", "call_method"):
            return f"the subgraph reads {n.name}, neither an input of the op nor a constant"
        if static and _numel(n) is None:
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


def _module(an: Analyzer, order: list, leaves: list, outputs: list, consts: dict, float64: bool = True):
    """The nodes `order` as a module of the leaves, the constants they read as buffers (in
    `consts`: node -> its float64 value, or its own with `float64` False, shared by the modules
    of one certificate)."""
    g, root, env = fx.Graph(), torch.nn.Module(), {}
    for p, leaf in enumerate(leaves):
        env[leaf] = g.placeholder(f"leaf{p}")

    def arg(x: fx.Node):
        if x not in env:
            if x not in consts:
                val = an.consts.evaluate(x) if an.consts.is_const(x) else an.consts.evaluate_static(x)
                if val is None:
                    raise LookupError(x.name)
                consts[x] = val.double() if float64 and val.is_floating_point() else val
            name = f"c{len(root._buffers)}"
            root.register_buffer(name, consts[x])
            env[x] = g.get_attr(name)
        return env[x]

    try:
        for n in order:
            env[n] = g.node_copy(n, arg)
    except LookupError as e:
        return f"the constant {e} could not be evaluated"
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, g)


def _agree(original, rewritten, shapes: list, seed: int) -> Optional[str]:
    gen = torch.Generator().manual_seed(seed)
    args = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    try:
        want = _Interpreter(original).run(*args)
        got = _Interpreter(rewritten).run(*args)
    except Exception as e:  # noqa: BLE001 - a rewrite that does not even run is not certified
        return f"its float64 certificate did not run ({type(e).__name__}: {e})"
    for p, (w, x) in enumerate(zip(want, got)):
        if not isinstance(w, torch.Tensor) or w.shape != x.shape or not torch.isfinite(w).all():
            return f"its float64 certificate's output {p} has another shape or is not finite"
        err = ((x.double() - w.double()).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        if not err <= CERT_RTOL:
            return f"its float64 certificate differs from the code by {err:.2g} (relative) in output {p}"
    return None


# ---- at fewer batches and heads -------------------------------------------------------------------
def _reduced(original: fx.GraphModule, rewritten: fx.GraphModule, leaves: list, layout: str):
    """([(original, rewritten) per group of heads], the leaves' shapes, estimated bytes) at
    shrink.KEEP batches and heads where both modules are proven to treat every (batch, head)
    slice alike and to put it at the same place of their outputs; else why not. The tags start on
    the leaves' axes at the layout's positions of the roles: a hypothesis that the table proves or
    refuses, not an assumption."""
    shapes = [tuple(example_value(x).shape) for x in leaves]
    if any(len(s) != len(layout) for s in shapes):
        return "the inputs are not all in q's layout"
    tags = {layout.index(r): r for r in shrink.ROLES if r in layout
            if len({s[layout.index(r)] for s in shapes}) == 1 and shapes[0][layout.index(r)] > shrink.KEEP}
    if not tags:
        return "batch and heads are already small"
    whys = []
    for keep in [tags] + ([{a: r} for a, r in tags.items()] if len(tags) > 1 else []):  # both, else each
        full = {r: shapes[0][a] for a, r in keep.items()}
        try:
            props = [_propagate(m, shapes, keep, full) for m in (original, rewritten)]
            if _out_tags(*props[0][::2]) != _out_tags(*props[1][::2]):
                raise shrink.Refuse("the outputs' batch and head axes differ between the code and the rewrite")
            pairs = [tuple(_rebuilt(m, _cut(s, consts, at), {n: s.remake(n, how) for n, how in s.sized.items()})
                           for m, (s, consts, _) in zip((original, rewritten), props))
                     for at in _head_groups(props, full)]
        except shrink.Refuse as e:
            whys.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001 - a reduction not made is only a costlier certificate
            log.info("gla_inductor: the trial certificate's reduction failed", exc_info=True)
            whys.append(f"the reduction failed ({type(e).__name__})")
            continue
        s = props[0][0]
        small = [tuple(s.reduced(a) for a in _leaf_axes(x, keep)) for x in shapes]
        need = max(_bytes(m, small, _reduced_numel(p[0])) for m, p in zip(pairs[0], props))
        return pairs, small, need
    return whys[0]


def _leaf_axes(shape: tuple, keep: dict) -> list:
    return [(keep[i],) if i in keep else shrink._normal([d]) for i, d in enumerate(shape)]


def _propagate(gm: fx.GraphModule, shapes: list, keep: dict, full: dict) -> tuple:
    """(shrink's propagation over gm, its constants, its outputs); shrink.Refuse where gm is not
    proven to treat every slice alike."""
    s, consts, outs = shrink._Shrink(full, {"gla": _gla_axes}), {}, ()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            s.axes[n] = _leaf_axes(shapes[int(n.target[len("leaf"):])], keep)
        elif n.op == "get_attr":
            consts[n] = getattr(gm, n.target)
            s.axes[n] = [(shrink._Free(d),) if d > 1 else () for d in consts[n].shape]
        elif n.op == "output":
            outs = n.args[0]
        else:
            s.visit(n)
    return s, consts, outs


def _head_groups(props: list, full: dict) -> list:
    """The first head of each group of shrink.KEEP heads to certify: one group where every
    constant is equal along the heads (each head is then the same function), else groups covering
    all heads (RetNet's decay mask [H, T, T] differs between heads: each head is its own function,
    of its own slice of the constants, and every one is run, KEEP heads at a time)."""
    heads = full.get("h")
    same = all(shrink._equal_along(val, i) for s, consts, _ in props for n, val in consts.items()
               for i, a in enumerate(s.axes[n]) if s.resolve(a) == ("h",))
    if heads is None or same:
        return [0]
    return sorted(set(range(0, heads - shrink.KEEP, shrink.KEEP)) | {heads - shrink.KEEP})


def _cut(s, consts: dict, head: int) -> dict:
    """The constants at reduced sizes: along the head axis, heads [head, head + KEEP); along any
    other reduced axis (batch, or merged roles) they must be equal, and the first are kept."""
    res = {}
    for n, val in consts.items():
        for i, axis in enumerate(s.axes[n]):
            r = s.resolve(axis)
            if r == ("h",):
                val = val.narrow(i, head, shrink.KEEP)
            elif any(isinstance(c, str) for c in r):
                if not shrink._equal_along(val, i):
                    raise shrink.Refuse(f"the constant {n.name} differs between batches")
                val = val.narrow(i, 0, s.reduced(axis))
        res[n] = val.clone()
    return res


def _rebuilt(gm: fx.GraphModule, cut: dict, remake: dict) -> fx.GraphModule:
    """gm with its constants cut and the nodes that carry sizes rebuilt (shrink's remake)."""
    g, root, env = fx.Graph(), torch.nn.Module(), {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.target)
        elif n.op == "get_attr":
            root.register_buffer(n.target, cut[n])
            env[n] = g.get_attr(n.target)
        elif n.op == "output":
            g.output(fx.node.map_arg(n.args[0], env.__getitem__))
        elif n in remake:
            op, target, args, kwargs = fx.node.map_arg(remake[n], env.__getitem__)
            env[n] = g.create_node(op, target, args, kwargs)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    return fx.GraphModule(root, g)


def _gla_axes(s: shrink._Shrink, n: fx.Node) -> tuple:
    """The GLA op (in the trial certificate's replacement): each (batch, head) slice of its
    outputs from that slice of q, k, v [B, T, H, .], the gate, g_gamma [H] and the initial state
    [B, H, K, V], by one function; along time and features only."""
    call = GLACall.from_op_args(n.args, n.kwargs)
    if call.gate.name or call.gate_a is not None or call.gate_bias is not None or call.cu_seqlens is not None:
        raise shrink.Refuse(f"{n.name}: a fused gate or packed sequences")
    q, k, v = (s.of(x) for x in (call.q, call.k, call.v))
    if not len(q) == len(k) == len(v) == 4:
        raise shrink.Refuse(f"{n.name}: q, k and v not of rank 4")
    b, h = q[0], q[2]
    for x in (q, k, v) + ((s.of(call.g),) if call.g is not None else ()):  # [B, T, H, .]
        s.unify(b, x[0], n.name)
        s.unify(h, x[2], n.name)
        for a in [x[1]] + list(x[3:]):
            s.plain(a, n.name)
    if call.g_gamma is not None:
        s.unify(h, s.of(call.g_gamma)[0], n.name)
    if call.initial_state is not None:  # [B, H, K, V]
        h0 = s.of(call.initial_state)
        s.unify(b, h0[0], n.name)
        s.unify(h, h0[1], n.name)
        s.plain(h0[2], n.name)
        s.plain(h0[3], n.name)
    return [b, None, h, None], ([b, h, None, None] if call.output_final_state else [None])  # (else shape (0,))


def _out_tags(s, outs) -> list:
    """Per output, the role of each axis (None: untagged); Refuse where a tagged axis is merged."""
    rows = []
    for o in outs:
        axes = s.axes.get(o)
        if not isinstance(axes, list):
            raise shrink.Refuse("an output is not a tensor of known axes")
        row = []
        for a in axes:
            r = s.resolve(a)
            tags = [c for c in r if isinstance(c, str)]
            if tags and len(r) != 1:
                raise shrink.Refuse("an output merges a batch or head axis with another")
            row.append(tags[0] if tags else None)
        rows.append(tuple(row))
    return rows


def _reduced_numel(s):
    def numel(n: fx.Node) -> int:
        axes = s.axes.get(n)
        parts = axes if isinstance(axes, tuple) else (axes,)
        return sum(math.prod(s.reduced(a) for a in p) for p in parts if isinstance(p, list))
    return numel


def _full_numel(n: fx.Node) -> int:
    val = example_value(n)
    parts = val if isinstance(val, (tuple, list)) else (val,)
    return sum(p.numel() for p in parts if isinstance(p, torch.Tensor))


def _bytes(gm: fx.GraphModule, shapes: list, numel) -> int:
    """Estimated float64 memory of running gm: its inputs, its constants and its intermediates at
    their peak."""
    order = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    fixed = sum(b.numel() for b in gm.buffers()) + sum(math.prod(s) for s in shapes)
    return 8 * fixed + shrink.peak_bytes(order, numel, outs)


# ---- the op in float64 ----------------------------------------------------------------------------
_CHUNK = 128  # steps of the op evaluated at once (its [B, H, C, C] scores in float64)


class _Interpreter(Float64Interpreter):
    """The certificate's interpreter, with the GLA op of a constant gate by chunks (_gla_f64)."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.gla_inductor.chunk_fwd.default:
            return _gla_f64(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _gla_f64(*args, **kwargs) -> tuple:
    """chunk_fwd's (o, final state) in float64 where the gate is a constant per head or none: the
    naive recurrence's map (``certificate.reference_op``), S_t = e^gamma S_(t-1) + k_t v_t^T and
    o_t = scale q_t S_t, summed in closed form over chunks of _CHUNK steps: a few large products
    instead of several small ones per step. Any other call goes to the recurrence itself."""
    call = GLACall.from_op_args(args, kwargs)
    fused = call.gate.name or call.gate_a is not None or call.gate_bias is not None
    if call.g is not None or fused or call.cu_seqlens is not None or not call.q.shape[2] == call.k.shape[2] == \
            call.v.shape[2]:
        return reference_op(*args, **kwargs)
    q, k, v = (x.double().flip(1) if call.reverse else x.double() for x in (call.q, call.k, call.v))
    B, T, H, K = q.shape
    scale = K ** -0.5 if call.scale is None else call.scale
    gamma = call.g_gamma.double() if call.g_gamma is not None else q.new_zeros(H)  # log decay per step
    S = call.initial_state.double() if call.initial_state is not None else q.new_zeros(B, H, K, v.shape[-1])
    pos = torch.arange(min(T, _CHUNK), dtype=torch.float64)
    dist = pos[:, None] - pos[None, :]
    decay = torch.where(dist >= 0, (dist.clamp_min(0) * gamma[:, None, None]).exp(), 0.0)  # [H, C, C]
    into = ((pos + 1) * gamma[:, None]).exp()[..., None]  # [H, C, 1]: the carried state's decay
    outs = []
    for s in range(0, T, _CHUNK):
        qc, kc, vc = (x[:, s:s + _CHUNK].transpose(1, 2) for x in (q, k, v))  # [B, H, L, .]
        L = qc.shape[2]  # (a last chunk of fewer steps: the top left of the same tables)
        outs.append(scale * ((qc @ kc.transpose(-1, -2)) * decay[:, :L, :L] @ vc + (qc * into[:, :L]) @ S))
        last = ((L - 1 - pos[:L]) * gamma[:, None]).exp()[..., None]  # steps from each key to the chunk's end
        S = (L * gamma).exp()[:, None, None] * S + (kc * last).transpose(-1, -2) @ vc
    o = torch.cat(outs, 2).transpose(1, 2) if outs else q.new_zeros(B, 0, H, v.shape[-1])
    return (o.flip(1) if call.reverse else o), S
