"""RetNet's parallel retention as people write it: decay masks built from a per-head buffer with
``masked_fill(inf)`` + ``exp`` + ``nan_to_num`` (torchscale's way), ``gamma ** (i - j)`` with the
upper triangle zeroed, a cached helper, ``exp(tril(d)) * tril(ones)`` and ``d.tril().exp().tril()``,
base-2 decays, the decay as a third einsum operand. The decay depends only on positions and
buffers: it is evaluated, checked to be gamma_h ** (i - j) on the causal triangle, and the op's
constant gate is read from it in the graph (so a buffer changed after compiling is honoured).
A mask whose rows are scaled (torchscale divides each by the root of its sum) is the same with a
factor per query, folded into q. Each is rewritten once and equals float64 eager. Look-alikes
(non-causal or shifted masks, a decay that is not a power of i - j, scores normalized by the row
sums of their absolute values) stay code, with a reason that says which fact failed."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import gla_inductor

from helpers import FP32_TOL, check_rewrite_exact, compile_rewritten, rel_err

B, H, T, K, V = 2, 3, 10, 4, 5

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def log_decay(heads):
    """RetNet's per-head log decay, log(1 - 2 ** (-5 - h))."""
    return torch.log(1 - 2 ** (-5 - torch.arange(heads, dtype=torch.float)))


# ---- the spellings ------------------------------------------------------------------------------
class TorchscaleMask(nn.Module):
    """The relative-position module's decay mask: +inf above the diagonal, times a negative log
    decay, exp (0 there), nan_to_num; optionally each row divided by the root of its sum."""

    def __init__(self, nan_to_num=True, normalize=False):
        super().__init__()
        self.register_buffer("decay", log_decay(H))
        self.nan_to_num, self.normalize = nan_to_num, normalize

    def forward(self, n):
        index = torch.arange(n).to(self.decay)
        causal = torch.tril(torch.ones(n, n).to(self.decay))
        dist = torch.masked_fill(index[:, None] - index[None, :], ~causal.bool(), float("inf"))
        mask = torch.exp(dist * self.decay[:, None, None])
        if self.nan_to_num:
            mask = torch.nan_to_num(mask)
        if self.normalize:
            mask = torch.nan_to_num(mask / mask.sum(dim=-1, keepdim=True).sqrt(), nan=0.0)
        return mask


class TorchscaleRetention(nn.Module):
    """q k^T scaled, times the mask, optionally each row divided by its absolute sum, then @ v."""

    def __init__(self, qk_norm=False, **mask_kw):
        super().__init__()
        self.rel_pos = TorchscaleMask(**mask_kw)
        self.qk_norm = qk_norm

    def forward(self, q, k, v):  # [B, H, T, D]
        mask = self.rel_pos(q.size(2))
        qk = q @ k.transpose(-1, -2) * K ** -0.5
        qk = qk * mask
        if self.qk_norm:
            qk = qk / qk.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)
        return torch.matmul(qk, v)


class PowerDecay(nn.Module):
    """gamma ** (i - j) (or gamma ** |i - j|) from a buffer of gammas, the future zeroed by
    masked_fill."""

    def __init__(self, absolute=False):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))
        self.absolute = absolute

    def forward(self, q, k, v):
        n = torch.arange(q.shape[2], device=q.device)
        dist = n[:, None] - n[None, :]
        D = self.gamma.view(-1, 1, 1) ** (dist.abs() if self.absolute else dist)
        D = D.masked_fill(n[:, None] < n[None, :], 0)
        return (q @ k.transpose(-1, -2) * D) @ v


@functools.lru_cache(maxsize=None)
def cached_decay_mask(n, heads):
    gamma = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))
    pos = torch.arange(n)
    return (gamma[:, None, None] ** (pos[:, None] - pos[None, :]).clamp(min=0)).tril().float()


def cached_helper(q, k, v):
    D = cached_decay_mask(q.shape[2], q.shape[1])
    return torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k) * D, v)


class TrilExp(nn.Module):
    """exp(tril(d)) * tril(ones), or d.tril().exp().tril(), with d = (i - j) * log gamma[h]."""

    def __init__(self, method=False):
        super().__init__()
        self.register_buffer("log_gamma", log_decay(H))
        self.method = method

    def forward(self, q, k, v):
        n = q.shape[2]
        pos = torch.arange(n, dtype=q.dtype, device=q.device)
        d = (pos[:, None] - pos[None, :]) * self.log_gamma[:, None, None]
        M = d.tril().exp().tril() if self.method else torch.exp(torch.tril(d)) * torch.tril(torch.ones(n, n))
        return ((q @ k.transpose(-1, -2)) * M) @ v * K ** -0.5


class Base2(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[2], dtype=torch.float)
        D = torch.exp2((pos[:, None] - pos[None, :]) * torch.log2(self.gamma)[:, None, None])
        D = torch.where(pos[:, None] >= pos[None, :], D, 0.0)
        return (q @ k.transpose(-1, -2) * D) @ v


class EinsumDecay(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("decay", log_decay(H))

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[2], dtype=torch.float)
        D = torch.exp((pos[:, None] - pos[None, :]) * self.decay[:, None, None]).tril()
        return torch.einsum("bhqd,bhkd,hqk->bhqk", q, k, D) @ v


class PositionsLikeQ(nn.Module):
    """Positions cast to q's dtype (`arange(n).to(q)`, `ones(n, n).type_as(q)`): only q's dtype is read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("decay", log_decay(H))

    def forward(self, q, k, v):
        n = q.shape[2]
        pos = torch.arange(n).to(q)
        causal = torch.ones(n, n).type_as(q).tril()
        D = torch.exp((pos[:, None] - pos[None, :]) * self.decay[:, None, None]) * causal
        return (q @ k.transpose(-1, -2) * D) @ v


class AntiCausal(nn.Module):
    """The reverse form: gamma ** (j - i) on j >= i, triu."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        n = torch.arange(q.shape[2])
        D = (self.gamma[:, None, None] ** (n[None, :] - n[:, None]).clamp(min=0)).triu()
        return (q @ k.transpose(-1, -2) * D) @ v


SPELLINGS = {
    "torchscale": lambda: TorchscaleRetention(),
    "torchscale_without_nan_to_num": lambda: TorchscaleRetention(nan_to_num=False),
    "power": lambda: PowerDecay(),
    "power_of_abs": lambda: PowerDecay(absolute=True),
    "cached_helper": lambda: cached_helper,
    "exp_tril_times_tril_ones": lambda: TrilExp(),
    "tril_exp_tril": lambda: TrilExp(method=True),
    "exp2": lambda: Base2(),
    "einsum_third_operand": lambda: EinsumDecay(),
    "anti_causal": lambda: AntiCausal(),
    "positions_cast_like_q": lambda: PositionsLikeQ(),
    "mask_precomputed_in_a_buffer": lambda: PrecomputedMask(),  # (defined with the look-alikes)
    # each row divided by the root of its sum (torchscale's mask): a row factor, folded into q
    "row_normalized_mask": lambda: TorchscaleRetention(normalize=True),
}


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=gen) for d in (K, K, V)]


def exact_in_float64(make):
    """fn and a twin whose module (buffers included) is in float64, called for float64 inputs."""
    fn = make()
    if not isinstance(fn, nn.Module):
        return fn
    fn64 = copy.deepcopy(fn).double()
    return lambda x, *rest: (fn64 if x.dtype == torch.float64 else fn)(x, *rest)


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_rewritten_with_a_constant_gate(name):
    matches = check_rewrite_exact(exact_in_float64(SPELLINGS[name]), inputs())
    assert counters["gla_inductor"]["rewrites"] == 1
    assert [(m.form, m.gate) for m in matches] == [("parallel", "constant")]
    assert matches[0].options["reverse"] is (name == "anti_causal")


def test_torchscale_through_inductor_with_gradients():
    """The whole backend, Inductor included: the op's output and every gradient as float64 eager."""
    fn = exact_in_float64(SPELLINGS["torchscale"])
    args = [a.requires_grad_() for a in inputs()]
    got = torch.compile(fn, backend=gla_inductor.backend, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    args64 = [a.detach().double().requires_grad_() for a in args]
    want = fn(*args64)
    assert rel_err(got, want) <= FP32_TOL
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = torch.autograd.grad((got.double() * w).sum(), args)
    grads64 = torch.autograd.grad((want * w).sum(), args64)
    for g, g64 in zip(grads, grads64):
        assert rel_err(g, g64) <= FP32_TOL


@pytest.mark.parametrize("name, buffer", [("torchscale", "rel_pos.decay"), ("power", "gamma"),
                                          ("tril_exp_tril", "log_gamma"), ("row_normalized_mask", "rel_pos.decay")])
def test_buffer_changed_after_compiling(name, buffer):
    """The gate is read from the buffer in the graph: new decays reach the op, no recompile."""
    module = SPELLINGS[name]()
    compiled = torch.compile(module, backend=gla_inductor.backend, fullgraph=True)
    q, k, v = inputs()
    compiled(q, k, v)
    owner, attr = module.get_submodule(buffer.rpartition(".")[0]), buffer.rpartition(".")[2]
    old = getattr(owner, attr)
    # each head decays faster: a log decay doubled, a gamma squared
    setattr(owner, attr, old * 2 if attr in ("decay", "log_gamma") else old ** 2)
    got = compiled(q, k, v)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert counters["stats"]["unique_graphs"] == 1
    want = copy.deepcopy(module).double()(*[x.double() for x in (q, k, v)])
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(got, module(q, k, v)) <= FP32_TOL


class Stack(nn.Module):
    """Layers sharing one mask, as torchscale's decoder computes it once per forward: each layer's
    v is computed from the previous layer's output (no correction of v by the decay)."""

    def __init__(self, layers=3, width=12):
        super().__init__()
        self.rel_pos = TorchscaleMask()
        self.proj = nn.ModuleList(nn.Linear(width, H * (2 * K + V)) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(H * V, width) for _ in range(layers))

    def forward(self, x):
        b, n, _ = x.shape
        mask = self.rel_pos(n)
        for proj, out in zip(self.proj, self.out):
            q, k, v = proj(x).view(b, n, H, -1).transpose(1, 2).split([K, K, V], dim=-1)
            o = (q @ k.transpose(-1, -2) * K ** -0.5 * mask) @ v
            x = x + out(o.transpose(1, 2).reshape(b, n, H * V))
        return x


def test_layers_sharing_one_mask():
    fn = exact_in_float64(Stack)
    x = torch.randn(B, T, 12, generator=torch.Generator().manual_seed(2))
    matches = check_rewrite_exact(fn, [x])
    assert counters["gla_inductor"]["rewrites"] == 3
    assert {(m.form, m.gate) for m in matches} == {("parallel", "constant")}


class LearnedDecay(nn.Module):
    """A per-head log decay that trains: d = (i - j) * log_gamma[h], exp(tril(d)) under tril(ones)."""

    def __init__(self):
        super().__init__()
        self.log_gamma = nn.Parameter(log_decay(H))

    def forward(self, q, k, v):
        n = q.shape[2]
        pos = torch.arange(n, dtype=q.dtype)
        d = (pos[:, None] - pos[None, :]) * self.log_gamma[:, None, None]
        return ((q @ k.transpose(-1, -2)) * torch.exp(torch.tril(d)) * torch.ones(n, n).tril()) @ v


def test_learned_decay_gets_its_gradient():
    """The gate is computed from the parameter in the graph: its gradient flows through the op."""
    module = LearnedDecay()
    module64 = copy.deepcopy(module).double()
    args = [a.requires_grad_() for a in inputs()]
    got = torch.compile(module, backend=gla_inductor.backend, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    args64 = [a.detach().double().requires_grad_() for a in args]
    want = module64(*args64)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (got.double() * w).sum().backward()
    (want * w).sum().backward()
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(module.log_gamma.grad, module64.log_gamma.grad) <= FP32_TOL
    for a, a64 in zip(args, args64):
        assert rel_err(a.grad, a64.grad) <= FP32_TOL


@pytest.mark.parametrize("name", ["torchscale", "power", "exp2"])
def test_dynamic_lengths_do_not_recompile(name):
    """The decay is checked at the length Dynamo hints; the gate, read in the graph, serves all."""
    from torch._dynamo.testing import CompileCounterWithBackend

    module = SPELLINGS[name]()
    module64 = copy.deepcopy(module).double()
    cnt = CompileCounterWithBackend(gla_inductor.backend)
    compiled = torch.compile(module, backend=cnt, dynamic=True, fullgraph=True)
    for t in (7, 11, 16):
        q, k, v = (torch.randn(B, H, t, d) for d in (K, K, V))
        assert rel_err(compiled(q, k, v), module64(q.double(), k.double(), v.double())) <= FP32_TOL
    assert cnt.frame_count == 1
    assert counters["gla_inductor"]["rewrites"] == 1


# ---- look-alikes ------------------------------------------------------------------------------------
class NonCausal(nn.Module):
    """gamma ** |i - j| over the whole matrix: the future decays too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        n = torch.arange(q.shape[2])
        D = self.gamma[:, None, None] ** (n[:, None] - n[None, :]).abs()
        return (q @ k.transpose(-1, -2) * D) @ v


class Shifted(nn.Module):
    """The mask j < i (strict): each query sees only the past, not itself."""

    def __init__(self, offset):
        super().__init__()
        self.register_buffer("decay", log_decay(H))
        self.offset = offset

    def forward(self, q, k, v):
        n = torch.arange(q.shape[2], dtype=torch.float)
        dist = n[:, None] - n[None, :]
        if self.offset:  # gamma ** (i - j - 1) on j <= i
            D = torch.exp((dist - 1) * self.decay[:, None, None]).masked_fill(dist < 0, 0)
        else:
            D = torch.exp(dist * self.decay[:, None, None]).masked_fill(dist <= 0, 0)
        return (q @ k.transpose(-1, -2) * D) @ v


class NotSeparable(nn.Module):
    """gamma ** ((i - j) ** 2): a decay on the triangle that no per-step gate gives."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))

    def forward(self, q, k, v):
        n = torch.arange(q.shape[2])
        dist = n[:, None] - n[None, :]
        D = (self.gamma[:, None, None] ** (dist * dist)).masked_fill(dist < 0, 0)
        return (q @ k.transpose(-1, -2) * D) @ v


class PrecomputedMask(nn.Module):
    """The whole decay mask in a buffer made in __init__, sliced to the length: its values, not the
    code, make it GLA's; rewritten with the mask checked at run time (the user's attention where a
    mask written later is no gate's: test_buffer_change_fallback.py)."""

    def __init__(self, max_len=32):
        super().__init__()
        n = torch.arange(max_len)
        dist = (n[:, None] - n[None, :]).float()
        self.register_buffer("mask", torch.exp(dist * log_decay(H)[:, None, None]) * (dist >= 0))

    def forward(self, q, k, v):
        n = q.shape[2]
        return (q @ k.transpose(-1, -2) * self.mask[:, :n, :n]) @ v


NEAR_MISSES = {
    "non_causal": (NonCausal, "decay D[i, j] for j > i is 0.9688 (at i=0, j=1), expected 0"),
    "shifted_strict": (lambda: Shifted(offset=False), "decay D[i, i] is 0 (at i=0), expected 1"),
    "shifted_by_one": (lambda: Shifted(offset=True),
                       "decay D[i, i] is 1.032 (at i=0), expected 1: the decay is c * gamma ** (i - j)"),
    "not_separable": (NotSeparable, "expected D[1, 0] ** (i - j) = "),
    "scores_normalized_by_the_row_sums_of_their_absolute_values": (
        lambda: TorchscaleRetention(qk_norm=True), "the scores q k^T D are read by abs"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_look_alike_left_alone_with_its_reason(name):
    make, reason = NEAR_MISSES[name]
    fn = exact_in_float64(make)
    args = inputs()
    got, results = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*[a.double() for a in args])) <= FP32_TOL
    reasons = [nm.reason for r in results for nm in r.near_misses if nm.form == "parallel"]
    assert any(reason in x for x in reasons), reasons


def decay_from_an_argument(q, k, v, gamma):
    n = torch.arange(q.shape[2])
    dist = n[:, None] - n[None, :]
    D = (gamma[:, None, None] ** dist).masked_fill(dist < 0, 0)
    return (q @ k.transpose(-1, -2) * D) @ v


def mask_as_an_argument(q, k, v, mask):
    return (q @ k.transpose(-1, -2) * mask) @ v


@pytest.mark.parametrize("fn, extra, name", [
    (decay_from_an_argument, 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)), "gamma"),
    (mask_as_an_argument, torch.ones(H, T, T).tril(), "mask"),
])
def test_decay_from_an_argument_is_not_proven(fn, extra, name):
    """A decay computed from a function's argument may differ at every call: left alone, and the
    reason names the argument (not a wrong fact about q, k and v)."""
    args = inputs() + [extra]
    got, results = compile_rewritten(fn, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(got[0], fn(*[a.double() for a in args])) <= FP32_TOL
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert reasons == [f"the decay D[i, j] is computed from the input(s) {name} (not constants or module buffers): "
                       "its values change from call to call, so its form cannot be proven"]


class MaskCachedOnTheModule(nn.Module):
    """gamma a plain tensor attribute (no register_buffer); the mask cached in a dict per length."""

    def __init__(self):
        super().__init__()
        self.gamma = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float))
        self._masks = {}

    def mask(self, n):
        if n not in self._masks:
            pos = torch.arange(n)
            self._masks[n] = (self.gamma[:, None, None] ** (pos[:, None] - pos[None, :]).clamp(min=0)).tril()
        return self._masks[n]

    def forward(self, q, k, v):
        return (q @ k.transpose(-1, -2) * self.mask(q.shape[2])) @ v


def test_mask_cached_on_the_module():
    """First call: the mask is computed from the attribute gamma in the graph, rewritten. Later,
    Dynamo reads the cached mask itself, whose values alone make it GLA's: rewritten with the mask
    checked at run time (the user's attention where it stops being a gate's)."""
    module = MaskCachedOnTheModule()
    reference = copy.deepcopy(module)
    reference.gamma = reference.gamma.double()
    q, k, v = inputs()
    got = torch.compile(module, backend=gla_inductor.backend, fullgraph=True)(q, k, v)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert rel_err(got, reference(*[x.double() for x in (q, k, v)])) <= FP32_TOL
    report = gla_inductor.explain(module, q, k, v)
    assert [(m.form, m.gate) for m in report.matches] == [("parallel", "constant")]
    assert report.near_misses == []
