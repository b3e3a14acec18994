"""Host time of the chunked op's eager forward at one shape (GPU): microseconds per call with the
launch queue kept from filling (a synchronize every 8 calls), the GPU time (CUDA graph), and the
top functions of a cProfile of the calls.

    PYTHONPATH=$PWD python benchmarks/gpu_host_profile.py [--shape 8,1024,8,64,64] [--gate vector]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
from triton.testing import do_bench_cudagraph

import gla_inductor
from gpu_schedule import sweep_inputs


def host_us(fn, n: int = 400) -> float:
    """Median over batches of 8 calls of the host time per call; each batch starts on an idle GPU, so
    a call never waits for a full launch queue."""
    times = []
    for i in range(n // 8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(8):
            fn()
        times.append((time.perf_counter() - start) / 8 * 1e6)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,1024,8,64,64")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, args.gate)

    def call():
        return gla_inductor.chunk_gla(q, k, v, g)[0]

    with torch.no_grad():
        for _ in range(20):
            call()
        print(f"{args.shape} {args.gate}: host {host_us(call):.1f} us per forward call, "
              f"GPU {do_bench_cudagraph(call, rep=50) * 1e3:.1f} us")
        prof = cProfile.Profile()
        prof.enable()
        for i in range(200):
            call()
            if i % 8 == 7:
                torch.cuda.synchronize()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
