"""Tensor parallelism over heads (and batch) with DTensor: the GLA ops on sharded inputs run each
rank's part locally, forward and backward, eager and compiled, equal to one process; bad layouts
raise errors that name the tensor and its placement.

The checks run inside spawned ranks (``dist_harness``); each test asserts one check's results.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

RTOL = 1e-5
CUDA_RTOL = 1e-4  # the kernels multiply fp32 as "tf32x3" (about 22 bits)


def _dtensors(ctx, tensors: dict, placements: dict) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return {n: distribute_tensor(x, ctx.mesh, [placements.get(n, Replicate())]) for n, x in tensors.items()}


def _compare(out: dict, grads: dict, ref_out: dict, ref_grads: dict) -> dict:
    errors = {n: cases.rel_err(x.full_tensor(), ref_out[n]) for n, x in out.items()}
    errors.update({f"d{n}": cases.rel_err(x.full_tensor(), ref_grads[n]) for n, x in grads.items()})
    return errors


def _expect_placements(x, *want) -> None:
    assert tuple(x.placements) == want, f"placements {tuple(x.placements)}, expected {want}"


def _tp_run(ctx, gate: str, placements: dict, fn=None, reverse: bool = False, **shape) -> tuple[dict, dict, dict]:
    """Reference and DTensor runs of one case: (errors, outputs, gradients)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    import gla_inductor
    import gla_inductor.distributed  # noqa: F401  (registers the sharding rules)

    tensors, options = cases.gla_inputs(gate, device=ctx.device, **shape)
    w_o, w_h = cases.loss_weights(tensors)
    ref_out, ref_grads = cases.reference(tensors, options, w_o, w_h, reverse=reverse)
    weights = [distribute_tensor(w, ctx.mesh, [Replicate()]) for w in (w_o, w_h)]
    out, grads = cases.forward_backward(fn or gla_inductor.chunk_gla, _dtensors(ctx, tensors, placements), options,
                                        *weights, reverse=reverse)
    return _compare(out, grads, ref_out, ref_grads), out, grads


def _heads(*names, dims=None):
    from torch.distributed.tensor import Shard

    dims = dims or {}
    return {n: Shard(dims.get(n, {"initial_state": 1, "g_gamma": 0, "gate_a": 0, "gate_bias": 0}.get(n, 2)))
            for n in names}


ALL = ("q", "k", "v", "g", "g_gamma", "initial_state", "gate_a", "gate_bias")


# ---------------------------------------------------------------------------------------------
# checks (run in every rank)
# ---------------------------------------------------------------------------------------------


def heads_vector_grouped(ctx):
    """Vector gate, q and k with half of v's heads, initial and final state, all over heads."""
    from torch.distributed.tensor import Shard

    errors, out, grads = _tp_run(ctx, "vector", _heads(*ALL), G=2 * ctx.world, H=4 * ctx.world)
    _expect_placements(out["o"], Shard(2))
    _expect_placements(out["ht"], Shard(1))
    _expect_placements(grads["q"], Shard(2))
    return errors


def heads_scalar_reverse(ctx):
    return _tp_run(ctx, "scalar", _heads(*ALL), reverse=True)[0]


def heads_constant_gate(ctx):
    from torch.distributed.tensor import Shard

    errors, _, grads = _tp_run(ctx, "gamma", _heads(*ALL))
    _expect_placements(grads["g_gamma"], Shard(0))
    return errors


def heads_no_gate(ctx):
    return _tp_run(ctx, "none", _heads(*ALL))[0]


def heads_fused_logsigmoid(ctx):
    return _tp_run(ctx, "logsigmoid", _heads(*ALL))[0]


def heads_fused_softplus(ctx):
    return _tp_run(ctx, "softplus", _heads(*ALL))[0]


def heads_with_replicated_inputs(ctx):
    """v and the initial state Replicate, the rest over heads: DTensor slices them, no communication."""
    from torch.distributed.tensor import Shard

    errors, out, _ = _tp_run(ctx, "vector", _heads("q", "k", "g"))
    _expect_placements(out["o"], Shard(2))
    return errors


def batch_constant_gate(ctx):
    """Sharded over the batch: g_gamma stays Replicate; its gradient sums over every rank's rows."""
    from torch.distributed.tensor import Shard

    placements = {n: Shard(0) for n in ("q", "k", "v", "initial_state")}
    errors, out, _ = _tp_run(ctx, "gamma", placements, B=2 * ctx.world)
    _expect_placements(out["o"], Shard(0))
    _expect_placements(out["ht"], Shard(0))
    return errors


def fused_recurrent_in_place(ctx):
    """The decode op on head-sharded inputs updates each rank's part of the state in place; so does
    fused_recurrent_gla, given a head-sharded initial state."""
    import gla_inductor
    import gla_inductor.distributed  # noqa: F401
    from torch.distributed.tensor import Shard

    tensors, _ = cases.gla_inputs("vector", T=3, device=ctx.device)
    state = tensors.pop("initial_state")
    ref_state = state.clone()
    heads = _heads("q", "k", "v", "g", "state", dims={"state": 1})
    with torch.no_grad():
        ref_o = torch.ops.gla_inductor.fused_recurrent(*tensors.values(), None, ref_state, 0.5, False)
        dt = _dtensors(ctx, dict(tensors, state=state), heads)
        local = dt["state"].to_local()
        before = local.clone()
        o = torch.ops.gla_inductor.fused_recurrent(dt["q"], dt["k"], dt["v"], dt["g"], None, dt["state"], 0.5, False)
        state0 = _dtensors(ctx, {"state": state}, heads)["state"]
        o_api, ht = gla_inductor.fused_recurrent_gla(dt["q"], dt["k"], dt["v"], dt["g"], scale=0.5,
                                                    initial_state=state0, output_final_state=True)
    _expect_placements(o, Shard(2))
    _expect_placements(ht, Shard(1))
    assert not torch.equal(local, before), "the local state was not updated in place"
    return {"o": cases.rel_err(o.full_tensor(), ref_o), "state": cases.rel_err(dt["state"].full_tensor(), ref_state),
            "o_api": cases.rel_err(o_api.full_tensor(), ref_o), "ht_api": cases.rel_err(ht.full_tensor(), ref_state)}


def fused_recurrent_zero_state(ctx):
    """fused_recurrent_gla without an initial state: the zero state it starts from is sharded like
    the inputs (over heads, then over the batch), so the final state comes back so too."""
    import gla_inductor
    from torch.distributed.tensor import Shard

    tensors, _ = cases.gla_inputs("vector", T=3, B=ctx.world, initial_state=False, device=ctx.device)
    with torch.no_grad():
        ref_o, ref_ht = gla_inductor.fused_recurrent_gla(**tensors, output_final_state=True)
        errors = {}
        for mode, o_dim, state_dim in (("heads", 2, 1), ("batch", 0, 0)):
            dt = _dtensors(ctx, tensors, dict.fromkeys(tensors, Shard(o_dim)))
            o, ht = gla_inductor.fused_recurrent_gla(**dt, output_final_state=True)
            _expect_placements(o, Shard(o_dim))
            _expect_placements(ht, Shard(state_dim))
            errors.update({f"{mode}_o": cases.rel_err(o.full_tensor(), ref_o),
                           f"{mode}_ht": cases.rel_err(ht.full_tensor(), ref_ht)})
    return errors


def _targets(graphs) -> set[str]:
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


def compiled_inductor_heads(ctx):
    """chunk_gla on head-sharded DTensors under torch.compile(fullgraph=True): the graphs hold the
    ops on local tensors and no collective."""
    import gla_inductor

    graphs: list = []

    def fn(**kwargs):
        return gla_inductor.chunk_gla(**kwargs)

    compiled = torch.compile(fn, backend=cases.recording_inductor(graphs), fullgraph=True)
    errors = _tp_run(ctx, "vector", _heads(*ALL), fn=compiled)[0]
    targets = _targets(graphs)
    assert {"gla_inductor.chunk_fwd.default", "gla_inductor.chunk_bwd.default"} <= targets, targets
    collectives = [t for t in targets if "c10d" in t]
    assert not collectives, f"collectives in the compiled graphs: {collectives}"
    return errors


def naive(q, k, v, g, initial_state, output_final_state=True, reverse=False):
    """The textbook GLA time loop, which gla_inductor.backend rewrites into the op."""
    B, T, H, K = q.shape
    S = initial_state
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
    return o, S


def compiled_naive_loop_heads(ctx):
    """A naive loop on head-sharded DTensors, compiled with gla_inductor.backend: rewritten into the
    op, which then runs per rank."""
    import gla_inductor
    import gla_inductor.distributed  # noqa: F401
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(naive, backend=gla_inductor.backend, fullgraph=True)
    errors = _tp_run(ctx, "vector", _heads(*ALL), fn=compiled, T=12)[0]
    assert counters["gla_inductor"]["rewrites"] == 1, dict(counters["gla_inductor"])
    return errors


def decode_step(q, k, v, g, cache):
    """One naive decode step on a state cache, written back in place."""
    S = cache * g.exp()[..., None] + k[..., None] * v[..., None, :]
    o = (q[..., None] * S).sum(-2) * q.shape[-1] ** -0.5
    cache.copy_(S)
    return o


def compiled_decode_step_heads(ctx):
    """A naive decode step on head-sharded DTensors, compiled with gla_inductor.backend: rewritten
    into the in-place fused_recurrent op, which updates each rank's part of the cache."""
    import gla_inductor
    import gla_inductor.distributed  # noqa: F401
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tensors, _ = cases.gla_inputs("vector", T=1, device=ctx.device)
    step = {n: tensors[n][:, 0] for n in ("q", "k", "v", "g")}
    ref_cache = tensors["initial_state"].clone()
    ref = decode_step(**step, cache=ref_cache)
    names = ("q", "k", "v", "g", "cache")  # [B, H, D] steps and a [B, H, K, V] cache: heads on dim 1
    dt = _dtensors(ctx, dict(step, cache=tensors["initial_state"]), _heads(*names, dims=dict.fromkeys(names, 1)))
    with torch.no_grad():
        o = torch.compile(decode_step, backend=gla_inductor.backend, fullgraph=True)(**dt)
    assert counters["gla_inductor"]["rewrites_decode"] == 1, dict(counters["gla_inductor"])
    return {"o": cases.rel_err(o.full_tensor(), ref), "cache": cases.rel_err(dt["cache"].full_tensor(), ref_cache)}


def _call_with(ctx, placements: dict, gate: str = "vector", **shape):
    import gla_inductor
    import gla_inductor.distributed  # noqa: F401

    tensors, options = cases.gla_inputs(gate, device=ctx.device, **shape)
    dt = _dtensors(ctx, tensors, placements)
    return lambda: gla_inductor.chunk_gla(**dt, **options, output_final_state=True)


def error_shard_over_k(ctx):
    from torch.distributed.tensor import Shard

    return cases.expect_error(_call_with(ctx, {"q": Shard(3), "k": Shard(2), "v": Shard(2)}), ValueError,
                              "q [B, T, H, K] is Shard(dim=3)", "Replicate or Shard(2) (heads)")


def error_shard_over_time(ctx):
    from torch.distributed.tensor import Shard

    return cases.expect_error(_call_with(ctx, {n: Shard(1) for n in ("q", "k", "v", "g")}), ValueError,
                              "q is Shard(dim=1)", "sharded over time", "context_parallel_gla")


def error_mixed_heads_and_batch(ctx):
    from torch.distributed.tensor import Shard

    return cases.expect_error(_call_with(ctx, {"q": Shard(2), "k": Shard(2), "v": Shard(0)}), ValueError,
                              "q is Shard(dim=2) (heads) but v is Shard(dim=0) (batch)")


def error_partial_input(ctx):
    from torch.distributed.tensor import DTensor, Partial

    import gla_inductor

    tensors, _ = cases.gla_inputs("none", initial_state=False, device=ctx.device)
    dt = _dtensors(ctx, tensors, {})
    dt["v"] = DTensor.from_local(tensors["v"] / ctx.world, ctx.mesh, [Partial()])
    return cases.expect_error(lambda: gla_inductor.chunk_gla(**dt), ValueError, "v [B, T, H, V] is Partial(sum)")


def error_state_not_sharded_in_place(ctx):
    from torch.distributed.tensor import Replicate

    tensors, _ = cases.gla_inputs("vector", T=2, device=ctx.device)
    tensors["state"] = tensors.pop("initial_state")
    dt = _dtensors(ctx, tensors, _heads("q", "k", "v", "g"))
    assert dt["state"].placements == (Replicate(),)

    def call():
        with torch.no_grad():
            torch.ops.gla_inductor.fused_recurrent(dt["q"], dt["k"], dt["v"], dt["g"], None, dt["state"], 1.0, False)

    return cases.expect_error(call, ValueError, "state is Replicate() on mesh dim 0", "in place", "Shard(dim=1)")


def error_groups_split(ctx):
    """Grouped q/k with 2 heads cannot be split over 4 ranks: a rank's v heads would read another's."""
    return cases.expect_error(_call_with(ctx, _heads(*ALL), G=2, H=8), ValueError,
                              "q and k have 2 heads shared by v's 8 heads", "G divisible by 4")


CHECKS_2 = [heads_vector_grouped, heads_scalar_reverse, heads_constant_gate, heads_no_gate, heads_fused_logsigmoid,
            heads_fused_softplus, heads_with_replicated_inputs, batch_constant_gate, fused_recurrent_in_place,
            fused_recurrent_zero_state, error_shard_over_k, error_shard_over_time, error_mixed_heads_and_batch,
            error_partial_input, error_state_not_sharded_in_place, compiled_inductor_heads, compiled_naive_loop_heads,
            compiled_decode_step_heads]
CHECKS_4 = [heads_vector_grouped, heads_fused_softplus, error_groups_split]
ERRORS = {error_shard_over_k, error_shard_over_time, error_mixed_heads_and_batch, error_partial_input,
          error_state_not_sharded_in_place, error_groups_split}


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
