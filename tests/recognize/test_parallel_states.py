"""The parallel form with its states and in reverse: the anti-causal form (a triu mask, the
decay from a reverse cumsum) becomes chunk_fwd(reverse=True); a term q_i exp(G_i) h0 added to the
output becomes the op's initial state; a separate value sum_j exp(G_T - G_j) k_j^T v_j (+ exp(G_T)
h0) becomes its final state. Each program is rewritten once, with those options, and matches
float64 eager in value and in every gradient. Near misses (the decay against the mask's direction,
a mask or a state term one step off) keep the code that is not GLA."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gla_inductor

from helpers import (FP32_TOL, HEAD_FIRST_SIZES, check_rewrite_exact, compile_rewritten, head_first_inputs,
                     rel_err)

B, H, T, K, V = HEAD_FIRST_SIZES

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


def rcumsum(g, dim):
    return g.flip(dim).cumsum(dim).flip(dim)


# ---- reverse ----------------------------------------------------------------------------------
def reverse_scalar(q, k, v, g):
    G = rcumsum(g, -1)
    D = (G[..., :, None] - G[..., None, :]).exp().triu()
    return ((q @ k.transpose(-1, -2)) * D) @ v * 0.5


def reverse_vector_pairwise(q, k, v, g):
    G = rcumsum(g, 2)
    M = torch.ones(T, T, dtype=torch.bool).triu()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~M[:, :, None], float("-inf"))
    return (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1) @ v


def reverse_vector_factored(q, k, v, g):
    G = torch.flip(torch.cumsum(torch.flip(g, [2]), 2), [2])
    return ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).triu() @ v


def reverse_constant(q, k, v, g_gamma):
    i = torch.arange(T)
    D = torch.exp((i[None, :] - i[:, None]) * g_gamma[:, None, None]) * (i[None, :] >= i[:, None])
    return ((q @ k.transpose(-1, -2)) * D) @ v


def reverse_no_gate(q, k, v):
    return torch.einsum("bhij,bhjv->bhiv", torch.einsum("bhik,bhjk->bhij", q, k).triu(), v)


def reverse_exclusive_forward_cumsum(q, k, v, g):
    """The reverse decay exp(E_j - E_i) from a forward exclusive cumsum E = G - g."""
    E = g.cumsum(-1) - g
    D = (E[..., None, :] - E[..., :, None]).exp().triu()
    return ((q @ k.transpose(-1, -2)) * D) @ v


def reverse_suffix_sums_no_gate(q, k, v):
    """The suffix sums of the materialized outer products, flip-cumsum-flip over time."""
    S = (k[..., :, None] * v[..., None, :]).flip(2).cumsum(2).flip(2)
    return (q[..., :, None] * S).sum(-2)


def reverse_suffix_sums_vector(q, k, v, g):
    G = torch.flip(torch.cumsum(torch.flip(g, [2]), dim=2), dims=(2,))
    S = torch.flip(torch.cumsum(torch.flip(torch.einsum("bhtk,bhtv->bhtkv", k * (-G).exp(), v), [2]), 2), [2])
    return torch.einsum("bhtkv,bhtk->bhtv", S, q * G.exp())


# ---- initial state ------------------------------------------------------------------------------
def h0_scalar(q, k, v, g, h0):
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    return (((q @ k.transpose(-1, -2)) * D) @ v + G.exp()[..., None] * (q @ h0)) * K**-0.5


def h0_vector(q, k, v, g, h0):
    G = g.cumsum(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).tril()
    return A @ v + torch.einsum("bhtk,bhkv->bhtv", q * G.exp(), h0)


def h0_constant(q, k, v, g_gamma, h0):
    i = torch.arange(T)
    D = torch.exp((i[:, None] - i[None, :]) * g_gamma[:, None, None]) * (i[:, None] >= i[None, :])
    return ((q @ k.transpose(-1, -2)) * D) @ v + (q * ((i + 1)[:, None] * g_gamma[:, None, None]).exp()) @ h0


def h0_no_gate(q, k, v, h0):
    return (q @ k.transpose(-1, -2)).tril() @ v + q @ h0


def h0_reverse_constant(q, k, v, g_gamma, h0):
    i = torch.arange(T)
    D = torch.exp((i[None, :] - i[:, None]) * g_gamma[:, None, None]) * (i[None, :] >= i[:, None])
    return ((q @ k.transpose(-1, -2)) * D) @ v + (q * ((T - i)[:, None] * g_gamma[:, None, None]).exp()) @ h0


# the initial state added to the prefix sums of k^T v before the read: q (cumsum(k^T v) + h0)
def h0_in_prefix_sums_no_gate(q, k, v, h0):
    S = (k[..., :, None] * v[..., None, :]).cumsum(2) + h0[:, :, None]
    return (q[..., :, None] * S).sum(-2)


def h0_in_prefix_sums_vector(q, k, v, g, h0):
    G = g.cumsum(2)
    S = torch.einsum("bhtk,bhtv->bhtkv", k * (-G).exp(), v).cumsum(2) + h0.unsqueeze(2)
    return torch.einsum("bhtkv,bhtk->bhtv", S, q * G.exp()) * K**-0.5


def h0_in_prefix_sums_scalar_v_first(q, k, v, g, h0):
    """A per-step scalar gate; h0 kept as [.., V, K] and transposed into the sum."""
    G = g.cumsum(-1)[..., None]
    hv = h0.transpose(-1, -2).contiguous()
    S = ((k * (-G).exp())[..., :, None] * v[..., None, :]).cumsum(2) + hv.transpose(-1, -2)[:, :, None]
    return ((q * G.exp())[..., :, None] * S).sum(-2)


# ---- final state --------------------------------------------------------------------------------
def final_scalar(q, k, v, g, h0):
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    o = ((q @ k.transpose(-1, -2)) * D) @ v + (q * G.exp()[..., None]) @ h0
    last = G[..., -1:]
    S = (k * (last - G).exp()[..., None]).transpose(-1, -2) @ v + last.exp()[..., None] * h0
    return o, S


def final_vector_no_h0(q, k, v, g):
    G = g.cumsum(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).tril()
    return A @ v, torch.einsum("bhtk,bhtv->bhkv", k * (G[:, :, -1:] - G).exp(), v)


def final_reverse_vector(q, k, v, g, h0):
    G = rcumsum(g, 2)
    o = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).triu() @ v + (q * G.exp()) @ h0
    S = torch.einsum("bhtk,bhtv->bhkv", k * (G[:, :, :1] - G).exp(), v) + G[:, :, 0, :, None].exp() * h0
    return o, S


def final_constant(q, k, v, g_gamma, h0):
    i = torch.arange(T)
    D = torch.exp((i[:, None] - i[None, :]) * g_gamma[:, None, None]) * (i[:, None] >= i[None, :])
    o = ((q @ k.transpose(-1, -2)) * D) @ v + (q * ((i + 1)[:, None] * g_gamma[:, None, None]).exp()) @ h0
    S = (k * ((T - 1 - i)[:, None] * g_gamma[:, None, None]).exp()).transpose(-1, -2) @ v
    return o, S + (T * g_gamma).exp()[:, None, None] * h0


# name -> (fn, gate, h0, options of the rewrite)
GLA = {
    f.__name__: (f, gate, h0, opts) for f, gate, h0, opts in [
        (reverse_scalar, "scalar", False, {"reverse": True}),
        (reverse_vector_pairwise, "vector", False, {"reverse": True}),
        (reverse_vector_factored, "vector", False, {"reverse": True}),
        (reverse_constant, "constant", False, {"reverse": True}),
        (reverse_no_gate, "none", False, {"reverse": True}),
        (reverse_exclusive_forward_cumsum, "scalar", False, {"reverse": True}),
        (reverse_suffix_sums_no_gate, "none", False, {"reverse": True}),
        (reverse_suffix_sums_vector, "vector", False, {"reverse": True}),
        (h0_scalar, "scalar", True, {"reverse": False, "initial_state": True}),
        (h0_vector, "vector", True, {"initial_state": True}),
        (h0_constant, "constant", True, {"initial_state": True}),
        (h0_no_gate, "none", True, {"initial_state": True}),
        (h0_reverse_constant, "constant", True, {"reverse": True, "initial_state": True}),
        (h0_in_prefix_sums_no_gate, "none", True, {"initial_state": True}),
        (h0_in_prefix_sums_vector, "vector", True, {"initial_state": True}),
        (h0_in_prefix_sums_scalar_v_first, "scalar", True, {"initial_state": True}),
        (final_scalar, "scalar", True, {"initial_state": True, "final_state": True}),
        (final_vector_no_h0, "vector", False, {"initial_state": False, "final_state": True}),
        (final_reverse_vector, "vector", True, {"reverse": True, "initial_state": True, "final_state": True}),
        (final_constant, "constant", True, {"initial_state": True, "final_state": True}),
    ]
}


@pytest.mark.parametrize("name", sorted(GLA))
def test_rewritten_with_its_states(name):
    fn, gate, h0, opts = GLA[name]
    matches = check_rewrite_exact(fn, head_first_inputs(gate, h0))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("parallel", gate)]
    assert {k: matches[0].options[k] for k in opts} == opts


def test_inductor_reverse_with_states():
    """Through Inductor: the reverse op with both states compiles and is exact."""
    args = head_first_inputs("vector", h0=True)
    out = torch.compile(final_reverse_vector, backend=gla_inductor.backend, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    for o, w in zip(out, final_reverse_vector(*[a.double() for a in args])):
        assert rel_err(o, w) <= FP32_TOL


def test_dynamic_lengths_do_not_recompile():
    """The decay and the state terms are proven for every length: one graph, symbolic T."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(q, k, v, g, h0):
        G = rcumsum(g, -1)
        D = (G[..., :, None] - G[..., None, :]).exp().triu()
        return ((q @ k.transpose(-1, -2)) * D) @ v + (q * G.exp()[..., None]) @ h0

    cnt = CompileCounterWithBackend(gla_inductor.backend)
    compiled = torch.compile(fn, backend=cnt, dynamic=True, fullgraph=True)
    for t in (7, 11, 16):
        q, k, v = (torch.randn(2, 3, t, d) for d in (4, 4, 5))
        g, h0 = F.logsigmoid(torch.randn(2, 3, t)), torch.randn(2, 3, 4, 5)
        assert rel_err(compiled(q, k, v, g, h0), fn(*[x.double() for x in (q, k, v, g, h0)])) <= FP32_TOL
    assert cnt.frame_count == 1
    assert counters["gla_inductor"]["rewrites"] == 1


# ---- near misses ------------------------------------------------------------------------------
def near_reverse_mask_forward_decay(q, k, v, g):
    """triu with exp(G_i - G_j) of a forward cumsum: the decay runs against the mask."""
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().triu()) @ v


def near_reverse_strict(q, k, v, g):
    """The reverse decay without the diagonal."""
    G = rcumsum(g, -1)
    return ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().triu(1)) @ v


def near_reverse_forward_cumsum_shifted(q, k, v, g):
    """triu with exp(G_j - G_i) of a forward cumsum: the steps (i, j], not [i, j)."""
    G = g.cumsum(-1)
    return ((q @ k.transpose(-1, -2)) * (G[..., None, :] - G[..., :, None]).exp().triu()) @ v


@pytest.mark.parametrize("fn", [near_reverse_mask_forward_decay, near_reverse_strict,
                                near_reverse_forward_cumsum_shifted], ids=lambda f: f.__name__)
def test_near_miss_is_left_alone(fn):
    args = head_first_inputs("scalar")
    got, results = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*[a.double() for a in args])) <= FP32_TOL
    assert any(nm.form == "parallel" for r in results for nm in r.near_misses)


def near_h0_one_step_short(q, k, v, g, h0):
    """The initial state decayed to step i - 1: the attention is GLA, the term is not its h0."""
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    return ((q @ k.transpose(-1, -2)) * D) @ v + (q * (G - g).exp()[..., None]) @ h0


def near_h0_scaled_apart(q, k, v, g, h0):
    """The attention scaled, the initial-state term not."""
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    return ((q @ k.transpose(-1, -2)) * D) @ v * 0.5 + (q * G.exp()[..., None]) @ h0


def near_h0_forward_in_reverse(q, k, v, g, h0):
    """Reverse attention with the initial state decayed forward."""
    G = rcumsum(g, -1)
    D = (G[..., :, None] - G[..., None, :]).exp().triu()
    return ((q @ k.transpose(-1, -2)) * D) @ v + (q * g.cumsum(-1).exp()[..., None]) @ h0


def near_final_one_step_short(q, k, v, g):
    """The final state decayed to step T - 2."""
    G = g.cumsum(-1)
    o = ((q @ k.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).exp().tril()) @ v
    return o, (k * (G[..., -2:-1] - G).exp()[..., None]).transpose(-1, -2) @ v


def near_final_without_h0(q, k, v, g, h0):
    """The output reads h0, the final state leaves it out."""
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    o = ((q @ k.transpose(-1, -2)) * D) @ v + (q * G.exp()[..., None]) @ h0
    return o, (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ v


@pytest.mark.parametrize("fn,h0,left_out", [
    (near_h0_one_step_short, True, "initial_state"),
    (near_h0_scaled_apart, True, "initial_state"),
    (near_h0_forward_in_reverse, True, "initial_state"),
    (near_final_one_step_short, False, "final_state"),
    (near_final_without_h0, True, "final_state"),
], ids=lambda x: getattr(x, "__name__", None))
def test_state_term_off_by_one_stays_code(fn, h0, left_out):
    """The attention is rewritten; the state term that is not GLA's is computed as written."""
    matches = check_rewrite_exact(fn, head_first_inputs("scalar", h0))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert matches[0].options[left_out] is False


@pytest.mark.parametrize("fn,why", [
    (near_h0_one_step_short, "the decay of the state does not match the attention's"),
    (near_h0_scaled_apart, "the initial-state term is scaled differently from the attention"),
    (near_h0_forward_in_reverse, "the decay of the state does not match the attention's"),
], ids=lambda x: getattr(x, "__name__", None))
def test_state_term_left_out_says_why(fn, why):
    """The attention is rewritten alone; explain names the state term's fault under the parallel
    form (not a chunked reading that failed its certificate)."""
    report = gla_inductor.explain(fn, *head_first_inputs("scalar", True))
    assert [(m.form, m.options["initial_state"]) for m in report.matches] == [("parallel", False)]
    assert [(nm.form, nm.reason) for nm in report.near_misses] == [("parallel", f"{why}; the attention alone is GLA")]


def h0_added_twice(q, k, v, g, h0):
    """The prefix sums plus h0 plus 2 h0: loop-free code, no recurrence."""
    G = g.cumsum(2)
    kv = (k * (-G).exp())[..., :, None] * v[..., None, :]
    return ((q * G.exp())[..., :, None] * (kv.cumsum(2) + h0[:, :, None] + 2 * h0[:, :, None])).sum(-2)


def test_a_longer_sum_in_the_bracket_is_no_loop():
    """(x + h0) + 2 h0 is a sum of three tensors: explain gives no loop-form reason (an
    elementwise recurrence) for code without a loop; the code runs as written."""
    args = head_first_inputs("vector", True)
    report = gla_inductor.explain(h0_added_twice, *args)
    assert report.matches == [] and not any(nm.form == "loop" for nm in report.near_misses)
    got, _ = compile_rewritten(h0_added_twice, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], h0_added_twice(*[a.double() for a in args])) <= FP32_TOL


def near_prefix_sums_plus_steps(q, k, v):
    """A tensor over time added to the prefix sums: no initial state."""
    kv = k[..., :, None] * v[..., None, :]
    return (q[..., :, None] * (kv.cumsum(2) + kv.sin())).sum(-2)


def near_prefix_sums_h0_undecayed(q, k, v, g, h0):
    """Gated prefix sums plus h0, read by an ungated q: h0 is not decayed as GLA's, and neither
    are the prefix sums."""
    G = g.cumsum(-1)[..., None]
    S = ((k * (-G).exp())[..., :, None] * v[..., None, :]).cumsum(2) + h0[:, :, None]
    return (q[..., :, None] * S).sum(-2)


def near_prefix_sums_h0_one_step_late(q, k, v, g, h0):
    """The attention is GLA's; h0 is decayed one step less than GLA's initial state, so the
    bracket is not read as one."""
    G = g.cumsum(-1)[..., None]
    S = ((k * (-G).exp())[..., :, None] * v[..., None, :]).cumsum(2) + (h0 * g[..., :1, None].exp())[:, :, None]
    return ((q * G.exp())[..., :, None] * S).sum(-2)


@pytest.mark.parametrize("fn,h0", [(near_prefix_sums_plus_steps, False), (near_prefix_sums_h0_undecayed, True),
                                   (near_prefix_sums_h0_one_step_late, True)], ids=lambda x: getattr(x, "__name__", None))
def test_prefix_sums_with_a_term_that_is_no_initial_state_stay_code(fn, h0):
    args = head_first_inputs("none" if fn is near_prefix_sums_plus_steps else "scalar", h0)
    got, results = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*[a.double() for a in args])) <= FP32_TOL
    assert any(nm.form == "parallel" for r in results for nm in r.near_misses)


def h0_term_by_broadcast_sum(q, k, v, g, h0):
    """q e^G h0 as a broadcast product and a sum over K: no scores of two steps (e^G is over one)."""
    G = g.cumsum(2)
    qe = q * G.exp()
    return ((qe @ (k * (-G).exp()).transpose(-1, -2)).tril() @ v + (qe[..., :, None] * h0[:, :, None]).sum(-2))


@pytest.mark.parametrize("fn,gate", [(h0_term_by_broadcast_sum, "vector"), (h0_in_prefix_sums_scalar_v_first, "scalar")],
                         ids=lambda x: getattr(x, "__name__", None))
def test_the_rewrite_is_the_only_finding(fn, gate):
    """The initial state read by a gated q and summed over K is no normalized attention's scores:
    explain lists the rewrite and no near miss beside it."""
    report = gla_inductor.explain(fn, *head_first_inputs(gate, True))
    assert [(m.form, m.gate, m.options["initial_state"]) for m in report.matches] == [("parallel", gate, True)]
    assert report.near_misses == []


def bidirectional_sums(q, k, v):
    """Prefix sums read forward plus suffix sums read backward: two ops, one of each direction."""
    kv = k[..., :, None] * v[..., None, :]
    return (q[..., :, None] * kv.cumsum(2)).sum(-2) + (q[..., :, None] * kv.flip(2).cumsum(2).flip(2)).sum(-2)


def test_prefix_and_suffix_sums_are_two_ops():
    matches = check_rewrite_exact(bidirectional_sums, head_first_inputs("none"))
    assert sorted(m.options["reverse"] for m in matches) == [False, True]


def test_two_ops_summed_are_the_only_findings():
    """The sum of the two attentions is no chunked computation that failed its certificate:
    explain lists the two rewrites and nothing beside them."""
    report = gla_inductor.explain(bidirectional_sums, *head_first_inputs("none"))
    assert sorted((m.form, m.options["reverse"]) for m in report.matches) == [("parallel", False), ("parallel", True)]
    assert report.near_misses == []


def flipped_along_keys(q, k, v):
    """flip-cumsum-flip with the flips over K: the prefix sums, each row's keys reversed twice."""
    return (q[..., :, None] * (k[..., :, None] * v[..., None, :]).flip(3).cumsum(2).flip(3)).sum(-2)


def suffix_sums_in_reversed_rows(q, k, v):
    """flip-cumsum without the last flip: row t holds the suffix sums from T - 1 - t."""
    return (q[..., :, None] * (k[..., :, None] * v[..., None, :]).flip(2).cumsum(2)).sum(-2)


@pytest.mark.parametrize("fn", [flipped_along_keys, suffix_sums_in_reversed_rows], ids=lambda f: f.__name__)
def test_flips_that_are_no_suffix_sums_stay_code(fn):
    args = head_first_inputs("none")
    got, _ = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*[a.double() for a in args])) <= FP32_TOL
