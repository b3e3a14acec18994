"""Pool decode (bf16 pool, K-first and V-first, B = 64, P = 1024, H = 32, K = V = 128) and a copy of
the same state bytes, a few calls each, for Nsight Compute (kept as run):
ncu -k regex:'recurrent|direct_copy' python benchmarks/results/h200-2026-11-29-kernel-split/pool_ncu.py"""
import torch
import torch.nn.functional as F
import gla_inductor

P, H, K, V, B = 1024, 32, 128, 128, 64
torch.manual_seed(0)
q, k, v = (torch.randn(B, 1, H, n, device="cuda", dtype=torch.bfloat16) for n in (K, K, V))
# made in bf16 and int32 directly: no copy kernels before the ones profiled
g = F.logsigmoid(torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16)) / 16
idx = torch.randperm(P, device="cuda", dtype=torch.int32)[:B]
for v_first in (False, True):
    pool = torch.randn(P, H, K, V, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        gla_inductor.fused_recurrent_gla(q, k, v, g, initial_state=pool, ssm_state_indices=idx,
                                         inplace_final_state=True, state_v_first=v_first)
x = torch.empty(B * H * K * V * 2, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
