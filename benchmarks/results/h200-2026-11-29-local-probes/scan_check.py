import torch, triton, triton.language as tl

@triton.jit
def k_cumsum(g, out, s_t, BT: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    rep = o_r // 16
    w = (o_r // 2) % 8
    lane = o_r % 2
    t = (w * 2 + lane) * 4 + rep
    if V == 0:
        t = o_r
    b_g = tl.load(g + t[:, None] * s_t + o_k[None, :]).to(tl.float32)
    if V == 0:
        b_G = tl.cumsum(b_g, axis=0)
    else:
        b4 = tl.reshape(b_g, (4, 8, 2, BK))
        c = tl.cumsum(b4, axis=0)
        s = tl.sum(b4, axis=0)
        s_w = tl.sum(s, axis=1)
        off = (tl.cumsum(s, axis=1) - s) + (tl.cumsum(s_w, axis=0) - s_w)[:, None, :]
        b_G = tl.reshape(c + off[None, :, :, :], (BT, BK))
    tl.store(out + t[:, None] * s_t + o_k[None, :], b_G)

g = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
ref = g.float().cumsum(0)
for V in (0, 1):
    out = torch.full((64, 128), float("nan"), device="cuda")
    k_cumsum[(1,)](g, out, 128, BT=64, BK=128, V=V, num_warps=8)
    torch.cuda.synchronize()
    print(V, "max abs err", (out - ref).abs().max().item(), "nan", out.isnan().sum().item())
    if V == 1:
        bad = ((out - ref).abs() > 1e-3).nonzero()[:8]
        print("first bad (row, col):", bad.tolist())
