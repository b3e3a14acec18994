"""Packed scalar-gate forward (the terms carry) at other carry tiles and equal segments, graph-timed
in one process: does a narrower value tile (twice the programs, a shorter step per chunk) or a cut
walk shorten the mixed-length case, whose longest sequence is one program's walk?"""
import dataclasses, sys
import torch
import gla_inductor
from gla_inductor.kernels import configs
from benchmarks import harness, inputs
from benchmarks.varlen import CASES, offsets, make_call

H, K, V = 16, 128, 128
VARIANT = {"v": None}
orig = configs.default_config


def patched(B, T, H_, K_, V_, dtype, vector_gate, device, varlen=False):
    cfg = orig(B, T, H_, K_, V_, dtype, vector_gate, device, varlen)
    v = VARIANT["v"]
    if v is None:
        return cfg
    bv, warps, segments = v
    return dataclasses.replace(cfg, segments=segments,
                               carry=dataclasses.replace(cfg.carry, block_v=bv, num_warps=warps))


configs.default_config = patched
variants = {"default": None, "bv32 w4": (32, 4, 1), "bv32 w2": (32, 2, 1), "bv64 P2": (64, 4, 2),
            "bv64 P4": (64, 4, 4), "bv32 P2": (32, 4, 2)}
print("| case | " + " | ".join(variants) + " | max rel err vs default |")
print("|---|" + "---|" * (len(variants) + 1))
for case in sys.argv[1].split(","):
    lengths = CASES[case]
    T = sum(lengths)
    cu = offsets(lengths, "cuda")
    args = inputs.gla_inputs(1, T, H, K, V, gate="scalar", device="cuda", dtype=torch.bfloat16)
    fns, outs = {}, {}
    for name, v in variants.items():
        VARIANT["v"] = v
        call = make_call(gla_inductor.chunk_gla, args, False, {"cu_seqlens": cu})

        def fn(call=call, v=v):
            VARIANT["v"] = v
            call()
        fns[name] = fn
        with torch.no_grad():
            outs[name] = gla_inductor.chunk_gla(*args, cu_seqlens=cu, output_final_state=True)
    t = harness.measure(fns, clock="graph", rounds=5)
    err = max(harness.rel_err(outs[n][i].float(), outs["default"][i].float()) for n in variants for i in range(2))
    print(f"| {case} | " + " | ".join(f"{t[n].median:.3f}" for n in variants) + f" | {err:.1e} |", flush=True)
