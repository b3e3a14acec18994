"""Decays held in buffers, changed after compiling. A rewrite of a chunk loop over decay tables
(lightning attention) or of a parallel form over a precomputed mask is proven for the buffers'
values as tables of the gate, reads its gate from them in the graph and checks them at run
time: tables recomputed for another gate are followed by the op; anything else (one table
edited alone, a mask no longer causal) runs the user's own code, in a ``torch.cond`` in the
graph. Inference and a training step's gradients, through the rewritten graph run eagerly and
through Inductor, fullgraph."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.ops import dispatch
from gla_inductor.recognize.forms import fallback

from helpers import rel_err, rewrite_then_eager
from test_chunk_loop_buffers import MaskedTableChunkLoop, TableChunkLoop

pytestmark = [pytest.mark.usefixtures("seeded_compiler"), pytest.mark.compat]

TOL = 1e-5
FALLBACK_TOL = 1e-6  # the user's own ops, run by the graph instead of eagerly (bitwise on CPU so far)


class BufferMask(nn.Module):
    """Retention's parallel form over a [H, L, L] mask gamma ** (i - j) (0 above the diagonal)
    computed in ``__init__`` from per-head gammas and sliced to the length."""

    def __init__(self, heads=3, max_len=24):
        super().__init__()
        self.register_buffer("gamma", 1 - 2.0 ** (-2 - torch.arange(heads, dtype=torch.float32)))
        self.register_buffer("mask", torch.empty(heads, max_len, max_len))
        self.retable()

    @torch.no_grad()
    def retable(self):
        n = torch.arange(self.mask.shape[-1], dtype=torch.float32, device=self.mask.device)
        d = n[:, None] - n[None, :]
        self.mask.copy_(self.gamma[:, None, None] ** d.clamp(min=0) * (d >= 0))

    def forward(self, q, k, v):
        T = q.shape[2]
        return (q @ k.transpose(-1, -2) * self.mask[:, :T, :T]) @ v


def inputs(B=2, H=3, T=16, K=8, V=6, grad=False):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, d, generator=gen).requires_grad_(grad) for d in (K, K, V))


@pytest.fixture
def op_calls(monkeypatch):
    """How many times the GLA op ran (its forward, on any implementation)."""
    calls = []
    inner = dispatch.chunk_fwd

    def counted(call):
        calls.append(call)
        return inner(call)

    monkeypatch.setattr(dispatch, "chunk_fwd", counted)
    return calls


def _outputs(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _step(fn, args):
    """Outputs and the gradients of q, k, v under a fixed weighting of the outputs."""
    outs = _outputs(fn(*args))
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, args)) if loss.requires_grad else []


def _compare(compiled, model, args, tol, op_calls, op_runs: bool) -> None:
    before = len(op_calls)
    got, got_grads = _step(compiled, args)
    assert (len(op_calls) > before) == op_runs
    want, want_grads = _step(model, args)
    for g, w in zip(got + got_grads, want + want_grads):
        assert rel_err(g, w) <= tol


def _break_chunk_loop(model):
    model.key_decay.mul_(0.5)  # one table alone: no gate's tables


def _retune_chunk_loop(model):
    model.slope.mul_(1.7)
    model.retable()


def _break_mask(model):
    model.mask[:, 0, 1] = 0.3  # no longer causal


def _retune_mask(model):
    model.gamma.copy_(torch.tensor([0.5, 0.8, 0.95]))
    model.retable()


CASES = {
    "chunk_loop_cat": (lambda: TableChunkLoop(heads=3, chunk=4, five_d=False), _retune_chunk_loop, _break_chunk_loop),
    "chunk_loop_written": (lambda: TableChunkLoop(heads=3, chunk=4, five_d=True), _retune_chunk_loop,
                           _break_chunk_loop),
    "parallel_mask": (BufferMask, _retune_mask, _break_mask),
}


def _run(name, backend, grad, op_calls):
    make, retune, corrupt = CASES[name]
    model = make()
    args = inputs(grad=grad)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    counters.clear()
    _compare(compiled, model, args, TOL, op_calls, op_runs=True)
    assert counters["gla_inductor"]["rewrites"] == 1
    retune(model)  # another gate's tables (a checkpoint loaded): the op follows them
    _compare(compiled, model, args, TOL, op_calls, op_runs=True)
    corrupt(model)  # no gate's tables: the user's code runs
    _compare(compiled, model, args, FALLBACK_TOL, op_calls, op_runs=False)
    retune(model)  # tables again: the op again
    _compare(compiled, model, args, TOL, op_calls, op_runs=True)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(CASES))
def test_follows_tables_and_falls_back(name, grad, op_calls):
    _run(name, rewrite_then_eager, grad, op_calls)


@pytest.mark.parametrize("name", ["chunk_loop_written", "parallel_mask"])
def test_through_inductor(name, op_calls):
    _run(name, gla_inductor.backend, True, op_calls)


def test_a_mask_buffer_guarded_by_value_falls_back():
    """A 0/1 mask table, no function of the gate, guarded by its fingerprint."""
    model = MaskedTableChunkLoop(heads=3, chunk=4)
    args = inputs()
    compiled = torch.compile(model, backend=rewrite_then_eager, fullgraph=True, dynamic=False)
    counters.clear()
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL
    assert counters["gla_inductor"]["rewrites"] == 1
    model.mask[0, 1] = 1.0  # no longer causal
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= FALLBACK_TOL


def test_the_graph_holds_one_cond_with_both_branches():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return rewrite_then_eager(gm, example_inputs)

    torch.compile(BufferMask(), backend=backend, fullgraph=True, dynamic=False)(*inputs())
    (gm,) = graphs
    assert gla_inductor.explain(BufferMask(), *inputs()).matches[0].options["tables_checked"] is True
    conds = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == 1
    true_gm, false_gm = (getattr(gm, a.target) for a in conds[0].args[1:3])
    ops = lambda g: {str(n.target) for n in g.graph.nodes if n.op == "call_function"}  # noqa: E731
    assert "gla_inductor.chunk_fwd.default" in ops(true_gm)
    assert not any("gla_inductor" in t for t in ops(false_gm))


@pytest.mark.parametrize("why", ["config", "torch"])
def test_without_the_fallback_the_checks_raise(monkeypatch, why):
    """With config.table_guard = "raise" (no host synchronization), or on a torch whose cond
    cannot be differentiated, the checks raise: no wrong outputs either way."""
    if why == "config":
        monkeypatch.setattr(gla_inductor.config, "table_guard", "raise")
    else:
        monkeypatch.setattr(fallback, "COND_AUTOGRAD", False)
    model = TableChunkLoop(heads=3, chunk=4, five_d=False)
    args = inputs()
    compiled = torch.compile(model, backend=rewrite_then_eager, fullgraph=True, dynamic=False)
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL
    assert counters["gla_inductor"]["rewrites"] == 1
    _break_chunk_loop(model)
    with pytest.raises(RuntimeError, match="decay buffer"):
        compiled(*args)


def test_a_trained_mask_is_left_alone():
    """A mask that is a parameter gets the user's elementwise gradient; the op's would reach it
    only through the gate read from it: no rewrite, and the reason said."""
    model = BufferMask()
    mask = model.mask.clone()
    del model._buffers["mask"]
    model.mask = nn.Parameter(mask)
    report = gla_inductor.explain(model, *inputs())
    assert report.matches == []
    assert any("are trained" in nm.reason for nm in report.near_misses), [nm.reason for nm in report.near_misses]


def test_operands_sharing_memory_are_not_branched():
    """torch.cond refuses operands that alias each other: where the user's nodes can only be cut
    so, the checks raise instead (the reason is logged)."""
    import torch.fx as fx

    g = fx.Graph()
    base = torch.zeros(4, 4)
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["example_value"], b.meta["example_value"] = base, base[1:]
    out = g.call_function(torch.add, (a, a))
    g.output(out)
    assert "share memory" in fallback._unclean([a, b], [], out)
    b.meta["example_value"] = torch.zeros(3, 4)
    assert fallback._unclean([a, b], [], out) is None
