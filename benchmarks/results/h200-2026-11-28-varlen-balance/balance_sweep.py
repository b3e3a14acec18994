"""A/B of packed sequences' carry segments: equal cuts (the old default, none here) against segments
balanced across sequences with several slot counts. Graph-timed, one process."""
import dataclasses, sys, json
import torch
import gla_inductor
from gla_inductor.kernels import chunk as kchunk, configs
from benchmarks import harness, inputs
from benchmarks.varlen import CASES, offsets, make_call

H, K, V = 16, 128, 128
sms = torch.cuda.get_device_properties(0).multi_processor_count
VARIANT = {"v": None}
orig = configs.default_config

def patched(B, T, H_, K_, V_, dtype, vector_gate, device, varlen=False):
    cfg = orig(B, T, H_, K_, V_, dtype, vector_gate, device, varlen)
    v = VARIANT["v"]
    if not varlen or v is None:
        return cfg
    pmax, slots = v
    if slots == 0:
        return dataclasses.replace(cfg, segments=1, balance=0)
    seg, bal = configs.balanced_segments(B, T, H_, max(16, 1 << (K_ - 1).bit_length()), V_, cfg.carry.block_v, slots, pmax)
    return dataclasses.replace(cfg, segments=seg, balance=bal)

configs.default_config = patched
variants = {"equal(none)": (8, 0), "P2 1xSM": (2, sms), "P2 2xSM": (2, 2 * sms), "P2 4xSM": (2, 4 * sms),
            "P4 2xSM": (4, 2 * sms), "P4 4xSM": (4, 4 * sms), "P8 2xSM": (8, 2 * sms)}
rows = []
for case in sys.argv[1].split(","):
    lengths = CASES[case]
    T = sum(lengths)
    cu = offsets(lengths, "cuda")
    for what, gate, training in (("fwd", "vector", False), ("fwd+bwd", "vector", True), ("scalar fwd", "scalar", False)):
        args = inputs.gla_inputs(1, T, H, K, V, gate=gate, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fns, outs = {}, {}
        for name, v in variants.items():
            VARIANT["v"] = v
            call = make_call(gla_inductor.chunk_gla, args, training, {"cu_seqlens": cu})
            def fn(call=call, v=v):
                VARIANT["v"] = v
                call()
            fns[name] = fn
            with torch.no_grad():
                outs[name] = gla_inductor.chunk_gla(*args, cu_seqlens=cu, output_final_state=True)
        ref = outs["equal(none)"]
        t = harness.measure(fns, clock="graph", rounds=5)
        base = t["equal(none)"].median
        for name in variants:
            err = max(harness.rel_err(outs[name][i].float(), ref[i].float()) for i in range(2))
            row = dict(case=case, what=what, variant=name, graph_ms=round(t[name].median, 4),
                       speedup=round(base / t[name].median, 3), rel_err=err)
            rows.append(row); print(row, flush=True)
        harness.free_memory()
print("\n| case | what | " + " | ".join(variants) + " |")
for case in dict.fromkeys(r["case"] for r in rows):
    for what in dict.fromkeys(r["what"] for r in rows):
        rs = [r for r in rows if r["case"] == case and r["what"] == what]
        print(f"| {case} | {what} | " + " | ".join(f"{r['graph_ms']:.3f}" for r in rs) + " |")
