"""Where the forward scan's time goes (issue 3): time variants of the kernel that leave one stage out.

    python benchmarks/gpu_ablate.py [--shape 8,2048,16,128,128] [--gate vector] [--only a|b] [--out x.json]

Each variant patches the template sources (plain text replacements, so the variants are easy to
read) or the tile, renders, checks it compiles and times ``chunk_fwd_triton`` (median of do_bench).
Variants that drop work give wrong outputs on purpose: only their time is meaningful, the
difference to "base" being the cost of what they drop.
"""

import argparse
import dataclasses
import json

import torch

from gla_inductor import triton_chunk
from gpu_schedule import sweep_inputs  # benchmarks/ is the script's directory
from gla_inductor.gates import GateFn

# (template, old, new): the replacements of each variant
PATCHES = {
    "base": [],
    # the per-chunk branch of _gla_cumsum: always take G_L - G (no max-reduction, no second scan)
    "no_gentle_check": [("gla_common", "if tl.max(tl.abs(b_G)) <= 16.0:", "if True:")],
    # the anchored split is always taken: the exact pairwise path is not compiled in
    "no_safe_check": [("gla_common", "return b_gd, tl.max(tl.abs(b_gd)) <= 64.0", "return b_gd, True")],
    "no_checks": [("gla_common", "if tl.max(tl.abs(b_G)) <= 16.0:", "if True:"),
                  ("gla_common", "return b_gd, tl.max(tl.abs(b_gd)) <= 64.0", "return b_gd, True")],
    # the intra-chunk output A v left out (A still computed, then unused: the compiler drops it)
    "no_intra": [("gla_chunk_scan", "b_o = _gla_dot(b_x, b_sd, F32_PRECISION) + _gla_dot(b_A, b_w, F32_PRECISION)",
                  "b_o = _gla_dot(b_x, b_sd, F32_PRECISION)")],
    # the inter-chunk output q S left out
    "no_inter": [("gla_chunk_scan", "b_o = _gla_dot(b_x, b_sd, F32_PRECISION) + _gla_dot(b_A, b_w, F32_PRECISION)",
                  "b_o = _gla_dot(b_A, b_w, F32_PRECISION)")],
    # the state update left out (the state stays the initial one)
    "no_update": [("gla_chunk_scan", "b_s += _gla_dot(tl.trans(b_y), b_w, F32_PRECISION)", "pass")],
    # the output store left out (o computed, stored only for the first row, so it is not dropped)
    "no_store": [("gla_chunk_scan", "m_o = m_t[:, None] & m_v[None, :]",
                  "m_o = (m_t[:, None] & m_v[None, :]) & (o_t[:, None] < 1)")],
}


def _tile(base, **kw):
    return dataclasses.replace(base, scan=dataclasses.replace(base.scan, **kw))


def _local(base, bv, warps, stages=2, local_warps=4):
    carry = triton_chunk.TileConfig(block_v=bv, num_warps=warps, num_stages=stages)
    local = triton_chunk.TileConfig(block_v=0, num_warps=local_warps, num_stages=2)
    return dataclasses.replace(base, local=True, carry=carry, local_tile=local)


# configs on top of the base variant's template sources: name -> base config -> config
CONFIGS = {
    "w16": lambda b: _tile(b, num_warps=16),
    "s1": lambda b: _tile(b, num_stages=1),
    "s3": lambda b: _tile(b, num_stages=3),
    "bt32": lambda b: dataclasses.replace(b, block_t=32),
    "bv64_w8": lambda b: _tile(b, block_v=64, num_warps=8),
    "local_bv64_w4": lambda b: _local(b, 64, 4),
    "local_bv64_w4_s3": lambda b: _local(b, 64, 4, 3),
    "local_bv64_w8": lambda b: _local(b, 64, 8),
    "local_bv128_w8": lambda b: _local(b, 128, 8),
    "local_bv128_w4": lambda b: _local(b, 128, 4),
    "local_bv32_w4": lambda b: _local(b, 32, 4),
    "local_bv64_w4_lw8": lambda b: _local(b, 64, 4, local_warps=8),
    "local_bv128_w8_lw8": lambda b: _local(b, 128, 8, local_warps=8),
    "fused": lambda b: dataclasses.replace(b, local=False),
    "carry_w8": lambda b: dataclasses.replace(b, carry=triton_chunk.TileConfig(64, 8, 2)),
    "carry_bv32": lambda b: dataclasses.replace(b, carry=triton_chunk.TileConfig(32, 4, 2)),
    "bt64_carry_w8": lambda b: dataclasses.replace(b, block_t=64, carry=triton_chunk.TileConfig(64, 8, 2)),
    "bt64_carry_bv32": lambda b: dataclasses.replace(b, block_t=64, carry=triton_chunk.TileConfig(32, 4, 2)),
    "local_bv32_w4_lw8": lambda b: _local(b, 32, 4, local_warps=8),
    "local_bv64_w8_lw8": lambda b: _local(b, 64, 8, local_warps=8),
    "local_kernel_only": lambda b: _local(b, 64, 4),  # gla_chunk_local alone
    "local_kernel_only_lw8": lambda b: _local(b, 64, 4, local_warps=8),
}


def patched_loader(patches, original):
    def load(name):
        src = original(name)
        for template, old, new in patches:
            if template == name:
                assert old in src, (name, old)
                src = src.replace(old, new)
        return src

    return load


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--only")
    p.add_argument("--out")
    p.add_argument("--once", action="store_true", help="one call of the named variant (for ncu)")
    p.add_argument("--graph", action="store_true", help="time CUDA graph replays (no launch overhead)")
    p.add_argument("--bwd", action="store_true", help="time forward + backward (output: dq)")
    args = p.parse_args()
    from triton.testing import do_bench, do_bench_cudagraph

    from gla_inductor.templates import standalone

    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, args.gate)
    base = triton_chunk.default_config(B, T, H, K, V, torch.bfloat16, args.gate == "vector", q.device)
    original = standalone.load_template

    names = list(PATCHES) + list(CONFIGS)
    if args.only:
        names = [n for n in names if n in args.only.split("|")]
    rows = []
    ref = None
    for name in names:
        cfg = CONFIGS[name](base) if name in CONFIGS else base
        standalone.load_template = patched_loader(PATCHES.get(name, []), original)
        standalone._render_cached.cache_clear()
        try:
            def fwd():
                if name.startswith("local_kernel_only"):
                    run = triton_chunk._Launcher(cfg, q, v, g, None, K ** -0.5, False, GateFn(), None, None)
                    return run.local(q, k, transpose=False)[0]
                o = triton_chunk.chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False, config=cfg)[0]
                if args.bwd:
                    return triton_chunk.chunk_bwd_triton(q, k, v, g, None, None, o, None, K ** -0.5, False,
                                                         config=cfg)[0]
                return o

            out = fwd()
            if args.once:
                torch.cuda.synchronize()
                continue
            if args.graph:
                ms = do_bench_cudagraph(fwd, rep=50, return_mode="median")
            else:
                ms = do_bench(fwd, warmup=10, rep=50, return_mode="median")
            ref = ref if name != "base" else out.float()
            comparable = ref is not None and out.shape == ref.shape
            err = ((out.float() - ref).norm() / ref.norm()).item() if comparable else float("nan")
            rows.append(dict(variant=name, ms=ms, rel_err_vs_base=err))
        except Exception as e:  # noqa: BLE001 - a variant that does not compile
            rows.append(dict(variant=name, ms=float("nan"), error=repr(e)[:300]))
        print(json.dumps(rows[-1]) if rows else name, flush=True)
    standalone.load_template = original
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=[B, T, H, K, V], gate=args.gate)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if rows:
        print(f"| variant ({args.gate}, {args.shape}) | fwd ms | rel. diff to base |\n|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['ms']:.3f} | {r.get('rel_err_vs_base', float('nan')):.1e} |")


if __name__ == "__main__":
    main()
