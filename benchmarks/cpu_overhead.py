"""Host-side cost of one eager ``gla_inductor.chunk_gla`` call on CUDA (launch overhead), profiled.

    python benchmarks/cpu_overhead.py [--calls 300] [--gate vector] [--bwd] [--trace]

At a tiny shape the GPU work is negligible, so the time per call is what the host spends; cProfile
lists where.
"""

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import gla_inductor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--trace", action="store_true", help="also list CUDA runtime calls (syncs, copies) by torch.profiler")
    args = p.parse_args()
    gla_inductor.config.triton_gates = ("vector", "scalar", "constant", "none")
    B, T, H, K, V = 1, 64, 1, 128, 128
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn((B, T, H, K) if args.gate == "vector" else (B, T, H), device="cuda")) / 16
    xs = [x.requires_grad_(args.bwd) for x in (q, k, v, g)]

    def call():
        o = gla_inductor.chunk_gla(*xs)[0]
        if args.bwd:
            o.sum().backward()

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - start) / args.calls * 1e6:.0f} us per call ({args.gate}, bwd={args.bwd})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tr:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        print(tr.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
