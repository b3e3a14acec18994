"""Grouped q/k heads in time loops and decode steps: q and k with G heads repeated over v's H
heads in the user's code reach the op unrepeated ([B, T, G, K]) where the repeat is in the op's
order (head h reads h // (H // G): repeat_interleave, expand + reshape); `repeat` (head h
reads h % G) stays materialized. Every case is exact against float64 eager."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite
from helpers import check_against_float64, outputs

pytestmark = pytest.mark.usefixtures("seeded_compiler")

B, T, G, R, K, V = 2, 9, 2, 3, 4, 5
H = G * R
OPS = ("chunk_fwd", "fused_recurrent")


def _interleave(x):
    return x.repeat_interleave(R, dim=-2)


def _expand(x):
    return x.unsqueeze(-2).expand(*x.shape[:-1], R, x.shape[-1]).reshape(*x.shape[:-2], H, x.shape[-1])


def _repeat(x):
    return x.repeat(*([1] * (x.dim() - 2)), R, 1)


REPEATS = {"repeat_interleave": (_interleave, G), "expand_reshape": (_expand, G), "repeat": (_repeat, H)}


def _loop(spread):
    def fn(q, k, v, g):
        q, k = spread(q), spread(k)
        S = q.new_zeros(B, H, K, V)
        o = torch.zeros_like(v)
        for t in range(T):
            S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
        return o, S

    return fn


def _decode(spread):
    def fn(q, k, v, g, cache):
        q, k = spread(q), spread(k)
        S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
        cache.copy_(S)
        return (q[..., :, None] * S).sum(-2)

    return fn


def _op_q_heads(fn, args) -> tuple:
    """(outputs, the heads of q at each GLA op the rewrite emitted)."""
    heads = []

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs)
        for n in gm.graph.nodes:
            if n.op == "call_function" and any(name in str(n.target) for name in OPS):
                meta = n.args[0].meta
                heads.append(meta.get("example_value", meta.get("val")).shape[-2])
        return gm.forward

    return outputs(torch.compile(fn, backend=backend, fullgraph=True)(*args)), heads


@pytest.mark.parametrize("how", list(REPEATS))
def test_loop_grouped(how):
    spread, want = REPEATS[how]
    q, k = torch.randn(B, T, G, K), torch.randn(B, T, G, K)
    v, g = torch.randn(B, T, H, V), F.logsigmoid(torch.randn(B, T, H, K) + 2)
    args = [x.requires_grad_() for x in (q, k, v, g)]
    fn = _loop(spread)
    got, heads = _op_q_heads(fn, args)
    assert heads == [want]
    assert counters["gla_inductor"]["rewrites"] == 1
    check_against_float64(fn, args, got)


def _decode_returned(spread):
    def fn(q, k, v, g, h):
        q, k = spread(q), spread(k)
        S = h * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
        return (q[..., :, None] * S).sum(-2), S

    return fn


def _decode_args():
    q, k = torch.randn(B, G, K), torch.randn(B, G, K)
    v, g = torch.randn(B, H, V), F.logsigmoid(torch.randn(B, H, K) + 2)
    return [q, k, v, g, torch.randn(B, H, K, V)]


@pytest.mark.parametrize("how", list(REPEATS))
def test_decode_in_place_grouped(how):
    """Without gradients a step that writes its cache back becomes an in-place fused_recurrent,
    which reads q and k grouped as chunk_fwd does (G heads; `repeat` stays materialized); the
    step and the cache it writes are exact."""
    spread, want = REPEATS[how]
    fn = _decode(spread)
    args = _decode_args()
    with torch.no_grad():
        want_cache = args[4].double().clone()
        want_o = fn(*(x.double() for x in args[:4]), want_cache)
        got, heads = _op_q_heads(fn, args)
    assert heads == [want]
    assert counters["gla_inductor"]["rewrites"] == 1
    assert (got[0].double() - want_o).abs().max() <= 1e-5 * want_o.abs().max()
    assert (args[4].double() - want_cache).abs().max() <= 1e-5 * want_cache.abs().max()


@pytest.mark.parametrize("how", list(REPEATS))
def test_decode_grouped(how):
    """A step returning its state, with gradients: chunk_fwd, q and k grouped as in a loop."""
    spread, want = REPEATS[how]
    fn = _decode_returned(spread)
    args = [x.requires_grad_() for x in _decode_args()]
    got, heads = _op_q_heads(fn, args)
    assert heads == [want]
    assert counters["gla_inductor"]["rewrites"] == 1
    check_against_float64(fn, args, got)
