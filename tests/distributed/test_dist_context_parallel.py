"""Context parallelism over time: ``context_parallel_gla`` on a sequence split over ranks equals
``chunk_gla`` on the whole sequence in one process, forward and every gradient, for every gate kind,
fused gates, initial and final states, reverse, both layouts, local tensors and DTensors, eager
and compiled (fullgraph, through gla_inductor.backend and plain Inductor).

The checks run inside spawned ranks (``dist_harness``); each test asserts one check's results.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

RTOL = 1e-5
CUDA_RTOL = 1e-4  # the kernels multiply fp32 as "tf32x3" (about 22 bits)
REPLICATED = ("initial_state", "g_gamma", "gate_a", "gate_bias")


def _local_index(T: int, rank: int, world: int, layout: str) -> torch.Tensor:
    """The time steps rank holds: its torch.chunk slice, or segments rank and 2W-1-rank of 2W."""
    steps = torch.arange(T)
    if layout == "contiguous":
        return steps.chunk(world)[rank]
    segments = steps.chunk(2 * world)
    return torch.cat([segments[rank], segments[2 * world - 1 - rank]])


def _local(tensors: dict, index: torch.Tensor) -> dict:
    return {n: x[:, index.to(x.device)] if n in cases.SEQUENCE else x for n, x in tensors.items()}


def two_layers(gla):
    """gla twice, the first one's output the second one's v (two layers' collectives in one graph)."""

    def run(**kwargs):
        o, _ = gla(**kwargs)
        return gla(**dict(kwargs, v=o))

    return run


@contextlib.contextmanager
def expect_two_pass(calls: int):
    """Asserts that the block ran the eager two-pass Function's forward and backward ``calls`` times
    each: eager calls on plain tensors (DTensors' local parts included) take it, compiled code the
    traced formulation (0)."""
    from gla_inductor.distributed import context_parallel as cp

    before = dict(cp.two_pass_calls)
    yield
    ran = {step: cp.two_pass_calls[step] - before.get(step, 0) for step in ("forward", "backward")}
    assert ran == {"forward": calls, "backward": calls}, f"two-pass Function ran {ran}, expected {calls} each"


def _cp_errors(ctx, gate: str, reverse: bool = False, layout: str = "contiguous", fn=None, layers: int = 1,
               local_index=_local_index, **shape) -> dict:
    """Local slices through context_parallel_gla (or fn) against chunk_gla on everything. The loss is
    the sum of the ranks' losses: each rank weighs its o slice, and the final state by 1/W on every
    rank; gradients of the replicated inputs are summed over the ranks."""
    import torch.distributed as dist

    import gla_inductor
    from gla_inductor.distributed import context_parallel_gla

    tensors, options = cases.gla_inputs(gate, device=ctx.device, **shape)
    w_o, w_h = cases.loss_weights(tensors)
    single = gla_inductor.chunk_gla if layers == 1 else two_layers(gla_inductor.chunk_gla)
    ref_out, ref_grads = cases.forward_backward(single, tensors, options, w_o, w_h, reverse=reverse)
    index = local_index(tensors["q"].shape[1], ctx.rank, ctx.world, layout)
    eager = fn is None
    fn = fn or functools.partial(context_parallel_gla, layout=layout)
    with expect_two_pass(layers if eager else 0):
        out, grads = cases.forward_backward(fn, _local(tensors, index), options, w_o[:, index.to(w_o.device)],
                                            w_h / ctx.world, reverse=reverse)
    errors = {"o": cases.rel_err(out["o"], ref_out["o"][:, index]), "ht": cases.rel_err(out["ht"], ref_out["ht"])}
    for name, grad in grads.items():
        if name in REPLICATED:
            dist.all_reduce(grad)
            errors[f"d{name}"] = cases.rel_err(grad, ref_grads[name])
        else:
            errors[f"d{name}"] = cases.rel_err(grad, ref_grads[name][:, index])
    return errors


# every gate kind, both directions, both layouts, grouped q/k and no initial state in some
CASES = [
    ("vector", False, "contiguous", dict(G=2)),
    ("vector", True, "head_tail", {}),
    ("scalar", False, "head_tail", {}),
    ("scalar", True, "contiguous", dict(G=2, initial_state=False)),
    ("gamma", False, "contiguous", {}),
    ("gamma", True, "head_tail", dict(G=2)),
    ("none", False, "contiguous", {}),
    ("none", True, "head_tail", dict(initial_state=False)),
    ("logsigmoid", False, "head_tail", {}),
    ("logsigmoid", True, "contiguous", {}),
    ("softplus", False, "contiguous", dict(G=2)),
    ("softplus", True, "head_tail", {}),
]


def _case_check(gate: str, reverse: bool, layout: str, shape: dict):
    def check(ctx):
        return _cp_errors(ctx, gate, reverse, layout, **shape)

    check.__name__ = f"{gate}_{'reverse' if reverse else 'forward'}_{layout}" + "".join(
        f"_{k}{v}" for k, v in shape.items())
    globals()[check.__name__] = check  # the ranks look checks up by name
    return check


CASE_CHECKS = [_case_check(*case) for case in CASES]


def uneven_slices(ctx):
    """T = 21 over the ranks: slices of different lengths (torch.chunk's)."""
    return _cp_errors(ctx, "vector", T=21)


def outputs_only(ctx):
    """No initial state, no final state, a loss on o alone: the first rank's o depends on no other
    rank, yet its backward must join the all-gather's backward (else the others wait forever)."""
    from gla_inductor.distributed import context_parallel_gla

    import gla_inductor

    tensors, _ = cases.gla_inputs("vector", initial_state=False, device=ctx.device)
    w_o, _ = cases.loss_weights(tensors)
    index = _local_index(tensors["q"].shape[1], ctx.rank, ctx.world, "contiguous")
    leaves = {n: x.clone().requires_grad_() for n, x in tensors.items()}
    (gla_inductor.chunk_gla(**leaves)[0] * w_o).sum().backward()
    local = {n: x[:, index].clone().requires_grad_() for n, x in tensors.items()}
    with expect_two_pass(1):
        o, ht = context_parallel_gla(**local)
        assert ht is None
        (o * w_o[:, index]).sum().backward()
    return {f"d{n}": cases.rel_err(local[n].grad, leaves[n].grad[:, index]) for n in local}


def dtensor_sequence(ctx):
    """DTensor inputs, Shard(1) over time, the rest Replicate: o Shard(1), the final state Replicate
    (counted once), Partial gradients for the replicated inputs."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gla_inductor.distributed import context_parallel_gla

    tensors, options = cases.gla_inputs("softplus", T=22, device=ctx.device)
    w_o, w_h = cases.loss_weights(tensors)
    ref_out, ref_grads = cases.reference(tensors, options, w_o, w_h)
    dt = {n: distribute_tensor(x, ctx.mesh, [Shard(1) if n in cases.SEQUENCE else Replicate()])
          for n, x in tensors.items()}
    weights = [distribute_tensor(w_o, ctx.mesh, [Shard(1)]), distribute_tensor(w_h, ctx.mesh, [Replicate()])]
    with expect_two_pass(1):
        out, grads = cases.forward_backward(context_parallel_gla, dt, options, *weights)
    assert out["o"].placements == (Shard(1),) and out["ht"].placements == (Replicate(),)
    errors = {n: cases.rel_err(x.full_tensor(), ref_out[n]) for n, x in out.items()}
    errors.update({f"d{n}": cases.rel_err(g.full_tensor(), ref_grads[n]) for n, g in grads.items()})
    return errors


def dtensor_sequence_and_heads(ctx):
    """A 2 x (W/2) mesh: time over mesh dim 0 (context parallel), heads over mesh dim 1 (tensor
    parallel), grouped q/k, the initial state and g_gamma over heads."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gla_inductor.distributed import context_parallel_gla

    mesh = ctx.make_mesh((2, ctx.world // 2), ("cp", "tp"))
    tensors, options = cases.gla_inputs("gamma", G=ctx.world // 2, H=ctx.world, device=ctx.device)
    w_o, w_h = cases.loss_weights(tensors)
    ref_out, ref_grads = cases.reference(tensors, options, w_o, w_h, reverse=True)
    heads = {"initial_state": 1, "g_gamma": 0}
    dt = {n: distribute_tensor(x, mesh, [Shard(1) if n in cases.SEQUENCE else Replicate(), Shard(heads.get(n, 2))])
          for n, x in tensors.items()}
    weights = [distribute_tensor(w, mesh, [Replicate(), Replicate()]) for w in (w_o, w_h)]
    with expect_two_pass(1):
        out, grads = cases.forward_backward(context_parallel_gla, dt, options, *weights, reverse=True)
    assert out["o"].placements == (Shard(1), Shard(2)), out["o"].placements
    assert out["ht"].placements == (Replicate(), Shard(1)), out["ht"].placements
    errors = {n: cases.rel_err(x.full_tensor(), ref_out[n]) for n, x in out.items()}
    errors.update({f"d{n}": cases.rel_err(g.full_tensor(), ref_grads[n]) for n, g in grads.items()})
    return errors


# Both compiled checks run the same case: their graphs compile to the same C++ kernels, which the
# second compile then finds in Inductor's code cache (each costs tens of seconds on a 2-core runner).
# Two layers: their collectives must pair up across the ranks in both graphs.
COMPILED_CASE = dict(gate="vector", G=2, layers=2)


def compiled_inductor(ctx):
    """fullgraph compile through plain Inductor: the two-pass Function's all-gathers, forward and
    backward, are functional collectives inside the compiled graphs, the same on every rank
    (NOTE:[CP uniform graph]); its states-only passes are ops."""
    from gla_inductor.distributed import context_parallel_gla

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(two_layers(context_parallel_gla), backend=cases.recording_inductor(graphs),
                             fullgraph=True)
    errors = _cp_errors(ctx, fn=compiled, **COMPILED_CASE)
    forward, backward = ([str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)] for gm in graphs)
    gather, wait = (f"_c10d_functional.{c}.default" for c in ("all_gather_into_tensor", "wait_tensor"))
    assert forward == [gather, wait] * 2, forward
    assert backward == [gather, wait] * 2, backward
    ops = [[str(n.target) for n in gm.graph.nodes if "gla_inductor" in str(n.target)] for gm in graphs]
    states, fwd, bwd = (f"gla_inductor.{op}.default" for op in ("chunk_final_state", "chunk_fwd", "chunk_bwd"))
    assert ops == [[states, fwd] * 2, [states, bwd] * 2], ops
    return errors


def eager_scans_on_plain_tensors(ctx):
    """Eager calls wait for each all-gather at once: the scans over the gathered states and their
    gradients run on plain tensors, not through AsyncCollectiveTensor's Python dispatch, which
    views of an unwaited result keep (it was most of the eager step's host time)."""
    import torch.distributed._functional_collectives as funcol

    original = funcol.AsyncCollectiveTensor.__dict__["__torch_dispatch__"]
    dispatched = []

    def counting(cls, func, types, args=(), kwargs=None):
        dispatched.append(str(func))
        return original.__func__(cls, func, types, args, kwargs)

    funcol.AsyncCollectiveTensor.__torch_dispatch__ = classmethod(counting)
    try:
        errors = _cp_errors(ctx, "vector", G=2)  # eager: fn None
    finally:
        funcol.AsyncCollectiveTensor.__torch_dispatch__ = original
    assert not dispatched, dispatched[:5]
    return errors


def compiled_gla_backend(ctx):
    """fullgraph compile through gla_inductor.backend, forward and backward."""
    import gla_inductor
    from gla_inductor.distributed import context_parallel_gla

    torch._dynamo.reset()
    compiled = torch.compile(two_layers(context_parallel_gla), backend=gla_inductor.backend, fullgraph=True)
    return _cp_errors(ctx, fn=compiled, **COMPILED_CASE)


def error_bad_layouts(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gla_inductor.distributed import context_parallel_gla

    tensors, _ = cases.gla_inputs("vector", T=9, device=ctx.device)
    cases.expect_error(lambda: context_parallel_gla(**tensors, layout="zigzag"), ValueError,
                       "layout must be one of ('contiguous', 'head_tail'), got 'zigzag'")
    cases.expect_error(lambda: context_parallel_gla(**tensors, layout="head_tail"), ValueError,
                       "layout='head_tail' needs each rank's T (9) divisible by 2")
    cases.expect_error(lambda: context_parallel_gla(**dict(tensors, g=tensors["g"][..., :3])), ValueError,
                       "context_parallel_gla: g has shape (2, 9, 4, 3)", "expected g to be [B, T, H, K]")
    cases.expect_error(lambda: context_parallel_gla(**tensors, gate_fn="softplus"), ValueError,
                       "context_parallel_gla: gate_fn='softplus' needs gate_a")
    heads = {n: distribute_tensor(x, ctx.mesh, [Shard(2) if n in cases.SEQUENCE else Replicate()])
             for n, x in tensors.items()}
    cases.expect_error(lambda: context_parallel_gla(**heads), ValueError,
                       "q is (Shard(dim=2),); expected Shard(1) (over time) on exactly one mesh dim")
    seq = {n: distribute_tensor(x, ctx.mesh, [Shard(1) if n in ("q", "k", "g") else Replicate()])
           for n, x in tensors.items()}
    cases.expect_error(lambda: context_parallel_gla(**seq), ValueError,
                       "v is Replicate() on mesh dim 0 where q is Shard(1); expected Shard(dim=1)")
    seq["v"] = tensors["v"]
    cases.expect_error(lambda: context_parallel_gla(**seq), TypeError,
                       "q is a DTensor but v is not")
    return {}


# Where the kernels run the local schedule (vector gates from K = 64; on CPU under the interpreter),
# chunk_fwd and chunk_bwd are cut around the all-gathers (``kernels.parts``): no states-only pass.
PARTS_SHAPE = dict(B=1, T=152, H=2, K=64, V=16)


@contextlib.contextmanager
def expect_parts(calls: int):
    """Asserts that the block ran ``chunk_sums`` ``calls`` times (forward and backward) and never the
    states-only pass."""
    from gla_inductor.ops import dispatch

    sums, states = dispatch.chunk_sums, dispatch.chunk_final_state
    ran = []

    def counting(*args):
        ran.append(1)
        return sums(*args)

    def refusing(*args):
        raise AssertionError("the states-only pass ran")

    dispatch.chunk_sums, dispatch.chunk_final_state = counting, refusing
    try:
        yield
    finally:
        dispatch.chunk_sums, dispatch.chunk_final_state = sums, states
    assert len(ran) == calls, f"chunk_sums ran {len(ran)} times, expected {calls}"


def parts_vector(ctx):
    """The cut, eager: grouped q/k, an initial and a final state, slices of two chunks."""
    with expect_parts(2):
        return _cp_errors(ctx, "vector", G=1, **PARTS_SHAPE)


def parts_fused_gate_reverse(ctx):
    """The cut, eager, reverse, head_tail: segments of one partial chunk each; a fused gate."""
    with expect_parts(2):
        return _cp_errors(ctx, "logsigmoid", True, "head_tail", **PARTS_SHAPE)


def parts_uneven(ctx):
    """The cut on slices of different lengths (33, 33, 33, 31 steps on four ranks), no initial state."""
    with expect_parts(2):
        return _cp_errors(ctx, "vector", **dict(PARTS_SHAPE, T=130, initial_state=False))


def _all_on_the_first(T: int, rank: int, world: int, layout: str) -> torch.Tensor:
    return torch.arange(T) if rank == 0 else torch.arange(0)


def parts_empty_rank(ctx):
    """The cut where every step is on the first rank and the others hold none, eager and compiled."""
    from gla_inductor.distributed import context_parallel_gla

    errors = _cp_errors(ctx, "vector", local_index=_all_on_the_first, **dict(PARTS_SHAPE, T=70))
    torch._dynamo.reset()
    compiled = _cp_errors(ctx, "vector", fn=torch.compile(context_parallel_gla, fullgraph=True),
                          local_index=_all_on_the_first, **dict(PARTS_SHAPE, T=70))
    return {**errors, **{f"compiled_{n}": e for n, e in compiled.items()}}


def parts_compiled(ctx):
    """The cut, fullgraph through Inductor: the ops of the two halves around each all-gather, and no
    states-only pass, in the forward graph and in the backward graph."""
    from gla_inductor.distributed import context_parallel_gla

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(context_parallel_gla, backend=cases.recording_inductor(graphs), fullgraph=True)
    errors = _cp_errors(ctx, "vector", fn=compiled, **PARTS_SHAPE)
    order = [[str(n.target).replace("gla_inductor.", "").replace("_c10d_functional.", "").replace(".default", "")
              for n in gm.graph.nodes if "gla_inductor" in str(n.target) or "c10d" in str(n.target)] for gm in graphs]
    assert order == [["chunk_sums", "all_gather_into_tensor", "wait_tensor", "chunk_fwd_from_parts"],
                     ["chunk_sums", "all_gather_into_tensor", "wait_tensor", "chunk_bwd_from_parts"]], order
    return errors


CHECKS_2 = [*CASE_CHECKS, uneven_slices, outputs_only, dtensor_sequence, error_bad_layouts, compiled_inductor,
            compiled_gla_backend, eager_scans_on_plain_tensors, parts_vector, parts_fused_gate_reverse,
            parts_compiled, parts_empty_rank]
CHECKS_4 = [CASE_CHECKS[0], CASE_CHECKS[3], CASE_CHECKS[11], uneven_slices, dtensor_sequence,
            dtensor_sequence_and_heads, parts_fused_gate_reverse, parts_uneven]


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
