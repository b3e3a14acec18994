"""GPU check of the carries' tiles: each config's outputs (forward o, backward dq, dk, dv, dg), run
three times, against those of the first config, bf16, vector gate. A config whose runs differ from
each other or from the first config's by more than rounding shows a race.

    PYTHONPATH=$PWD python benchmarks/gpu_carry_check.py [--shape 8,2048,4,256,512] [--configs 64:4:2,128:8:2]
        [--package DIR]

Each config is BV:warps:stages of ``ChunkConfig.carry``. --package puts DIR (a folder holding a
variant ``gla_inductor``) first on sys.path.
"""

import argparse
import dataclasses
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,4,256,512")
    p.add_argument("--configs", default="64:4:2,128:8:2")
    p.add_argument("--package")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    if args.package:
        sys.path.insert(0, os.path.abspath(args.package))
    import torch

    from gla_inductor import triton_chunk
    from gpu_schedule import rel_err, sweep_inputs

    print("gla_inductor from", os.path.dirname(triton_chunk.__file__))
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, "vector")
    do = torch.randn_like(v)
    base = triton_chunk.default_config(B, T, H, K, V, q.dtype, True, q.device)
    names = ["o", "dq", "dk", "dv", "dg"]
    ref = None
    print("| BV:warps:stages | run | " + " | ".join(f"{n} rel err" for n in names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for spec in args.configs.split(","):
        bv, warps, stages = map(int, spec.split(":"))
        cfg = dataclasses.replace(base, local=True, segments=1, carry=dataclasses.replace(
            base.carry, block_v=bv, num_warps=warps, num_stages=stages))
        for run in range(args.runs):
            o = triton_chunk.chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False, config=cfg)[0]
            grads = triton_chunk.chunk_bwd_triton(q, k, v, g, None, None, do, None, K ** -0.5, False, config=cfg)[:4]
            out = [o, *grads]
            ref = ref or [t.float().clone() for t in out]
            errs = [rel_err(a, b) for a, b in zip(out, ref)]
            print(f"| {spec} | {run} | " + " | ".join(f"{e:.1e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
