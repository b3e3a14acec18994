"""Gate fusion and the final state: a fused gate must equal the graph's gate everywhere the op reads
it, the zero-padded time steps of a chunked scan included (the state decays through them).

Mamba2's SSD scan clamps dt = softplus(dt + dt_bias) to its time-step limit and pads the sequence
to whole chunks with zeros. The fused op pads its gate input with -inf, whose softplus is 0; the
clamp then lifts it to the limit's lower bound, so each padded step decayed the final state by
exp(a * lo) where the graph's gate is 0 (the outputs, causal, were right). Gate fusion certifies
the fused gate against the graph's in float64, the clamp's bounds and the padding included, and
is refused where they differ; everything here is checked against float64 eager.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from helpers import FP32_TOL, rel_err, rewrite_then_eager

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")

CHUNK = 4


def segment_sum(a):
    """exp of it: the decay from step s to step l within a chunk (-inf above the diagonal)."""
    n = a.size(-1)
    a = a[..., None].repeat(*([1] * a.dim()), n)
    a = a.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), 0)
    s = a.cumsum(-2)
    return s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(0), float("-inf"))


def into_chunks(t, pad):
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))  # zero padding of time
    return t.reshape(t.shape[0], -1, CHUNK, *t.shape[2:])


def ssd(x, A, B, C, h0=None):
    """Mamba2's SSD chunk scan (as transformers' torch fallback): x [b, t, h, p], the log gate
    A [b, t, h], B and C [b, t, h, n], the initial state h0 [b, h, p, n] or None; (y, the final
    state [b, h, p, n])."""
    T = x.shape[1]
    pad = (CHUNK - T % CHUNK) % CHUNK
    x, A, B, C = (into_chunks(t, pad) for t in (x, A, B, C))
    A = A.permute(0, 3, 1, 2)
    A_cumsum = A.cumsum(-1)
    L = torch.exp(segment_sum(A))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]) if h0 is None else h0[:, None], states], 1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    y = (y_diag + y_off).reshape(x.shape[0], -1, *x.shape[3:])[:, :T]
    return y, final_state


def mamba2(limit):
    """The Mamba2 mixer's scan: dt = clamp(softplus(dt + dt_bias), *limit), A = -exp(A_log) * dt."""

    def fn(x, dt, A_log, dt_bias, B, C, h0=None):
        dt = torch.clamp(F.softplus(dt + dt_bias), min=limit[0], max=limit[1])
        A = -torch.exp(A_log) * dt.to(x.dtype)
        return ssd(x * dt[..., None].to(x.dtype), A, B, C, h0)

    return fn


def gla_clamped_above(x, w, B, C):
    """A logsigmoid gate clamped below 0: its padding is no neutral step either."""
    return ssd(x, (F.logsigmoid(w) / 4).clamp(max=-0.05), B, C)


def inputs(T, softplus=True, initial_state=False, B=2, H=3, P=4, N=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen)
    w = 4 * torch.randn(B, T, H, generator=gen)  # dt from softplus(-8) ~ 3e-4 to softplus(10)
    Bm, Cm = (torch.randn(B, T, H, N, generator=gen) for _ in range(2))
    if not softplus:
        return [x, w, Bm, Cm]
    A_log = 2 * torch.rand(H, generator=gen)
    dt_bias = 2.5 * torch.rand(H, generator=gen) - 2
    h0 = [torch.randn(B, H, P, N, generator=gen)] if initial_state else []
    return [x, w, A_log, dt_bias, Bm, Cm, *h0]


def check(fn, args, fused):
    """One rewrite, `fused` fused gates; output and final state as float64 eager's."""
    y, state = torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    y64, state64 = fn(*(a.double() for a in args))
    assert rel_err(y, y64) <= FP32_TOL
    assert rel_err(state, state64) <= FP32_TOL
    assert counters["gla_inductor"]["fused_gates"] == fused


LIMITS = pytest.mark.parametrize("limit", [(1e-3, float("inf")), (1e-3, 2.0)], ids=["min", "min_max"])
INITIAL = pytest.mark.parametrize("initial_state", [False, True], ids=["h0_none", "h0"])


@LIMITS
@INITIAL
def test_time_step_limit_with_padding_is_not_fused(limit, initial_state):
    """T = 13 in chunks of 4: three padded steps. The clamp lifts the fused gate's padding to
    a * lo, the graph's is 0: the certificate refuses, the state is exact. (Fused, the state was
    off by about 1e-2 here, the output not at all.)"""
    args = inputs(13, initial_state=initial_state)
    lo_hit = (F.softplus(args[1] + args[3]) < limit[0]).any()
    assert lo_hit  # real inputs cross the clamp's lower bound too
    check(mamba2(limit), args, fused=0)
    assert counters["gla_inductor"]["fused_gates_refused"] == 1


@LIMITS
@INITIAL
def test_time_step_limit_without_padding_is_fused(limit, initial_state):
    """T = 12, whole chunks: the clamped gate is fused, both bounds crossed, the state (from an
    initial state too) exact."""
    args = inputs(12, initial_state=initial_state)
    sp = F.softplus(args[1] + args[3])
    assert (sp < limit[0]).any() and (limit[1] == float("inf") or (sp > limit[1]).any())
    check(mamba2(limit), args, fused=1)


def test_zero_lower_limit_with_padding_is_fused():
    """Bamba's default limit (0, inf): clamp(softplus(-inf)) is 0, the padding stays neutral."""
    check(mamba2((0.0, float("inf"))), inputs(13), fused=1)


def test_logsigmoid_clamped_below_zero_with_padding_is_not_fused():
    check(gla_clamped_above, inputs(13, softplus=False), fused=0)
    assert counters["gla_inductor"]["fused_gates_refused"] == 1


def test_state_decays_through_padding_matters():
    """The class of bug is visible: the final state with the padded steps decayed by a * lo,
    as the wrong fusion computed it, is far from the true one."""
    args = [a.double() for a in inputs(13)]
    lo = 1e-3
    _, state = mamba2((lo, float("inf")))(*args)
    a = -args[2].exp()
    wrong = state * torch.exp(3 * lo * a)[None, :, None, None]
    assert rel_err(wrong, state) > 1e-3
