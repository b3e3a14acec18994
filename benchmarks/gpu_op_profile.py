"""Where the time of one eager GLA op call goes (GPU): the CUDA kernels of a forward, or of a
forward+backward, at one shape, bf16, as `gpu_gla.py` calls the op.

    PYTHONPATH=$PWD python benchmarks/gpu_op_profile.py [--shape 8,2048,4,256,512] [--gate vector] [--bwd]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import gla_inductor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,4,256,512")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
    q, k = (torch.randn(B, T, H, K, **bf16) for _ in range(2))
    v = torch.randn(B, T, H, V, **bf16)
    gshape = (B, T, H, K) if args.gate == "vector" else (B, T, H)
    g = (F.logsigmoid(torch.randn(gshape, device="cuda")) / 16).to(torch.bfloat16).requires_grad_(args.bwd)
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def call():
        for x in (q, k, v, g):
            x.grad = None  # no gradient accumulation kernels in the profile
        o = gla_inductor.chunk_gla(q, k, v, g)[0]
        if args.bwd:
            o.backward(do)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            call()
        torch.cuda.synchronize()
    print(f"{args.shape} {args.gate} {'fwd+bwd' if args.bwd else 'fwd'}: totals over {args.steps} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
