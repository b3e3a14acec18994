"""GPU time of each kernel of one eager packed call (bf16, H = 16, K = V = 128), by launch order, at
forced carry segments P (1: one walk per sequence; P > 1: the stream in P segments, N + P pieces):
PYTHONPATH=/tmp/site:$PWD python kernel_times.py (kept as run)."""
import dataclasses

import torch

import gla_inductor
from benchmarks import inputs
from benchmarks.varlen import CASES, offsets
from gla_inductor.kernels import configs

orig = configs.default_config
P = {"P": 1}
configs.default_config = lambda *a: dataclasses.replace(orig(*a), segments=P["P"], sum_splits=1)
for case, gate, ps in (("mixed12", "scalar", (1, 8, 16)), ("mixed12", "vector", (1, 8, 16)), ("8x2048", "scalar", (1, 8, 16))):
    lengths = CASES[case]
    T = sum(lengths)
    cu = offsets(lengths, "cuda")
    q, k, v, g = inputs.gla_inputs(1, T, 16, 128, 128, gate=gate, device="cuda", dtype=torch.bfloat16)
    for p in ps:
        P["P"] = p
        f = lambda: gla_inductor.chunk_gla(q, k, v, g, cu_seqlens=cu)[0]
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                f()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        per = len(evs) // 10
        rows = {}
        for i, e in enumerate(evs):
            rows.setdefault((i % per, e.name[:30]), []).append(e.device_time_total)
        print(case, gate, f"P={p}", "kernels per call", per, flush=True)
        for (i, name), ts in sorted(rows.items()):
            ts = sorted(ts)
            print(f"   {i} {name:30s} median {ts[len(ts) // 2]:.1f} us  min {ts[0]:.1f}", flush=True)
