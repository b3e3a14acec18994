"""The float64 certificate: a candidate's replacement equals the user's subgraph, by value.

The subgraph from a ``Spec``'s inputs (the leaves) to its output and final state must be a
pure function of them, built only from analytic ops (``subgraph.py``: sums, products,
contractions, exp, cumsum, views, pads, concatenation, masks that are constants): no
comparison, clamp or other branch on data. It runs in float64 on random inputs, and so does
the exact replacement the rewrite would insert (``spec.emit_replacement``), with the GLA op
replaced by the naive reference recurrence. Both are exponential polynomials of the inputs on
fixed masks: if they differ, they differ on all but a measure-zero set of inputs, so
agreement (to the float32 rounding of the code's own constants, CERT_RTOL) at two random
points certifies that they are equal. Sizes must be static (Dynamo specializes them, and the
certificate holds at those sizes). A certificate is kept per subgraph structure (sizes
included), so the layers of a model pay once.

*Its cost.* At model sizes the user's subgraph materializes [b, c, l, l, h] tensors and
larger: gigabytes in float64. Where the subgraph is proven to treat every batch and head
alike (``shrink.py``: a table of ops, tags on the batch and head axes, constants checked by
value; the argument is written there), both sides run at 2 batches and 2 heads instead,
which certifies the full sizes. Otherwise the full-size certificate runs if its estimated
float64 memory is within CERT_BUDGET_BYTES, and the candidate is rejected if not. (One
transformers Mamba2Mixer at 1.3B sizes, B=4, T=4096, 64 heads of 64, state 128: ~13.5 GiB
estimated at full size, 0.2 GiB at 2 batches and 2 heads.)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ...contract import GLACall
from ...reference import naive_recurrent_gla
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import Emitter, Transaction, fake_mode
from ..core.match import Reject
from . import shrink, summed_products
from .spec import Spec, emit_replacement
from .subgraph import evaluate_consts, subgraph

log = logging.getLogger("gla_inductor")

# Agreement required of the certificate (relative, float64). Not tighter: the code's own
# constants (decay tables from a float32 arange) carry float32 rounding into the comparison;
# a function that is not GLA differs by far more at random inputs.
CERT_RTOL = 1e-6
CERTIFIED: dict = {}  # structure of a certified subgraph -> whether it certified (bounded below)
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


def certify(an: Analyzer, spec: Spec) -> bool:
    """Whether the subgraph from the spec's inputs to its outputs equals the replacement."""
    leaves = spec.leaves()
    cut = set(leaves.values())
    nodes, frontier, consts = subgraph(an, spec.outputs(), cut, static=spec.static_tables)
    if frontier or any(_symbolic(n) for n in list(nodes) + list(cut)):
        return False
    if not evaluate_consts(an, consts):
        return False
    key = _structure(an, spec, nodes, consts, leaves)
    if key in CERTIFIED:
        return CERTIFIED[key]
    plan = plan_certificate(an, spec, nodes, consts, spec.outputs())
    rewritten = _emission_module(an, plan.spec, plan.shapes)
    counters["gla_inductor"]["certificates_reduced" if plan.reduced else "certificates_full"] += 1
    with one_thread(plan.reduced):
        ok = all(_agree(plan.original, rewritten, plan.shapes, seed, spec.gate_is_log) for seed in (0, 1))
    if len(CERTIFIED) > 256:
        CERTIFIED.clear()
    CERTIFIED[key] = ok
    return ok


@dataclass
class Plan:
    """What the certificate runs: the original subgraph, the spec and the inputs' shapes, at
    reduced sizes or at full size."""

    original: fx.GraphModule
    spec: Spec
    shapes: dict  # leaf role -> shape
    reduced: bool


def plan_certificate(an: Analyzer, spec: Spec, nodes: set, consts: dict, outputs: list) -> Plan:
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
            return Plan(module, replace(spec, sizes=red.sizes, gamma=red.gamma), red.shapes, True)
        why = f"even at {shrink.KEEP} batches and heads it needs ~{need / 2**30:.1f} GiB"
    shapes = {r: tuple(example_value(n).shape) for r, n in leaves.items()}
    need = _bytes(an, nodes, outputs, lambda n: _numel(example_value(n)), shapes, consts)
    if need > CERT_BUDGET_BYTES:
        raise CertificateTooLarge(
            f"the float64 certificate needs ~{need / 2**30:.1f} GiB at full size (budget "
            f"{CERT_BUDGET_BYTES / 2**30:.1f} GiB), and fewer batches and heads will not do: {why}", reducible)
    return Plan(_slice_module(an, nodes, consts, leaves, outputs), spec, shapes, False)


@contextlib.contextmanager
def one_thread(on: bool):
    """At reduced sizes the certificate is thousands of small ops (the reference recurrence
    steps through time): intra-op threads only synchronize, and on a busy host that made it
    many times slower."""
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
    fused = {n for n in order
             if summed_products.is_summed_product(n) and n not in outputs and set(n.users) <= nodes}
    held = lambda n: 0 if n in fused else numel(n)  # noqa: E731 - the product is never materialized
    return 8 * (inputs + fixed) + shrink.peak_bytes(order, held, outputs)


def _numel(val) -> int:
    return val.numel() if isinstance(val, torch.Tensor) else 0


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
            with fake_mode(an.graph):
                val = torch.empty(shapes[role], dtype=val.dtype, device=val.device)
        nodes[role].meta["example_value"] = val
    out = g.output(None)
    em = Emitter(Transaction(g), out, spec.sizes, spec.splits)
    outs = emit_replacement(em, spec, nodes)
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
        want = Float64Interpreter(original).run(*args)
        got = Float64Interpreter(rewritten).run(*args)
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
    """An argument for the float64 CPU run: float dtypes as float64, devices as the CPU (the
    user's code on a GPU creates its zeros and positions there; the certificate's inputs are
    CPU tensors)."""
    if isinstance(x, torch.dtype):
        return torch.float64 if x.is_floating_point else x
    if isinstance(x, torch.device):
        return _CPU
    if isinstance(x, (list, tuple)) and any(isinstance(i, (torch.dtype, torch.device)) for i in x):
        return type(x)(map(_f64, x))
    return x


def _f64_kwargs(kwargs: dict) -> dict:
    return {k: _CPU if k == "device" and isinstance(v, str) else _f64(v) for k, v in kwargs.items()}


_CPU = torch.device("cpu")


class Float64Interpreter(fx.Interpreter):
    """Runs a graph in float64 on the CPU: casts and factories to other float types go to
    float64, devices to the CPU, and the GLA op is the naive reference recurrence."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.gla_inductor.chunk_fwd.default:
            return reference_op(*args, **kwargs)
        return super().call_function(target, tuple(map(_f64, args)), _f64_kwargs(kwargs))

    def call_method(self, target, args, kwargs):
        if target in ("float", "half", "bfloat16"):
            target = "double"
        elif target == "cuda":
            target = "cpu"
        args = tuple(_CPU if target == "to" and isinstance(a, str) and a.split(":")[0] == "cuda" else _f64(a)
                     for a in args)
        return super().call_method(target, args, _f64_kwargs(kwargs))


def reference_op(*args, **kwargs) -> tuple:
    """chunk_fwd's (o, final state) by the naive float64 recurrence, for its arguments (the final
    state whether the call stores it or not)."""
    call = GLACall.from_op_args(args, kwargs)
    return naive_recurrent_gla(call.q, call.k, call.v, call.g, g_gamma=call.g_gamma, scale=call.scale,
                               initial_state=call.initial_state, output_final_state=True, reverse=call.reverse)
