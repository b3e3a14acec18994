"""Time loops compiled with `dynamic=True`: symbolic batch and head sizes never crash the pass,
every graph is rewritten and exact, and the backend compiles no more graphs than Dynamo
itself does (Dynamo unrolls `for t in range(T)`, so T is static per graph: a new T is a new
graph for any backend; a new B is not)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import spellings
from helpers import check_against_float64, rewrite_then_eager
from spellings import SPELLINGS

pytestmark = pytest.mark.usefixtures("seeded_compiler")

LOOPS = [s for s in SPELLINGS if s.form == "loop"]
# (B, T, H): a new B at the same T, then a long loop (periodic.py's proof) at two B
SIZES = [(2, 9, 3), (3, 9, 3), (2, 16, 2), (3, 16, 2)]


def readme_loop(q, k, v, g):
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
    return o, S


def _graphs(fn, make_args, backend, sizes=SIZES) -> int:
    """Graphs Dynamo compiles for fn over these sizes with this backend."""
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=cnt, dynamic=True, fullgraph=True)
    for size in sizes:
        compiled(*make_args(size))
    return cnt.frame_count


def _spelling_args(sp, monkeypatch):
    def make(size):
        for name, value in zip("BTH", size):
            monkeypatch.setattr(spellings, name, value)
        return [a.detach().requires_grad_() for a in sp.make(torch.float32)]

    return make


@pytest.mark.parametrize("sp", LOOPS, ids=lambda s: s.name)
def test_loop_spelling_dynamic(sp, monkeypatch):
    make = _spelling_args(sp, monkeypatch)
    cnt = CompileCounterWithBackend(rewrite_then_eager)
    compiled = torch.compile(sp.fn, backend=cnt, dynamic=True, fullgraph=True)
    for size in SIZES:
        args = make(size)
        check_against_float64(sp.fn, args, compiled(*args))
    assert counters["gla_inductor"]["failures"] == 0
    assert counters["gla_inductor"]["rewrites"] == cnt.frame_count, dict(counters["gla_inductor"])
    assert cnt.frame_count == _graphs(sp.fn, make, "eager")


def _readme_args(size, kv=16):
    b, t, h = size
    q, k, v = (torch.randn(b, t, h, kv) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, t, h, kv) + 2.0)
    return [x.requires_grad_() for x in (q, k, v, g)]


@pytest.mark.parametrize("t", [16, 24])
def test_readme_loop_where_sizes_coincide(t):
    """B = H = 2 and T = K = V = 16: Dynamo's duck sizing gives T and K one symbol, range(T)
    makes it 16, and each step then computes its own node for K ** -0.5, all of one value.
    The scale is read as that number, so the steps have one structure at T = 16 as at 24."""
    sizes = [(2, t, 2), (3, t, 2)]
    cnt = CompileCounterWithBackend(rewrite_then_eager)
    compiled = torch.compile(readme_loop, backend=cnt, dynamic=True, fullgraph=True)
    for size in sizes:
        args = _readme_args(size)
        check_against_float64(readme_loop, args, compiled(*args))
    assert counters["gla_inductor"]["failures"] == 0
    assert counters["gla_inductor"]["near_misses"] == 0
    assert counters["gla_inductor"]["rewrites"] == cnt.frame_count
    assert cnt.frame_count == _graphs(readme_loop, _readme_args, "eager", sizes)
