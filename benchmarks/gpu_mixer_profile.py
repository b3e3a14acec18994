"""Where the time of the compiled Mamba2 mixer goes (GPU): the top CUDA kernels of one call, and the
scan op alone at each fp32 dot precision with its error against float64.

    PYTHONPATH=$PWD python benchmarks/gpu_mixer_profile.py [--B 4 --T 4096] [--groups 1] [--out DIR]
"""

import argparse
import os
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

import gla_inductor
from gla_inductor import triton_chunk
from gpu_mamba2 import MixerShape, mamba2_config


def top_kernels(fn, n: int = 15) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=90)


def bench(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def scan_precisions(s: MixerShape) -> list[str]:
    """chunk_gla on the mixer's scan shapes, fp32, under each matmul precision: ms and error."""
    B, T, H, K, V = s.B, s.T, s.heads, s.state, s.head_dim
    torch.manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda") * K**-0.5 for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda")
    g = -torch.rand(B, T, H, device="cuda") * 0.5
    want, _ = gla_inductor.chunk_gla(*(x[:1, :512].double().cpu() for x in (q, k, v, g)), scale=1.0)
    rows = []
    real = triton_chunk.default_config
    for f32 in ("ieee", "tf32x3", "tf32"):
        triton_chunk.default_config = lambda *a, **kw: replace(real(*a, **kw), f32_precision=f32)  # noqa: E731
        fn = lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0)  # noqa: E731
        with torch.no_grad():
            ms = bench(fn)
            got, _ = gla_inductor.chunk_gla(*(x[:1, :512] for x in (q, k, v, g)), scale=1.0)
        err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
        rows.append(f"| scan alone, fp32 dots {f32} | {ms:.3f} | max rel err {err:.1e} |")
    triton_chunk.default_config = real
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    s = MixerShape(B=args.B, T=args.T, groups=args.groups)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(mamba2_config(s, layers=1), layer_idx=0).cuda().to(torch.bfloat16).eval()
    x = torch.randn(s.B, s.T, s.hidden, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(mixer, backend=gla_inductor.backend, dynamic=False)
    with torch.no_grad():
        from torch._inductor.utils import run_and_get_code

        _, code = run_and_get_code(fn, x)
        with open(os.path.join(args.out, "mixer_code.py"), "w") as f:
            f.write("\n\n# ---- next module ----\n".join(code))
        table = top_kernels(lambda: fn(x))
        ms = bench(lambda: fn(x))
    rows = [f"| compiled mixer (ours) | {ms:.3f} | |", *scan_precisions(s)]
    text = "\n".join(["| what | ms | note |", "|---|---|---|", *rows, "", table])
    with open(os.path.join(args.out, "mixer_profile.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
