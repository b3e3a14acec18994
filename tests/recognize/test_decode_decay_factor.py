"""Decode steps whose state decays by a factor the graph computes, not exp(g): accepted with the
gate log(a) where a sign analysis proves a >= 0, with a factor 1 / y on the outer product folded
into k or v (torchscale RetNet's recurrent step, here without torchscale: the sqrt ratio of a
running decay sum). Each spelling is compiled with the rewrite and compared with float64 eager
(outputs, the new state, a cache written in place, and where gradients flow, every gradient);
factors that may be negative are left alone with the reason."""

import re

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.recognize import rewrite_graph

from helpers import FP32_TOL, check_rewrite_exact, compile_rewritten, outputs, rel_err

B, H, K, V = 2, 3, 4, 5

pytestmark = pytest.mark.usefixtures("one_thread", "seeded_compiler")


def _retnet_step(q, k, v, prev, prev_scale, decay, v_first: bool):
    """torchscale 0.3.0's recurrent retention step: the state divided by the root of a running
    decay sum. q, k [B, H, 1, K] (V-first) or [B, H, K, 1]; v [B, H, V]; decay [H], >= 0."""
    scale = prev_scale * decay + 1
    a = (prev_scale.sqrt() * decay / scale.sqrt()).view(H, 1, 1)
    if v_first:
        kv = k * v.view(B, H, V, 1)
        state = prev * a + kv / scale.sqrt().view(H, 1, 1)
        return torch.sum(q * state, dim=3), state, scale
    kv = k * v.view(B, H, 1, V)
    state = prev * a + kv / scale.sqrt().view(H, 1, 1)
    return torch.sum(q * state, dim=2), state, scale


def retnet_v_first(q, k, v, prev, prev_scale, log_decay):
    return _retnet_step(q, k, v, prev, prev_scale, log_decay.exp(), True)


def retnet_k_first(q, k, v, prev, prev_scale, log_decay):
    """The state K-first [B, H, K, V] (prev is given so)."""
    return _retnet_step(q.transpose(2, 3), k.transpose(2, 3), v, prev, prev_scale, log_decay.exp(), False)


def retnet_constant(q, k, v, prev, prev_scale):
    """The decay a Python number (0.9), not a tensor."""
    return _retnet_step(q, k, v, prev, prev_scale, 0.9, True)


def sigmoid_gate(q, k, v, prev, prev_scale, x):
    """A K-first state decayed by sigmoid(x) per head and batch (a [B, H, 1, 1] factor)."""
    a = torch.sigmoid(x.view(B, H, 1, 1) + prev_scale.view(1, H, 1, 1))
    state = prev * a + k.transpose(2, 3) * v.view(B, H, 1, V)
    return (q.transpose(2, 3) * state).sum(2), state


def key_divisor(q, k, v, prev, prev_scale, x):
    """The outer product divided per key (a [B, H, K, 1] divisor, folded into k) and the state
    decayed by a softplus over abs: softplus(x) / (1 + |x|)."""
    a = (torch.nn.functional.softplus(x + prev_scale) / (1 + x.abs())).view(B, H, 1, 1)
    n = (k.transpose(2, 3).square() + 1).sqrt()  # [B, H, K, 1]
    state = prev * a + k.transpose(2, 3) * v.view(B, H, 1, V) / n
    return (q.transpose(2, 3) * state).sum(2), state


class BufferDecay(torch.nn.Module):
    """The decay exp(buffer) of a module (torchscale's `self.decay.exp()`), V-first."""

    def __init__(self):
        super().__init__()
        self.register_buffer("log_decay", torch.log(1 - 2 ** (-5 - torch.arange(H, dtype=torch.float64))))

    def forward(self, q, k, v, prev, prev_scale, unused):
        return _retnet_step(q, k, v, prev, prev_scale, self.log_decay.exp().to(q.dtype), True)


def make(seed: int = 0, v_first: bool = True) -> list:
    """q, k [B, H, 1, K]; v [B, H, V]; the state [B, H, V, K] (V-first) or [B, H, K, V];
    prev_scale [H] > 0; the log-decay [H]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, 1, K, generator=gen), torch.randn(B, H, 1, K, generator=gen)
    v, prev = torch.randn(B, H, V, generator=gen), torch.randn(B, H, V, K, generator=gen)
    prev_scale = torch.rand(H, generator=gen) * 5 + 1
    log_decay = torch.log(1 - 2 ** (-5 - torch.arange(H, dtype=torch.float32)))
    return [q, k, v, prev if v_first else prev.transpose(2, 3).contiguous(), prev_scale, log_decay]


def make_k_first() -> list:
    return make(v_first=False)


def make_gate_input() -> list:
    """make_k_first's, with a gate input [B, H] for the log-decay."""
    args = make_k_first()
    args[-1] = torch.randn(B, H, generator=torch.Generator().manual_seed(1))
    return args


def with_cache(fn, args: list, cached: int):
    """(fn of the first `cached` args, those args): the others (the running decay sum and the
    log-decay, a cache and a buffer) are fixed tensors that need no gradient."""
    rest = args[cached:]
    return (lambda *leaves: fn(*leaves, *rest)), args[:cached]


@pytest.mark.parametrize("fn, inputs, cached", [
    (retnet_v_first, make, 4), (retnet_k_first, make_k_first, 4), (retnet_constant, lambda: make()[:5], 4),
    (sigmoid_gate, make_gate_input, 6), (key_divisor, make_gate_input, 6),
], ids=["sqrt_ratio_v_first", "sqrt_ratio_k_first", "python_constant", "sigmoid", "key_divisor"])
def test_rewritten_and_exact_with_gradients(fn, inputs, cached):
    """One decode rewrite; outputs, the new state and the gradients of q, k, v, the state (and
    of the gate's inputs, where the factor is proven positive) as float64 eager's."""
    matches = check_rewrite_exact(*with_cache(fn, inputs(), cached))
    assert [m.form for m in matches] == ["decode"]
    assert matches[0].options["initial_state"]


def test_factor_that_may_be_zero_needs_no_gradient():
    """sqrt(s_prev) may be 0, where d/da log(a) is 0 / 0: left alone when the running sum
    needs a gradient, rewritten when it does not (above)."""
    args = [a.requires_grad_() for a in make()]
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite_graph(gm))
        return gm.forward

    got = outputs(torch.compile(retnet_v_first, backend=backend, fullgraph=True)(*args))
    assert not [m for r in results for m in r.matches]
    assert [n.reason for r in results for n in r.near_misses] == [
        "decay factor div(mul(sqrt(l_prev_scale_), exp(l_log_decay_)), sqrt(add(mul, 1))) may be zero where its "
        "gradient is needed: expected exp(g) or a provably positive factor"]
    for g, w in zip(got, outputs(retnet_v_first(*args))):
        assert torch.equal(g, w)


def test_buffer_decay_is_rewritten_and_exact():
    module = BufferDecay()
    args = make()
    with torch.no_grad():
        got, results = compile_rewritten(module, args)
        want = outputs(module.double()(*[a.double() for a in args]))
    assert [m.form for r in results for m in r.matches] == ["decode"]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= FP32_TOL


def in_place(q, k, v, cache, prev_scale, log_decay):
    """The new state written back into the V-first cache (`copy_`), then read."""
    o, state, scale = retnet_v_first(q, k, v, cache, prev_scale, log_decay)
    cache.copy_(state)
    prev_scale.copy_(scale)
    return o


def test_in_place_cache_v_first():
    """The cache is updated in place by the op (fused_recurrent on a [B, H, K, V] view of the
    V-first cache: no transposed copy), with the user's copy_ gone; cache and output exact."""
    args = make()
    ref = [a.double().clone() for a in args]
    want = in_place(*ref)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(rewrite_graph(gm))
        graphs.append({str(n.target) for n in gm.graph.nodes})
        graphs.append(gm.graph)
        return gm.forward

    got_args = [a.clone() for a in args]
    with torch.no_grad():
        got = torch.compile(in_place, backend=backend, fullgraph=True)(*got_args)
    result, ops, graph = graphs
    assert [m.form for m in result.matches] == ["decode"]
    assert "gla_inductor.fused_recurrent.default" in ops
    assert sum(str(n.target) == "copy_" for n in graph.nodes) == 1  # prev_scale's; the state's is gone
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(got_args[3], ref[3]) <= FP32_TOL, "the cache written back"
    assert rel_err(got_args[4], ref[4]) <= FP32_TOL, "the running decay sum"


# ---- factors that may be negative ----------------------------------------------------------------
def raw_parameter(q, k, v, prev, w):
    return _k_first_step(q, k, v, prev, w.view(1, H, 1, 1))


def one_minus(q, k, v, prev, w):
    return _k_first_step(q, k, v, prev, (1 - w).view(1, H, 1, 1))


def tanh(q, k, v, prev, w):
    return _k_first_step(q, k, v, prev, torch.tanh(w).view(1, H, 1, 1))


def _k_first_step(q, k, v, prev, a):
    state = prev * a + k.transpose(2, 3) * v.view(B, H, 1, V)
    return (q.transpose(2, 3) * state).sum(2), state


@pytest.mark.parametrize("fn, expr", [(raw_parameter, "l_w_"), (one_minus, "sub(1, l_w_)"),
                                      (tanh, "tanh(l_w_)")], ids=["raw_parameter", "one_minus", "tanh"])
def test_factor_that_may_be_negative_is_left_alone(fn, expr):
    gen = torch.Generator().manual_seed(3)
    q, k, v, prev, _, _ = make_k_first()
    args = [q, k, v, prev, torch.rand(H, generator=gen)]
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite_graph(gm))
        return gm.forward

    got = outputs(torch.compile(fn, backend=backend, fullgraph=True)(*args))
    want = outputs(fn(*args))
    assert not [m for r in results for m in r.matches]
    assert counters["gla_inductor"]["rewrites"] == 0
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "decode"]
    assert reasons == [f"decay factor {expr} may be negative: expected exp(g) or a provably nonnegative factor"]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def full_constant(q, k, v, prev):
    """A decay tensor the graph builds from constants: torch.full(0.9), proven by its op."""
    return _k_first_step(q, k, v, prev, torch.full((H, 1, 1), 0.9))


def retnet_formula(q, k, v, prev):
    """1 - 2 ** (-5 - h), torchscale's decay, built in the graph: positive, but only by its values."""
    return _k_first_step(q, k, v, prev, (1 - 2 ** (-5 - torch.arange(H, dtype=torch.float32))).view(H, 1, 1))


@pytest.mark.parametrize("fn, gates, reasons", [
    (full_constant, ["constant"], []),
    (retnet_formula, [], ["decay factor sub(1, pow(2, sub(-5, arange))) may be negative: expected exp(g) or a "
                          "provably nonnegative factor"]),
], ids=["full", "retnet_formula"])
def test_constant_tensor_decay(fn, gates, reasons):
    args = make_k_first()[:4]
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite_graph(gm))
        return gm.forward

    with torch.no_grad():
        got = outputs(torch.compile(fn, backend=backend, fullgraph=True)(*args))
        want = outputs(fn(*[a.double() for a in args]))
    assert [m.gate for r in results for m in r.matches] == gates
    assert [n.reason for r in results for n in r.near_misses] == reasons
    for g, w in zip(got, want):
        assert rel_err(g, w) <= FP32_TOL


# ---- time loops share the step analysis ----------------------------------------------------------
T = 5


def loop(q, k, v, x, y, gate=None):
    """A Dynamo-unrolled loop whose decay a_t = softplus(x_t) / (1 + |x_t|) and divisor
    sqrt(y_t^2 + 1) of the outer product each step computes from its own slices."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        a = gate(x[:, t]) if gate is not None else torch.nn.functional.softplus(x[:, t]) / (1 + x[:, t].abs())
        n = (y[:, t].square() + 1).sqrt().view(B, H, 1, 1)
        S = S * a.view(B, H, 1, 1) + k[:, t, :, :, None] * v[:, t, :, None, :] / n
        outs.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, 1)


def loop_inputs() -> list:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
            torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, generator=gen),
            torch.randn(B, T, H, generator=gen)]


def test_loop_with_computed_decay_and_divisor():
    matches = check_rewrite_exact(loop, loop_inputs())
    assert [(m.form, m.gate) for m in matches] == [("loop", "scalar")]


def test_loop_with_tanh_decay_is_left_alone():
    def tanh_loop(q, k, v, x, y):
        return loop(q, k, v, x, y, gate=torch.tanh)

    results = []

    def backend(gm, example_inputs):
        results.append(rewrite_graph(gm))
        return gm.forward

    args = loop_inputs()
    got = torch.compile(tanh_loop, backend=backend, fullgraph=True)(*args)
    assert torch.equal(got, tanh_loop(*args))
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses if n.form == "loop"]
    assert reasons and all("may be negative: expected exp(g) or a provably nonnegative factor" in r for r in reasons)
    assert re.match(r"decay factor tanh\(l_x_\[:, \d\]\) may be negative", reasons[0]), reasons[0]  # a step's own slice


# ---- the sign analysis on its own ----------------------------------------------------------------
POS, NONNEG, UNKNOWN = 2, 1, 0
SIGNS = [
    (lambda x, w: x.exp() * w.sigmoid(), POS),
    (lambda x, w: x.sqrt() / (x.abs() + 1), NONNEG),  # sqrt(-x) is NaN, which the gate carries
    (lambda x, w: torch.nn.functional.softplus(x) + torch.relu(w) * 2, POS),
    (lambda x, w: x.square().rsqrt() + x.pow(2) + x ** 0.5 + 2 ** w, POS),
    (lambda x, w: x.square().rsqrt() + x.pow(2) + x ** 0.5, NONNEG),
    (lambda x, w: x.clamp(min=0.1) * torch.maximum(w, x.exp()), POS),
    (lambda x, w: x.clamp(min=0), NONNEG),
    (lambda x, w: torch.where(x > 0, x.exp(), torch.ones_like(x)).float().view(-1), POS),
    (lambda x, w: torch.full_like(x, 0.5) * torch.ones_like(w), POS),
    (lambda x, w: x.view(-1) * 1.0, UNKNOWN),  # an input: its values may change
    (lambda x, w: 1 - x.sigmoid(), UNKNOWN),  # a difference (>= 0 here, but not proven so)
    (lambda x, w: x.exp() * -1, UNKNOWN),
    (lambda x, w: x.pow(3), UNKNOWN),
    (lambda x, w: torch.tanh(x).abs() * torch.tanh(w), UNKNOWN),
    (lambda x, w: torch.floor_divide(x.exp(), w.exp()), UNKNOWN),
    (lambda x, w: torch.reciprocal(x), UNKNOWN),
    (lambda x, w: x.exp().clamp(max=-1.0), UNKNOWN),
    (lambda x, w: x.exp().clamp(min=0.0, max=2.0), POS),
]


@pytest.mark.parametrize("expr, level", SIGNS, ids=[str(i) for i in range(len(SIGNS))])
def test_sign_analysis(expr, level):
    from gla_inductor.recognize.core.analyzer import Analyzer
    from gla_inductor.recognize.forms.decay_sign import sign_level

    found = []

    def backend(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        found.append(sign_level(Analyzer(gm.graph), out))
        return gm.forward

    torch.compile(lambda x, w: (expr(x, w),), backend=backend, fullgraph=True)(torch.randn(3), torch.randn(3))
    assert found == [level]
