"""Host time of an eager backward (chunk_bwd) at small shapes, where the host sets the pace: the
median of 200 calls timed with CUDA events (a synchronize after each call). Run once per version
(PYTHONPATH picks its gla_inductor)."""
import statistics
import sys

import torch
import torch.nn.functional as F

import gla_inductor  # noqa: F401  (registers the ops)

label = sys.argv[1]
for (B, T, H, K, V), gate in [((1, 64, 2, 64, 64), "vector"), ((1, 64, 2, 64, 64), "scalar"),
                              ((8, 1024, 8, 64, 64), "vector"), ((2, 256, 4, 128, 128), "scalar")]:
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = F.logsigmoid(torch.randn((B, T, H, K) if gate == "vector" else (B, T, H), device="cuda")) / 16

    def bwd():
        return torch.ops.gla_inductor.chunk_bwd(q, k, v, g, None, None, do, None, K ** -0.5, False)

    for _ in range(20):
        bwd()
    times = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        bwd()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    print(f"{label} {B},{T},{H},{K},{V}:{gate} bwd events ms {statistics.median(times):.4f}", flush=True)
