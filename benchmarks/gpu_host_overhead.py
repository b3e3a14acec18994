"""Host time of one GLA op call on the GPU (decode-sized inputs, where launching is the cost):
microseconds per call, unsynchronized, for the decode op and the chunked op, and the top
functions of a cProfile of the decode op.

    PYTHONPATH=$PWD python benchmarks/gpu_host_overhead.py [--out DIR]
"""

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

import gla_inductor


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    B, H, K, V = 64, 24, 128, 64
    dev = "cuda"
    q, k = (torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, 1, H, V, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(B, 1, H, device=dev)
    state = torch.zeros(B, H, K, V, device=dev)
    op = torch.ops.gla_inductor.fused_recurrent.default
    rows = {
        "fused_recurrent op (decode)": lambda: op(q, k, v, g, None, state, 1.0, False),
        "chunk_gla (T=1)": lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0),
        "empty kernel-free baseline: torch.add": lambda: torch.add(q, k),
    }
    lines = ["| call | us per call (host) |", "|---|---|"]
    with torch.no_grad():
        for name, fn in rows.items():
            lines.append(f"| {name} | {per_call_us(fn):.1f} |")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            rows["fused_recurrent op (decode)"]()
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    text = "\n".join(lines) + "\n\n" + s.getvalue()
    with open(os.path.join(args.out, "host_overhead.txt"), "w") as f:
        f.write(text)
    print(text[:6000])


if __name__ == "__main__":
    main()
