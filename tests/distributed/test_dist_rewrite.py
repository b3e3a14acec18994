"""A naive GLA in the user's code, compiled with gla_inductor.backend while its inputs are DTensors:
sharded over heads it becomes the GLA op, which runs each rank's heads locally (no collective in
the compiled graphs); sharded over time it becomes context parallelism, its all-gathers (forward
and backward) functional collectives in the graphs, fullgraph. Eager (the naive code
on DTensors) and compiled equal ``chunk_gla`` on the whole tensors in one process, forward and
every gradient. A time shard context parallelism cannot take is left alone with the reason.

The checks run inside spawned ranks (``dist_harness``); each test asserts one check's results.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

RTOL = 1e-5
CUDA_RTOL = 1e-4  # the kernels multiply fp32 as "tf32x3" (about 22 bits)


# ---------------------------------------------------------------------------------------------
# the user's naive GLA: a time loop and a parallel form
# ---------------------------------------------------------------------------------------------


def naive_loop(q, k, v, g, initial_state, output_final_state=True):
    """The textbook time loop, [B, T, H, D], a vector gate, initial and final state."""
    B, T, H, K = q.shape
    S = initial_state
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
    return o, S


def naive_parallel(q, k, v, g, output_final_state=True):
    """The parallel form with a per-head gate ([B, T, H]), computed head-first: a causal decay
    matrix, no states. Returns (o, None)."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    o = ((q @ k.mT) * D) @ v * q.shape[-1] ** -0.5
    return o.transpose(1, 2), None


# ---------------------------------------------------------------------------------------------
# running one case
# ---------------------------------------------------------------------------------------------


def _rewrite_module():
    return importlib.import_module("gla_inductor.backend")  # the package's ``backend`` is the function


def recording_backend(graphs: list, results: list, compile: bool = True):
    """gla_inductor's rewrite, then plain Inductor keeping the graphs it compiles (forward and
    backward), or, without ``compile``, the rewritten graph run as it is. Each rewrite's result
    (matches, near misses) is appended to ``results``."""

    def backend(gm, example_inputs):
        results.append(_rewrite_module().rewrite(gm, example_inputs))
        if not compile:
            return gm.forward
        return cases.recording_inductor(graphs)(gm, example_inputs)

    return backend


def _dtensors(mesh, tensors: dict, placements: dict) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    replicate = [Replicate()] * mesh.ndim
    return {n: distribute_tensor(x, mesh, placements.get(n, replicate)) for n, x in tensors.items()}


def _errors(out: dict, grads: dict, ref_out: dict, ref_grads: dict) -> dict:
    errors = {n: cases.rel_err(x.full_tensor(), ref_out[n]) for n, x in out.items() if x is not None}
    errors.update({f"d{n}": cases.rel_err(x.full_tensor(), ref_grads[n]) for n, x in grads.items()})
    return errors


def _run(fn, mesh, tensors: dict, placements: dict, backend, eager: Optional[str] = "dtensor") -> dict:
    """fn on DTensors compiled with ``backend`` (fullgraph), and eager (the naive code itself) on
    DTensors or on the whole plain tensors (``eager="plain"``), against chunk_gla on the whole
    tensors in this process: relative errors by name.

    Eager on DTensors sharded over time, the naive code is no reference: torch's DTensor computes a
    cumsum over the sharded axis per shard and writes ``o[:, t] = ...`` at the local index t, so
    the parallel form and the loop's o come out wrong (torch 2.13). The rewrite computes what the
    code means on the whole tensors, which the plain eager run checks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    w_o, w_h = cases.loss_weights(tensors)
    ref_out, ref_grads = _forward_backward(_reference if fn is naive_loop else _reference_o, tensors, w_o, w_h)
    weights = list(_dtensors(mesh, dict(w_o=w_o, w_h=w_h), {}).values())

    def run(f):
        out, grads = _forward_backward(f, _dtensors(mesh, tensors, placements), *weights)
        return _errors(out, grads, ref_out, ref_grads)

    errors = {}
    if eager == "dtensor":
        errors.update({f"eager_{n}": e for n, e in run(fn).items()})
    elif eager == "plain":
        out, grads = _forward_backward(fn, tensors, w_o, w_h)
        errors.update({f"eager_{n}": cases.rel_err(x, ref_out[n]) for n, x in out.items() if x is not None})
        errors.update({f"eager_d{n}": cases.rel_err(x, ref_grads[n]) for n, x in grads.items()})
    errors.update(run(torch.compile(fn, backend=backend, fullgraph=True)))
    return errors


def _reference(**kwargs):
    import gla_inductor

    return gla_inductor.chunk_gla(**kwargs)


def _reference_o(**kwargs):
    return _reference(**kwargs)[0], None


def _forward_backward(fn, tensors: dict, w_o, w_h) -> tuple[dict, dict]:
    """As cases.forward_backward, for a fn whose final state may be None."""
    leaves = {n: x.detach().requires_grad_() for n, x in tensors.items()}
    o, ht = fn(**leaves, output_final_state=True)
    loss = (o * w_o).sum() + (0 if ht is None else (ht * w_h).sum())
    loss.backward()
    return {"o": o, "ht": ht}, {n: x.grad for n, x in leaves.items()}


def _targets(graphs) -> list[str]:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def _collectives(gm) -> list[str]:
    return [str(n.target).split(".")[1] for n in gm.graph.nodes if "c10d" in str(n.target)]


def _expect_rewritten(results: list, form: str) -> None:
    matches = [m.form for r in results for m in r.matches]
    near = [(n.form, n.reason) for r in results for n in r.near_misses]
    assert matches == [form] and not near, f"rewrites {matches}, near misses {near}"


def _expect_context_parallel(graphs: list, replicated_grads: int = 0) -> None:
    """Forward: the local op and one all-gather; backward: the op's backward, the all-gather of the
    entering states' gradients, and an all-reduce per replicated input (its Partial gradient made
    Replicate)."""
    forward, backward = graphs
    assert "gla_inductor.chunk_fwd.default" in _targets([forward]), _targets([forward])
    assert "gla_inductor.chunk_bwd.default" in _targets([backward]), _targets([backward])
    assert _collectives(forward) == ["all_gather_into_tensor", "wait_tensor"], _collectives(forward)
    want = ["all_gather_into_tensor", "wait_tensor"] + ["all_reduce_", "wait_tensor"] * replicated_grads
    assert _collectives(backward) == want, _collectives(backward)


def _time(*names):
    from torch.distributed.tensor import Shard

    return {n: [Shard(1)] for n in names}


def _heads(*names):
    from torch.distributed.tensor import Shard

    return {n: [Shard(1 if n == "initial_state" else 2)] for n in names}


# ---------------------------------------------------------------------------------------------
# checks (run in every rank)
# ---------------------------------------------------------------------------------------------


def loop_over_time(ctx):
    """The time loop on q, k, v, g sharded over time (T = 11: slices of 6 and 5 steps on 2 ranks),
    the initial state replicated: rewritten into context parallelism."""
    tensors, _ = cases.gla_inputs("vector", T=11, device=ctx.device)
    graphs, results = [], []
    errors = _run(naive_loop, ctx.mesh, tensors, _time(*cases.SEQUENCE), recording_backend(graphs, results),
                  eager="plain")
    _expect_rewritten(results, "loop")
    _expect_context_parallel(graphs, replicated_grads=1)  # the initial state's
    return errors


def parallel_over_time(ctx):
    """The parallel form (per-head gate) on inputs sharded over time: context parallelism too."""
    tensors, _ = cases.gla_inputs("scalar", T=12, initial_state=False, device=ctx.device)
    graphs, results = [], []
    errors = _run(naive_parallel, ctx.mesh, tensors, _time(*cases.SEQUENCE), recording_backend(graphs, results),
                  eager="plain")
    _expect_rewritten(results, "parallel")
    _expect_context_parallel(graphs)
    return errors


def parallel_over_heads(ctx):
    """The parallel form on inputs sharded over heads: the GLA op on each rank's heads, no
    collective in either graph."""
    tensors, _ = cases.gla_inputs("scalar", T=12, initial_state=False, device=ctx.device)
    graphs, results = [], []
    errors = _run(naive_parallel, ctx.mesh, tensors, _heads(*cases.SEQUENCE), recording_backend(graphs, results))
    _expect_rewritten(results, "parallel")
    forward, backward = graphs
    assert "gla_inductor.chunk_fwd.default" in _targets([forward]), _targets([forward])
    assert not _collectives(forward) and not _collectives(backward), (_collectives(forward), _collectives(backward))
    return errors


def loop_over_heads(ctx):
    """The time loop on inputs and initial state sharded over heads: no collective either."""
    tensors, _ = cases.gla_inputs("vector", T=8, device=ctx.device)
    graphs, results = [], []
    placements = _heads(*cases.SEQUENCE, "initial_state")
    errors = _run(naive_loop, ctx.mesh, tensors, placements, recording_backend(graphs, results))
    _expect_rewritten(results, "loop")
    assert not _collectives(graphs[0]) and not _collectives(graphs[1])
    return errors


def near_miss_value_not_sharded(ctx):
    """q, k, g sharded over time but v replicated: context parallelism cannot take it, so the
    loop is left alone with the reason (and runs as written, on DTensors)."""
    tensors, _ = cases.gla_inputs("vector", T=6, device=ctx.device)
    results = []
    errors = _run(naive_loop, ctx.mesh, tensors, _time("q", "k", "g"), recording_backend([], results, compile=False),
                  eager=None)
    assert not [m for r in results for m in r.matches]
    reasons = [n.reason for r in results for n in r.near_misses]
    assert len(reasons) == 1 and "v is Replicate() on mesh dim 0 where q is Shard(1)" in reasons[0], reasons
    return errors


def loop_over_time_and_heads(ctx):
    """A 2 x (W/2) mesh, time over mesh dim 0 and heads over mesh dim 1 (the initial state over
    heads): context parallelism over the first, the heads local on the second."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = ctx.make_mesh((2, ctx.world // 2), ("cp", "tp"))
    tensors, _ = cases.gla_inputs("vector", T=8, H=ctx.world, device=ctx.device)
    placements = {n: [Shard(1), Shard(2)] for n in cases.SEQUENCE}
    placements["initial_state"] = [Replicate(), Shard(1)]
    graphs, results = [], []
    errors = _run(naive_loop, mesh, tensors, placements, recording_backend(graphs, results), eager="plain")
    _expect_rewritten(results, "loop")
    _expect_context_parallel(graphs, replicated_grads=1)  # the initial state's, over the time mesh dim
    return errors


CHECKS_2 = [loop_over_time, parallel_over_time, parallel_over_heads, loop_over_heads, near_miss_value_not_sharded]
CHECKS_4 = [loop_over_time_and_heads]


@functools.cache
def _results(world: int, backend: str):
    checks = CHECKS_2 if world == 2 else CHECKS_4
    return harness.run_checks(__name__, [c.__name__ for c in checks], world, backend)


@pytest.mark.parametrize("check", CHECKS_2, ids=lambda c: c.__name__)
def test_two_ranks(check):
    harness.assert_close(_results(2, "gloo"), check.__name__, RTOL)


@pytest.mark.parametrize("check", CHECKS_4, ids=lambda c: c.__name__)
def test_four_ranks(check):
    harness.assert_close(_results(4, "gloo"), check.__name__, RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4], ids=harness.world_id)
def test_nccl(world):
    if reason := harness.need_gpus(world):
        pytest.skip(reason)
    checks = CHECKS_2 if world == 2 else CHECKS_4
    results = harness.run_checks(__name__, [c.__name__ for c in checks], world, "nccl")
    for check in checks:
        harness.assert_close(results, check.__name__, CUDA_RTOL)
