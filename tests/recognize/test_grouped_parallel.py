"""Grouped q/k heads in parallel forms: q and k with G heads repeated over v's H heads in the
user's code (repeat_interleave, expand + reshape, `[:, :, None].expand(...).reshape`, `repeat`)
reach the op unrepeated ([B, G, T, K] read as the op's [B, T, G, K]). For `repeat` (head h reads
h % G) the op reads v, the gate, the states and the output with the two parts of the heads
swapped. Every case: one rewrite, q and k of G heads at the op, exact against float64 eager in
the outputs and every gradient (dq and dk of G heads)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite
from helpers import check_against_float64, outputs

pytestmark = pytest.mark.usefixtures("seeded_compiler")

B, T, G, R, K, V = 2, 7, 2, 3, 4, 5
H = G * R


def _interleave(x):
    return x.repeat_interleave(R, dim=1)


def _expand(x):
    return x.unsqueeze(2).expand(B, G, R, T, K).reshape(B, H, T, K)


def _expand_index(x):
    return x[:, :, None].expand(-1, -1, R, -1, -1).reshape(B, H, T, K)


def _repeat(x):
    return x.repeat(1, R, 1, 1)


REPEATS = {"repeat_interleave": _interleave, "expand_reshape": _expand, "index_expand": _expand_index,
           "repeat": _repeat}
GATES = ("vector", "scalar", "constant")


def _parallel(spread, gate, final_state=False):
    """Head-first [B, H, T, D] parallel GLA of q and k repeated by `spread`."""

    def fn(q, k, v, g):
        q, k = spread(q), spread(k)
        i = torch.arange(T)
        if gate == "vector":
            Gc = g.cumsum(2)
            A = ((q * Gc.exp()) @ (k * (-Gc).exp()).transpose(-1, -2)).tril()
            kd = k * (Gc[:, :, -1:] - Gc).exp()
        elif gate == "scalar":
            Gc = g.cumsum(-1)
            D = (Gc[..., :, None] - Gc[..., None, :]).exp().masked_fill(i[:, None] < i[None, :], 0)
            A = (q @ k.transpose(-1, -2)) * D
            kd = k * (Gc[..., -1:] - Gc).exp()[..., None]
        else:
            D = torch.where(i[:, None] >= i[None, :], ((i[:, None] - i[None, :]) * g[:, None, None]).exp(), 0.0)
            A = torch.einsum("bhik,bhjk->bhij", q, k) * D
            kd = k * ((T - 1 - i)[:, None] * g[:, None, None]).exp()
        o = A @ v * K**-0.5
        if final_state:
            return o, kd.transpose(-1, -2) @ v
        return o

    return fn


def _args(gate):
    q, k = torch.randn(B, G, T, K), torch.randn(B, G, T, K)
    v = torch.randn(B, H, T, V)
    shape = {"vector": (B, H, T, K), "scalar": (B, H, T), "constant": (H,)}[gate]
    g = F.logsigmoid(torch.randn(shape) + 2)
    return [x.requires_grad_() for x in (q, k, v, g)]


def _compile(fn, args) -> tuple:
    """(outputs, the rewrite results, the shapes of q and k at each GLA op emitted)."""
    results, qk = [], []

    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        for n in gm.graph.nodes:
            if n.op == "call_function" and "chunk_fwd" in str(n.target):
                qk.append(tuple(tuple(_val(a).shape) for a in n.args[:2]))
        return gm.forward

    return outputs(torch.compile(fn, backend=backend, fullgraph=True)(*args)), results, qk


def _val(node):
    return node.meta.get("example_value", node.meta.get("val"))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("how", list(REPEATS))
def test_parallel_grouped(how, gate):
    fn = _parallel(REPEATS[how], gate)
    args = _args(gate)
    got, results, qk = _compile(fn, args)
    assert qk == [((B, T, G, K), (B, T, G, K))]
    (match,) = [m for r in results for m in r.matches]
    assert match.layout == "bhtk" and match.shapes["H"] == H
    assert counters["gla_inductor"]["rewrites"] == 1
    check_against_float64(fn, args, got)


@pytest.mark.parametrize("how", ["repeat_interleave", "repeat"])
def test_parallel_grouped_final_state(how):
    """The final state read back from the op, its heads in the user's order."""
    fn = _parallel(REPEATS[how], "scalar", final_state=True)
    args = _args("scalar")
    got, results, qk = _compile(fn, args)
    assert qk == [((B, T, G, K), (B, T, G, K))]
    (match,) = [m for r in results for m in r.matches]
    assert match.options["final_state"]
    check_against_float64(fn, args, got)


def test_unequal_repeats_stay_materialized():
    """q repeated by repeat_interleave and k by repeat: head h reads q's h // R but k's h % G, no
    one grouping of both. Any op emitted gets both repeated (H heads) and the result is exact
    (at present the analyzer cannot name the heads of both and the program stays as it is)."""

    def fn(q, k, v, g):
        q, k = _interleave(q), _repeat(k)
        Gc = g.cumsum(-1)
        D = (Gc[..., :, None] - Gc[..., None, :]).exp().tril()
        return (q @ k.transpose(-1, -2) * D) @ v

    args = _args("scalar")
    got, _, qk = _compile(fn, args)
    assert all(shapes == ((B, T, H, K), (B, T, H, K)) for shapes in qk)
    check_against_float64(fn, args, got)


@pytest.mark.parametrize("how", ["repeat_interleave", "repeat"])
def test_retention_decay_grouped(how):
    """A decay from positions and constants only (RetNet's gamma ** (i - j) per head, read by
    evaluation) over grouped heads: its head axis is both parts of the heads."""

    def fn(q, k, v):
        q, k = REPEATS[how](q), REPEATS[how](k)
        gamma = 1 - 2.0 ** (-3 - torch.arange(H, dtype=torch.float32))
        i = torch.arange(T)
        D = (gamma[:, None, None] ** (i[:, None] - i[None, :])).masked_fill(i[:, None] < i[None, :], 0)
        return (q @ k.transpose(-1, -2) * D) @ v

    args = _args("constant")[:3]
    got, results, qk = _compile(fn, args)
    assert qk == [((B, T, G, K), (B, T, G, K))]
    assert [(m.form, m.gate) for r in results for m in r.matches] == [("parallel", "constant")]
    check_against_float64(fn, args, got)


def test_grouped_through_inductor():
    """The whole backend: the grouped op and the swapped head parts (`repeat`) through Inductor,
    value and every gradient against float64."""
    import gla_inductor

    fn = _parallel(_repeat, "vector", final_state=True)
    args = _args("vector")
    got = outputs(torch.compile(fn, backend=gla_inductor.backend, fullgraph=True)(*args))
    assert counters["gla_inductor"]["rewrites"] == 1
    check_against_float64(fn, args, got)


def _one_group(k_size, h_size):
    """q and k of one head repeated over v's h_size heads, V = 1, a scalar gate per head."""

    def fn(q, k, v, g):
        q, k = q.expand(-1, h_size, -1, -1), k.expand(-1, h_size, -1, -1)
        Gc = g.cumsum(-1)
        D = (Gc[..., :, None] - Gc[..., None, :]).exp().tril()
        return (q @ k.transpose(-1, -2) * D) @ v

    args = [torch.randn(B, 1, T, k_size), torch.randn(B, 1, T, k_size), torch.randn(B, h_size, T, 1),
            F.logsigmoid(torch.randn(B, h_size, T) + 2)]
    return fn, [x.requires_grad_() for x in args]


@pytest.mark.parametrize("k_size,h_size", [(3, 2), (1, 2), (2, 7)])
def test_one_group_without_value_axis(k_size, h_size):
    """With V = 1 both q (the query time) and v (its heads, which q and k do not have) carry an
    output axis no other input has: q is the one whose axis is as long as the key time."""
    fn, args = _one_group(k_size, h_size)
    got, results, _ = _compile(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 1, [nm.reason for r in results for nm in r.near_misses]
    check_against_float64(fn, args, got)


def test_one_group_without_value_axis_ambiguous():
    """K = H as well: v's heads are as long as the key axis that q and k contract, and q's time
    as long as the key time: left alone, saying so (and exact)."""
    fn, args = _one_group(2, 2)
    got, results, _ = _compile(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert any("which is q cannot be told by shape" in nm.reason for r in results for nm in r.near_misses)
    check_against_float64(fn, args, got)
