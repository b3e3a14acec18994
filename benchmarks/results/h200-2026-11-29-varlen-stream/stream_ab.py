"""A/B of packed sequences' carries: one walk per sequence (P = 1, main before the stream) against
the stream of all sequences' state slots cut in P segments (gla_chunk_carry's STREAM), and the
default config. CUDA-graph GPU time, one process; errors against P = 1."""
import dataclasses
import sys

import torch

import gla_inductor
from benchmarks import harness, inputs
from benchmarks.varlen import CASES, make_call, offsets
from gla_inductor.kernels import configs

H, K, V = 16, 128, 128
VARIANT = {"P": None}
orig = configs.default_config


def patched(B, T, H_, K_, V_, dtype, vector_gate, device, varlen=False):
    cfg = orig(B, T, H_, K_, V_, dtype, vector_gate, device, varlen)
    if not varlen or VARIANT["P"] is None:
        return cfg
    return dataclasses.replace(cfg, segments=VARIANT["P"], sum_splits=1)


configs.default_config = patched
variants = {"P1 (main)": 1, "default": None}
variants.update({f"P{p}": p for p in map(int, sys.argv[2].split(","))})
rows = []
for case in sys.argv[1].split(","):
    lengths = CASES[case]
    T = sum(lengths)
    cu = offsets(lengths, "cuda")
    for what, gate, training in (("fwd", "vector", False), ("fwd+bwd", "vector", True), ("scalar fwd", "scalar", False)):
        args = inputs.gla_inputs(1, T, H, K, V, gate=gate, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fns, outs = {}, {}
        for name, p in variants.items():
            VARIANT["P"] = p
            call = make_call(gla_inductor.chunk_gla, args, training, {"cu_seqlens": cu})

            def fn(call=call, p=p):
                VARIANT["P"] = p
                call()
            fns[name] = fn
            with torch.no_grad():
                outs[name] = gla_inductor.chunk_gla(*args, cu_seqlens=cu, output_final_state=True)
            VARIANT["P"] = p
            print(case, what, name, orig(len(lengths), T, H, K, V, torch.bfloat16, gate == "vector",
                                         torch.device("cuda"), True).segments if p is None else p, flush=True)
        ref = outs["P1 (main)"]
        t = harness.measure(fns, clock="graph", rounds=5)
        base = t["P1 (main)"].median
        for name in variants:
            err = max(harness.rel_err(outs[name][i].float(), ref[i].float()) for i in range(2))
            row = dict(case=case, what=what, variant=name, graph_ms=round(t[name].median, 4),
                       speedup=round(base / t[name].median, 3), rel_err=err)
            rows.append(row)
            print(row, flush=True)
        harness.free_memory()
print("\n| case | what | " + " | ".join(variants) + " |")
print("|---|---|" + "---|" * len(variants))
for case in dict.fromkeys(r["case"] for r in rows):
    for what in dict.fromkeys(r["what"] for r in rows):
        rs = [r for r in rows if r["case"] == case and r["what"] == what]
        print(f"| {case} | {what} | " + " | ".join(f"{r['graph_ms']:.3f}" for r in rs) + " |")
