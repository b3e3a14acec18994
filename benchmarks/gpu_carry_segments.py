"""GPU sweep of the carries' segments (``ChunkConfig.segments``): forward and backward of the local
schedule at one shape, each timed alone in CUDA graphs (GPU time, no host overhead), bf16.

    PYTHONPATH=$PWD python benchmarks/gpu_carry_segments.py [--shape 2,16384,16,128,128] [--segments 1,2,4,8]
        [--carry-v 64] [--warps 4] [--stages 2] [--block-t 64] [--local-warps 8] [--out segments.json]

Every config's outputs are checked against the unsegmented one's.
"""

import argparse
import dataclasses
import json

import torch
from triton.testing import do_bench_cudagraph

from gla_inductor.triton_chunk import chunk_bwd_triton, chunk_fwd_triton, default_config
from gpu_schedule import rel_err, save_rows, sweep_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="2,16384,16,128,128")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--segments", default="1,2,4,8")
    p.add_argument("--carry-v", default="64", help="the carries' value tiles")
    p.add_argument("--warps", default="4", help="the carries' warps")
    p.add_argument("--stages", default=None, help="the carries' pipeline stages (default: the config's)")
    p.add_argument("--block-t", type=int, default=None, help="the chunk size (default: the config's)")
    p.add_argument("--local-warps", type=int, default=8, help="gla_chunk_local's warps")
    p.add_argument("--out")
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, args.gate)
    do = torch.randn_like(v)
    base = default_config(B, T, H, K, V, torch.bfloat16, args.gate == "vector", q.device)
    scale = K ** -0.5
    rows, ref = [], None
    if args.block_t:
        base = dataclasses.replace(base, block_t=args.block_t)
    stages = [base.carry.num_stages] if args.stages is None else list(map(int, args.stages.split(",")))
    sweep = [(s, bv, w, st) for bv in map(int, args.carry_v.split(",")) for w in map(int, args.warps.split(","))
             for st in stages for s in map(int, args.segments.split(","))]
    for segments, carry_v, warps, st in sweep:
        cfg = dataclasses.replace(base, local=True, segments=segments,
                                  carry=dataclasses.replace(base.carry, block_v=carry_v, num_warps=warps,
                                                            num_stages=st),
                                  local_tile=dataclasses.replace(base.local_tile, num_warps=args.local_warps))

        def fwd():
            return chunk_fwd_triton(q, k, v, g, None, None, scale, False, False, config=cfg)[0]

        def bwd():
            return chunk_bwd_triton(q, k, v, g, None, None, do, None, scale, False, config=cfg)

        try:
            out = (fwd(), *bwd()[:4])
        except Exception as e:
            print(json.dumps(dict(segments=segments, carry_v=carry_v, warps=warps, stages=st, error=repr(e)[:200])))
            continue
        if ref is None:
            ref = out
        err = max(rel_err(a, b) for a, b in zip(out, ref))
        try:
            row = dict(segments=segments, carry_v=carry_v, warps=warps, stages=st, fwd_ms=do_bench_cudagraph(fwd, rep=50),
                       bwd_ms=do_bench_cudagraph(bwd, rep=50), max_rel_err_vs_first=err)
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            row = dict(segments=segments, carry_v=carry_v, warps=warps, stages=st, fwd_ms=float("nan"), bwd_ms=float("nan"),
                       error=repr(e)[:200])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        save_rows(args.out, rows, shape=[B, T, H, K, V], gate=args.gate, default_segments=base.segments,
                  default_carry_v=base.carry.block_v, block_t=base.block_t)
    print(f"| segments ({args.gate}, {args.shape}, BT {base.block_t}, local {args.local_warps} warps) | carry BV "
          "| warps | stages | fwd ms | bwd ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['segments']} | {r['carry_v']} | {r['warps']} | {r['stages']} | {r['fwd_ms']:.3f} "
              f"| {r['bwd_ms']:.3f} |")


if __name__ == "__main__":
    main()
