"""GPU benchmark of a whole GLA block (issue 4's target): projections, GLA, RMS norm, output gate.

    python benchmarks/gpu_block.py --out block.json          # H100, bf16, B=8 T=2048 H=16 K=V=128
    python benchmarks/gpu_block.py --check                   # CPU: tiny shapes, rewrite + numerics

Variants, side by side in one process:
  ours          the block with GLA written naively (the stable pairwise parallel form, vector gate),
                compiled with `backend=gla_inductor.backend`: rewritten to our op, lowered to our
                templates, the logsigmoid / 16 gate fused into them (recognize/gate.py);
  ours-unfused  the same with gla_inductor.config.fuse_gates off: the gate is a tensor Inductor
                computes before the op;
  fla           the same block calling FLA's `chunk_gla` (skipped if FLA is absent), under default
                `torch.compile` (FLA's op is a graph break).
Reports forward+backward ms (median of `triton.testing.do_bench`), peak memory, and the compile
time: the wall time of the first compiled forward+backward minus a warm one (FLA's kernels are
autotuned once before, so its run-time autotuning is not counted as compile time). A small
unrelated model is compiled first, and its compile workers waited for, so that Inductor's one-time
start-up (imports, compile workers) is charged to no variant (--no-worker-wait: not waited for).
"""

import argparse
import cProfile
import datetime
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


PROFILE_DIR = None  # --profile-compile: cProfile of each variant's first (compiling) step goes there


def naive_gla(q, k, v, g):
    """GLA as people write it from the paper: [B, T, H, D] in, pairwise decays on the causal triangle."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))  # [B, H, T, D]
    G = g.float().cumsum(2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    A = (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1) * q.shape[-1] ** -0.5
    return (A.to(v.dtype) @ v).transpose(1, 2)


def fla_gla(q, k, v, g):
    from fla.ops.gla import chunk_gla

    return chunk_gla(q, k, v, g, scale=q.shape[-1] ** -0.5)[0]


class GLABlock(nn.Module):
    """The attention half of a GLA layer (as in the GLA paper / FLA's GatedLinearAttention)."""

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


def make(attn, shape, device, dtype, seed=0):
    B, T, H, K, V = shape
    torch.manual_seed(seed)
    block = GLABlock(attn, H * K, H, K, V).to(device, dtype)
    x = torch.randn(B, T, H * K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(B, T, H * K, device=device, dtype=dtype)
    return block, x, dy


def compiled(variant, block):
    import gla_inductor

    torch._dynamo.reset()
    if variant.startswith("ours"):
        return torch.compile(block, backend=gla_inductor.backend)
    return torch.compile(block)


def report_rewrites(gm, result):
    """Print what the backend did with each graph (a block left naive would not fit in memory)."""
    print(f"gla_inductor: {len(result.matches)} rewrite(s); left alone: "
          f"{[(n.form, n.reason) for n in result.near_misses]}", flush=True)


def step(fn, x, dy):
    x.grad = None
    fn(x).backward(dy)


def check():
    """CPU: the naive block is rewritten once and matches eager (tiny shapes)."""
    from torch._dynamo.utils import counters

    block, x, dy = make(naive_gla, (2, 24, 2, 16, 16), "cpu", torch.float32)
    counters.clear()
    fn = compiled("ours", block)
    got = fn(x)
    want = block(x)
    err = ((got - want).norm() / want.norm()).item()
    print(f"rewrites {counters['gla_inductor']['rewrites']}, relative error {err:.1e}")
    assert counters["gla_inductor"]["rewrites"] == 1 and counters["gla_inductor"]["fused_gates"] == 1 and err < 1e-5


def run(shape, variants, compile_only=False, wait_for_workers=True):
    from triton.testing import do_bench

    from gla_inductor.backend import _listeners

    _listeners.append(report_rewrites)

    import gla_inductor

    warm_up_inductor(wait_for_workers)
    rows = []
    for variant in variants:
        with gla_inductor.config.patch(fuse_gates=variant != "ours-unfused"):
            rows.append(_run_variant(variant, shape, None if compile_only else do_bench))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def warm_up_inductor(wait_for_workers=True):
    """Compile and run a tiny MLP forward and backward with default Inductor, then wait until
    Inductor's compile workers have started: until then it compiles every Triton kernel in the main
    process, one after another (a fresh H100 machine took over 10 s to start them)."""
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


def _run_variant(variant, shape, do_bench):
    from torch._dynamo.utils import counters

    counters.clear()
    attn = fla_gla if variant == "fla" else naive_gla
    block, x, dy = make(attn, shape, "cuda", torch.bfloat16)
    if variant == "fla":  # FLA autotunes its kernels on first use: not compile time
        step(block, x, dy)
    fn = compiled(variant, block)
    torch.cuda.synchronize()
    mark = do_bench is None  # under `python -X importtime`, the imports the compile triggers lie between
    if mark:
        print(f"@@ compile of {variant} starts", file=sys.stderr, flush=True)
    profiler = cProfile.Profile() if PROFILE_DIR else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    step(fn, x, dy)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if profiler:
        profiler.disable()
        profiler.dump_stats(f"{PROFILE_DIR}/compile-{variant}.prof")
    if mark:
        print(f"@@ compile of {variant} ends", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    step(fn, x, dy)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    row = dict(variant=variant, shape=list(shape), compile_s=first - warm,
               fused_gates=counters["gla_inductor"]["fused_gates"])
    if do_bench is None:  # where the compile time went, by Dynamo's and Inductor's own timers
        print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)
        return row
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = do_bench(lambda: step(fn, x, dy), warmup=10, rep=50, return_mode="median")
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    fwd_ms = do_bench(lambda: fn(x), warmup=10, rep=50, return_mode="median")
    return dict(row, fwd_bwd_ms=ms, fwd_ms=fwd_ms, peak_extra_mib=peak)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--check", action="store_true")
    p.add_argument("--variants", default="ours,ours-unfused,fla")
    p.add_argument("--compile-only", action="store_true", help="only the compile times (gpu_compile_time.sh)")
    p.add_argument("--no-worker-wait", action="store_true",
                   help="compile the variants while Inductor's compile workers may still be starting")
    p.add_argument("--profile-compile", metavar="DIR", help="cProfile each variant's compiling step into DIR")
    args = p.parse_args()
    global PROFILE_DIR
    PROFILE_DIR = args.profile_compile
    if args.check:
        return check()
    import triton

    variants = args.variants.split(",")
    try:
        import fla  # noqa: F401
    except ImportError:
        variants = [v for v in variants if v != "fla"]
    rows = run((8, 2048, 16, 128, 128), variants, args.compile_only, not args.no_worker_wait)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.compile_only:
        return
    print("| variant | fwd ms | fwd+bwd ms | peak extra MiB | compile s | fused gates |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['peak_extra_mib']:.0f} | "
              f"{r['compile_s']:.1f} | {r['fused_gates']} |")


if __name__ == "__main__":
    main()
