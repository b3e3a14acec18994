"""GPU sweep of gla_chunk_local's key slices: BKS (keys per slice of the common path) and BKP (keys
per slice of the steep chunks' pairwise path, which sets the kernel's registers), forward and
backward in CUDA graphs (GPU time), bf16, vector gate.

    PYTHONPATH=$PWD python benchmarks/gpu_local_slices.py [--shape 8,2048,16,128,128] [--slices 128:16,128:8:p:w16]
        [--out slices.json]

Each config is BKS:BKP, then optionally "p" (q and k loaded before the gate sums, ``local_preload``)
and "wN" (N warps for gla_chunk_local instead of the default config's).

Every config's outputs are checked against the first one's.
"""

import argparse
import dataclasses
import json

import torch
from triton.testing import do_bench_cudagraph

from gla_inductor import triton_chunk
from gpu_schedule import rel_err, save_rows, sweep_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--slices", default="128:16,128:8", help="comma-separated BKS:BKP[:p][:wN] (see above)")
    p.add_argument("--out")
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, "vector")
    do = torch.randn_like(v)
    scale = K ** -0.5
    rows, ref = [], None
    for pair in args.slices.split(","):
        bks, bkp, *flags = pair.split(":")
        bks, bkp, preload = int(bks), int(bkp), "p" in flags
        warps = next((int(f[1:]) for f in flags if f.startswith("w")), None)
        cfg = triton_chunk.default_config(B, T, H, K, V, q.dtype, True, q.device)
        if warps is not None:
            cfg = dataclasses.replace(cfg, local_tile=dataclasses.replace(cfg.local_tile, num_warps=warps))
        triton_chunk.local_key_slice = lambda BK, bks=bks: min(BK, bks)
        triton_chunk.local_steep_slice = lambda BKS, bkp=bkp: min(BKS, bkp)
        triton_chunk.local_preload = lambda BK, BKS, preload=preload: preload

        def fwd():
            return triton_chunk.chunk_fwd_triton(q, k, v, g, None, None, scale, False, False, config=cfg)[0]

        def bwd():
            return triton_chunk.chunk_bwd_triton(q, k, v, g, None, None, do, None, scale, False, config=cfg)

        out = (fwd(), *bwd()[:4])
        ref = ref or out
        err = max(rel_err(a, b) for a, b in zip(out, ref))
        row = dict(bks=bks, bkp=bkp, preload=preload, warps=cfg.local_tile.num_warps, fwd_ms=do_bench_cudagraph(fwd, rep=50), bwd_ms=do_bench_cudagraph(bwd, rep=50),
                   max_rel_err_vs_first=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        save_rows(args.out, rows, shape=[B, T, H, K, V])
    print(f"| BKS:BKP ({args.shape}) | local warps | fwd ms | bwd ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['bks']}:{r['bkp']}{':preload' if r['preload'] else ''} | {r['warps']} | {r['fwd_ms']:.3f} "
              f"| {r['bwd_ms']:.3f} |")


if __name__ == "__main__":
    main()
