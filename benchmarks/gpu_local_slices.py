"""GPU sweep of gla_chunk_local's key slices: BKS (keys per slice of the common path) and BKP (keys
per slice of the steep chunks' pairwise path, which sets the kernel's registers), forward and
backward in CUDA graphs (GPU time), bf16, vector gate.

    PYTHONPATH=$PWD python benchmarks/gpu_local_slices.py [--shape 8,2048,16,128,128] [--slices 128:16,128:8]
        [--out slices.json]

Every config's outputs are checked against the first one's.
"""

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from gla_inductor import triton_chunk
from gpu_schedule import sweep_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--slices", default="128:16,128:8", help="comma-separated BKS:BKP pairs, or BKS:BKP:preload")
    p.add_argument("--out")
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, "vector")
    do = torch.randn_like(v)
    scale = K ** -0.5
    rows, ref = [], None
    for pair in args.slices.split(","):
        bks, bkp, *preload = pair.split(":")
        bks, bkp, preload = int(bks), int(bkp), bool(preload)
        triton_chunk.local_key_slice = lambda BK, bks=bks: min(BK, bks)
        triton_chunk.local_steep_slice = lambda BKS, bkp=bkp: min(BKS, bkp)
        triton_chunk.local_preload = lambda BK, BKS, preload=preload: preload

        def fwd():
            return triton_chunk.chunk_fwd_triton(q, k, v, g, None, None, scale, False, False)[0]

        def bwd():
            return triton_chunk.chunk_bwd_triton(q, k, v, g, None, None, do, None, scale, False)

        out = (fwd(), *bwd()[:4])
        ref = ref or out
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))
        row = dict(bks=bks, bkp=bkp, preload=preload, fwd_ms=do_bench_cudagraph(fwd, rep=50), bwd_ms=do_bench_cudagraph(bwd, rep=50),
                   max_rel_err_vs_first=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=[B, T, H, K, V])
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"| BKS:BKP ({args.shape}) | fwd ms | bwd ms |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['bks']}:{r['bkp']}{':preload' if r['preload'] else ''} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} |")


if __name__ == "__main__":
    main()
