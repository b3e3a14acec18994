"""Long loops proven periodic (``recognize/forms/periodic.py``): steps 3 and later are not parsed.

The shortcut must decide exactly what the general path decides. Each program below is
recognized twice on the same Dynamo graph, with the shortcut and without it (every node
parsed), and the two must report the same rewrites and the same near misses, and the
rewritten graphs must compute the same values. Several programs break the period at one
interior step (a time index that jumps, a different gate, an input written in place, a
constant table, an index counted from the end, a final state read by more than its
assembly): there the proof must fail and the general path decide.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from gla_inductor.recognize import rewrite_graph
from gla_inductor.recognize.forms import periodic
from gla_inductor.recognize.core.analyzer import Analyzer
from gla_inductor.recognize.forms import loop
from spellings import NEAR_MISSES, SPELLINGS

B, T, H, K, V = 2, 12, 2, 4, 3


pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


def _read(q_t, S):
    return (q_t[..., None] * S).sum(-2)


def _loop(q, k, v, g, index=lambda t: t, gate=lambda g, t: g[:, t].exp(), after=None):
    """A vector-gate loop whose time index and gate a program may change at one step."""
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        S = S * gate(g, t)[..., None] + k[:, index(t), :, :, None] * v[:, t, :, None, :]
        o.append(_read(q[:, t], S))
        if after is not None:
            after(t, g)
    return torch.stack(o, 1), S


def plain(q, k, v, g):
    return _loop(q, k, v, g)[0]


def final_state_returned(q, k, v, g):
    return _loop(q, k, v, g)


def final_state_scaled(q, k, v, g):
    """The final state read by more than the output assembly: the general path decides."""
    o, S = _loop(q, k, v, g)
    return o, S * 2


def index_jumps(q, k, v, g):
    return _loop(q, k, v, g, index=lambda t: t + 1 if t == 6 else t)[0]


def index_from_end(q, k, v, g):
    return _loop(q, k, v, g, index=lambda t: t - T)[0]


def gate_differs(q, k, v, g):
    return _loop(q, k, v, g, gate=lambda g, t: (g[:, t] * (0.5 if t == 7 else 1.0)).exp())[0]


def gate_written_in_place(q, k, v, g):
    g = g.clone()
    return _loop(q, k, v, g, after=lambda t, g: g.mul_(0.5) if t == 5 else None)[0]


def gate_from_a_table(q, k, v, g):
    """A decay sliced from a constant table (evaluated per index by the algebra)."""
    table = (0.5 + 0.4 * torch.arange(T) / T)[None, :, None, None].expand(B, T, H, K)
    return _loop(q, k, v, table, gate=lambda g, t: g[:, t])[0]


def gate_per_step(q, k, v, g):
    return _loop(q, k, v, g, gate=lambda g, t: (F.logsigmoid(g[:, t]) / 16).exp())[0]


def gate_normalized(q, k, v, g):
    """A per-step gate the op takes stacked from every step: the general path decides."""
    return _loop(q, k, v, g, gate=lambda g, t: F.logsigmoid(F.normalize(g[:, t], dim=-1)).exp())[0]


def reversed_loop(q, k, v, g):
    S = q.new_zeros(B, H, K, V)
    o = [None] * T
    for t in reversed(range(T)):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[t] = _read(q[:, t], S)
    return torch.stack(o, 1)


def slices_before_the_loop(q, k, v, g):
    """Every step's slices taken before the loop (unbind over time)."""
    S = q.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for t, (q_t, k_t, v_t, g_t) in enumerate(zip(q.unbind(1), k.unbind(1), v.unbind(1), g.unbind(1))):
        S = S * g_t.exp()[..., None] + k_t[..., None] * v_t[..., None, :]
        o[:, t] = _read(q_t, S)
    return o


def delta_rule(q, k, v, g):
    S = q.new_zeros(B, H, K, V)
    o = []
    for t in range(T):
        k_t = k[:, t]
        u = v[:, t] - (k_t[..., None] * S).sum(-2)
        S = S * g[:, t].exp()[..., None] + k_t[..., None] * u[..., None, :]
        o.append(_read(q[:, t], S))
    return torch.stack(o, 1)


PROGRAMS = [plain, final_state_returned, final_state_scaled, index_jumps, index_from_end, gate_differs,
            gate_written_in_place, gate_from_a_table, gate_per_step, gate_normalized, reversed_loop,
            slices_before_the_loop, delta_rule]
# (program, whether the shortcut applies): it must not where the period breaks
SHORTCUT = {plain: True, final_state_returned: True, final_state_scaled: False, index_jumps: False,
            index_from_end: False, gate_differs: False, gate_written_in_place: False, gate_from_a_table: False,
            gate_per_step: True, reversed_loop: True, slices_before_the_loop: True,
            delta_rule: True}  # (a near miss found at step 1, as it is at every step)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, g = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    return q, k, torch.randn(B, T, H, V, generator=gen), F.logsigmoid(g)


def _graphs(fn, args) -> list:
    got = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, ex: got.append((gm, ex)) or gm.forward, fullgraph=True)(*args)
    return got


def _recognize(gm, shortcut: bool, monkeypatch):
    g = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    proofs = []
    find = periodic.find
    with monkeypatch.context() as m:
        m.setattr(periodic, "find", lambda an, out: proofs.extend(find(an, out)) or proofs if shortcut else [])
        res = rewrite_graph(g)
    report = ([(r.form, r.gate, r.layout, r.shapes, r.options) for r in res.matches],
              sorted((nm.form, nm.reason, len(nm.nodes)) for nm in res.near_misses))
    return g, report, [p for p in proofs if not p.failed]


def _same(fn, args, monkeypatch) -> list:
    """Both paths agree on each graph of fn; returns the shortcut's proofs."""
    used = []
    for gm, ex in _graphs(fn, args):
        g_all, every_node, _ = _recognize(gm, False, monkeypatch)
        g_cut, shortcut, proofs = _recognize(gm, True, monkeypatch)
        assert shortcut == every_node
        with torch.no_grad():
            for a, b in zip(tree_leaves(g_all(*ex)), tree_leaves(g_cut(*ex))):
                torch.testing.assert_close(a, b)
        used += proofs
    return used


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_shortcut_decides_as_every_node(fn, monkeypatch):
    proofs = _same(fn, _inputs(), monkeypatch)
    if fn in SHORTCUT:
        assert bool(proofs) == SHORTCUT[fn]


@pytest.mark.parametrize("sp", [s for s in SPELLINGS + NEAR_MISSES if s.form == "loop"], ids=lambda s: s.name)
def test_spellings_decide_as_every_node(sp, monkeypatch):
    torch.manual_seed(0)
    _same(sp.fn, sp.make(torch.float32), monkeypatch)


def test_long_loop_parses_three_steps():
    """At T = 64 the pass computes the normal forms of the head and steps 1 and 2 only (and
    of the nodes before the loop), not of the 64 steps' ~13 nodes each."""
    global T
    saved, T = T, 64
    try:
        (gm, _), = _graphs(plain, _inputs())
    finally:
        T = saved
    an = Analyzer(gm.graph)
    matches, near = loop.recognize(an)
    assert len(matches) == 1 and not near
    assert len(an._cache) < 60 < len(gm.graph.nodes) // 10
