"""GPU time of each kernel launch of one eager call of gla_inductor.chunk_gla (forward, or forward +
backward), fixed-length and packed, median of 10 calls (torch profiler). Run on the GPU machine:
PYTHONPATH=/tmp/site:$PWD python benchmarks/results/h200-2026-11-29-kernel-split/kernel_split.py"""
import sys
import torch
import gla_inductor
from benchmarks import inputs

MIXED12 = [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773]


def offsets(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.cuda()


def split(label, fn, reps=10):
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
        rows.setdefault((i % per, e.name[:48]), []).append(e.device_time_total)
    total = 0.0
    print(f"{label}: {per} kernels per call")
    for (i, name), ts in sorted(rows.items()):
        ts = sorted(ts)
        total += ts[len(ts) // 2]
        print(f"   {i:2d} {name:48s} {ts[len(ts) // 2]:8.1f} us")
    print(f"   total {total:.1f} us")
    sys.stdout.flush()


def call(shape, gate, lengths=None, train=False):
    B, T, H, K, V = shape
    q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate=gate, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=train)
    kw = {} if lengths is None else {"cu_seqlens": offsets(lengths)}
    if not train:
        def f():
            with torch.no_grad():
                gla_inductor.chunk_gla(q, k, v, g, **kw)
        return f
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def f():
        o = gla_inductor.chunk_gla(q, k, v, g, **kw)[0]
        torch.autograd.grad(o, (q, k, v, g), do)
    return f


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    split("vector fwd (8,1024,8,64,64)", call((8, 1024, 8, 64, 64), "vector"))
    split("vector fwd (8,2048,16,128,128)", call((8, 2048, 16, 128, 128), "vector"))
    split("vector fwd packed 8x2048", call((1, 16384, 16, 128, 128), "vector", [2048] * 8))
    split("vector fwd packed mixed12", call((1, sum(MIXED12), 16, 128, 128), "vector", MIXED12))
    split("vector fwd fixed 1x25.7k", call((1, sum(MIXED12), 16, 128, 128), "vector"))
    split("vector fwd+bwd packed 8x2048", call((1, 16384, 16, 128, 128), "vector", [2048] * 8, True))
    split("vector fwd+bwd packed mixed12", call((1, sum(MIXED12), 16, 128, 128), "vector", MIXED12, True))
    split("scalar fwd packed mixed12", call((1, sum(MIXED12), 16, 128, 128), "scalar", MIXED12))
    split("scalar fwd fixed 1x25.7k", call((1, sum(MIXED12), 16, 128, 128), "scalar"))
