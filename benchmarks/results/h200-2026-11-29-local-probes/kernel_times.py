"""GPU time of each kernel of one eager scalar-gate forward (gla_inductor.chunk_gla), by launch order:
the segmented forward's sums launch (0) and walk (1). Run on the GPU machine with a variant's package
first on the path: PYTHONPATH=/tmp/site:$PWD/<variant>:$PWD python kernel_times.py (kept as run)."""
import torch, gla_inductor, sys
from benchmarks import inputs
shapes = [(4,2048,16,128,128),(2,4096,16,128,128),(1,8192,16,128,128),(8,1024,8,64,64),(1,8192,96,64,64),(8,2048,16,128,128)]
print(gla_inductor.__file__)
for shape in shapes:
    q,k,v,g = inputs.sweep_inputs(shape, "scalar")
    f = lambda: gla_inductor.chunk_gla(q,k,v,g)[0]
    for _ in range(5): f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10): f()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = len(evs) // 10
    rows = {}
    for i, e in enumerate(evs):
        key = (i % per, e.name[:40])
        rows.setdefault(key, []).append(e.device_time_total if hasattr(e,'device_time_total') else e.cuda_time_total)
    print(shape, "kernels per call", per)
    for (i, name), ts in sorted(rows.items()):
        ts = sorted(ts)
        print(f"   {i} {name:40s} median {ts[len(ts)//2]:.1f} us  min {ts[0]:.1f}")
