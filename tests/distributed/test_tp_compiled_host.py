"""What a compiled ``chunk_gla`` on head-sharded DTensors runs per step, on the host, beyond the same
compiled call on the rank's heads as plain tensors.

One Dynamo graph, compiled once (no graph break, no recompile over steps); per step none of
``gla_inductor.distributed`` runs (its rules serve the trace only) and our code runs as in the plain
step, call for call; the DTensors' own work is torch's wrapping at the compiled region's boundary:
o and the four gradients wrapped (``__tensor_unflatten__``), and no DTensor op dispatched beyond
the gradients' accumulation into the leaves (one ``detach`` each), no redistribution, and no
symbolic size arithmetic (a static graph; a dynamic one does it, which the last check shows the
count sees). The benchmark's compiled functions (``tp-overhead``) keep DTensor and plain calls from
recompiling each other.

The checks run inside two spawned gloo ranks (``dist_harness``); each test asserts one check's results.
"""

from __future__ import annotations

import collections
import cProfile
import functools
import pstats

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

NAMES = ("q", "k", "v", "g")
OURS = "/gla_inductor/"
RULES = "/gla_inductor/distributed/"
DTENSOR_DISPATCH = "torch/distributed/tensor/_dispatch.py"
SYMBOLIC = "torch/fx/experimental/sym_node.py"
UNFLATTEN = "torch/distributed/tensor/_api.py:__tensor_unflatten__"


def _calls(step, n: int = 2) -> collections.Counter:
    """Python calls per step ('file:function' -> count) over n steps, as cProfile records them (it
    sees the functions C++ calls back too: autograd's engine, DTensor's dispatch)."""
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(n)])
    out: collections.Counter = collections.Counter()
    for (file, _, fn), (_, calls, *_) in pstats.Stats(prof).stats.items():
        out[f"{file.split('site-packages/')[-1]}:{fn}"] += calls / n
    return out


def _only(calls: collections.Counter, part: str) -> dict:
    return {k: v for k, v in calls.items() if part in k}


def _count(calls: collections.Counter, part: str) -> float:
    return sum(_only(calls, part).values())


def _inputs(ctx):
    """Head-sharded q, k, v, g (vector gate) as DTensor leaves, their local parts as plain leaves,
    and o's gradient of each kind."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tensors, _ = cases.gla_inputs("vector", B=1, T=16, H=4, K=8, V=8, initial_state=False, device=ctx.device)
    sharded = [distribute_tensor(tensors[n], ctx.mesh, [Shard(2)]).requires_grad_() for n in NAMES]
    local = [x.to_local().detach().clone().requires_grad_() for x in sharded]
    do = distribute_tensor(torch.randn_like(tensors["v"]), ctx.mesh, [Shard(2)])
    return sharded, local, do, do.to_local().clone()


def _gla_o(q, k, v, g):
    import gla_inductor

    return gla_inductor.chunk_gla(q, k, v, g)[0]


def _step(fn, leaves: list, do):
    def step():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(do)

    return step


def _compiled(dynamic=None):
    """_gla_o compiled on a copy of its code: each check's own Dynamo cache entries."""
    from benchmarks.tp_overhead import _own_code

    return torch.compile(_own_code(_gla_o), fullgraph=True, dynamic=dynamic)


def _warm(step, n: int = 3) -> dict:
    """n steps; Dynamo's graph and graph break counts they added."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for _ in range(n):
        step()
    return {"graphs": counters["stats"]["unique_graphs"] - graphs,
            "breaks": sum(counters["graph_break"].values()) - breaks}


def compiled_dtensor_one_graph(ctx):
    """Three compiled fwd+bwd steps on DTensors: one graph, no graph break, no recompile."""
    import gla_inductor.distributed  # noqa: F401  (the sharding rules)

    sharded, _, do, _ = _inputs(ctx)
    counts = _warm(_step(_compiled(), sharded, do))
    assert counts == {"graphs": 1, "breaks": 0}, counts
    assert all(x.grad is not None for x in sharded)
    return {}


def compiled_dtensor_runs_as_plain(ctx):
    """A steady compiled fwd+bwd step on DTensors against one on plain tensors: none of our
    sharding code, our other code call for call as in the plain step, and of DTensor's own work
    only the boundary's: o and four gradients wrapped, one dispatched op (the accumulation's
    detach) per leaf, no symbolic size arithmetic."""
    import gla_inductor.distributed  # noqa: F401

    sharded, local, do, do_local = _inputs(ctx)
    steps = {"dtensor": _step(_compiled(), sharded, do), "plain": _step(_compiled(), local, do_local)}
    for step in steps.values():
        _warm(step)
    calls = {name: _calls(step) for name, step in steps.items()}
    ours = {name: _only(c, OURS) for name, c in calls.items()}
    assert not _only(calls["dtensor"], RULES), _only(calls["dtensor"], RULES)
    assert ours["dtensor"] == ours["plain"] and ours["plain"], _diff(ours["dtensor"], ours["plain"])
    dt = calls["dtensor"]
    assert _count(dt, UNFLATTEN) == 5, _only(dt, UNFLATTEN)  # o in the forward, dq, dk, dv, dg in the backward
    assert _count(dt, f"{DTENSOR_DISPATCH}:wrap") == len(sharded), _only(dt, DTENSOR_DISPATCH)
    redistributed = {k: v for k, v in dt.items() if "redistribute" in k.lower()}
    assert not redistributed, redistributed
    assert not _only(dt, SYMBOLIC), sorted(_only(dt, SYMBOLIC))
    return {}


def _diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}


def compiled_forward_dispatches_nothing(ctx):
    """A compiled forward without grad on DTensors: no DTensor op dispatched, o wrapped once."""
    import gla_inductor.distributed  # noqa: F401

    sharded, _, _, _ = _inputs(ctx)
    fn = _compiled()

    def step():
        with torch.no_grad():
            fn(*sharded)

    _warm(step)
    calls = _calls(step)
    assert not _only(calls, DTENSOR_DISPATCH), _only(calls, DTENSOR_DISPATCH)
    assert _count(calls, UNFLATTEN) == 1 and not _only(calls, RULES), (_only(calls, UNFLATTEN), _only(calls, RULES))
    return {}


def dynamic_graph_does_symbolic_work(ctx):
    """The same step compiled with dynamic shapes does symbolic size arithmetic at run time (the
    wrappers' and the tangent's metadata): what the static checks above rule out is seen."""
    import gla_inductor.distributed  # noqa: F401

    sharded, _, do, _ = _inputs(ctx)
    step = _step(_compiled(dynamic=True), sharded, do)
    _warm(step)
    assert _only(_calls(step), SYMBOLIC), "no symbolic size arithmetic in a dynamic DTensor step"
    return {}


def benchmark_functions_keep_apart(ctx):
    """tp-overhead's compiled functions in its order (forward without grad, then fwd+bwd; DTensor,
    then plain): one graph each, none recompiled by the other calls, and no symbolic size
    arithmetic in the DTensor fwd+bwd step (the plain calls bring other head counts)."""
    import gla_inductor.distributed  # noqa: F401
    from benchmarks.tp_overhead import _functions

    sharded, local, do, do_local = _inputs(ctx)
    inference, train = _functions("compiled"), _functions("compiled")

    def no_grad(fn, leaves):
        def step():
            with torch.no_grad():
                fn(*leaves)

        return step

    steps = [no_grad(inference["dtensor"], sharded), no_grad(inference["plain"], local),
             _step(train["dtensor"], sharded, do), _step(train["plain"], local, do_local)]
    graphs = [_warm(step, 1)["graphs"] for step in steps + steps]
    assert graphs == [1] * 4 + [0] * 4, graphs
    symbolic = _only(_calls(steps[2]), SYMBOLIC)
    assert not symbolic, f"symbolic size arithmetic in the DTensor step: {sorted(symbolic)}"
    return {}


CHECKS = [compiled_dtensor_one_graph, compiled_dtensor_runs_as_plain, compiled_forward_dispatches_nothing,
          dynamic_graph_does_symbolic_work, benchmark_functions_keep_apart]


@functools.cache
def _results():
    return harness.run_checks(__name__, [c.__name__ for c in CHECKS], 2, "gloo")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_two_ranks(check):
    harness.assert_close(_results(), check.__name__, 0.0)
