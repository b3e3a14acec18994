"""Chunked GLA compiled with `dynamic=True`: symbolic sizes never crash the pass (no failure,
no replacement that fails), every output and gradient equals float64 eager at each size, and
the backend compiles no more graphs than Dynamo does with the eager backend.

What is rewritten (``recognize/forms/symbolic_chunks.py`` says why): the chunked form is proven
by a float64 certificate at the sizes it runs at, so with symbolic sizes it is left alone, with
a near miss naming them; the parallel form, proven by algebra at any size, rewrites loop-free
chunked code with ungated or constant decays chunk by chunk (each chunk's attention, the state
entering it read as an initial state), one graph for every length. With the sizes marked
static, the chunked form is rewritten whole."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import spellings
from helpers import check_against_float64, rewrite_then_eager

pytestmark = pytest.mark.usefixtures("seeded_compiler")

C, H, K, V = 4, 3, 4, 5


def chunks(x):
    """[B, H, T, D] -> [B, H, T / C, C, D]."""
    return x.reshape(x.shape[0], x.shape[1], -1, C, x.shape[-1])


def causal():
    return torch.tril(torch.ones(C, C, dtype=torch.bool))


def exclusive(s):
    """The states entering each chunk: a zero chunk in front, the last chunk's sum dropped."""
    return torch.cat([torch.zeros_like(s[:, :, :1]), s[:, :, :-1]], 2)


def plain_cat(q, k, v):
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive((kc.transpose(-1, -2) @ vc).cumsum(2))
    return ((qc @ kc.transpose(-1, -2)).masked_fill(~causal(), 0) @ vc + qc @ state).flatten(2, 3)


def padded(q, k, v):
    """T any length: time padded to whole chunks, the output sliced back."""
    t = q.shape[2]
    q, k, v = (F.pad(x, (0, 0, 0, -t % C)) for x in (q, k, v))
    return plain_cat(q, k, v)[:, :, :t]


def retention(q, k, v, log_gamma):
    """A constant decay per head; the number of chunks read off q (symbolic under dynamic=True)."""
    n_chunks = q.shape[2] // C
    lg = log_gamma[:, None, None, None]
    i, n = torch.arange(C, dtype=q.dtype), torch.arange(n_chunks, dtype=q.dtype)
    D = torch.exp((i[:, None] - i[None, :]) * lg).masked_fill(~causal(), 0)
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kv = (kc * torch.exp((C - 1 - i)[:, None] * lg)).transpose(-1, -2) @ vc
    kv = kv * torch.exp(-C * n[None, :] * log_gamma[:, None])[..., None, None]
    state = exclusive(kv.cumsum(2)) * torch.exp(C * (n - 1)[None, :] * log_gamma[:, None])[..., None, None]
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * torch.exp((i + 1)[:, None] * lg)) @ state).flatten(2, 3)


class PowerRetention(nn.Module):
    """The decays as powers of a gamma buffer (gamma ** n)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        g = self.gamma[:, None, None, None]
        i, n = torch.arange(C, dtype=q.dtype), torch.arange(q.shape[2] // C, dtype=q.dtype)
        D = (g ** (i[:, None] - i[None, :])).masked_fill(~causal(), 0)
        qc, kc, vc = chunks(q), chunks(k), chunks(v)
        kv = (kc * g ** (C - 1 - i)[:, None]).transpose(-1, -2) @ vc
        gn = g ** (C * n)[:, None, None]
        state = exclusive((kv / gn).cumsum(2)) * gn / g**C
        return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * g ** (i + 1)[:, None]) @ state).flatten(2, 3)


def scalar_gate(q, k, v, g):
    """g [B, H, T]: cumulative log decays over the whole sequence, cut into chunks."""
    G = chunks(g.cumsum(-1)[..., None])
    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    state = exclusive(((kc * (-G).exp()).transpose(-1, -2) @ vc).cumsum(2))
    D = (G - G.transpose(-1, -2)).masked_fill(~causal(), float("-inf")).exp()
    return (((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * G.exp()) @ state).flatten(2, 3)


def _inputs(b, t, gate=None):
    gen = torch.Generator().manual_seed(t * 10 + b)
    args = [torch.randn(b, H, t, d, generator=gen) for d in (K, K, V)]
    if gate == "constant":
        args.append(torch.log(1 - 2.0 ** (-2 - torch.arange(H, dtype=torch.float))))
    elif gate == "scalar":
        args.append(F.logsigmoid(torch.randn(b, H, t, generator=gen) + 2))
    return [a.requires_grad_() for a in args]


def _graphs(fn, inputs, backend) -> int:
    """Graphs Dynamo compiles for fn over these inputs with this backend."""
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=cnt, dynamic=True, fullgraph=True)
    for args in inputs:
        compiled(*args)
    return cnt.frame_count


def _run_dynamic(fn, inputs) -> tuple:
    """(graphs compiled, near-miss reasons) of fn compiled once with dynamic=True over `inputs`,
    each checked against float64 eager in value and every gradient."""
    from gla_inductor.backend import rewrite

    reasons = []

    def backend(gm, example_inputs):
        reasons.extend(n.reason for n in rewrite(gm, example_inputs).near_misses if n.form == "chunked")
        return gm.forward

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=cnt, dynamic=True, fullgraph=True)
    for args in inputs:
        check_against_float64(fn, args, compiled(*args))
    assert counters["gla_inductor"]["failures"] == 0
    return cnt.frame_count, reasons


# (program, gate, lengths): the lengths whole chunks, except for the padded program
REWRITTEN = [
    (plain_cat, None, [8, 12, 20]),
    (padded, None, [9, 12, 14]),
    (retention, "constant", [8, 12, 16]),
    (PowerRetention(), None, [8, 12, 16]),
]


@pytest.mark.parametrize("fn,gate,lengths", REWRITTEN, ids=["plain_cat", "padded", "retention", "power"])
def test_cumsum_chunks_are_rewritten_once_for_every_length(fn, gate, lengths):
    inputs = [_inputs(b, t, gate) for t in lengths for b in (2, 3)]
    frames, reasons = _run_dynamic(fn, inputs)
    assert frames == _graphs(fn, inputs, "eager") == 1
    assert counters["gla_inductor"]["rewrites"] == frames, dict(counters["gla_inductor"])
    assert not reasons and "replacement failed" not in str(dict(counters["gla_inductor"]))


def test_a_gated_cumsum_chunk_form_is_a_near_miss_with_symbolic_chunks():
    inputs = [_inputs(b, t, "scalar") for t in (8, 12, 16) for b in (2, 3)]
    frames, reasons = _run_dynamic(scalar_gate, inputs)
    assert frames == _graphs(scalar_gate, inputs, "eager") == 1
    assert counters["gla_inductor"]["rewrites"] == 0
    assert set(reasons) == {reasons[0]} and "time axis of symbolic length" in reasons[0] and "chunks of 4" in reasons[0]


def _spelling_inputs(sp, monkeypatch, sizes) -> list:
    res = []
    for b, t in sizes:
        monkeypatch.setattr(spellings, "B", b)
        monkeypatch.setattr(spellings, "T", t)
        res.append([a.detach().requires_grad_() for a in sp.make(torch.float32)])
    return res


CHUNK_LOOPS = ["chunk_loop_cat", "chunk_loop_retention", "chunk_loop_constant_decay"]
SCANS = ["chunked_hf_einsum", "chunked_ssd_minimal"]


@pytest.mark.parametrize("name", CHUNK_LOOPS + SCANS)
def test_chunked_spellings_with_symbolic_sizes_are_exact_near_misses(name, monkeypatch):
    """Chunk loops (T specialized by Dynamo's unrolling, B, H, K, V symbolic) and Mamba2 scans
    (the number of chunks symbolic too): not rewritten as chunked, said why, exact, and no more
    graphs than Dynamo compiles."""
    sp = next(s for s in spellings.SPELLINGS if s.name == name)
    inputs = _spelling_inputs(sp, monkeypatch, [(2, 8), (3, 8), (2, 16), (3, 12)])
    frames, reasons = _run_dynamic(sp.fn, inputs)
    assert frames == _graphs(sp.fn, inputs, "eager")
    assert counters["gla_inductor"]["rewrites_chunked"] == 0
    assert reasons and all("symbolic" in r and "dynamic=True" in r for r in reasons), reasons
    if name in CHUNK_LOOPS:
        assert any("symbolic sizes (B, H, K, V" in r for r in reasons), reasons


@pytest.mark.parametrize("name", ["chunk_loop_cat", "chunked_hf_einsum"])
def test_sizes_marked_static_are_rewritten_whole(name):
    """The near miss's advice: with the inputs' sizes marked static, dynamic=True or not, the
    chunked form is rewritten."""
    sp = next(s for s in spellings.SPELLINGS if s.name == name)
    args = [a.requires_grad_() for a in sp.make(torch.float32)]
    for a in args:
        torch._dynamo.mark_static(a)
    got = torch.compile(sp.fn, backend=rewrite_then_eager, dynamic=True, fullgraph=True)(*args)
    check_against_float64(sp.fn, args, got)
    assert counters["gla_inductor"]["rewrites_chunked"] == 1, dict(counters["gla_inductor"])
