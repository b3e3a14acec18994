"""Context and tensor parallelism at real sizes in bf16, on 2 or 4 GPUs with NCCL: B = 1..2,
T = 8k..32k, H = 16, K = V = 128.

Each rank builds the same full inputs (a seeded CUDA generator), computes the fp32 single-GPU
result (``chunk_gla`` on q, k, v upcast, the reference) and the bf16 single-GPU result, then its
distributed bf16 result. bf16 has no fixed tolerance against fp32, so the check is relative to one
GPU: the distributed run's error (against the reference) may be at most twice the single-GPU bf16
run's, plus a floor. Errors are relative in the 2-norm, ||x - ref|| / ||ref||, over the rank's part.

Checks: ``context_parallel_gla`` on local slices (eager and compiled, vector gate, initial and
final state, every gradient); a naive parallel form on DTensors sharded over time, and over heads,
compiled with gla_inductor.backend (fullgraph; the rewrite must happen before anything runs:
unrewritten, the parallel form would materialize [B, H, T, T]).

On CPU (gloo) the same checks run at small sizes, with ``--slow`` (``test_gloo_small``: it checks
the checks where there is no GPU).
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import dist_cases as cases
import dist_harness as harness

# the distributed error over (twice the single-GPU bf16 error + FLOOR): at most 1
BOUND = 1.0
FLOOR = 2e-3

# (B, T, H, K, V) per check, by device type
SIZES = {
    "cuda": {"context_parallel_local": (2, 32768, 16, 128, 128),
             "context_parallel_compiled": (1, 16384, 16, 128, 128), "compiled_time": (1, 8192, 16, 128, 128),
             "compiled_heads": (1, 8192, 16, 128, 128)},
    "cpu": {"context_parallel_local": (1, 64, 4, 16, 16), "context_parallel_compiled": (1, 64, 4, 16, 16),
            "compiled_time": (1, 32, 4, 16, 16), "compiled_heads": (1, 32, 4, 16, 16)},
}


def _inputs(ctx, name: str, gate: str, initial_state: bool) -> dict:
    """fp32 full inputs (q, k, v rounded to bf16 already, so both runs see the same values)."""
    B, T, H, K, V = SIZES[ctx.device.type][name]
    gen = torch.Generator(device=ctx.device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=ctx.device)

    t = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V))
    t = {n: x.bfloat16().float() for n, x in t.items()}
    gate_shape = (B, T, H, K) if gate == "vector" else (B, T, H)
    # log gates near 0 (-0.02 on average): a memory of ~50 steps, the regime of trained models
    t["g"] = torch.nn.functional.logsigmoid(randn(*gate_shape) + 4)
    if initial_state:
        t["initial_state"] = randn(B, H, K, V)
    return t


def _bf16(tensors: dict) -> dict:
    return {n: x.bfloat16() if n in ("q", "k", "v") else x for n, x in tensors.items()}


def norm_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.shape != ref.shape:
        return float("inf")
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _ratios(dist_errors: dict, single_errors: dict) -> dict:
    """Each distributed error over its bound; the errors themselves too, for the record (as
    "err_" entries, checked against infinity only)."""
    out = {n: e / (2 * single_errors[n] + FLOOR) for n, e in dist_errors.items()}
    out.update({f"err_{n}": e for n, e in dist_errors.items()})
    out.update({f"err_single_{n}": e for n, e in single_errors.items()})
    return out


def _weights(ctx, tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    v, q = tensors["v"], tensors["q"]
    B, T, H, V = v.shape
    return (torch.randn(B, T, H, V, generator=gen, device=ctx.device),
            torch.randn(B, H, q.shape[-1], V, generator=gen, device=ctx.device))


def _single(fn, tensors: dict, w_o, w_h) -> tuple[dict, dict]:
    """(outputs, gradients) of fn under the weighted loss; the final state's term where fn gives one."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
    o, ht = fn(**leaves)
    loss = (o.float() * w_o).sum() + (0 if ht is None else (ht.float() * w_h).sum())
    loss.backward()
    out = {"o": o.detach()} if ht is None else {"o": o.detach(), "ht": ht.detach()}
    return out, {n: x.grad for n, x in leaves.items()}


def _chunk_gla(with_state: bool):
    import gla_inductor

    def run(**kwargs):
        o, ht = gla_inductor.chunk_gla(**kwargs, output_final_state=with_state)
        return o, ht

    return run


def context_parallel_local(ctx, name: str = "context_parallel_local", compiled: bool = False):
    """context_parallel_gla on this rank's contiguous slice, vector gate, initial and final state."""
    import torch.distributed as dist

    from gla_inductor.distributed import context_parallel_gla

    tensors = _inputs(ctx, name, "vector", initial_state=True)
    w_o, w_h = _weights(ctx, tensors)
    ref_out, ref_grads = _single(_chunk_gla(True), tensors, w_o, w_h)
    one_out, one_grads = _single(_chunk_gla(True), _bf16(tensors), w_o, w_h)
    T = tensors["q"].shape[1]
    steps = torch.arange(T, device=ctx.device).chunk(ctx.world)[ctx.rank]
    local = {n: x[:, steps] if n in cases.SEQUENCE else x for n, x in _bf16(tensors).items()}

    def cp(**kwargs):
        return context_parallel_gla(**kwargs, output_final_state=True)

    if compiled:
        torch._dynamo.reset()
        cp = torch.compile(cp, fullgraph=True)

    out, grads = _single(cp, local, w_o[:, steps], w_h / ctx.world)
    dist.all_reduce(grads["initial_state"])  # each rank holds its share of the replicated input's gradient

    def part(n, x):  # this rank's part of a full tensor: its time slice of o and the sequence inputs
        return x[:, steps] if n in ("o", *cases.SEQUENCE) else x

    dist_errors = {n: norm_err(x, part(n, ref_out[n])) for n, x in out.items()}
    dist_errors.update({f"d{n}": norm_err(x, part(n, ref_grads[n])) for n, x in grads.items()})
    single = {n: norm_err(part(n, x), part(n, ref_out[n])) for n, x in one_out.items()}
    single.update({f"d{n}": norm_err(part(n, x), part(n, ref_grads[n])) for n, x in one_grads.items()})
    return _ratios(dist_errors, single)


def context_parallel_compiled(ctx):
    """The same, compiled (fullgraph, Inductor): on the GPU the vector gate at K = 128 takes the local
    schedule, so the step runs chunk_fwd and chunk_bwd cut around the all-gathers (``kernels.parts``)."""
    return context_parallel_local(ctx, "context_parallel_compiled", compiled=True)


def parallel_form(q, k, v, g):
    """The user's naive GLA: a parallel form, per-head gate (fp32), bf16 q, k, v whose products the
    code takes in fp32, head-first."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    G = g.cumsum(-1)
    D = (G[..., :, None] - G[..., None, :]).exp().tril()
    o = ((q @ k.mT).float() * D) @ v.float() * q.shape[-1] ** -0.5
    return o.transpose(1, 2), None


def _rewrite_first(graphs: list):
    """gla_inductor's rewrite, which must replace the parallel form, then plain Inductor keeping the
    graphs it compiles."""
    rewrite = importlib.import_module("gla_inductor.backend").rewrite

    def backend(gm, example_inputs):
        result = rewrite(gm, example_inputs)
        if [m.form for m in result.matches] != ["parallel"]:
            raise AssertionError(f"not rewritten: {[(n.form, n.reason) for n in result.near_misses]}")
        return cases.recording_inductor(graphs)(gm, example_inputs)

    return backend


def _compiled_on_dtensors(ctx, name: str, placement) -> tuple[dict, list]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch._dynamo.reset()
    tensors = _inputs(ctx, name, "scalar", initial_state=False)
    w_o, _ = _weights(ctx, tensors)
    ref_out, ref_grads = _single(_chunk_gla(False), tensors, w_o, None)
    one_out, one_grads = _single(_chunk_gla(False), _bf16(tensors), w_o, None)
    graphs: list = []
    compiled = torch.compile(parallel_form, backend=_rewrite_first(graphs), fullgraph=True)
    dt = {n: distribute_tensor(x, ctx.mesh, [placement]) for n, x in _bf16(tensors).items()}
    out, grads = _single(compiled, dt, distribute_tensor(w_o, ctx.mesh, [Replicate()]), None)
    dist_errors = {"o": norm_err(out["o"].full_tensor(), ref_out["o"])}
    dist_errors.update({f"d{n}": norm_err(x.full_tensor(), ref_grads[n]) for n, x in grads.items()})
    single = {"o": norm_err(one_out["o"], ref_out["o"])}
    single.update({f"d{n}": norm_err(x, ref_grads[n]) for n, x in one_grads.items()})
    return _ratios(dist_errors, single), graphs


def _collectives(gm) -> list[str]:
    return [str(n.target).split(".")[1] for n in gm.graph.nodes if "c10d" in str(n.target)]


def compiled_time(ctx):
    """The parallel form on DTensors sharded over time: context parallelism, one all-gather."""
    from torch.distributed.tensor import Shard

    ratios, (forward, backward) = _compiled_on_dtensors(ctx, "compiled_time", Shard(1))
    assert _collectives(forward) == ["all_gather_into_tensor", "wait_tensor"], _collectives(forward)
    assert _collectives(backward) == ["all_gather_into_tensor", "wait_tensor"], _collectives(backward)
    return ratios


def compiled_heads(ctx):
    """The parallel form on DTensors sharded over heads: the op per rank, no collective."""
    from torch.distributed.tensor import Shard

    ratios, graphs = _compiled_on_dtensors(ctx, "compiled_heads", Shard(2))
    assert not any(_collectives(gm) for gm in graphs), [_collectives(gm) for gm in graphs]
    return ratios


CHECKS = [context_parallel_local, context_parallel_compiled, compiled_time, compiled_heads]


def assert_within_bounds(results: list, check: str) -> None:
    for rank, r in enumerate(harness.outcome(results, check)):
        assert "raised" not in r, f"rank {rank}: {r['raised']}\n{r['trace']}"
        errors = r["errors"]
        bad = {n: v for n, v in errors.items() if not n.startswith("err_") and not v <= BOUND}
        assert not bad, (f"rank {rank}: errors above twice the single-GPU bf16 error + {FLOOR}: {bad}; "
                         f"errors {errors}")
        assert all(v < float("inf") for v in errors.values()), errors


@functools.cache
def _results(world: int, backend: str):
    return harness.run_checks(__name__, [c.__name__ for c in CHECKS], world, backend)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4], ids=harness.world_id)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nccl(world, check):
    if reason := harness.need_gpus(world):
        pytest.skip(reason)
    assert_within_bounds(_results(world, "nccl"), check.__name__)


@pytest.mark.slow
def test_gloo_small():
    results = _results(2, "gloo")
    for check in CHECKS:
        assert_within_bounds(results, check.__name__)
