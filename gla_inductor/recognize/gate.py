"""Gate fusion: a GLA op whose log gate is computed in the graph by a known gate function takes the
function's input instead, and the kernels apply the function as they read it (``gla_inductor.gates``).

Runs on the Dynamo graph after the GLA rewrites (so it also sees ``chunk_gla`` called by user code):
for each ``chunk_fwd`` node it follows the log gate back through layout-only ops (permutations,
casts, zero padding of batch or time; for logsigmoid also permutations between its pieces, as a
loop's per-step gate lifted to the whole sequence has them) to one of

    logsigmoid(x) | log(sigmoid(x))        [* c | / c]      [clamp(lo, hi)]          ("logsigmoid")
    a * [clamp(lo, hi)] softplus(x + bias)                  (a, bias per head)       ("softplus")

(c, lo, hi Python numbers; softplus with beta 1 and threshold 20; a and bias broadcast along the
head axis only, or along head and key for the bias of a vector gate) and passes x, re-laid out as
the gate was, with the function's constants. The gate tensor then dies: no gate of x's size is
written, and autograd of the op returns the gradients of x, a and bias.

Fused only when the gate is read by nothing else (it would be materialized anyway), and only when
a certificate shows the fused gate equal to the graph's: both evaluated in float64 at random inputs
that cross the clamp's bounds, the padded positions included. Those matter: the op's final state
decays through them, and a zero-padded gate is replayed as x padded with the function's zero, which
a clamp away from 0 moves (Mamba2's softplus clamped to a time-step limit lo > 0 gives a * lo
there). A candidate that does not match exactly, or is not certified, is left as it is.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ..contract import GLACall
from ..gates import GateFn, log_gate
from .core.clean import dead_code_elimination
from .core.consts import example_value
from .core.op_names import op_name

log = logging.getLogger("gla_inductor")

_LOGSIGMOID = {F.logsigmoid, torch._C._nn.log_sigmoid}
_SIGMOID = {torch.sigmoid, F.sigmoid, torch.special.expit}
_LOG = {torch.log}
_SOFTPLUS = {F.softplus, torch._C._nn.softplus}
_CLAMPS = {torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max}
_CLAMP_METHODS = {"clamp", "clip", "clamp_min", "clamp_max"}
_PAD = {F.pad, torch._C._nn.pad, torch.constant_pad_nd}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Chain:
    """Layout-only ops from a gate function's output to the op's g: g axis i is the function's axis
    perm[i]; pads (in g's axes) are the zero padding applied on the way."""

    start: fx.Node  # the gate function's output
    perm: list
    pads: dict  # g axis -> (before, after)
    nodes: list  # the chain's nodes, from start's user to g


@dataclass
class _Fusion:
    op: fx.Node
    chain: _Chain
    x: fx.Node
    fn: GateFn
    a: Optional[fx.Node] = None
    bias: Optional[fx.Node] = None


def chunk_fwd_targets() -> tuple:
    """The targets of the op this pass rewrites: the recognizers emit the overload, Dynamo
    records user code's calls as the packet. (Looked up when used: the op is registered by
    the ops package, which the backend imports before it runs this pass.)"""
    packet = torch.ops.gla_inductor.chunk_fwd
    return packet.default, packet


def fuse_gates(gm: fx.GraphModule) -> int:
    """Fuse every gate function this module recognizes into its GLA op; returns how many."""
    plans = []
    targets = chunk_fwd_targets()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            plan = _plan(node)
            if plan is not None:
                plans.append(plan)
    for plan in plans:
        _apply(gm.graph, plan)
    if plans:
        # not fx's DCE, which drops a user's in-place cache.copy_(...) as unused
        dead_code_elimination(gm.graph)
        gm.recompile()
    return len(plans)


# ----------------------------------------------------------------------------------------------
# matching
# ----------------------------------------------------------------------------------------------


def _val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _unfused_call(op: fx.Node) -> Optional[GLACall]:
    """The call chunk_fwd node `op` makes, if it has no fused gate. A call with a number computed
    in the graph (user code's scale and gate_scale under dynamic shapes) is left as it is: its
    arguments are rewritten as Python numbers."""
    if any(isinstance(example_value(x), (int, float, torch.SymInt, torch.SymFloat)) for x in op.all_input_nodes):
        return None
    call = GLACall.from_op_args(op.args, op.kwargs)
    if call.gate != GateFn() or call.gate_a is not None or call.gate_bias is not None:
        return None
    return call


def _plan(op: fx.Node) -> Optional[_Fusion]:
    call = _unfused_call(op)
    g = call.g if call is not None else None
    if not isinstance(g, fx.Node) or _val(g) is None:
        return None  # already fused, or a call we do not know
    chain = _chain(g)
    if chain is None or len(chain.start.users) != 1:
        return None
    gdim = _val(g).dim()
    fusion = _logsigmoid_gate(op, chain) or _softplus_gate(op, chain, gdim)
    if fusion is None:
        return None
    why = _uncertified(fusion, g)
    if why is not None:
        log.info("gla_inductor: gate fusion of %s refused: %s", op.name, why)
        counters["gla_inductor"]["fused_gates_refused"] += 1
        return None
    return fusion


def _chain(g: fx.Node) -> Optional[_Chain]:
    """Walk from g back through single-use layout-only ops to the first other node."""
    nodes, node = [], g
    perm = list(range(_val(g).dim()))
    pads: dict = {}
    while True:
        step = _layout_step(node)
        if step is None:
            break
        src, axes, pad = step
        if len(src.users) != 1 or _val(src) is None:
            return None  # the gate would stay alive for its other reader
        # the pad is in node's axes, i.e. of g's axes through perm so far
        for axis, (before, after) in (pad or {}).items():
            b0, a0 = pads.get(perm.index(axis), (0, 0))
            pads[perm.index(axis)] = (b0 + before, a0 + after)
        perm = [axes[p] for p in perm]
        nodes.append(node)
        node = src
    if any(axis not in (0, 1) for axis in pads):
        return None  # zero padding of heads or keys would pad the gate's parameters too
    return _Chain(node, perm, pads, list(reversed(nodes)))


def _layout_step(node: fx.Node):
    """(input, axes, pad) if node is a layout-only op of one tensor: output axis i is input axis
    axes[i]; pad maps output axes to (before, after) zero padding. None otherwise."""
    if node.op == "call_function" and node.target is torch.einsum:
        return _einsum_step(node)
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src, out = node.args[0], _val(node)
    if out is None or _val(src) is None:
        return None
    n = out.dim()
    same = list(range(n))
    name = op_name(node)
    if name == "identity" and _val(src).dim() == n and _is_float_cast_or_copy(node):
        return src, same, None
    if name == "transpose" and len(node.args) == 3 and not node.kwargs:
        i, j = (d % n for d in node.args[1:])
        same[i], same[j] = same[j], same[i]
        return src, same, None
    if name == "permute" and not node.kwargs:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return src, [d % n for d in dims], None
    if node.op == "call_function" and node.target in _PAD:
        return _pad_step(node, src, n)
    return None


def _is_float_cast_or_copy(node: fx.Node) -> bool:
    """contiguous / clone / a cast between float dtypes on the same device."""
    if node.target in ("contiguous", "clone", torch.clone, "float", "double", "half", "bfloat16"):
        return True
    if node.target in ("to", "type"):
        rest = list(node.args[1:]) + list(node.kwargs.values())
        return len(rest) == 1 and rest[0] in _FLOAT_DTYPES
    return False


def _einsum_step(node: fx.Node):
    """einsum("bhtk->bthk", x): a permutation."""
    if len(node.args) != 2 or not isinstance(node.args[0], str) or not isinstance(node.args[1], fx.Node):
        return None
    eq = node.args[0].replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, rhs = eq.split("->")
    if sorted(lhs) != sorted(rhs) or len(set(lhs)) != len(lhs):
        return None
    return node.args[1], [lhs.index(c) for c in rhs], None


def _pad_step(node: fx.Node, src: fx.Node, n: int):
    """F.pad(x, pads) with constant zeros: pads pair up from the last axis."""
    pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 0)
    if node.target is torch.constant_pad_nd:
        mode, value = "constant", (node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0))
    if mode != "constant" or value not in (0, 0.0, None) or not isinstance(pads, (list, tuple)):
        return None
    if not all(isinstance(p, int) and p >= 0 for p in pads) or len(pads) % 2:
        return None
    widths = {n - 1 - i: (pads[2 * i], pads[2 * i + 1]) for i in range(len(pads) // 2)}
    return src, list(range(n)), {a: w for a, w in widths.items() if w != (0, 0)}


def _through_casts(node) -> fx.Node:
    while isinstance(node, fx.Node) and op_name(node) == "identity" and _is_float_cast_or_copy(node) \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _number(x) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _clamp_bounds(node: fx.Node):
    """(input, lo, hi) of a clamp with number bounds (inf as none), else None."""
    if not (node.op == "call_function" and node.target in _CLAMPS or
            node.op == "call_method" and node.target in _CLAMP_METHODS):
        return None
    name = node.target if isinstance(node.target, str) else node.target.__name__
    rest = list(node.args[1:])
    if name in ("clamp_min", "clamp_max"):
        if len(rest) != 1 or node.kwargs:
            return None
        lo, hi = (rest[0], None) if name == "clamp_min" else (None, rest[0])
    else:
        lo = rest[0] if len(rest) > 0 else node.kwargs.get("min")
        hi = rest[1] if len(rest) > 1 else node.kwargs.get("max")
    bounds = []
    for b, unbounded in ((lo, -math.inf), (hi, math.inf)):
        if b is None or b == unbounded:
            bounds.append(None)  # clamp(min=-inf) / clamp(max=inf): no bound
        elif _number(b) is None or not math.isfinite(b):
            return None  # a NaN or an infinite bound on the wrong side is no gate function of ours
        else:
            bounds.append(float(b))
    return node.args[0], bounds[0], bounds[1]


def _strip_clamp(node: fx.Node):
    got = _clamp_bounds(node)
    if got is None or not isinstance(got[0], fx.Node) or len(got[0].users) != 1:
        return node, None, None
    return got


def _logsigmoid_gate(op: fx.Node, chain: _Chain) -> Optional[_Fusion]:
    node, lo, hi = _strip_clamp(_through_casts(chain.start))
    node, chain = _inner_layout(node, chain)
    node, scale = _scaled(_through_casts(node))
    node, chain = _inner_layout(node, chain)
    x, chain = _logsigmoid_input(_through_casts(node), chain)
    if x is None:
        return None
    return _Fusion(op, chain, _strip_upcast(x), GateFn("logsigmoid", scale, lo, hi))


def _inner_layout(node: fx.Node, chain: _Chain) -> tuple:
    """Permutations between the pieces of a logsigmoid gate (a loop's per-step gate lifted to
    the sequence is permuted after the gate function, before its scale): the scale, clamp and
    log commute with them. Walks back through single-use ones (no padding: clamp(0) need not
    be 0), composing them into the chain; (the node reached, the chain from it)."""
    perm, nodes = list(chain.perm), list(chain.nodes)
    while True:
        step = _layout_step(node)
        if step is None or step[2] or len(step[0].users) != 1 or _val(step[0]) is None:
            break
        src, axes, _ = step
        perm = [axes[p] for p in perm]
        nodes.insert(0, node)
        node = src
    if node is chain.start:
        return node, chain
    return node, _Chain(node, perm, chain.pads, nodes)


def _scaled(node: fx.Node):
    """(y, c) for y * c, c * y or y / c with a number c; (node, 1.0) otherwise."""
    name = op_name(node)
    if name in ("mul", "div") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if name == "mul" and _number(a) is not None and isinstance(b, fx.Node):
            a, b = b, a
        c = _number(b)
        if isinstance(a, fx.Node) and c is not None and c != 0 and math.isfinite(c) and len(a.users) == 1:
            return a, (c if name == "mul" else 1.0 / c)
    return node, 1.0


def _logsigmoid_input(node: fx.Node, chain: _Chain) -> tuple:
    """(x, the chain from the gate function) for logsigmoid(x) or log(sigmoid(x)); (None, chain)."""
    if node.op == "call_function" and node.target in _LOGSIGMOID and len(node.args) == 1 and not node.kwargs:
        return node.args[0], chain
    is_log = node.op == "call_function" and node.target in _LOG or node.op == "call_method" and node.target == "log"
    if is_log and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node) \
            and len(node.args[0].users) == 1:
        s, chain = _inner_layout(node.args[0], chain)
        is_sigmoid = s.op == "call_function" and s.target in _SIGMOID or s.op == "call_method" and s.target == "sigmoid"
        if is_sigmoid and len(s.args) == 1 and not s.kwargs and len(s.users) == 1:
            return s.args[0], chain
    return None, chain


def _strip_upcast(x) -> Optional[fx.Node]:
    """The kernels compute the gate in fp32: read a low-precision x before its upcast."""
    if not isinstance(x, fx.Node) or _val(x) is None:
        return None
    src = _through_casts(x)
    if _val(src) is not None and src is not x and _val(src).dtype in (torch.float16, torch.bfloat16) and \
            _val(x).dtype in (torch.float32, torch.float64) and _val(src).shape == _val(x).shape:
        return src
    return x


def _softplus_gate(op: fx.Node, chain: _Chain, gdim: int) -> Optional[_Fusion]:
    node = _through_casts(chain.start)
    if op_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    for a, sp in (node.args, reversed(node.args)):
        if not isinstance(a, fx.Node) or not isinstance(sp, fx.Node) or len(sp.users) != 1:
            continue
        inner, lo, hi = _strip_clamp(_through_casts(sp))
        inner = _through_casts(inner)
        z = _softplus_input(inner)
        if z is None or op_name(z) != "add" or len(z.args) != 2 or z.kwargs or len(z.users) != 1:
            continue
        for x, bias in (z.args, reversed(z.args)):
            fusion = _Fusion(op, chain, x, GateFn("softplus", 1.0, lo, hi), a, bias)
            if isinstance(x, fx.Node) and isinstance(bias, fx.Node) and _per_head_ok(fusion, gdim):
                fusion.x = _strip_upcast(x)
                return fusion
    return None


def _softplus_input(node: fx.Node) -> Optional[fx.Node]:
    if not (node.op == "call_function" and node.target in _SOFTPLUS and node.args):
        return None
    beta = node.args[1] if len(node.args) > 1 else node.kwargs.get("beta", 1)
    threshold = node.args[2] if len(node.args) > 2 else node.kwargs.get("threshold", 20)
    if _number(beta) != 1.0 or _number(threshold) != 20.0:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _aligned_shape(p: fx.Node, rank: int) -> Optional[list]:
    v = _val(p)
    if v is None or v.dim() > rank:
        return None
    return [1] * (rank - v.dim()) + list(v.shape)


def _per_head_ok(f: _Fusion, gdim: int) -> bool:
    """x has the gate's full shape; a varies along the head axis only; bias along the head axis
    (and the key axis of a vector gate) only. In g's axes: 0 batch, 1 time, 2 head, 3 key."""
    x, start = _val(f.x), _val(f.chain.start)
    if x is None or start is None or tuple(x.shape) != tuple(start.shape):
        return False
    rank = start.dim()
    a_shape, b_shape = _aligned_shape(f.a, rank), _aligned_shape(f.bias, rank)
    if a_shape is None or b_shape is None:
        return False
    perm = f.chain.perm
    a_in_g = [a_shape[p] for p in perm]
    b_in_g = [b_shape[p] for p in perm]
    free_b = (2, 3) if gdim == 4 else (2,)
    return all(s == 1 for i, s in enumerate(a_in_g) if i != 2) and \
        all(s == 1 for i, s in enumerate(b_in_g) if i not in free_b)


# ----------------------------------------------------------------------------------------------
# certificate
# ----------------------------------------------------------------------------------------------

_CERT_TOL = 1e-9  # float64: the two sides differ by rounding only
_CERT_NODES = 64  # a gate's subgraph is a handful of nodes; more is not one of ours
_CERT_BATCH_TIME = (2, 32)  # x's batch and time extents evaluated (the padding comes on top)


def _uncertified(f: _Fusion, g: fx.Node) -> Optional[str]:
    """Why the fused gate may differ from the graph's g, or None: both evaluated in float64 (casts
    as identities: the kernels compute the gate in fp32 whatever x's dtype) at random x, a and bias,
    x spread so the clamp's bounds are crossed on both sides, over every head and key, a few batch
    rows and steps, and the padded positions (the final state decays through those)."""
    leaves = [n for n in (f.x, f.a, f.bias) if n is not None]
    nodes = _subgraph(g, leaves)
    if nodes is None:
        return "the gate reads more than x and its per-head parameters"
    gen = torch.Generator().manual_seed(0)
    values = {}
    for leaf in leaves:
        shape = _concrete_shape(leaf)
        if shape is None:
            return f"no size hint for {leaf.name}"
        if leaf is f.x:  # the gate is pointwise along batch and time: a few of each are as good
            for axis, most in zip(f.chain.perm[:2], _CERT_BATCH_TIME):
                shape[axis] = min(shape[axis], most)
        values[leaf] = torch.randn(shape, generator=gen, dtype=torch.float64)
    values[f.x] = _spread(values[f.x], f.fn, gen)
    try:
        want = _evaluate(nodes, values)
        got = _fused_gate(f, values, list(want.shape))
    except Exception as e:  # a node this evaluator cannot run: no certificate, no fusion
        return f"the gate could not be evaluated ({type(e).__name__}: {e})"
    if got.shape != want.shape:
        return f"the fused gate has shape {tuple(got.shape)}, the graph's {tuple(want.shape)}"
    both_inf = torch.isinf(got) & (got == want)
    err = torch.where(both_inf, 0.0, (got - want).abs()).nan_to_num(math.inf)  # NaN or one-sided inf: inf
    finite = want[torch.isfinite(want)]
    scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    worst = err.max().item() if err.numel() else 0.0
    if worst > _CERT_TOL * scale:
        where = "at padded positions" if _differs_only_in_padding(f, got, want) else "at random points"
        return (f"the fused {f.fn.name} gate (clamp {f.fn.lo}, {f.fn.hi}) differs from the graph's "
                f"{where} by {worst:.3g} in float64")
    return None


def _subgraph(g: fx.Node, leaves: list) -> Optional[list]:
    """The nodes from the leaves to g, in graph order; None if g depends on another input."""
    seen, todo = set(), [g]
    while todo:
        node = todo.pop()
        if node in seen or node in leaves:
            continue
        if node.op not in ("call_function", "call_method") or len(seen) >= _CERT_NODES:
            return None
        seen.add(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(g.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _concrete_shape(node: fx.Node) -> Optional[list]:
    """The value's shape in this example: symbolic sizes read through their hints (no guard added;
    the hint is on the size's node in every torch from 2.11); None where a size has none."""
    shape = []
    for d in _val(node).shape:
        hint = d if isinstance(d, int) else getattr(getattr(d, "node", None), "hint", None)
        if hint is None:
            return None
        shape.append(int(hint))
    return shape


def _spread(x: torch.Tensor, fn: GateFn, gen: torch.Generator) -> torch.Tensor:
    """Gate inputs over the function's whole range, a third of them next to the clamp's bounds
    (the inverse of the function there, give or take the bias's spread)."""
    wide = (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 30
    edges = [b for b in (fn.lo, fn.hi) if b is not None]
    inverse = [_inverse(fn, b) for b in edges]
    inverse = [z for z in inverse if z is not None and math.isfinite(z)]
    if not inverse:
        return wide
    near = torch.tensor(inverse, dtype=torch.float64)[torch.randint(len(inverse), x.shape, generator=gen)]
    near = near + x  # x: standard normal
    pick = torch.rand(x.shape, generator=gen) < 1 / 3
    return torch.where(pick, near, wide)


def _inverse(fn: GateFn, y: float) -> Optional[float]:
    """The input at which the function (before its clamp) is y, where there is one."""
    if fn.name == "softplus" and y > 0:
        return math.log(math.expm1(y)) if y < 30 else y
    if fn.name == "logsigmoid" and y / fn.scale < 0:
        return -math.log(math.expm1(-y / fn.scale))
    return None


def _evaluate(nodes: list, values: dict) -> torch.Tensor:
    """Runs the gate's nodes on float64 values, casts as identities."""
    env = dict(values)

    def arg(a):
        return fx.node.map_arg(a, env.__getitem__)

    for node in nodes:
        args, kwargs = arg(node.args), arg(node.kwargs)
        if op_name(node) == "identity" and _is_float_cast_or_copy(node):
            env[node] = args[0]
        elif node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env[nodes[-1]]


def _fused_gate(f: _Fusion, values: dict, g_shape: list) -> torch.Tensor:
    """What the op computes from the fused inputs (``gates.log_gate``), in float64."""
    emit, rank = _EagerEmit(), len(f.chain.perm)
    x = _replay(None, values[f.x], f.chain, f.fn, emit)
    a = bias = None
    if f.fn.name == "softplus":
        a = _per_head(None, values[f.a], f.chain, g_shape[2:3], emit, _aligned_shape(f.a, rank))
        bias = _per_head(None, values[f.bias], f.chain, g_shape[2:], emit, _aligned_shape(f.bias, rank))
    return log_gate(x, f.fn, a, bias, torch.float64)


def _differs_only_in_padding(f: _Fusion, got: torch.Tensor, want: torch.Tensor) -> bool:
    if not f.chain.pads:
        return False
    inner = tuple(slice(f.chain.pads.get(i, (0, 0))[0], got.shape[i] - f.chain.pads.get(i, (0, 0))[1])
                  for i in range(got.dim()))
    return torch.allclose(got[inner], want[inner], rtol=_CERT_TOL, atol=_CERT_TOL)


# ----------------------------------------------------------------------------------------------
# rewriting
# ----------------------------------------------------------------------------------------------


def _apply(graph: fx.Graph, f: _Fusion) -> None:
    op = f.op
    call = _unfused_call(op)
    g_shape = list(_val(call.g).shape)
    with graph.inserting_before(op):
        x = _replay(graph, f.x, f.chain, f.fn)
        a = bias = None
        if f.fn.name == "softplus":
            a = _per_head(graph, f.a, f.chain, g_shape[2:3])
            bias = _per_head(graph, f.bias, f.chain, g_shape[2:])
        fused = call.replace(g=x, gate=f.fn, gate_a=a, gate_bias=bias)
        new = graph.call_function(torch.ops.gla_inductor.chunk_fwd.default, fused.op_args())
    new.meta = dict(op.meta)
    op.replace_all_uses_with(new)
    graph.erase_node(op)
    log.info("gla_inductor: fused the %s gate into %s", f.fn.name, new.name)


class _GraphEmit:
    """Emits the fused gate's inputs as graph nodes (the rewrite)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph

    def function(self, target, *args, **kwargs):
        return self.graph.call_function(target, args, kwargs)

    def method(self, name, *args):
        return self.graph.call_method(name, args)


class _EagerEmit:
    """Computes the same inputs from tensors (the certificate)."""

    @staticmethod
    def function(target, *args, **kwargs):
        return target(*args, **kwargs)

    @staticmethod
    def method(name, self, *args):
        return getattr(self, name)(*args)


def _replay(graph: fx.Graph, x: fx.Node, chain: _Chain, fn: GateFn, emit=None) -> fx.Node:
    """x laid out as the gate was: the chain's permutation, and its padding with the value whose
    gate function is 0 before any clamp (logsigmoid(+inf) = 0, softplus(-inf) = 0), as the
    zero-padded gate had (the certificate refuses a clamp that moves that 0)."""
    emit = emit or _GraphEmit(graph)
    rank = len(chain.perm)
    if chain.perm != list(range(rank)):
        x = emit.function(torch.permute, x, chain.perm)
    if chain.pads:
        widths = []
        for axis in reversed(range(rank)):
            widths += list(chain.pads.get(axis, (0, 0)))
        while widths[-2:] == [0, 0]:
            widths = widths[:-2]
        neutral = math.inf if fn.name == "logsigmoid" else -math.inf
        x = emit.function(F.pad, x, widths, mode="constant", value=neutral)
    return x


def _per_head(graph: fx.Graph, p: fx.Node, chain: _Chain, shape: list, emit=None, aligned=None) -> fx.Node:
    """A per-head parameter as [H] (or [H, K]) in g's axis order: aligned to the gate function's
    rank, permuted as the chain did, the leading axes (size 1) dropped, broadcast (a view)."""
    emit = emit or _GraphEmit(graph)
    rank = len(chain.perm)
    aligned = aligned or _aligned_shape(p, rank)
    if list(p.shape if isinstance(p, torch.Tensor) else _val(p).shape) != aligned:
        p = emit.method("reshape", p, aligned)
    if chain.perm != list(range(rank)):
        p = emit.function(torch.permute, p, chain.perm)
    in_g = [aligned[i] for i in chain.perm]
    p = emit.method("reshape", p, in_g[2:2 + len(shape)])
    return emit.method("expand", p, shape)
