"""Packed sequences written as a loop over spans (recognize/forms/packed_spans.py): the N calls
the forms rewrite each span to become one chunk_fwd with cu_seqlens, exact in value, final
states and every gradient against the user's program run in float64 (each span on its own);
spans that cannot be packed stay N calls with a reason."""

import operator

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.backend import rewrite
from gla_inductor.reference import naive_recurrent_gla
from helpers import FP32_TOL, check_against_float64, outputs, rel_err

pytestmark = pytest.mark.usefixtures("seeded_compiler")

H, K, V = 2, 4, 3


# ---- the programs ----------------------------------------------------------------------------
def loop_gla(q, k, v, g, h0=None):
    """The README's time loop, [B, T, H, D], from zeros or h0."""
    B, T, _, Kd = q.shape
    S = q.new_zeros(B, q.shape[2], Kd, v.shape[-1]) if h0 is None else h0
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * Kd ** -0.5
    return o, S


def parallel_gla(q, k, v, g):
    """Scalar-gate parallel form, [B, T, H, D]."""
    T = q.shape[1]
    G = g.cumsum(1)
    D = (G[:, :, None, :] - G[:, None, :, :]).exp()
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    A = torch.einsum("bihk,bjhk->bijh", q, k) * D.masked_fill(~mask[None, :, :, None], 0)
    return torch.einsum("bijh,bjhv->bihv", A, v) * q.shape[-1] ** -0.5


def reverse_loop_gla(q, k, v, g):
    """The time loop run backwards, from zeros."""
    B, T, _, Kd = q.shape
    S = q.new_zeros(B, q.shape[2], Kd, v.shape[-1])
    o = torch.zeros_like(v)
    for t in reversed(range(T)):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2)
    return o, S


def loop_program(spans, h0_spans=(), gla=loop_gla):
    """Outputs written into a buffer span by span, final states stacked; the spans numbered in
    h0_spans start from the inputs after g, in that order."""
    def fn(q, k, v, g, *h0s):
        o = torch.zeros_like(v)
        states = []
        for i, (s, e) in enumerate(spans):
            h = (h0s[h0_spans.index(i)],) if i in h0_spans else ()
            o[:, s:e], S = gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], *h)
            states.append(S)
        return o, torch.stack(states, 1)
    return fn


def parallel_program(spans):
    """Outputs of the spans concatenated along time."""
    def fn(q, k, v, g):
        return torch.cat([parallel_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e]) for s, e in spans], 1)
    return fn


def inputs(B, T, gate="vector", seed=0, N=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn((B, T, H, K) if gate == "vector" else (B, T, H), generator=gen))
    return [q, k, v, g, *(torch.randn(B, H, K, V, generator=gen) for _ in range(N))]


# ---- running them --------------------------------------------------------------------------
def rewritten(fn, args):
    """(outputs, the rewritten graphs, the rewrite results) of fn compiled with the rewrite only."""
    graphs, results = [], []

    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, graphs, results


def chunk_calls(graphs) -> list:
    target = torch.ops.gla_inductor.chunk_fwd.default
    return [n for gr in graphs for n in gr.nodes if n.target is target]


def offsets_of(op) -> list | None:
    """The cu_seqlens a chunk_fwd node passes (a torch.tensor of a list in the graph), or None."""
    if len(op.args) < 16 or op.args[15] is None:
        return None
    cu = op.args[15]
    assert cu.target is torch.tensor
    return list(cu.args[0])


def packed_offsets(spans, T, B=1) -> list:
    """The cu_seqlens one call over `spans` (sorted, disjoint) of [0, T) passes: the spans and the
    gaps between them, for each batch row."""
    bounds, pos = [], 0
    for s, e in sorted(spans):
        if s > pos:
            bounds.append(s)
        bounds.append(e)
        pos = e
    if pos < T:
        bounds.append(T)
    return [0] + [b * T + x for b in range(B) for x in bounds]


def check_exact(fn, args, tol=FP32_TOL):
    """fn compiled with the rewrite against fn in float64 (which runs each span alone): outputs
    and the gradient of every input. Returns the rewritten graphs and results."""
    args = [a.clone().requires_grad_() for a in args]
    out, graphs, results = rewritten(fn, args)
    check_against_float64(fn, args, out, tol)
    return graphs, results


# ---- merged ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [(3, 2, 4), (1, 3, 0, 5), (2, 2, 2), (5, 1, 2)],
                         ids=lambda ls: "-".join(map(str, ls)))
def test_loop_spans_are_one_varlen_call(lengths):
    spans, pos = [], 0
    for n in lengths:
        spans.append((pos, pos + n))
        pos += n
    graphs, results = check_exact(loop_program(spans), inputs(1, pos))
    calls = chunk_calls(graphs)
    assert len(calls) == 1
    # a 1-step span from zero and an empty one are not rewritten by the loop form: they are
    # gaps of the packed call, their outputs the user's own code
    rewritten_spans = [(s, e) for s, e in spans if e - s > 1]
    assert offsets_of(calls[0]) == packed_offsets(rewritten_spans, pos)
    assert sorted(m.options.get("packed") for m in results[0].matches) == [len(rewritten_spans)] * len(rewritten_spans)


@pytest.mark.parametrize("lengths", [(63, 64, 65), (1, 64, 0, 65), (65, 63)], ids=lambda ls: "-".join(map(str, ls)))
def test_parallel_spans_at_chunk_boundaries(lengths):
    spans, pos = [], 0
    for n in lengths:
        spans.append((pos, pos + n))
        pos += n
    graphs, _ = check_exact(parallel_program(spans), inputs(1, pos, gate="scalar"), tol=1e-4)
    calls = chunk_calls(graphs)
    assert len(calls) == 1
    assert offsets_of(calls[0]) == packed_offsets(spans, pos)  # the empty span is a sequence of 0 steps


def test_spans_by_split():
    lengths = [3, 0, 5, 1]

    def fn(q, k, v, g):
        parts = zip(*(x.split(lengths, 1) for x in (q, k, v, g)))
        return torch.cat([parallel_gla(*p) for p in parts], 1)

    graphs, _ = check_exact(fn, inputs(2, 9, gate="scalar"))
    calls = chunk_calls(graphs)
    assert len(calls) == 1 and offsets_of(calls[0]) == packed_offsets([(0, 3), (3, 3), (3, 8), (8, 9)], 9, B=2)


def test_gate_computed_per_span_is_packed_and_fused():
    """Each span computes its gate from its slice of x; the packed call reads x through the
    fused logsigmoid / 16 (gate fusion runs after packing), and only o is used."""
    spans = [(0, 4), (4, 9)]

    def fn(q, k, v, x):
        o = torch.zeros_like(v)
        for s, e in spans:
            o[:, s:e] = loop_gla(q[:, s:e], k[:, s:e], v[:, s:e], F.logsigmoid(x[:, s:e]) / 16)[0]
        return o

    graphs, _ = check_exact(fn, inputs(1, 9))
    calls = chunk_calls(graphs)
    assert len(calls) == 1 and offsets_of(calls[0]) == packed_offsets(spans, 9)
    assert calls[0].args[9:11] == ("logsigmoid", 1 / 16)


def test_batched_spans_pack_the_batch_too():
    spans = [(0, 4), (4, 9)]
    graphs, _ = check_exact(parallel_program(spans), inputs(3, 9, gate="scalar"))
    calls = chunk_calls(graphs)
    assert len(calls) == 1 and offsets_of(calls[0]) == packed_offsets(spans, 9, B=3)


@pytest.mark.parametrize("h0_spans", [(0, 1, 2), (1,)], ids=["all", "middle"])
def test_initial_states_and_final_states_per_span(h0_spans):
    spans = [(0, 3), (3, 7), (7, 12)]
    fn = loop_program(spans, h0_spans)
    args = inputs(2, 12, N=len(h0_spans))
    graphs, _ = check_exact(fn, args)
    calls = chunk_calls(graphs)
    assert len(calls) == 1 and offsets_of(calls[0]) == packed_offsets(spans, 12, B=2)
    # against the float64 time loop run on each sequence alone
    o, states = outputs(torch.compile(fn, backend=gla_inductor.backend, fullgraph=True)(*args))
    q, k, v, g, *h0s = (a.double() for a in args)
    for i, (s, e) in enumerate(spans):
        h0 = h0s[h0_spans.index(i)] if i in h0_spans else None
        o_ref, ht_ref = naive_recurrent_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=h0,
                                            output_final_state=True, scale=K ** -0.5)
        assert rel_err(o[:, s:e], o_ref) <= FP32_TOL and rel_err(states[:, i], ht_ref) <= FP32_TOL


def test_reverse_spans():
    """Backward spans pack as a reverse varlen call; a 2-step one, whose last gate multiplies
    zeros, is read by the loop form with its first gate for both steps and stays its own call."""
    spans = [(0, 3), (3, 5), (5, 9)]
    graphs, results = check_exact(loop_program(spans, gla=reverse_loop_gla), inputs(1, 9))
    calls = chunk_calls(graphs)
    assert len(calls) == 2 and all(c.args[8] for c in calls)  # reverse
    assert sorted(map(str, map(offsets_of, calls))) == sorted(map(str, [None, packed_offsets([(0, 3), (5, 9)], 9)]))
    assert any("[3, 5) is not merged" in r for r in packed_near_misses(results))


def test_gaps_keep_the_users_values():
    """Positions no span covers are the buffer's: here v itself."""
    spans = [(1, 4), (6, 9)]

    def fn(q, k, v, g):
        o = v.clone()
        for s, e in spans:
            o[:, s:e] = parallel_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])
        return o

    args = inputs(2, 11, gate="scalar")
    graphs, _ = check_exact(fn, args)
    calls = chunk_calls(graphs)
    assert len(calls) == 1 and offsets_of(calls[0]) == packed_offsets(spans, 11, B=2)


# ---- left as N calls, with a reason ----------------------------------------------------------
def packed_near_misses(results) -> list:
    return [nm.reason for r in results for nm in r.near_misses if nm.form == "packed"]


def test_overlapping_spans_stay_separate():
    spans = [(0, 5), (3, 9)]
    graphs, results = check_exact(parallel_program(spans), inputs(1, 9, gate="scalar"))
    assert len(chunk_calls(graphs)) == 2 and all(offsets_of(c) is None for c in chunk_calls(graphs))
    assert any("overlap" in r for r in packed_near_misses(results))


def test_a_span_with_another_gate_stays_separate():
    def fn(q, k, v, g, g2):
        return torch.cat([parallel_gla(q[:, :4], k[:, :4], v[:, :4], g[:, :4]),
                          parallel_gla(q[:, 4:], k[:, 4:], v[:, 4:], g2[:, 4:])], 1)

    args = inputs(1, 9, gate="scalar") + [F.logsigmoid(torch.randn(1, 9, H))]
    graphs, results = check_exact(fn, args)
    assert len(chunk_calls(graphs)) == 2
    assert any("gate is not the same slice" in r for r in packed_near_misses(results))


def test_chained_spans_are_not_packed():
    """A span started from a function of the previous one's final state waits for it."""
    def fn(q, k, v, g):
        o1, S = loop_gla(q[:, :3], k[:, :3], v[:, :3], g[:, :3])
        o2, S = loop_gla(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], S.tanh())
        return torch.cat([o1, o2], 1), S

    graphs, results = check_exact(fn, inputs(1, 7))
    assert len(chunk_calls(graphs)) == 2 and all(offsets_of(c) is None for c in chunk_calls(graphs))
    assert any("after the first span's call" in r for r in packed_near_misses(results))


def test_input_written_between_spans_is_not_packed():
    def fn(q, k, v, g):
        q = q.clone()
        o1 = parallel_gla(q[:, :4], k[:, :4], v[:, :4], g[:, :4])
        q.mul_(2)
        o2 = parallel_gla(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:])
        return torch.cat([o1, o2], 1)

    args = inputs(1, 9, gate="scalar")  # no gradients: the eager program's in-place write forbids them
    out, graphs, results = rewritten(fn, args)
    assert rel_err(out, fn(*[a.double() for a in args])) <= FP32_TOL
    assert len(chunk_calls(graphs)) == 2
    assert any("written in place" in r for r in packed_near_misses(results))


def test_packed_off_by_config():
    spans = [(0, 4), (4, 9)]
    with gla_inductor.config.patch(forms=("loop", "parallel")):
        graphs, _ = check_exact(parallel_program(spans), inputs(1, 9, gate="scalar"))
    assert len(chunk_calls(graphs)) == 2


# ---- explain, and the whole backend ---------------------------------------------------------
def test_explain_reports_the_packing_and_the_near_miss():
    report = gla_inductor.explain(parallel_program([(0, 4), (4, 9)]), *inputs(1, 9, gate="scalar"))
    assert [m.options.get("packed") for m in report.matches] == [2, 2]
    torch._dynamo.reset()  # else Dynamo recompiles the same code with symbolic sizes, which stay N calls
    report = gla_inductor.explain(parallel_program([(0, 5), (3, 9)]), *inputs(1, 9, gate="scalar"))
    packed = [n for n in report.near_misses if n.form == "packed"]
    assert len(packed) == 1 and "overlap" in packed[0].reason and packed[0].source
    assert "packed" in str(report)


@pytest.mark.parametrize("spans", [[(0, 10)], [(0, 4), (4, 10)]], ids=["one-call", "spans"])
def test_left_padded_batch_masked_by_zeroing_k_and_v(spans):
    """A batch padded on the left (pads 0 and 3) and masked as HF models mask: zero k and v at
    the pads. Compiled with the backend (Inductor included), as one call or spans, it equals
    eager."""
    B, T = 2, 10
    mask = torch.ones(B, T)
    mask[1, :3] = 0

    def fn(q, k, v, g, m):
        k = k * m[:, :, None, None]
        v = v * m[:, :, None, None]
        o = torch.zeros_like(v)
        for s, e in spans:
            o[:, s:e] = loop_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])[0]
        return o

    args = inputs(B, T) + [mask]
    got = torch.compile(fn, backend=gla_inductor.backend, fullgraph=True)(*args)
    want = fn(*[a.double() for a in args])
    assert rel_err(got, want) <= FP32_TOL
    assert torch.count_nonzero(got[1, :3]) == 0  # pads read nothing
    _, graphs, _ = rewritten(fn, args)
    calls = chunk_calls(graphs)
    assert len(calls) == 1
    assert offsets_of(calls[0]) == (packed_offsets(spans, T, B=2) if len(spans) > 1 else None)
