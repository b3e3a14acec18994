"""The time-loop form's near misses on code that is not GLA: a residual stream at batch size 1
(every term of a state with a size-1 axis reads as an outer product) is no candidate; a
recurrence whose decay is indexed by every state axis says so; a chunk's k^T v summed over
its positions is not called a delta rule, while a real delta rule still is."""

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.recognize import rewrite_graph

from helpers import rel_err
from spellings import loop_broadcast_setitem, near_chunk_loop_delta, near_normalized

B, T, H, D = 1, 6, 2, 4


def near_misses(fn, *args, forms=("chunked", "loop", "decode", "parallel")) -> tuple:
    """(output, matches' forms, (form, reason, node names) of each near miss) of fn's graphs,
    which run unchanged where nothing is rewritten (the callers compare with eager's output)."""
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite_graph(gm, forms=forms))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=backend)(*args)
    near = [(n.form, n.reason, [x.name for x in n.nodes]) for r in results for n in r.near_misses]
    return out, [m.form for r in results for m in r.matches], near


class Layer(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer
        self.qkvg = torch.nn.Linear(H * D, 4 * H * D)
        self.out = torch.nn.Linear(H * D, H * D, bias=False)

    def forward(self, x):
        q, k, v, g = self.qkvg(x).view(x.shape[0], T, H, 4 * D).chunk(4, -1)
        o = self.mixer(q, k, v, torch.nn.functional.logsigmoid(g))
        return self.out(o.reshape(x.shape[0], T, H * D))


def stacked(mixer, layers: int = 3):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Layer(mixer) for _ in range(layers)])

    def model(x):
        for block in blocks:
            x = x + block(x)  # the residual stream: x_{l+1} = x_l + f(x_l)
        return x

    return model


@pytest.mark.parametrize("batch", [1, 2])
def test_residual_stream_is_no_loop_candidate(batch, no_cost_rule):
    """Each layer's GLA loop is rewritten; the stream of residual adds around them is no
    time loop (at batch size 1 its updates parse as steps: nothing is reported of them)."""
    model = stacked(loop_broadcast_setitem)
    x = torch.randn(batch, T, H * D)
    with torch.no_grad():
        _, forms, near = near_misses(model, x)
    assert forms == ["loop"] * 3
    assert near == []


def test_single_layer_residual_is_no_decode_candidate(no_cost_rule):
    """One layer's residual add at batch size 1, x read from a graph input, parses as a single
    step from outside the graph (a decode step's shape): nothing is reported of it."""
    model = stacked(loop_broadcast_setitem, layers=1)
    x = torch.randn(1, T, H * D)
    with torch.no_grad():
        out, forms, near = near_misses(model, x)
    assert forms == ["loop"]
    assert near == []
    assert rel_err(out, model(x)) < 1e-5


def test_real_near_miss_in_a_stacked_model_is_kept():
    """The normalized read of each layer is still reported (one entry: the same reason merged
    over the three layers' states), and nothing of the residual stream."""
    model = stacked(lambda q, k, v, g: near_normalized(q, k, v))
    x = torch.randn(B, T, H * D)
    with torch.no_grad():
        out, forms, near = near_misses(model, x)
        assert rel_err(out, model(x)) == 0
    assert forms == []
    assert len(near) == 1 and near[0][0] == "loop" and "not read into an assembled output" in near[0][1], near
    assert len(near[0][2]) == 3 * T and not any(n.startswith("x") for n in near[0][2]), near


def mamba1_scan(x, dt, A, Bm, C):
    """Mamba-1's selective scan: the state [B, D, N] decays by exp(A[d, n] dt[d]) elementwise."""
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    dBu = dt[:, :, :, None] * Bm[:, None, :, :] * x[:, :, :, None]
    S = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1])
    outs = []
    for t in range(x.shape[2]):
        S = dA[:, :, t] * S + dBu[:, :, t]
        outs.append(torch.matmul(S, C[:, t, :].unsqueeze(-1))[:, :, 0])
    return torch.stack(outs, -1)


def test_mamba1_decay_over_both_axes_is_named():
    gen = torch.Generator().manual_seed(0)
    b, d, n, t = 2, 8, 4, 5
    x, dt = torch.randn(b, d, t, generator=gen), torch.rand(b, d, t, generator=gen)
    A = -torch.rand(d, n, generator=gen)
    Bm, C = torch.randn(b, t, n, generator=gen), torch.randn(b, t, n, generator=gen)
    out, forms, near = near_misses(mamba1_scan, x, dt, A, Bm, C)
    assert forms == [] and rel_err(out, mamba1_scan(x, dt, A, Bm, C)) == 0
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("elementwise recurrence" in r and "every axis of the state" in r for r in reasons), near


def test_elementwise_recurrence_over_k_only_is_not_said_to_decay_v():
    """HGRN-style h = exp(g) h + k * q with a decay over (b, h) only: no claim about V."""

    def hgrn(q, k, g):
        h = q.new_zeros(q.shape[0], q.shape[2], q.shape[3])
        outs = []
        for t in range(q.shape[1]):
            h = h * g[:, t].exp()[..., None] + k[:, t] * q[:, t]
            outs.append(h)
        return torch.stack(outs, 1)

    q, k = torch.randn(2, 5, H, D), torch.randn(2, 5, H, D)
    g = torch.nn.functional.logsigmoid(torch.randn(2, 5, H))
    _, forms, near = near_misses(hgrn, q, k, g)
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("elementwise recurrence" in r and "not V" not in r for r in reasons), near


def chunk_loop(q, k, v, g):
    """A GLA chunk loop: its state update adds k^T v summed over a chunk's positions."""
    b, h, n, d = q.shape
    S = q.new_zeros(b, h, d, v.shape[-1])
    outs = []
    for s in range(0, n, 4):
        q_i, k_i, v_i = q[:, :, s : s + 4], k[:, :, s : s + 4], v[:, :, s : s + 4]
        G = g[:, :, s : s + 4].cumsum(-1)
        c = G.shape[-1]
        Dm = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(), 0)
        outs.append((q_i * G[..., None].exp()) @ S + (q_i @ k_i.transpose(-1, -2) * Dm) @ v_i)
        S = S * G[..., -1, None, None].exp() + (k_i * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ v_i
    return torch.cat(outs, dim=2)


def chunk_args():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 8, D, generator=gen) for _ in range(3))
    return q, k, v, torch.nn.functional.logsigmoid(torch.randn(2, H, 8, generator=gen))


def test_chunk_loop_update_is_not_called_a_delta_rule():
    """Without the chunked form (as if it refused the loop), the time-loop form says nothing
    false about the chunk loop's state update."""
    _, forms, near = near_misses(chunk_loop, *chunk_args(), forms=("loop", "decode"))
    assert forms == []
    assert not any("delta-rule" in r for _, r, _ in near), near


def test_chunked_delta_rule_is_still_called_one():
    _, forms, near = near_misses(near_chunk_loop_delta, *chunk_args())
    assert forms == []
    assert any("delta-rule" in r for _, r, _ in near), near


def test_decay_after_the_outer_product_is_named():
    """S = (S + k^T v) * exp(g): the decay multiplies the step's own k^T v too, so the state the
    loop reads is GLA's times exp(g_t), and the read carries that exponential. Left alone, and
    explain says which input carries it (it said "an input factor is a exp")."""

    def decay_after(q, k, v, g):
        S = q.new_zeros(q.shape[0], H, D, D)
        outs = []
        for t in range(q.shape[1]):
            S = (S + k[:, t, :, :, None] * v[:, t, :, None, :]) * g[:, t].exp()[..., None]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, H, D, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(2, T, H, D, generator=gen))
    out, forms, near = near_misses(decay_after, q, k, v, g)
    assert forms == [] and rel_err(out, decay_after(q, k, v, g)) == 0
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("carry an exponential of the step's inputs" in r for r in reasons), near


def test_outer_product_shared_with_a_bonus_is_named():
    """An RWKV-style loop, o_t = q_t (S_{t-1} + diag(u) k_t^T v_t), S_t = diag(w_t) S_{t-1} + k_t^T v_t:
    k^T v is computed once and read twice, so the algebra keeps it a whole tensor and the update is a
    sum of two state-like tensors, no GLA step (explain said nothing of it). Left alone, and named."""

    def bonus_read(q, k, v, w, u):
        S = q.new_zeros(q.shape[0], H, D, D)
        outs = []
        for t in range(q.shape[1]):
            kv = k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * (S + u[:, :, None] * kv)).sum(-2))
            S = S * w[:, t, :, :, None] + kv
        return torch.stack(outs, 1)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, H, D, generator=gen) for _ in range(3))
    w = torch.exp(-torch.exp(torch.randn(2, T, H, D, generator=gen)))
    u = torch.randn(H, D, generator=gen)
    out, forms, near = near_misses(bonus_read, q, k, v, w, u)
    assert forms == [] and rel_err(out, bonus_read(q, k, v, w, u)) == 0
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("RWKV-style bonus" in r for r in reasons), near


def test_shared_outer_product_keeps_the_decay_reason():
    """A Mamba-1-style recurrence whose dB x (an outer product over D and N) is also summed
    elsewhere: named as shared, and its decay over both axes still said."""

    def shared_dbx(x, dt, A, Bm, C):
        h = x.new_zeros(x.shape[0], D, 4)
        ys, extra = [], 0
        for t in range(x.shape[1]):
            dbx = dt[:, t, :, None] * Bm[:, t, None, :] * x[:, t, :, None]
            h = h * torch.exp(dt[:, t, :, None] * A) + dbx
            extra = extra + dbx.sum()
            ys.append((h * C[:, t, None, :]).sum(-1))
        return torch.stack(ys, 1), extra

    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(2, T, D, generator=gen), torch.rand(2, T, D, generator=gen)
    A, Bm, C = -torch.rand(D, 4, generator=gen), torch.randn(2, T, 4, generator=gen), torch.randn(2, T, 4, generator=gen)
    out, forms, near = near_misses(shared_dbx, x, dt, A, Bm, C)
    assert forms == [] and rel_err(out[0], shared_dbx(x, dt, A, Bm, C)[0]) == 0
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("used outside the update" in r for r in reasons), near
    assert any("decay acts over every axis" in r for r in reasons), near


def test_one_rwkv_step_with_a_matmul_outer_product_is_named():
    """RWKV-6's single-token step as its demo writes it, a = k^T v by matmul read by the bonus and
    by the update of the state passed in: named as the loop's is, without claiming a decay over V."""

    def rwkv_step(r, k, v, w, u, s):
        a = k.unsqueeze(-1) @ v.unsqueeze(-2)
        x = r.unsqueeze(-2) @ (u.unsqueeze(-1) * a + s)
        return x.squeeze(-2), a + w.unsqueeze(-1) * s

    gen = torch.Generator().manual_seed(0)
    r, k, v, u = (torch.randn(H, D, generator=gen) for _ in range(4))
    w, s = torch.rand(H, D, generator=gen), torch.randn(H, D, D, generator=gen)
    out, forms, near = near_misses(rwkv_step, r, k, v, w, u, s)
    assert forms == [] and all(torch.equal(a, b) for a, b in zip(out, rwkv_step(r, k, v, w, u, s)))
    reasons = [r for _, r, _ in near]
    assert reasons and all("RWKV-style bonus" in r and "every axis" not in r for r in reasons), near


def read_before_update(q, k, v, g, h0=None, steps=T):
    """o_t = q_t S_{t-1}: each output read before its step's update (an exclusive read), from a zero
    start or from h0, assembled by stack."""
    S = q.new_zeros(q.shape[0], H, D, D) if h0 is None else h0
    outs = []
    for t in range(steps):
        outs.append((q[:, t, :, :, None] * S).sum(-2))
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
    return torch.stack(outs, 1), S


def read_before_update_setitem(q, k, v, g, h0=None, steps=T):
    S = q.new_zeros(q.shape[0], H, D, D)
    o = q.new_empty(q.shape[0], steps, H, D)
    for t in range(steps):
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2)
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
    return o, S


@pytest.mark.parametrize("fn", [read_before_update, read_before_update_setitem])
@pytest.mark.parametrize("steps", [T, 70])  # 70: a long loop, parsed by its periodic proof
@pytest.mark.parametrize("with_h0", [False, True])
def test_read_before_update_is_named(fn, steps, with_h0):
    """An exclusive read, o_t = q_t S_{t-1}, is not GLA's o_t = q_t S_t: left alone, and explain says
    so (it said the states are not read into an assembled output, 'e.g. the read is normalized')."""
    if with_h0 and fn is read_before_update_setitem:
        pytest.skip("the setitem spelling starts from zeros")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, steps, H, D, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(2, steps, H, D, generator=gen))
    h0 = torch.randn(2, H, D, D, generator=gen) if with_h0 else None
    out, forms, near = near_misses(lambda *a: fn(*a, steps=steps), q, k, v, g, h0)
    want = fn(q, k, v, g, h0, steps=steps)
    assert forms == [] and rel_err(out[0], want[0]) == 0 and rel_err(out[1], want[1]) == 0
    reasons = [r for f, r, _ in near if f == "loop"]
    assert reasons and all("before the step's update" in r and "exclusive read" in r for r in reasons), near


def test_inclusive_read_is_still_rewritten(no_cost_rule):
    """The same loop reading each state after its update is GLA, rewritten (the exclusive reads'
    check sits on the path of loops whose reads do not all parse)."""

    def inclusive(q, k, v, g):
        S = q.new_zeros(q.shape[0], H, D, D)
        outs = []
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, H, D, generator=gen) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(2, T, H, D, generator=gen))
    with torch.no_grad():
        out, forms, near = near_misses(inclusive, q, k, v, g)
    assert forms == ["loop"] and near == []
    assert rel_err(out, inclusive(q, k, v, g)) < 1e-5
