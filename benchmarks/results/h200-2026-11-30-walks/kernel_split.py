"""GPU time of each kernel launch of one eager forward (or forward + backward) of gla_inductor.chunk_gla:
by default at the shapes where the scalar forward trails 1.5x FLA, and the vector forward at (8, 1024,
8, 64, 64); or at "gate:B,T,H,K,V" arguments (gate "scalar+bwd" adds the backward). Median of 20 calls
(torch profiler). Run on the GPU machine: PYTHONPATH=/tmp/site:$PWD python <this file> [args]"""
import sys
import torch
import gla_inductor
from benchmarks import inputs


def split(label, fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = len(evs) // reps
    rows = {}
    for i, e in enumerate(evs):
        rows.setdefault((i % per, e.name[:40]), []).append(e.device_time_total)
    parts = []
    total = 0.0
    for (i, name), ts in sorted(rows.items()):
        ts = sorted(ts)
        total += ts[len(ts) // 2]
        parts.append(f"{name} {ts[len(ts) // 2]:.1f}")
    print(f"| {label} | {'; '.join(parts)} | {total:.1f} |")
    sys.stdout.flush()


def call(shape, gate, train=False):
    q, k, v, g = inputs.gla_inputs(*shape, gate=gate, device="cuda", dtype=torch.bfloat16, requires_grad=train)
    if not train:
        def f():
            with torch.no_grad():
                gla_inductor.chunk_gla(q, k, v, g)
        return f
    do = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda", dtype=torch.bfloat16)

    def f():
        o = gla_inductor.chunk_gla(q, k, v, g)[0]
        torch.autograd.grad(o, (q, k, v, g), do)
    return f


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| call | kernels (us) | total us |\n|---|---|---|")
    if len(sys.argv) > 1:  # gate:B,T,H,K,V ...
        for arg in sys.argv[1:]:  # gate "scalar+bwd": forward and backward
            gate, shape = arg.split(":")
            shape = tuple(map(int, shape.split(",")))
            split(f"{gate} {shape}", call(shape, gate.split("+")[0], gate.endswith("+bwd")))
        sys.exit(0)
    for shape in ((4, 2048, 16, 128, 128), (2, 4096, 16, 128, 128), (1, 8192, 16, 128, 128),
                  (8, 1024, 8, 64, 64), (1, 8192, 96, 64, 64), (8, 2048, 16, 128, 128)):
        split(f"scalar {shape}", call(shape, "scalar"))
    split("vector (8, 1024, 8, 64, 64)", call((8, 1024, 8, 64, 64), "vector"))
