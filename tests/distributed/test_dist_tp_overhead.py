"""What a head-sharded ``chunk_gla`` costs beyond the same call on the rank's heads as plain tensors.

Eager: DTensors placed as their mode asks run as one autograd node on the local tensors (no DTensor
dispatch of the ops, no collective unless a gradient comes placed otherwise); inputs that need
slicing take the op through DTensor. Compiled (plain Inductor and ``gla_inductor.backend``): the
post-grad graphs of the DTensor call hold the same ops, as many, as those of the plain call: the
local op calls, no collective, no copy. And DTensor's sharding cache keys every non-tensor argument
of the ops (``output_final_state`` decides the final state's placement).

The checks run inside spawned ranks (``dist_harness``); each test asserts one check's results.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

RTOL = 1e-5
LOCAL_NODE = "_LocalChunkGLABackward"  # the grad_fn of the eager route's outputs
OP_NODE = "GeneratedBackwardFor_gla_inductor_chunk_fwd_defaultBackward"  # through the op
COLLECTIVE_WORDS = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                    "broadcast", "all_to_all")


def _place(ctx, tensors: dict, placements: dict, mesh=None) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = mesh or ctx.mesh
    default = [Replicate()] * mesh.ndim
    return {n: distribute_tensor(x, mesh, placements.get(n, default)) for n, x in tensors.items()}


def _heads(names, world_dims: int = 1) -> dict:
    """Shard over heads: dim 2 of [B, T, H, D], 1 of the state, 0 of per-head parameters."""
    from torch.distributed.tensor import Shard

    dims = {"initial_state": 1, "g_gamma": 0, "gate_a": 0, "gate_bias": 0}
    return {n: [Shard(dims.get(n, 2))] * world_dims for n in names}


def _collectives(step) -> list[str]:
    """Names of the collective events the profiler records while step() runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sorted({e.name for e in prof.events() if any(w in e.name.lower() for w in COLLECTIVE_WORDS)})


def _errors(out: dict, grads: dict, ref_out: dict, ref_grads: dict) -> dict:
    errors = {n: cases.rel_err(x.full_tensor(), ref_out[n]) for n, x in out.items()}
    errors.update({f"d{n}": cases.rel_err(x.full_tensor(), ref_grads[n]) for n, x in grads.items()})
    return errors


def _run(ctx, gate: str, placements: dict, mesh=None, do_placements=None, **shape):
    """(errors against one process, o's grad_fn name, collectives in the step, gradients) of
    chunk_gla forward + backward on DTensors; ``do_placements`` gives o's gradient other placements."""
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    import gla_inductor
    import gla_inductor.distributed  # noqa: F401  (registers the rules and the eager route)

    tensors, options = cases.gla_inputs(gate, device=ctx.device, **shape)
    w_o, w_h = cases.loss_weights(tensors)
    ref_out, ref_grads = cases.reference(tensors, options, w_o, w_h)
    mesh = mesh or ctx.mesh
    leaves = {n: x.requires_grad_() for n, x in _place(ctx, tensors, placements, mesh).items()}
    seen = {}

    def call():
        return gla_inductor.chunk_gla(**leaves, **options, output_final_state=True)

    with torch.no_grad():  # the output placements, for gradients made outside the profiled step
        o, ht = call()
    do = distribute_tensor(w_o, mesh, o.placements)
    if do_placements is not None:  # each rank holds 1/W of the gradient: their sum is w_o
        assert all(isinstance(p, Partial) for p in do_placements)
        do = DTensor.from_local(w_o / mesh.size(), mesh, do_placements, run_check=False)
    dht = distribute_tensor(w_h, mesh, ht.placements)

    def step():
        o, ht = call()
        seen["node"], seen["out"] = type(o.grad_fn).__name__, {"o": o, "ht": ht}
        torch.autograd.backward([o, ht], [do, dht])

    collectives = _collectives(step)
    grads = {n: x.grad for n, x in leaves.items()}
    return _errors(seen["out"], grads, ref_out, ref_grads), seen["node"], collectives, grads


# ---------------------------------------------------------------------------------------------
# checks (run in every rank)
# ---------------------------------------------------------------------------------------------


def eager_heads_one_local_node(ctx):
    """Every input over heads: one autograd node of the eager route, no collective, forward or
    backward; the gradients placed like their inputs."""
    from torch.distributed.tensor import Shard

    errors, node, collectives, grads = _run(ctx, "vector", _heads(("q", "k", "v", "g", "initial_state")))
    assert node == LOCAL_NODE, node
    assert not collectives, f"collectives in the step: {collectives}"
    assert grads["q"].placements == (Shard(2),) and grads["initial_state"].placements == (Shard(1),)
    return errors


def eager_heads_fused_gate(ctx):
    """A softplus gate with per-head parameters: their gradients stay over heads, no collective."""
    errors, node, collectives, _ = _run(ctx, "softplus", _heads(("q", "k", "v", "g", "gate_a", "gate_bias",
                                                                   "initial_state")))
    assert node == LOCAL_NODE and not collectives, (node, collectives)
    return errors


def eager_partial_gradient(ctx):
    """o's gradient arriving Partial (a later op summed over ranks): the route reduce-scatters it
    to o's heads first, the one collective of the step (which the profiler sees)."""
    from torch.distributed.tensor import Partial

    errors, node, collectives, _ = _run(ctx, "scalar", _heads(("q", "k", "v", "g", "initial_state")),
                                        do_placements=[Partial()])
    assert node == LOCAL_NODE, node
    assert collectives, "the Partial gradient's reduce-scatter was not seen"
    return errors


def eager_replicated_input_takes_op(ctx):
    """A Replicate v among head-sharded inputs needs slicing: the call takes the op (DTensor's
    dispatch slices v, locally)."""
    errors, node, collectives, _ = _run(ctx, "vector", _heads(("q", "k", "g")))
    assert node == OP_NODE, node
    assert not collectives, collectives
    return errors


def final_state_flag_in_cache_key(ctx):
    """The op through DTensor's dispatch, the same specs with output_final_state off then on: the
    final state comes back over heads the second time (not the first call's Replicate [0])."""
    from torch.distributed.tensor import Replicate, Shard

    import gla_inductor.distributed  # noqa: F401

    tensors, _ = cases.gla_inputs("vector", device=ctx.device)
    dt = _place(ctx, tensors, _heads(tensors))
    args = [dt[n] for n in ("q", "k", "v", "g")] + [None, dt["initial_state"], 0.5]
    with torch.no_grad():
        _, ht0 = torch.ops.gla_inductor.chunk_fwd(*args, False, False)
        o, ht = torch.ops.gla_inductor.chunk_fwd(*args, True, False)
        ref_o, ref_ht = torch.ops.gla_inductor.chunk_fwd(*[tensors[n] for n in ("q", "k", "v", "g")], None,
                                                         tensors["initial_state"], 0.5, True, False)
    assert ht0.placements == (Replicate(),) and ht0.shape == (0,), (ht0.placements, ht0.shape)
    assert ht.placements == (Shard(1),), ht.placements
    return {"o": cases.rel_err(o.full_tensor(), ref_o), "ht": cases.rel_err(ht.full_tensor(), ref_ht)}


def _post_grad_ops(backend, args: list, train: bool) -> list[collections.Counter]:
    """The call_function targets (getitem aside) of each post-grad graph Inductor compiles for
    chunk_gla(*args) (and its backward where train)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config

    import gla_inductor

    graphs: list[collections.Counter] = []

    def record(graph: torch.fx.Graph) -> None:
        graphs.append(collections.Counter(str(n.target) for n in graph.nodes
                                          if n.op == "call_function" and "getitem" not in str(n.target)))

    def fn(q, k, v, g, initial_state):
        return gla_inductor.chunk_gla(q, k, v, g, initial_state=initial_state, output_final_state=True)

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        if train:
            leaves = [x.detach().requires_grad_() for x in args]
            o, ht = compiled(*leaves)
            (o.sum() + ht.sum()).backward()
        else:
            with torch.no_grad():
                compiled(*args)
    return graphs


def compiled_graphs_as_plain(ctx):
    """Head-sharded DTensors against the rank's heads as plain tensors, forward (inference) and
    forward + backward, plain Inductor and gla_inductor.backend: the same ops in every post-grad
    graph, the GLA ops among them, no collective."""
    import gla_inductor

    tensors, _ = cases.gla_inputs("vector", device=ctx.device)
    names = ("q", "k", "v", "g", "initial_state")
    dt = _place(ctx, tensors, _heads(names))
    sharded = [dt[n] for n in names]
    local = [x.to_local().clone() for x in sharded]
    for backend_name, backend in (("inductor", "inductor"), ("gla", gla_inductor.backend)):
        for train in (False, True):
            ours, plain = _post_grad_ops(backend, sharded, train), _post_grad_ops(backend, local, train)
            where = f"{backend_name} {'training' if train else 'inference'}"
            assert len(ours) == len(plain) == (2 if train else 1), (where, ours, plain)
            assert ours == plain, f"{where}: DTensor graphs {ours}, plain {plain}"
            targets = set().union(*ours)
            want = {"gla_inductor.chunk_fwd.default"} | ({"gla_inductor.chunk_bwd.default"} if train else set())
            assert want <= targets, (where, targets)
            assert not [t for t in targets if any(w in t for w in COLLECTIVE_WORDS)], (where, targets)
    return {}


def mesh_2d_batch_and_heads(ctx):
    """A (batch, heads) mesh of 2 x 2 ranks and a constant gate: the eager route on both dims, the
    gradient of g_gamma (replicated over the batch) Partial there and over heads on the other dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = ctx.make_mesh((2, 2), ("batch", "heads"))
    placements = {n: [Shard(0), Shard(2)] for n in ("q", "k", "v")}
    placements.update(initial_state=[Shard(0), Shard(1)], g_gamma=[Replicate(), Shard(0)])
    errors, node, collectives, grads = _run(ctx, "gamma", placements, mesh=mesh, B=4)
    assert node == LOCAL_NODE and not collectives, (node, collectives)
    assert grads["g_gamma"].placements == (Partial(), Shard(0)), grads["g_gamma"].placements
    return errors


CHECKS_2 = [eager_heads_one_local_node, eager_heads_fused_gate, eager_partial_gradient,
            eager_replicated_input_takes_op, final_state_flag_in_cache_key, compiled_graphs_as_plain]
CHECKS_4 = [mesh_2d_batch_and_heads]


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
