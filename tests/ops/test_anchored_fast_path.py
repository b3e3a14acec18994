"""The vector-gate forward's anchored fast path (NOTE:[GLA anchored fast path] in gla_inductor/impl/chunked.py):
which chunks take it, and both it and the split it falls back to against the float64 loop."""

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.impl import chunked as chunked_impl
from gla_inductor.ops import chunk_gla
from gla_inductor.reference import naive_recurrent_gla

from helpers import check_against_loop, gla_inputs

pytestmark = pytest.mark.usefixtures("one_thread", "chunked_impl")

BT = chunked_impl.BT


def make_inputs(g, K=8, V=5, dtype=torch.float32, seed=0):
    """q, k, v and an initial state (helpers.gla_inputs), with the log gates g [B, T, H, K] (given in
    float64), all in dtype."""
    B, T, H, _ = g.shape
    return gla_inputs("vector", B, T, H, K, V, dtype=dtype, g_fn=lambda shape, _: g, seed=seed)


def logsigmoid_gates(B=2, T=4 * BT, H=2, K=8, seed=1):
    """The benchmark's gates: logsigmoid of a normal, ~-0.8 per step."""
    gen = torch.Generator().manual_seed(seed)
    return F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))


def check_forward(inputs, tol, reverse=False):
    """chunk_gla's o and final state against the float64 loop, within tol of their largest entry."""
    check_against_loop(inputs, tol, backward=False, reverse=reverse)


@pytest.fixture
def paths(monkeypatch):
    """Counts the chunks each path computes: "anchored" (all chunks of a call that has any in range),
    "split" (those out of range, or all of them), and records the chunk indices redone by the split."""
    seen = {"anchored": 0, "split": 0, "redone": []}

    def counting(name, fn):
        def wrapper(q, *args):
            seen[name] += q.shape[:-2].numel()
            return fn(q, *args)

        return wrapper

    def recording(intra, idx, *args):
        seen["redone"].append(tuple(i.tolist() for i in idx))
        return redo(intra, idx, *args)

    redo = chunked_impl._redo_by_split
    monkeypatch.setattr(chunked_impl, "_anchored_intra", counting("anchored", chunked_impl._anchored_intra))
    monkeypatch.setattr(chunked_impl, "_intra", counting("split", chunked_impl._intra))
    monkeypatch.setattr(chunked_impl, "_redo_by_split", recording)
    return seen


# ----------------------------------------------------------------------------------------------
# the factors, and which chunks are in range
# ----------------------------------------------------------------------------------------------


def chunk_of(step_gates, K=4):
    """One chunk [1, BT, K] of log gates, step_gates[t] at step t (broadcast over the keys)."""
    return torch.as_tensor(step_gates, dtype=torch.float64).view(1, BT, 1).expand(1, BT, K).clone()


def test_anchor_factors_are_decays_from_the_anchor():
    g = logsigmoid_gates(B=1, T=BT, H=1, K=3).view(1, BT, 3) * 1.5
    e, from_start, ok = chunked_impl._anchor_factors(g)
    a = chunked_impl._ANCHOR
    G = g.cumsum(-2)  # fine in float64 at this size
    torch.testing.assert_close(e, (G - G[:, a : a + 1]).exp(), rtol=1e-12, atol=0)
    torch.testing.assert_close(from_start, G[:, a : a + 1].exp(), rtol=1e-12, atol=0)
    assert ok.tolist() == [True]


def test_anchor_factors_round_like_spans():
    # fp32: the factors' quotient exp(x[i]) / exp(x[j]), a pair's decay, is off by a few roundings
    # of the gates at its ends and between, growing with its span, not by an ulp of |x| (here up
    # to ~50) or of the chunk's cumulative gates (down to ~-100) as exp of x rounded to fp32 would be
    gen = torch.Generator().manual_seed(6)
    g = -1.3 - 0.3 * torch.rand(8, BT, 16, generator=gen)
    e, _, ok = chunked_impl._anchor_factors(g)
    assert ok.all()
    G = g.double().cumsum(-2)
    span = G[:, :, None] - G[:, None]  # [i, j]: the log decay of pair (i, j)
    got = e.double()[:, :, None] / e.double()[:, None]
    causal = torch.ones(BT, BT, dtype=torch.bool).tril()[None, :, :, None].expand_as(span)
    err = (got / span.exp() - 1).abs() / (8 + span.abs())
    assert err[causal].max() <= 2**-23


RANGE_CASES = {
    "logsigmoid": (F.logsigmoid(torch.randn(BT, generator=torch.Generator().manual_seed(0))), True),
    "-1.8 per step, x down to -57.6": ([-1.8] * BT, True),
    "-1.9 per step, x down to -60.8": ([-1.9] * BT, False),
    "+0.9 per step": ([0.9] * BT, True),
    "+1.9 per step": ([1.9] * BT, False),
    "a reset of -40": ([-0.1] * 40 + [-40.0] + [-0.1] * (BT - 41), True),
    "a reset of -100": ([-0.1] * 40 + [-100.0] + [-0.1] * (BT - 41), False),
    "-100 at step 0, ga out of range": ([-100.0] + [-0.1] * (BT - 1), False),
    "nan": ([-0.5] * 10 + [float("nan")] + [-0.5] * (BT - 11), False),
    "-inf": ([-0.5] * 50 + [float("-inf")] + [-0.5] * (BT - 51), False),
    "+inf": ([-0.5] * 5 + [float("inf")] + [-0.5] * (BT - 6), False),
}


@pytest.mark.parametrize("name", RANGE_CASES)
def test_which_chunks_are_in_range(name):
    steps, ok = RANGE_CASES[name]
    for dtype in (torch.float32, torch.float64):
        g = chunk_of(steps).to(dtype)
        assert chunked_impl._anchor_factors(g)[2].tolist() == [ok], name


# ----------------------------------------------------------------------------------------------
# which path, and both against the float64 loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("T,reverse", [(4 * BT, False), (4 * BT, True), (100, False), (130, True)])
def test_in_range_gates_take_the_anchor(paths, dtype, tol, T, reverse):
    inputs = make_inputs(logsigmoid_gates(T=T), dtype=dtype)
    check_forward(inputs, tol, reverse=reverse)
    assert paths["anchored"] == 2 * 2 * -(-T // BT) and paths["split"] == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_strong_decay_takes_the_split(paths, dtype, tol):
    # log gates down to -20 per step: a chunk spans ~-640, far outside the anchor's range
    g = -20 * torch.rand(1, 2048, 2, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    check_forward(make_inputs(g, dtype=dtype), tol)
    assert paths["anchored"] == 0 and paths["split"] == 2 * 2048 // BT


def test_mixed_call_redoes_only_the_chunks_out_of_range(paths):
    g = logsigmoid_gates(B=2, T=4 * BT, H=2)
    g[0, BT : 2 * BT, 1, 3] = -20.0  # one key of chunk 1, head 1, batch 0
    g[1, 3 * BT + 10, 0, 0] = -100.0  # one step of chunk 3, head 0, batch 1: a reset
    check_forward(make_inputs(g), 1e-5)
    assert paths["anchored"] == 2 * 2 * 4 and paths["split"] == 2
    assert paths["redone"] == [([0, 1], [1, 0], [1, 3])]  # (batch, head, chunk) of each


@pytest.mark.parametrize("per_step,anchored", [(-1.85, True), (-1.95, False)])
def test_decay_at_the_edge_of_the_range(paths, per_step, anchored):
    # the anchor's largest exponents, just inside and just outside its range
    g = per_step * (1 + 0.01 * torch.rand(1, 4 * BT, 2, 8, generator=torch.Generator().manual_seed(3)))
    check_forward(make_inputs(g.double()), 1e-5)
    assert (paths["anchored"] > 0) == anchored and (paths["split"] > 0) != anchored


def test_decays_near_one_far_from_the_anchor(paths):
    # decays ~1 near the chunk ends and the anchor, ~-1.9 per step in between: the pairs near the
    # ends decay little, but their exponents from the anchor reach ~50, whose fp32 rounding alone
    # would put 3e-6 into o; built from the blocks' y and fp64 X, it stays within 1e-6 (the split
    # is at ~2e-7)
    t = torch.arange(4 * BT) % BT
    soft = (t < 4) | (t >= BT - 4) | ((t - chunked_impl._ANCHOR).abs() <= 2)
    gen = torch.Generator().manual_seed(4)
    strong = -1.9 * (1 + 0.02 * torch.rand(1, 4 * BT, 2, 16, generator=gen, dtype=torch.float64))
    g = torch.where(soft.view(1, -1, 1, 1), -1e-3, strong)
    check_forward(make_inputs(g, K=16, V=16), 1e-6)
    assert paths["anchored"] == 2 * 4 and paths["split"] == 0


def test_resets_in_range_take_the_anchor(paths):
    # single steps of -40 among decays ~1: in range, though the pairs after one in its block
    # carry the rounding of its partial sum (o within ~5e-7 of the float64 loop, the split ~2e-7)
    g = -0.05 * torch.rand(2, 4 * BT, 2, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for c in range(4):
        g[:, c * BT + 5, :, ::2] = -40.0
        g[:, c * BT + 49, :, 1::2] = -40.0
    check_forward(make_inputs(g, K=16, V=16), 1e-5)
    assert paths["anchored"] == 2 * 2 * 4 and paths["split"] == 0


def test_mixed_sign_gates_take_the_anchor(paths):
    # 32 steps of +0.9 then 32 of -0.9: the state grows and shrinks again within every chunk
    t = torch.arange(4 * BT)
    g = torch.where((t % BT < BT // 2).view(1, -1, 1, 1), 0.9, -0.9).expand(2, -1, 2, 8).double()
    g = g + 0.05 * torch.randn(g.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    check_forward(make_inputs(g), 1e-5)
    assert paths["split"] == 0


def test_nonfinite_gate_sends_its_chunk_to_the_split(paths):
    g = logsigmoid_gates(B=1, T=3 * BT, H=1)
    g[0, BT + 20, 0, 2] = float("nan")
    inputs = make_inputs(g)
    o, ht = chunk_gla(**inputs, output_final_state=True)
    o_ref, _ = naive_recurrent_gla(**inputs, output_final_state=True)
    assert torch.equal(o.isnan(), o_ref.isnan()) and o[0, : BT + 20].isfinite().all()
    assert ht.isnan().any()
    assert paths["redone"] == [([0], [0], [1])]


@pytest.mark.parametrize("gates", ["in range", "out of range", "mixed"])
def test_inputs_are_not_written(gates):
    # aligned T, no reverse: q, k and g reach the paths as views of the inputs
    g = logsigmoid_gates(B=1, T=2 * BT)
    if gates != "in range":
        g[..., : BT if gates == "mixed" else None, :, :] = -20.0
    inputs = make_inputs(g)
    saved = {n: x.clone() for n, x in inputs.items() if x is not None}
    chunk_gla(**inputs, output_final_state=True)
    assert all(torch.equal(inputs[n], saved[n]) for n in saved)


def test_anchored_intra_matches_the_definition():
    # every output of the anchored path against the direct [BT, BT, K] definition, in float64
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, BT, 5, dtype=torch.float64), torch.randn(2, 3, BT, 5, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(2, 3, BT, 5, dtype=torch.float64)) * 1.5
    e, from_start, ok = chunked_impl._anchor_factors(g)
    assert ok.all()
    intra = chunked_impl._anchored_intra(q, k, e, from_start)
    gc = g.cumsum(-2)
    span = gc[..., :, None, :] - gc[..., None, :, :]
    causal = torch.ones(BT, BT, dtype=torch.bool).tril()[:, :, None]
    ref = (q[..., :, None, :] * k[..., None, :, :] * span.exp() * causal).sum(-1)
    torch.testing.assert_close(intra.A, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.qg, q * gc.exp(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.kg, k * (gc[..., -1:, :] - gc).exp(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.decay, gc[..., -1:, :].exp(), rtol=1e-12, atol=1e-12)
