"""Per-kernel GPU time of packed calls (ours: schedules; FLA), mixed12 against 8x2048."""
import dataclasses, collections, sys
import torch
from torch.profiler import profile, ProfilerActivity
import gla_inductor
from gla_inductor.kernels import configs
from benchmarks import inputs, fla_warm
from benchmarks.varlen import CASES, offsets, make_call

H, K, V = 16, 128, 128
VARIANT = {"v": None}
orig = configs.default_config
def patched(B, T, H_, K_, V_, dtype, vector_gate, device, varlen=False):
    cfg = orig(B, T, H_, K_, V_, dtype, vector_gate, device, varlen)
    return cfg if VARIANT["v"] is None else dataclasses.replace(cfg, **VARIANT["v"])
configs.default_config = patched

def prof(fn, n=5):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:60]] += e.device_time / n / 1000
    return agg

fla = None
if "fla" in sys.argv:
    fla_warm.load_autotune("benchmarks/fla_autotune")
    import fla.ops.simple_gla as fsg, fla.ops.gla as fg
    fla = (fg.chunk_gla, fsg.chunk_simple_gla)
for case in ("mixed12", "8x2048"):
    lengths = CASES[case]; T = sum(lengths)
    cu, cu64 = offsets(lengths, "cuda"), offsets(lengths, "cuda", torch.int64)
    runs = [("scalar fwd", "scalar", False, None), ("scalar fwd local", "scalar", False, dict(local=True, terms=False)),
            ("scalar fwd fused", "scalar", False, dict(terms=False)),
            ("vector fwd", "vector", False, None), ("vector fwd+bwd", "vector", True, None)]
    for what, gate, training, v in runs:
        args = inputs.gla_inputs(1, T, H, K, V, gate=gate, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        VARIANT["v"] = v
        agg = prof(make_call(gla_inductor.chunk_gla, args, training, {"cu_seqlens": cu}))
        print(f"== {case} {what} ours: total {sum(agg.values()):.3f} ms")
        for name, t in sorted(agg.items(), key=lambda x: -x[1])[:8]:
            print(f"   {t:.3f}  {name}")
        if fla is not None and v is None:
            op = fla[0] if gate == "vector" else fla[1]
            try:
                agg = prof(make_call(op, args, training, {"cu_seqlens": cu64}))
                print(f"== {case} {what} FLA: total {sum(agg.values()):.3f} ms")
                for name, t in sorted(agg.items(), key=lambda x: -x[1])[:8]:
                    print(f"   {t:.3f}  {name}")
            except Exception as e:
                print("FLA failed", repr(e)[:200])
        VARIANT["v"] = None
