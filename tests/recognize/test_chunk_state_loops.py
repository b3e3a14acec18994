"""Chunk loops whose carried state S = S * d + X_i (X_i the chunk's k^T v) is read through code that
is not GLA (``gla_inductor/recognize/forms/chunk_states.py``): the states are computed at once over the
chunk axis, and every read of them stays as written. Torchscale's chunkwise retention is the
model case (``tests/e2e/test_torchscale.py``); here its class, varied: the state normalized by a
clamped maximum of its column sums or by its largest entry, no normalization of the intra-chunk
part, a decay per head, per key (a vector), per chunk from the data, none, other chunk sizes, an
initial state. Each is rewritten once, equal to float64 eager in value and every gradient. Chunk
loops that are GLA as a whole stay the chunked form's (one rewrite, not two). Look-alikes stay code
with the reason: a delta rule's increment reads the state, a decay read from the state, decays of
different shapes per chunk, a state carried by a matrix product. States read only linearly are the
chunked form's to judge: not rewritten alone."""

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import check_rewrite_exact, compile_rewritten, rel_err

B, H, K, V = 2, 3, 4, 5

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def inputs(T=12, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    return [torch.randn(B, H, T, D, generator=gen) for D in (K, K, V)]


def gammas():
    return 1 - 2.0 ** (-1 - torch.arange(H, dtype=torch.float64))


def masks(gamma, C):
    """(intra-chunk decay [H, C, C], query decay [H, C, 1], key decay [H, C, 1], chunk decay [H, 1, 1])."""
    i = torch.arange(C, dtype=gamma.dtype)
    dist = i[:, None] - i[None, :]
    g = gamma[:, None, None]
    intra = torch.where(dist >= 0, g ** dist.clamp_min(0), torch.zeros(()))
    return intra, (g ** (i + 1)[:, None]), (g ** (C - 1 - i)[:, None]), g ** C


def column_max(S):
    """The state's normalizer: the largest absolute column sum, at least 1 (torchscale's kind)."""
    return S.detach().abs().sum(-2, keepdim=True).amax(-1, keepdim=True).clamp(min=1)


def largest_entry(S):
    return 1 + S.abs().amax(dim=(-2, -1), keepdim=True)


def normalized_retention(q, k, v, C=4, norm=column_max, decay="head", h0=None):
    """Chunkwise retention with the carried state divided by norm(S) where it is read, the
    intra-chunk scores by their absolute row sums, the two aligned by a maximum."""
    b, h, t, _ = q.shape
    n = t // C
    intra, qd, kd, cd = (x.to(q.dtype) for x in masks(gammas(), C))
    if decay == "vector":  # a decay per key feature: the chunk's keys decay by it too
        cd = cd * torch.linspace(0.5, 1.0, K, dtype=q.dtype)[:, None]
    elif decay == "number":  # a Python number for every head
        cd = 0.8
    elif decay == "none":
        intra = torch.ones(C, C, dtype=q.dtype).tril().expand(h, C, C)
        qd, kd, cd = torch.ones_like(qd), torch.ones_like(kd), None
    qc, kc, vc = (x.reshape(b, h, n, C, x.shape[-1]).transpose(1, 2) for x in (q, k, v))
    scores = (qc @ kc.transpose(-1, -2)) * intra
    inner_scale = scores.detach().abs().sum(-1, keepdim=True).clamp(min=1)
    inner = (scores / inner_scale) @ vc
    kv = (kc * kd).transpose(-1, -2) @ vc
    S = q.new_zeros(b, h, K, V) if h0 is None else h0
    reads, scales = [], []
    for i in range(n):
        scale = norm(S)
        reads.append(S / scale)
        scales.append(scale.expand(b, h, 1, 1) if scale.dim() == 4 else scale)
        S = (S if cd is None else S * cd) + kv[:, i]
    cross_scale = torch.stack(scales, 1)
    top = torch.maximum(inner_scale, cross_scale)
    cross = (qc * qd) @ torch.stack(reads, 1)
    o = inner / (top / inner_scale) + cross / (top / cross_scale)
    return o.transpose(1, 2).reshape(b, h, t, V), S


def per_chunk_decay(q, k, v, x, C=4):
    """A decay per chunk from the data (sigmoid of a per-chunk input), the state read normalized."""
    b, h, t, _ = q.shape
    n = t // C
    qc, kc, vc = (x_.reshape(b, h, n, C, x_.shape[-1]) for x_ in (q, k, v))
    kv = kc.transpose(-1, -2) @ vc  # [b, h, n, K, V]
    S = q.new_zeros(b, h, K, V)
    outs = []
    for i in range(n):
        outs.append(qc[:, :, i] @ (S / largest_entry(S)))
        S = S * torch.sigmoid(x[:, :, i])[..., None, None] + kv[:, :, i]
    return torch.cat(outs, 2), S


def chunks_indexed_in_the_loop(q, k, v, C=4):
    """The chunks indexed per iteration from [B, H, N, C, D] views, the state's read normalized."""
    b, h, t, _ = q.shape
    qc, kc, vc = (x.reshape(b, h, t // C, C, x.shape[-1]) for x in (q, k, v))
    S = q.new_zeros(b, h, K, V)
    outs = []
    for i in range(t // C):
        outs.append(qc[:, :, i] @ (S / column_max(S)))
        S = S.float() * 0.75 + kc[:, :, i].transpose(-1, -2) @ vc[:, :, i]  # (a cast that keeps S)
    return torch.cat(outs, 2)


def matches_of(fn, *args):
    return [(m.form, m.gate) for m in check_rewrite_exact(fn, args, tol=2e-5)]


# ---- rewritten -----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [column_max, largest_entry], ids=["column-max", "largest-entry"])
def test_normalized_states_are_rewritten(norm):
    q, k, v = inputs()
    assert matches_of(lambda q, k, v: normalized_retention(q, k, v, norm=norm), q, k, v) == \
        [("chunk_states", "constant")]
    assert counters["gla_inductor"]["rewrites"] == 1


@pytest.mark.parametrize("C,T", [(2, 12), (8, 32), (4, 28), (2, 40)])
def test_other_chunk_sizes(C, T):
    """Chunk counts from 3 to 20: one block or several, the last one padded or whole."""
    q, k, v = inputs(T)
    assert matches_of(lambda q, k, v: normalized_retention(q, k, v, C=C), q, k, v) == [("chunk_states", "constant")]


@pytest.mark.parametrize("decay", ["vector", "number"])
def test_decay_per_key_or_a_number(decay):
    q, k, v = inputs()
    assert matches_of(lambda q, k, v: normalized_retention(q, k, v, decay=decay), q, k, v) == \
        [("chunk_states", "constant")]


def test_no_decay_is_a_cumulative_sum():
    q, k, v = inputs()
    assert matches_of(lambda q, k, v: normalized_retention(q, k, v, decay="none"), q, k, v) == \
        [("chunk_states", "none")]


def test_initial_state():
    q, k, v = inputs()
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3))
    assert matches_of(lambda q, k, v, h0: normalized_retention(q, k, v, h0=h0), q, k, v, h0) == \
        [("chunk_states", "constant")]


def test_decay_per_chunk_from_the_data():
    q, k, v = inputs(16)
    x = torch.randn(B, H, 4, generator=torch.Generator().manual_seed(4))
    assert matches_of(per_chunk_decay, q, k, v, x) == [("chunk_states", "per-chunk")]


def test_chunks_indexed_in_the_loop():
    assert matches_of(chunks_indexed_in_the_loop, *inputs()) == [("chunk_states", "constant")]


def gla_chunk_loop(q, k, v, C=4):
    """A chunk loop that is GLA as a whole (constant decay, plain reads)."""
    b, h, t, _ = q.shape
    intra, qd, kd, cd = (x.to(q.dtype) for x in masks(gammas(), C))
    S = q.new_zeros(b, h, K, V)
    outs = []
    for s in range(0, t, C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(((qi @ ki.transpose(-1, -2)) * intra) @ vi + (qi * qd) @ S)
        S = S * cd + (ki * kd).transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def test_a_gla_chunk_loop_stays_one_chunked_rewrite():
    """The chunked form takes the whole loop; its states are not rewritten a second time."""
    q, k, v = inputs()
    assert matches_of(gla_chunk_loop, q, k, v) == [("chunked", "constant")]
    assert counters["gla_inductor"]["rewrites"] == 1


# ---- left alone ----------------------------------------------------------------------------------
def left_alone(fn, *args):
    """Compiled with the rewrite: nothing rewritten, outputs as eager; the chunk-states reasons."""
    got, results = compile_rewritten(fn, args)
    want = fn(*args)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert not [m for r in results for m in r.matches]
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(got, want))
    return [n.reason for r in results for n in r.near_misses if n.form == "chunk_states"]


def delta_rule(q, k, v, C=4):
    b, h, t, _ = q.shape
    S = q.new_zeros(b, h, K, V)
    outs = []
    for s in range(0, t, C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(qi @ (S / largest_entry(S)))
        S = S * 0.9 + ki.transpose(-1, -2) @ (vi - ki @ S)
    return torch.cat(outs, 2)


def decay_from_state(q, k, v, C=4):
    b, h, t, _ = q.shape
    S = q.new_zeros(b, h, K, V)
    outs = []
    for s in range(0, t, C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(qi @ (S / largest_entry(S)))
        S = S * torch.sigmoid(S.mean((-2, -1), keepdim=True)) + ki.transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def decays_of_two_shapes(q, k, v, C=4):
    b, h, t, _ = q.shape
    S = q.new_zeros(b, h, K, V)
    outs = []
    per_head, per_key = gammas().float()[:, None, None], torch.linspace(0.5, 1.0, K)[:, None]
    for j, s in enumerate(range(0, t, C)):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(qi @ (S / largest_entry(S)))
        S = S * (per_head if j % 2 else per_key) + ki.transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def matrix_carry(q, k, v, C=4):
    b, h, t, _ = q.shape
    S = q.new_zeros(b, h, K, V)
    A = torch.eye(K) * 0.9 + 0.05  # the state mixed across keys from chunk to chunk
    outs = []
    for s in range(0, t, C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(qi @ (S / largest_entry(S)))
        S = A @ S + ki.transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def linear_reads_of_a_look_alike(q, k, v, C=4):
    """A chunk loop that is not GLA (its intra-chunk mask is not causal) whose states are read
    linearly: the chunked form's to judge; its states are not rewritten alone."""
    b, h, t, _ = q.shape
    intra, qd, kd, cd = (x.to(q.dtype) for x in masks(gammas(), C))
    S = q.new_zeros(b, h, K, V)
    outs = []
    for s in range(0, t, C):
        qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
        outs.append(((qi @ ki.transpose(-1, -2)) * intra.transpose(-1, -2)) @ vi + (qi * qd) @ S)
        S = S * cd + (ki * kd).transpose(-1, -2) @ vi
    return torch.cat(outs, 2)


def test_delta_rule_is_reported():
    reasons = left_alone(delta_rule, *inputs())
    assert reasons and all("delta-rule" in r and "computed from the state itself" in r for r in reasons), reasons


def test_decay_read_from_the_state_is_reported():
    reasons = left_alone(decay_from_state, *inputs())
    assert reasons and all("decay" in r and "computed from the state itself" in r for r in reasons), reasons


def test_decays_of_two_shapes_are_reported():
    reasons = left_alone(decays_of_two_shapes, *inputs(16))
    assert reasons and all("differ in shape" in r for r in reasons), reasons


def time_loop_residual(x, w):
    """A residual stream (h = h * 1 + f(h)) is a chain too, but its increments are no chunk's
    k^T v: not a candidate, no reason."""
    h = x
    for _ in range(3):
        h = h * 1.0 + torch.tanh(h @ w)
    return h


def test_other_recurrences_are_no_candidates():
    gen = torch.Generator().manual_seed(5)
    reasons = left_alone(time_loop_residual, torch.randn(2, 6, 4, generator=gen), torch.randn(4, 4, generator=gen))
    assert reasons == []


def test_matrix_carry_is_reported():
    reasons = left_alone(matrix_carry, *inputs())
    assert reasons and all("carried to the next chunk by matmul" in r and "not multiplied by a decay" in r
                           for r in reasons), reasons


def test_linearly_read_states_are_left_to_the_chunked_form():
    """(The first chunk alone reads as a reverse-time parallel form; the loop is no GLA.)"""
    args = inputs()
    got, results = compile_rewritten(linear_reads_of_a_look_alike, args)
    assert rel_err(got[0], linear_reads_of_a_look_alike(*args)) <= 1e-6
    assert not [m for r in results for m in r.matches if m.form == "chunk_states"]
    assert not [n for r in results for n in r.near_misses if n.form == "chunk_states"]
    assert [n for r in results for n in r.near_misses if n.form == "chunked"]
