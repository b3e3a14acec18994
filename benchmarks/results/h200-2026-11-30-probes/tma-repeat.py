"""Repeat the scalar forward with fixed inputs, eagerly and as CUDA-graph replays: how many outputs
hold NaN, how many differ bit-wise from the first call's (a deterministic kernel: none). The
package comes from PYTHONPATH (a variant folder first); argv[1] names it in the output."""
import sys

import torch
import torch.nn.functional as F

import gla_inductor

N = 200
for B, T, H, K, V in [(8, 2048, 16, 128, 128), (2, 4096, 16, 128, 128)]:
    torch.manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")) / 16

    def f():
        return gla_inductor.chunk_gla(q, k, v, g, scale=K ** -0.5)[0]

    with torch.no_grad():
        ref = f().clone()
        e_nan = e_diff = 0
        for _ in range(N):
            o = f()
            e_nan += bool(o.isnan().any())
            e_diff += not torch.equal(o, ref)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f()
        g_nan = g_diff = 0
        for _ in range(N):
            graph.replay()
            g_nan += bool(out.isnan().any())
            g_diff += not torch.equal(out, ref)
    print(f"{sys.argv[1]:6s} {(B, T, H, K, V)}: first call NaN {bool(ref.isnan().any())}; of {N} eager calls "
          f"{e_nan} with NaN, {e_diff} different; of {N} replays {g_nan} with NaN, {g_diff} different", flush=True)
