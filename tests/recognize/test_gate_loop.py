"""Time loops whose per-step decay is computed inside the graph (``loop.py``, ``step_walk``).

Dynamo unrolls a gate computed in the loop body into one node per step, so no two steps name
the same decay tensor. The recognizer proves that every step computes the same function of
its own time slices and hands the op that function over the whole sequence (replayed on the
un-sliced tensors, or the steps' own values stacked). Each program below compiles to exactly
one rewrite and matches float64 eager in value and gradients; the near misses (a gate that
reads the state, differs at one step, or decays over V) are left alone and still run as eager.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite
from gla_inductor.recognize.forms import loop
from gla_inductor.recognize.core.analyzer import Analyzer

from helpers import FP32_TOL, check_against_float64, rel_err, rewrite_then_eager

B, T, H, K, V = 2, 7, 3, 4, 5


pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


def _read(q_t, S):
    return (q_t[..., None] * S).sum(-2)


# ---- programs: [B, T, H, D] inputs, state [B, H, K, V] ----------------------------------------
def mamba2_dt_before(q, k, v, dt_raw, dt_bias, A_log):
    """Mamba2: dt and A once before the loop, dA = exp(dt_t * A) per step, dt folded into k."""
    dt = F.softplus(dt_raw + dt_bias)
    A = -torch.exp(A_log)
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        dA = torch.exp(dt[:, t] * A)
        S = S * dA[..., None, None] + (k[:, t] * dt[:, t, :, None])[..., None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def mamba2_per_step(q, k, v, dt_raw, dt_bias, A_log):
    """Everything per step (Dynamo does not CSE `-exp(A_log)`), dt folded into v."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        A = -torch.exp(A_log)
        dt = F.softplus(dt_raw[:, t] + dt_bias)
        S = S * torch.exp(A * dt)[..., None, None] + k[:, t, :, :, None] * (v[:, t] * dt[..., None])[..., None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def softplus_gate_per_step(q, k, v, dt_raw, dt_bias, A_log):
    """A scalar gate a * softplus(x + bias) per step, read by the decay alone (fusable)."""
    S = q.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for t in range(T):
        dA = torch.exp(-torch.exp(A_log) * F.softplus(dt_raw[:, t] + dt_bias))
        S = S * dA[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = _read(q[:, t], S)
    return o


def logsigmoid_per_step(q, k, v, x):
    """A GLA vector gate logsigmoid(x_t) / 16 per step."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t]) / 16
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def sigmoid_per_step_reversed(q, k, v, x):
    """A decay sigmoid(x_t) itself, the loop run backwards over time."""
    S = q.new_zeros(B, H, K, V)
    o = [None] * T
    for t in reversed(range(T)):
        S = S * torch.sigmoid(x[:, t])[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[t] = _read(q[:, t], S)
    return torch.stack(o, 1)


def gate_before_sliced(q, k, v, dt_raw, dt_bias, A_log):
    """dA computed once before the loop over the whole sequence and sliced per step."""
    dt = F.softplus(dt_raw + dt_bias)
    dA = torch.exp(dt * -torch.exp(A_log))
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        S = S * dA[:, t, :, None, None] + k[:, t, :, :, None] * (v[:, t] * dt[:, t, :, None])[..., None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def decay_before_sliced(q, k, v, x):
    """exp(logsigmoid(x) / 16) before the loop: an exp of a linear form, sliced per step."""
    decay = (F.logsigmoid(x) / 16).exp()
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        S = S * decay[:, t, :, :, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def unbind_gate_and_projection(q, k, v, x):
    """Per step through unbind, with a projection the replay keeps (matmul by a constant)."""
    w = torch.linspace(-1.0, 1.0, K * K, dtype=x.dtype).reshape(K, K)
    xs = x.unbind(1)
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(xs[t] @ w)
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def normalized_gate(q, k, v, x):
    """A per-step op the replay does not know (F.normalize): the steps' gates are stacked."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(F.normalize(x[:, t], dim=-1))
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def normalized_reversed_with_state(q, k, v, x, h0):
    """Stacked gates and keys (F.normalize per step), backwards from a given state, with the
    final state returned."""
    S = h0
    o = [None] * T
    for t in reversed(range(T)):
        g = F.logsigmoid(F.normalize(x[:, t], dim=-1))
        S = S * g.exp()[..., None] + F.normalize(k[:, t], dim=-1)[..., None] * v[:, t, :, None, :]
        o[t] = _read(q[:, t], S)
    return torch.stack(o, 1), S


def unit_slice_gate(q, k, v, x):
    """x[:, t:t+1] kept as a size-1 axis, squeezed after the gate function."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t : t + 1]).squeeze(1) * 0.25
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


# ---- near misses -------------------------------------------------------------------------------
def near_gate_reads_state(q, k, v, x):
    """The gate reads the state it decays: not GLA."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t] + S.sum(-1))
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def near_gate_differs_at_one_step(q, k, v, x):
    """One step scales its gate differently."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t]) / (8 if t == T // 2 else 16)
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def near_gate_function_differs(q, k, v, x):
    """One step computes its gate by another function (equal in value: still not proven)."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t]) if t != 2 else -F.softplus(-x[:, t])
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def near_gate_over_v(q, k, v, xv):
    """A per-step gate that decays the value axis."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(xv[:, t]) / 16
        S = S * g.exp()[..., None, :] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


def near_gate_reads_next_step(q, k, v, x):
    """The gate of step t reads x at t and t + 1."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        g = F.logsigmoid(x[:, t] + x[:, min(t + 1, T - 1)])
        S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


# ---- inputs ------------------------------------------------------------------------------------
def _args(fn, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).requires_grad_()

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    if fn in MAMBA:
        return [q, k, v, rand(B, T, H), rand(H), rand(H, s=0.5)]
    x = rand(B, T, H, V if fn is near_gate_over_v else K, s=2.0)
    return [q, k, v, x, rand(B, H, K, V)] if fn is normalized_reversed_with_state else [q, k, v, x]


MAMBA = {mamba2_dt_before, mamba2_per_step, softplus_gate_per_step, gate_before_sliced}

# (program, gate kind, fused gates)
PROGRAMS = [
    (mamba2_dt_before, "scalar", 0),  # dt is read by k too: its softplus is not the gate's alone
    (mamba2_per_step, "scalar", 0),  # likewise, by v
    (softplus_gate_per_step, "scalar", 1),
    (logsigmoid_per_step, "vector", 1),
    (sigmoid_per_step_reversed, "vector", 1),
    (gate_before_sliced, "scalar", 0),
    (decay_before_sliced, "vector", 1),
    (unbind_gate_and_projection, "vector", 1),  # the op reads x_t @ w, logsigmoid in the kernel
    (normalized_gate, "vector", 0),
    (normalized_reversed_with_state, "vector", 0),
    (unit_slice_gate, "vector", 0),  # the lifted gate keeps the size-1 axis: no permutation to see through
]
NEAR_MISSES = [
    (near_gate_reads_state, "reads the state"),
    (near_gate_differs_at_one_step, "differs in structure"),
    (near_gate_function_differs, "differs in structure"),
    (near_gate_over_v, "over V"),
    (near_gate_reads_next_step, "several time indices"),
]


@pytest.mark.parametrize("fn, gate, fused", PROGRAMS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_loop_gate_is_rewritten_and_exact(fn, gate, fused):
    args = _args(fn)
    report = gla_inductor.explain(fn, *args)
    assert [(m.form, m.gate) for m in report.matches] == [("loop", gate)], str(report)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1, dict(counters["gla_inductor"])
    assert counters["gla_inductor"]["fused_gates"] == fused
    assert counters["gla_inductor"]["failures"] == 0
    check_against_float64(fn, args, out)


@pytest.mark.parametrize("fn", [mamba2_per_step, logsigmoid_per_step], ids=lambda f: f.__name__)
def test_training_with_inductor(fn):
    """The full backend (Inductor lowers the GLA op): forward and every gradient."""
    args = _args(fn, seed=3)
    out = torch.compile(fn, backend=gla_inductor.backend, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    check_against_float64(fn, args, out)


@pytest.mark.parametrize("fn, reason", NEAR_MISSES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_near_miss_is_left_alone(fn, reason):
    args = _args(fn)
    report = gla_inductor.explain(fn, *args)
    assert not report.matches
    assert any(reason in n.reason for n in report.near_misses), str(report)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 0
    ref = fn(*[a.detach().double() for a in args])
    assert rel_err(out, ref) <= FP32_TOL


def test_rewritten_gate_is_one_replay_of_the_step():
    """The op reads the gate function applied once to the whole x (no per-step node survives),
    and with the gate fused the op reads x itself."""
    graphs = []

    def capture(gm, example_inputs):
        rewrite(gm, example_inputs)
        graphs.append(gm)
        return gm.forward

    torch.compile(softplus_gate_per_step, backend=capture, fullgraph=True)(*_args(softplus_gate_per_step))
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.gla_inductor.chunk_fwd.default) == 1
    assert F.softplus not in targets and torch._C._nn.softplus not in targets  # computed by the kernel
    assert len(gm.graph.nodes) < 30


# ---- stacked blocks, as in examples/gla_block.py ----------------------------------------------
# A second layer's loop reads tensors computed after the first layer's loop, which read time
# slices of their own: those are still inputs of the second layer's steps, the same every step.
class GLABlock(torch.nn.Module):
    """examples/gla_block.py's block (pre-norm, fused q/k/v projection viewed as heads, output
    gate, MLP). `gate`: where the log gate is computed: "before" the loop and sliced (the
    example), "per_step" in the loop from a slice of its projection, or "fused": split from
    the same projection as q, k, v by unbind, logsigmoid per step."""

    def __init__(self, dim: int, heads: int, gate: str):
        super().__init__()
        self.heads, self.head_dim, self.spelling = heads, dim // heads, gate
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (4 if gate == "fused" else 3) * dim, bias=False)
        self.gate = torch.nn.Linear(dim, dim) if gate != "fused" else None
        self.out_gate = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def attention(self, q, k, v, x):
        B_, T_, H_, K_ = q.shape
        S = q.new_zeros(B_, H_, K_, v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(T_):
            g = x[:, t] if self.spelling == "before" else F.logsigmoid(x[:, t]) / 16
            S = S * g.exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K_**-0.5
        return o

    def forward(self, x):
        B_, T_, _ = x.shape
        h = self.norm1(x)
        parts = self.qkv(h).view(B_, T_, -1, self.heads, self.head_dim).unbind(2)
        q, k, v = parts[:3]
        if self.spelling == "fused":
            gx = parts[3]
        else:
            gx = self.gate(h).view(B_, T_, self.heads, self.head_dim)
            gx = F.logsigmoid(gx) / 16 if self.spelling == "before" else gx
        o = self.attention(q, k, v, gx).reshape(B_, T_, -1)
        x = x + o * F.silu(self.out_gate(h))
        return x + self.mlp(self.norm2(x))


def two_blocks(gate: str, dim: int = 16, heads: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(GLABlock(dim, heads, gate), GLABlock(dim, heads, gate))


def check_model_against_float64(model, compiled, x, tol):
    """The output and every parameter's gradient, against the model run eagerly in float64."""
    out = compiled(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * weight).sum(), list(model.parameters()))
    model64 = copy.deepcopy(model).double()
    ref = model64(x.double())
    want = torch.autograd.grad((ref * weight.double()).sum(), list(model64.parameters()))
    assert rel_err(out, ref.detach()) <= tol
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert rel_err(a, b) <= tol, name


def test_stacked_blocks_train_with_inductor():
    """The README's example: both layers' loops become the op, forward and backward through
    Inductor."""
    model = two_blocks("before")
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend=gla_inductor.backend)
    check_model_against_float64(model, compiled, x, 1e-4)
    assert counters["gla_inductor"]["rewrites"] == 2, dict(counters["gla_inductor"])
    assert counters["gla_inductor"]["failures"] == 0


@pytest.mark.parametrize("gate", ["before", "per_step", "fused"])
def test_stacked_blocks_every_gate_spelling(gate):
    model = two_blocks(gate)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend=rewrite_then_eager, fullgraph=True)
    check_model_against_float64(model, compiled, x, FP32_TOL)
    assert counters["gla_inductor"]["rewrites"] == 2, dict(counters["gla_inductor"])
    assert counters["gla_inductor"]["fused_gates"] == 2


def _loop_work(model, T, monkeypatch=None) -> tuple:
    """(loops found, normal forms computed, step walks built) by the time-loop pass on the
    model's graph; with monkeypatch, the pass without step walks (the feature off)."""
    graphs = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(torch.randn(2, T, 16))
    if monkeypatch is not None:
        monkeypatch.setattr(loop, "step_walk", lambda an, node: None)
    an = Analyzer(graphs[0].graph)
    matches, _ = loop.recognize(an)
    if monkeypatch is not None:
        monkeypatch.undo()
    return len(matches), len(an._cache), len(an.memo.get("walks", {}))


def test_stacked_blocks_recognition_work(monkeypatch):
    """The second layer's tensors are walked once, not once per step (the walk of a node
    depends on its inputs' walks only, memoized), and walks compute no normal forms: the
    pass does the work it does without them, plus a number of walks independent of T."""
    model = two_blocks("before")
    found, forms, walks = _loop_work(model, 8)
    assert (found, forms) == _loop_work(model, 8, monkeypatch)[:2] and found == 2
    assert _loop_work(model, 16)[2] == walks
