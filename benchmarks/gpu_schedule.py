"""GPU sweep of the forward's schedule and tiles (issue 3: is the fused scan the right forward?).

    python benchmarks/gpu_schedule.py [--out sweep.json] [--shape 8,2048,16,128,128] [--gate vector]

Times ``chunk_fwd_triton`` (median of ``triton.testing.do_bench``) for the fused schedule (one scan)
over value tiles, warps and stages (and 128-step chunks), for the local schedule over the carry's
tiles and segments, and for the split schedule (states scan, then the chunk-parallel
output kernel) over the output kernel's tiles; every config is checked against the default one.
"""

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F


def sweep_inputs(B: int, T: int, H: int, K: int, V: int, gate: str):
    """q, k, v and the log gate (bf16, ``logsigmoid(randn) / 16``) of the sweeps, seeded."""
    torch.manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    gshape = (B, T, H, K) if gate == "vector" else (B, T, H)
    g = (F.logsigmoid(torch.randn(gshape, device="cuda")) / 16).to(torch.bfloat16)
    return q, k, v, g


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in fp32: how far a config's output is from the reference config's."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def save_rows(path: str, rows: list, **meta) -> None:
    """The sweeps' JSON: meta (with the GPU and torch version) and one row per config."""
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, **meta)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--out")
    p.add_argument("--only", help="run only the configs whose names contain one of these '|'-separated "
                                  "strings (one process per config isolates a kernel that faults)")
    args = p.parse_args()
    from triton.testing import do_bench

    from gla_inductor.triton_chunk import TileConfig, chunk_fwd_triton, default_config

    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, args.gate)
    base = default_config(B, T, H, K, V, torch.bfloat16, args.gate == "vector", q.device)
    ref = chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False, config=base)[0].float()

    configs = [("default", base)]
    for bv in (32, 64, 128):
        for warps in (4, 8):
            for stages in (1, 2):
                tile = TileConfig(block_v=bv, num_warps=warps, num_stages=stages)
                configs.append((f"fused BV={bv} w={warps} s={stages}", dataclasses.replace(base, scan=tile)))
    for bv in (32, 64, 128):
        for warps in (4, 8):
            tile = TileConfig(block_v=bv, num_warps=warps, num_stages=2)
            configs.append((f"split out BV={bv} w={warps}", dataclasses.replace(base, split=True, output=tile)))

    for bv in (32, 64):  # longer chunks: half the scan's sequential steps, each with larger dots
        for warps in (4, 8):
            tile = TileConfig(block_v=bv, num_warps=warps, num_stages=2)
            configs.append((f"fused BT=128 BV={bv} w={warps}", dataclasses.replace(base, block_t=128, scan=tile)))
    for bv in (32, 64):  # the local schedule (chunk-local terms, then the carry scan)
        for warps in (4, 8):
            for stages in (1, 2):  # one stage: half the shared memory, so two programs may share an SM
                tile = TileConfig(block_v=bv, num_warps=warps, num_stages=stages)
                name = f"local carry BV={bv} w={warps} s={stages}"
                configs.append((name, dataclasses.replace(base, local=True, carry=tile, segments=1)))
    for segments in (2, 4, 8, 16):  # the local schedule's forward carry cut into segments
        for bv in (32, 64):
            tile = TileConfig(block_v=bv, num_warps=4, num_stages=2)
            name = f"local carry P={segments} BV={bv} w=4 s=2"
            configs.append((name, dataclasses.replace(base, local=True, carry=tile, segments=segments)))
    if args.only:  # the default stays, as the baseline
        configs = [(n, c) for n, c in configs if n == "default" or any(o in n for o in args.only.split("|"))]
    rows = []
    for name, cfg in configs:
        try:
            def fwd():
                return chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False, config=cfg)[0]

            err = rel_err(fwd(), ref)
            ms = do_bench(fwd, warmup=10, rep=50, return_mode="median")
            rows.append(dict(config=name, ms=ms, rel_err_vs_default=err))
        except Exception as e:  # a config that does not compile (registers, shared memory)
            rows.append(dict(config=name, ms=float("nan"), error=repr(e)[:200]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        save_rows(args.out, rows, shape=[B, T, H, K, V], gate=args.gate)
    print(f"| config ({args.gate}, {B},{T},{H},{K},{V}) | fwd ms |")
    print("|---|---|")
    for r in sorted(rows, key=lambda r: r["ms"] if r["ms"] == r["ms"] else 1e9):
        print(f"| {r['config']} | {r['ms']:.3f} |")


if __name__ == "__main__":
    main()
