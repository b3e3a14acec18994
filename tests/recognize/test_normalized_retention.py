"""Parallel retention normalized by its scores' own row sums, as torchscale writes it, without torchscale:

    A = (q k^T) * M,   M[h, i, j] = c[h, i] * gamma_h ** (i - j) (j <= i),  c a factor per row
    o = (A / n(A.sum(-1))) @ v    or    (A @ v) / n(A.sum(-1))

with n any elementwise function of the row sums (abs, clamp, detach). The row factor folds into q,
and the row sums are the op's output for values of ones: one op call, the user's normalizer kept
(gla_inductor/recognize/forms/normalized.py, row_factor.py). Each spelling is rewritten once and
equals float64 eager in value and every gradient; look-alikes (a normalizer of |A|'s row sums, a
maximum, a factor per key column) stay code with their reason."""

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite

from helpers import FP32_TOL, check_rewrite_exact, compile_rewritten, rel_err

B, H, T, K, V = 2, 2, 10, 4, 5

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def decay_mask(n: int, dtype, scale: str = "rows", reverse: bool = False, device=None) -> torch.Tensor:
    """gamma_h ** (i - j) on j <= i (RetNet's gammas; gamma_h ** (j - i) on j >= i reversed), each
    row divided by the root of its sum (torchscale's), each column so ("columns"), or neither."""
    pos = torch.arange(n, dtype=dtype, device=device)
    log_gamma = torch.log(1 - 2 ** (-5 - torch.arange(H, dtype=dtype, device=device)))
    dist = (pos[None, :] - pos[:, None]) if reverse else (pos[:, None] - pos[None, :])
    D = torch.exp(dist.masked_fill(dist < 0, float("inf")) * log_gamma[:, None, None])
    if scale == "rows":
        D = D / D.sum(dim=-1, keepdim=True).sqrt()
    elif scale == "columns":
        D = D / D.sum(dim=-2, keepdim=True).sqrt()
    return D


def scores(q, k, scale="rows", reverse=False):  # [B, H, T, K]
    return (q @ k.transpose(-1, -2)) * decay_mask(q.shape[2], q.dtype, scale, reverse, q.device)


def scores_seq_first(q, k):  # [B, T, H, K] -> [B, H, T, T]
    return torch.einsum("bihd,bjhd->bhij", q, k) * decay_mask(q.shape[1], q.dtype, device=q.device)


# ---- rewritten ------------------------------------------------------------------------------------
def torchscale_parallel(q, k, v):
    """torchscale 0.3.0's parallel_forward: divided before the product, the sums detached."""
    a = scores(q, k)
    a = a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)
    return torch.matmul(a, v)


def divided_after_the_product(q, k, v):
    a = scores(q, k)
    return (a @ v) / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)


def not_detached(q, k, v):
    """The gradient flows through the normalizer too (into q and k through the op's row sums)."""
    a = scores(q, k)
    return (a / a.sum(-1, keepdim=True).abs().clamp_min(1.0)) @ v


def sums_without_keepdim(q, k, v):
    a = scores(q, k)
    n = a.detach().sum(-1).abs().clamp(min=1)
    return (a / n[..., None]) @ v


def cast_before_the_sum(q, k, v):
    a = scores(q, k)
    n = a.detach().float().sum(dim=-1, keepdim=True).abs().clamp(min=1).sqrt()
    return a / n @ v


def plain_mask_with_a_scale(q, k, v):
    """No row factor in the mask, a scale on the scores."""
    a = scores(q, k, scale="none") * K ** -0.5
    return (a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)) @ v


def anti_causal(q, k, v):
    """The reverse form: each query reads the keys from itself to the end."""
    a = scores(q, k, reverse=True)
    return (a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)) @ v


def seq_first_einsum(q, k, v):  # [B, T, H, D]
    a = scores_seq_first(q, k)
    a = a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)
    return torch.einsum("bhij,bjhd->bihd", a, v)


def seq_first_divided_after(q, k, v):
    a = scores_seq_first(q, k)
    n = a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)
    return torch.einsum("bhij,bjhd->bihd", a, v) / n.transpose(1, 2)


REWRITTEN = [torchscale_parallel, divided_after_the_product, not_detached, sums_without_keepdim,
             cast_before_the_sum, plain_mask_with_a_scale, anti_causal, seq_first_einsum,
             seq_first_divided_after]


def inputs(seq_first: bool, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda d: (B, T, H, d)) if seq_first else (lambda d: (B, H, T, d))
    return [torch.randn(shape(d), generator=gen) for d in (K, K, V)]


@pytest.mark.parametrize("fn", REWRITTEN, ids=lambda f: f.__name__)
def test_rewritten_once_and_exact(fn):
    matches = check_rewrite_exact(fn, inputs("seq_first" in fn.__name__))
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("parallel", "constant")]
    assert matches[0].options["reverse"] is (fn is anti_causal)


def test_the_scores_are_no_longer_computed():
    """After the rewrite no [.., T, T] tensor is left: the scores, their sums and the division are
    the op's (the user's abs and clamp remain, on [B, H, T, 1])."""
    graphs = []

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs)
        graphs.append(gm)
        return gm.forward

    q, k, v = inputs(False)
    got = torch.compile(torchscale_parallel, backend=backend, fullgraph=True)(q, k, v)
    assert rel_err(got, torchscale_parallel(*(x.double() for x in (q, k, v)))) <= FP32_TOL
    square = [n.name for n in graphs[0].graph.nodes if n.op == "call_function" or n.op == "call_method"
              if _shape(n)[-2:] == (T, T) and len(_shape(n)) == 4]
    assert not square, square
    targets = {getattr(n.target, "__name__", n.target) for n in graphs[0].graph.nodes}
    assert {"abs", "clamp"} <= targets


def _shape(n) -> tuple:
    val = n.meta.get("example_value")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


class TorchscaleParallel(torch.nn.Module):
    """torchscale's RetNetRelPos mask (from a float32 buffer of log decays) and parallel_forward."""

    def __init__(self, heads=H):
        super().__init__()
        self.register_buffer("decay", torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float))))

    def forward(self, q, k, v):
        index = torch.arange(q.shape[2]).to(self.decay)
        dist = torch.masked_fill(index[:, None] - index[None, :], index[:, None] < index[None, :], float("inf"))
        mask = torch.nan_to_num(torch.exp(dist * self.decay[:, None, None]))
        mask = mask / mask.sum(dim=-1, keepdim=True).sqrt()
        return torchscale_parallel_on(q, k, v, mask)


def torchscale_parallel_on(q, k, v, mask):
    a = q @ k.transpose(-1, -2) * mask
    return (a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)) @ v


def test_long_sequence_as_exact_as_eager():
    """The op's gate is read from the float32 row-scaled mask over many steps, not one: its
    rounding is not multiplied by the length (read over one step, the slowest of 8 RetNet heads,
    gamma = 1 - 2 ** -12, is off by ~1e-4 in its log, and the output by ~2e-5 at T = 1024)."""
    heads, n = 8, 1024
    module = TorchscaleParallel(heads)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, heads, n, d, generator=gen) for d in (K, K, V))
    got, _ = compile_rewritten(module, [q, k, v])
    assert counters["gla_inductor"]["rewrites"] == 1
    want = module.double()(q.double(), k.double(), v.double())
    assert rel_err(got[0], want) <= FP32_TOL
    assert rel_err(module.float()(q, k, v), want) <= FP32_TOL  # (eager's own error, for scale)


# ---- left alone -----------------------------------------------------------------------------------
def absolute_row_sums(q, k, v):
    """torchscale's chunkwise normalizer: the row sums of |A|, no function of GLA's outputs."""
    a = scores(q, k)
    return (a / a.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)) @ v


def row_maximum(q, k, v):
    a = scores(q, k)
    return (a / a.detach().amax(dim=-1, keepdim=True).clamp(min=1)) @ v


def column_factor(q, k, v):
    """The mask's columns scaled (c_j), the scores normalized as torchscale does."""
    a = scores(q, k, scale="columns")
    return (a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)) @ v


@pytest.mark.parametrize("fn, reason", [
    (absolute_row_sums, "the scores q k^T D are read by abs"),
    (row_maximum, "the scores q k^T D are read by amax"),
    (column_factor, "times a factor of the key's column c_j (D[i, j] / D[j, j] is GLA"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_look_alike_left_alone_with_its_reason(fn, reason):
    args = inputs(False)
    got, results = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*(a.double() for a in args))) <= FP32_TOL
    reasons = [nm.reason for r in results for nm in r.near_misses if nm.form == "parallel"]
    assert any(reason in x for x in reasons), reasons


# ---- the trial certificate at fewer batches and heads -------------------------------------------
@pytest.fixture
def fresh_trials(monkeypatch):
    """No trial certificate kept from another test (a kept one is not run, nor counted)."""
    from gla_inductor.recognize.certify import trial

    monkeypatch.setattr(trial, "CERTIFIED", {})
    return trial


def shared_decay(q, k, v):
    """One decay for every head (a [T, T] mask): heads may be reduced as well as batches."""
    a = (q @ k.transpose(-1, -2)) * decay_mask(q.shape[2], q.dtype, device=q.device)[0]
    return (a / a.detach().sum(dim=-1, keepdim=True).abs().clamp(min=1)) @ v


@pytest.mark.parametrize("fn", [torchscale_parallel, shared_decay, seq_first_divided_after],
                         ids=lambda f: f.__name__)
def test_certificate_at_two_batches(fn, fresh_trials):
    """4 batches (and 4 heads where the decay is one for all): the certificate runs at 2 of each,
    the rewrite is exact at full size."""
    heads = 4 if fn is shared_decay else H
    gen = torch.Generator().manual_seed(3)
    shape = (lambda d: (4, T, heads, d)) if "seq_first" in fn.__name__ else (lambda d: (4, heads, T, d))
    args = [torch.randn(shape(d), generator=gen) for d in (K, K, V)]
    check_rewrite_exact(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert counters["gla_inductor"]["certificates_trial_reduced"] == 1
    assert counters["gla_inductor"]["certificates_trial"] == 0


def test_reduced_certificate_still_refuses_a_wrong_rewrite(monkeypatch, fresh_trials):
    """The row factor left out of q: the rewrite differs from the code, and the certificate at two
    batches says so."""
    from gla_inductor.recognize.forms import row_factor

    monkeypatch.setattr(row_factor, "scale_q", lambda em, q, row, letters: q)
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(4, H, T, d, generator=gen) for d in (K, K, V)]
    got, results = compile_rewritten(torchscale_parallel, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert counters["gla_inductor"]["certificates_trial_reduced"] == 1
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert any("float64 certificate differs from the code" in x for x in reasons), reasons
    assert rel_err(got[0], torchscale_parallel(*(a.double() for a in args))) <= FP32_TOL


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("state", [False, True])
def test_op_by_chunks_is_the_recurrence(reverse, state):
    """The certificate's float64 op for a constant gate (by chunks) is the naive recurrence's map,
    over several chunks and a partial last one, with an initial state and its final state."""
    import gla_inductor.ops  # noqa: F401  (the op's schema)
    from gla_inductor.contract import GLACall
    from gla_inductor.recognize.certify.certificate import reference_op
    from gla_inductor.recognize.certify.trial import _CHUNK, _gla_f64

    gen = torch.Generator().manual_seed(5)
    n = 2 * _CHUNK + 7
    q, k, v = (torch.randn(2, n, 3, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    gamma = -torch.rand(3, generator=gen, dtype=torch.float64) * 0.2
    h0 = torch.randn(2, 3, K, V, generator=gen, dtype=torch.float64) if state else None
    call = GLACall(q, k, v, None, gamma, h0, scale=0.7, output_final_state=True, reverse=reverse)
    args = call.op_args()
    for got, want in zip(_gla_f64(*args), reference_op(*args)):
        assert got.shape == want.shape and rel_err(got, want) <= 1e-12


def test_certificate_past_its_budget_says_why(monkeypatch, fresh_trials):
    """Two batches and two heads cannot be reduced: past the memory budget the layer is left alone,
    and the reason says both."""
    monkeypatch.setattr(fresh_trials, "CERT_BUDGET_BYTES", 1000)
    args = inputs(False)
    got, results = compile_rewritten(torchscale_parallel, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert any("fewer batches and heads will not do (batch and heads are already small)" in x
               for x in reasons), reasons
    assert rel_err(got[0], torchscale_parallel(*(a.double() for a in args))) <= FP32_TOL


def test_every_head_certified_where_the_decay_differs_between_heads(monkeypatch, fresh_trials):
    """RetNet's mask differs between heads: each head is its own function, so the certificate runs
    every head, two at a time (5 heads: 0-1, 2-3, 3-4). An op that were wrong for the slowest decay
    only (the last head's) is caught, and the rewrite is left alone."""
    heads, real = 5, fresh_trials._gla_f64
    module = TorchscaleParallel(heads)
    gen = torch.Generator().manual_seed(6)
    args = [torch.randn(3, heads, T, d, generator=gen) for d in (K, K, V)]
    got, _ = compile_rewritten(module, args)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert counters["gla_inductor"]["certificates_trial_reduced"] == 1
    assert rel_err(got[0], module.double()(*(a.double() for a in args))) <= FP32_TOL

    def wrong_for_the_last_head(*op_args, **kwargs):  # op_args[4]: g_gamma, its log decay per head
        o, state = real(*op_args, **kwargs)
        return (o * 1.01 if op_args[4].max() > -0.0029 else o), state  # (head 4: log(1 - 2 ** -9))

    monkeypatch.setattr(fresh_trials, "_gla_f64", wrong_for_the_last_head)
    monkeypatch.setattr(fresh_trials, "CERTIFIED", {})
    torch._dynamo.reset()
    counters.clear()
    _, results = compile_rewritten(module.float(), args)
    assert counters["gla_inductor"]["rewrites"] == 0
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert any("float64 certificate differs from the code" in x for x in reasons), reasons
