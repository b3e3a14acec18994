"""State updates written in place on the program's own tensor (``S *= d; S += k v``,
``S.mul_(d); S.add_(x)``): read as the values they compute (recognize/core/local_updates.py), so
the time loop is rewritten, equal to float64 eager; where the memory is not the program's alone
(an input, a view read after the write) or a write would cast away a promotion, the writes stay
and the result is eager's."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from gla_inductor.recognize.core.local_updates import functionalize
from helpers import assert_rewritten_like_eager

B, H, T, K, V = 2, 2, 6, 3, 4

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


def inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, T, K, generator=gen), torch.randn(B, H, T, K, generator=gen)
    v = torch.randn(B, H, T, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, H, T, K, generator=gen))
    return [q, k, v, g]


def augmented(q, k, v, g):
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S *= g[:, :, t, :, None].exp()
        S += k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2), S


def methods(q, k, v, g):
    S = torch.zeros(B, H, K, V, dtype=q.dtype)
    outs = []
    for t in range(T):
        S.mul_(g[:, :, t, :, None].exp())
        S.add_(k[:, :, t, :, None] * v[:, :, t, None, :], alpha=0.5)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, 2)


def view_read_after_write(q, k, v, g):
    """A view of S taken before the writes sees them: the writes stay."""
    S = q.new_zeros(B, H, K, V)
    first = S[:, 0]
    outs = []
    for t in range(T):
        S *= g[:, :, t, :, None].exp()
        S += k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2), first * 1


def input_state(q, k, v, g, S):
    """The caller's tensor written in place: the writes stay (the caller sees them)."""
    outs = []
    for t in range(T):
        S *= g[:, :, t, :, None].exp()
        S += k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2)


def promoted(q, k, v, g):
    """A float64 update into a float32 state: the write casts it back, the functional op would not."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S += (k[:, :, t, :, None] * v[:, :, t, None, :]).double()
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2)


def masked_in_place(q, k, v, g, C=3):
    """Chunked linear attention (no gate) as FLA's naive reference writes it: the chunk's scores
    masked in place (``masked_fill_``) before they meet v, the states a cumsum over chunks."""
    qc, kc, vc = (x.reshape(B, H, T // C, C, x.shape[-1]) for x in (q, k, v))
    kv = (kc.transpose(-1, -2) @ vc).cumsum(2)
    kv = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2)
    intra = (qc @ kc.transpose(-1, -2)).masked_fill_(torch.triu(torch.ones(C, C, dtype=torch.bool), 1), 0) @ vc
    return (qc @ kv + intra).reshape(B, H, T, v.shape[-1])


def triangle_in_place(q, k, v, g):
    """The parallel form with the causal triangle taken in place (``tril_``)."""
    return (q @ k.transpose(-1, -2)).tril_() @ v


def masked_input(q, k, v, g, scores):
    """The caller's scores masked in place: the write stays (the caller sees it)."""
    return scores.masked_fill_(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), 0) @ v


CASES = [(augmented, 1), (methods, 1), (masked_in_place, 1), (triangle_in_place, 1), (view_read_after_write, 0),
         (input_state, 0), (promoted, 0), (masked_input, 0)]


@pytest.mark.parametrize("fn,rewrites", CASES, ids=[c[0].__name__ for c in CASES])
def test_compiled_equals_eager(fn, rewrites):
    extra = {input_state: [torch.randn(B, H, K, V)], masked_input: [torch.randn(B, H, T, T)]}
    args = inputs() + extra.get(fn, [])
    assert_rewritten_like_eager(fn, args, rewrites, 1e-5)


def test_only_qualifying_tensors_are_functionalized():
    """The pass itself: the augmented-assignment loop's state becomes functional (no in-place op
    left), the caller's state keeps its writes."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, functionalize(gm.graph)))
        return gm.forward

    torch.compile(augmented, backend=capture, fullgraph=True)(*inputs())
    torch._dynamo.reset()
    torch.compile(input_state, backend=capture, fullgraph=True)(*inputs(), torch.randn(B, H, K, V))
    (own, n_own), (caller, n_caller) = graphs
    assert n_own == 1 and n_caller == 0

    def writes(gm: fx.GraphModule) -> int:
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "i" in getattr(n.target, "__name__", "")
                   and n.target.__name__ in ("imul", "iadd"))

    assert writes(own) == 0 and writes(caller) == 2 * T
