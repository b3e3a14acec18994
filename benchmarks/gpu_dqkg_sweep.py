"""Tile sweep of the backward's dq/dk/dg kernel alone (GPU): gla_chunk_bwd_dqkg at one shape, with
and without a fused gate, for each (block_k, block_v, warps, stages); prints a table sorted by time.

    PYTHONPATH=$PWD python benchmarks/gpu_dqkg_sweep.py [--shape 8,2048,16,128,128] [--gate vector]
"""

import argparse
import itertools
import math
from dataclasses import replace

import torch
from triton.testing import do_bench

from gla_inductor import triton_chunk
from gla_inductor.gates import GateFn


def inputs(shape, gate: str, gate_fn: GateFn):
    B, T, H, K, V = shape
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = (torch.randn(B, T, H, K, **bf16) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, **bf16) for _ in range(2))
    gshape = (B, T, H, K) if gate == "vector" else (B, T, H)
    x = torch.randn(gshape, **bf16)
    g = x if gate_fn.name else torch.nn.functional.logsigmoid(x) / 16
    return q, k, v, g, do


def time_dqkg(shape, gate: str, gate_fn: GateFn, tile) -> float:
    B, T, H, K, V = shape
    q, k, v, g, do = inputs(shape, gate, gate_fn)
    cfg = triton_chunk.default_config(B, T, H, K, V, torch.bfloat16, gate == "vector", q.device)
    cfg = replace(cfg, dqkg=tile)
    run = triton_chunk._Launcher(cfg, q, v, g, None, K**-0.5, False, gate_fn, None, None)
    NT = math.ceil(T / cfg.block_t)
    h, dh = (torch.randn(B, NT, H, K, V, device="cuda", dtype=cfg.states_dtype) for _ in range(2))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(g.shape, dtype=torch.float32 if gate_fn.name else g.dtype, device="cuda")
    fn = lambda: run.dqkg(dq, q=q, k=k, v=v, do=do, h=h, dh=dh, dk=dk, dg=dg)  # noqa: E731
    return do_bench(fn, warmup=5, rep=30, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--gate", default="vector")
    p.add_argument("--gate-fns", default=",logsigmoid")
    p.add_argument("--stages", default="1,2")
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    K = shape[3]
    stage_counts = [int(s) for s in args.stages.split(",")]
    ks = [32, 64, 128] if args.gate == "vector" else [max(16, 1 << (K - 1).bit_length())]
    rows = []
    for name in args.gate_fns.split(","):
        gate_fn = GateFn(name, 1 / 16) if name else GateFn()
        for bk, bv, warps, stages in itertools.product(ks, [32, 64, 128], [4, 8], stage_counts):
            tile = triton_chunk.TileConfig(block_v=bv, num_warps=warps, num_stages=stages, block_k=bk)
            try:
                ms = time_dqkg(shape, args.gate, gate_fn, tile)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row too
                ms = float("nan")
                print(f"{tile}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            rows.append((name or "-", bk, bv, warps, stages, ms))
            print(rows[-1], flush=True)
    print("\n| gate fn | block_k | block_v | warps | stages | ms |\n|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r[0], r[5])):
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} |")


if __name__ == "__main__":
    main()
