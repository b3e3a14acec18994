"""A whole GLA block compiled (CUDA): projections, ``logsigmoid(x) / 16`` gate, GLA, per-head RMS
norm, ``silu`` output gate, output projection; B=8, T=2048, H=16, K=V=128, bf16, a training step.

Variants, in one process, one after the other (each compiles afresh after ``torch._dynamo.reset``):
  ours          GLA written naively (the pairwise parallel form, vector gate), compiled with
                ``backend=gla_inductor.backend``: rewritten to the op, lowered to its templates, the
                gate function fused into them;
  ours-unfused  the same with ``gla_inductor.config.fuse_gates`` off (the gate a tensor Inductor
                computes before the op);
  fla           the block calling FLA's ``chunk_gla`` under default ``torch.compile`` (FLA's op is a
                graph break); skipped with a note where FLA is absent.
Forward and forward+backward ms (CUDA events), peak extra memory, and the compile time: the wall
time of the first compiled step minus a warm one (FLA's kernels are autotuned before, eagerly: its
run-time autotuning is not compile time). A small unrelated model is compiled first and Inductor's
compile workers are waited for, so that Inductor's one-time start-up is charged to no variant.
"""

from __future__ import annotations

import cProfile
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import harness, inputs, report

VARIANTS = ("ours", "ours-unfused", "fla")
SHAPE = (8, 2048, 16, 128, 128)
QUICK_SHAPE = (2, 256, 4, 64, 64)


def add_arguments(p) -> None:
    p.add_argument("--variants", default=",".join(VARIANTS), help="of " + ",".join(VARIANTS))
    p.add_argument("--shape", default=",".join(map(str, SHAPE)), help="B,T,H,K,V")
    p.add_argument("--compile-only", action="store_true", help="only the compile times (the compile-time benchmark)")
    p.add_argument("--no-worker-wait", action="store_true",
                   help="compile while Inductor's compile workers may still be starting (as a fresh script would)")
    p.add_argument("--profile-compile", metavar="DIR", help="cProfile each variant's compiling step into DIR")


def fla_gla(q, k, v, g):
    from fla.ops.gla import chunk_gla

    return chunk_gla(q, k, v, g, scale=q.shape[-1] ** -0.5)[0]


class GLABlock(nn.Module):
    """The attention half of a GLA layer (as in the GLA paper and FLA's GatedLinearAttention)."""

    def __init__(self, attn, d_model: int, H: int, K: int, V: int):
        super().__init__()
        self.attn, self.H, self.K, self.V = attn, H, K, V
        self.q = nn.Linear(d_model, H * K, bias=False)
        self.k = nn.Linear(d_model, H * K, bias=False)
        self.v = nn.Linear(d_model, H * V, bias=False)
        self.g = nn.Linear(d_model, H * K, bias=False)
        self.z = nn.Linear(d_model, H * V, bias=False)
        self.norm = nn.Parameter(torch.ones(V))
        self.out = nn.Linear(H * V, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        q, k = self.q(x).view(B, T, H, K), self.k(x).view(B, T, H, K)
        v = self.v(x).view(B, T, H, V)
        g = F.logsigmoid(self.g(x).view(B, T, H, K)) / 16
        o = self.attn(q, k, v, g)
        o = o * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(o.dtype) * self.norm
        o = o * F.silu(self.z(x).view(B, T, H, V))
        return self.out(o.reshape(B, T, H * V))


def make(attn, shape, device: str, dtype: torch.dtype, seed: int = 0):
    """(block, input x with gradients, output gradient dy)."""
    B, T, H, K, V = shape
    torch.manual_seed(seed)
    block = GLABlock(attn, H * K, H, K, V).to(device, dtype)
    x = torch.randn(B, T, H * K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(B, T, H * K, device=device, dtype=dtype)
    return block, x, dy


def compiled(variant: str, block):
    import gla_inductor

    torch._dynamo.reset()
    if variant.startswith("ours"):
        return torch.compile(block, backend=gla_inductor.backend)
    return torch.compile(block)


def step(fn, x, dy) -> None:
    x.grad = None
    fn(x).backward(dy)


def warm_fla(shape) -> None:
    """One eager FLA block step: FLA autotunes its kernels (into TRITON_CACHE_DIR)."""
    block, x, dy = make(fla_gla, shape, "cuda", torch.bfloat16)
    step(block, x, dy)
    torch.cuda.synchronize()


def warm_up_inductor(wait_for_workers: bool = True) -> None:
    """Compile and run a tiny MLP forward and backward with default Inductor, then wait until
    Inductor's compile workers have started: until then it compiles every Triton kernel in the main
    process, one after another."""
    torch._dynamo.reset()
    mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    torch.compile(mlp)(x).sum().backward()
    torch.cuda.synchronize()
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    deadline = time.perf_counter() + 300
    while wait_for_workers and config.compile_threads > 1 and time.perf_counter() < deadline:
        if AsyncCompile.use_process_pool():
            break
        time.sleep(0.05)


def run_variant(variant: str, shape, compile_only: bool, profile_dir) -> dict:
    from torch._dynamo.utils import counters

    import gla_inductor

    counters.clear()
    block, x, dy = make(fla_gla if variant == "fla" else inputs.naive_pairwise_vector, shape, "cuda", torch.bfloat16)
    if variant == "fla":
        step(block, x, dy)
    with gla_inductor.config.patch(fuse_gates=variant != "ours-unfused"):
        fn = compiled(variant, block)
        if compile_only:  # under `python -X importtime`, the imports the compile triggers lie between
            print(f"@@ compile of {variant} starts", file=sys.stderr, flush=True)
        profiler = cProfile.Profile() if profile_dir else None
        if profiler:
            profiler.enable()
        _, first, warm = harness.first_and_warm(lambda: step(fn, x, dy), "cuda")
        if profiler:
            profiler.disable()
            profiler.dump_stats(f"{profile_dir}/compile-{variant}.prof")
        row = dict(variant=variant, shape=list(shape), compile_s=first - warm,
                   rewrites=counters["gla_inductor"]["rewrites"], fused_gates=counters["gla_inductor"]["fused_gates"])
        if compile_only:  # where the compile time went, by Dynamo's and Inductor's own timers
            print(f"@@ compile of {variant} ends", file=sys.stderr, flush=True)
            print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), file=sys.stderr, flush=True)
            return row
        row.update(harness.time_one(lambda: step(fn, x, dy)).fields("fwdbwd_"))
        row["peak_extra_mib"] = harness.peak_extra_mib(lambda: step(fn, x, dy))
        row.update(harness.time_one(lambda: fn(x)).fields("fwd_"))  # with autograd: a training forward
    return row


def run(args):
    harness.require_cuda("block")
    shape = inputs.QUICK_SHAPE if args.quick and args.shape == ",".join(map(str, SHAPE)) else \
        tuple(int(s) for s in args.shape.split(","))
    variants = args.variants.split(",")
    notes = []
    if "fla" in variants and inputs.fla_ops()[0] is None:
        notes.append(inputs.fla_ops()[1])
        variants.remove("fla")
    name, title = ("compile-time", "Compile time of the GLA block") if args.compile_only else \
        ("block", "A GLA block compiled, against FLA's")
    result = report.new_result(name, title, "cuda", shape=list(shape), dtype="bfloat16", variants=variants)
    result.notes += notes + ["compile s: first compiled training step minus a warm one; ms: median of CUDA "
                             "events, variants timed one after the other"]
    warm_up_inductor(not args.no_worker_wait)
    for variant in variants:
        try:
            row = run_variant(variant, shape, args.compile_only, args.profile_compile)
        except Exception as e:  # one failing variant must not hide the others
            row = dict(variant=variant, shape=list(shape), error=harness.error_text(e))
        harness.log(row)
        result.rows.append(row)
    result.sections.append(report.table(result.rows, [
        ("variant", "variant", ""), ("fwd ms", "fwd_ms", ".3f"), ("fwd+bwd ms", "fwdbwd_ms", ".3f"),
        ("peak extra MiB", "peak_extra_mib", ".0f"), ("compile s", "compile_s", ".1f"),
        ("rewrites", "rewrites", "d"), ("fused gates", "fused_gates", "d"),
        ("error", lambda r: r.get("error", "")[:100] or None, "")]))
    return result
