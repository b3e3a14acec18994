import triton, triton.language as tl, sys, subprocess, os
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

@triton.jit
def k_cumsum(g, out, s_t, BT: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    if V == 0:
        b_g = tl.load(g + o_r[:, None] * s_t + o_k[None, :]).to(tl.float32) * 1.4426950408889634
        b_G = tl.cumsum(b_g, axis=0)
        tl.store(out + o_r[:, None] * s_t + o_k[None, :], b_G)
    elif V == 2:
        rep = o_r // 16
        w = (o_r // 2) % 8
        lane = o_r % 2
        t = w * 8 + lane * 4 + rep
        b_g = tl.load(g + t[:, None] * s_t + o_k[None, :]).to(tl.float32) * 1.4426950408889634
        b4 = tl.reshape(b_g, (4, 8, 2, BK))
        c = tl.cumsum(b4, axis=0)
        s = tl.sum(b4, axis=0)
        s_w = tl.sum(s, axis=1)
        off_w = tl.cumsum(s_w, axis=0) - s_w
        off_l = tl.cumsum(s, axis=1) - s
        b_G = tl.reshape(c + (off_l + off_w[:, None, :])[None, :, :, :], (BT, BK))
        tl.store(out + t[:, None] * s_t + o_k[None, :], b_G)
    else:
        # row r = rep * 16 + w * 2 + lane holds step t = w * 8 + rep * 2 + lane
        rep = o_r // 16
        w = (o_r // 2) % 8
        lane = o_r % 2
        t = w * 8 + rep * 2 + lane
        b_g = tl.load(g + t[:, None] * s_t + o_k[None, :]).to(tl.float32) * 1.4426950408889634
        b4 = tl.reshape(b_g, (4, 8, 2, BK))
        c1 = tl.cumsum(b4, axis=2)
        s1 = tl.sum(b4, axis=2)
        c0 = tl.cumsum(s1, axis=0) - s1
        within = c1 + c0[:, :, None, :]
        tot = tl.sum(s1, axis=0)
        off = tl.cumsum(tot, axis=0) - tot
        b_G = tl.reshape(within + off[None, :, None, :], (BT, BK))
        tl.store(out + t[:, None] * s_t + o_k[None, :], b_G)

for V in range(3):
    src = ASTSource(k_cumsum, {"g": "*bf16", "out": "*fp32", "s_t": "i32", "BT": "constexpr", "BK": "constexpr", "V": "constexpr"},
                    constexprs={(3,): 64, (4,): 128, (5,): V}, attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=2))
    open(f"/tmp/mk/p{V}.ptx", "w").write(c.asm["ptx"])
    open(f"/tmp/mk/p{V}.ttgir", "w").write(c.asm["ttgir"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"/tmp/mk/p{V}.ptx", "-o", f"/tmp/mk/p{V}.cubin"], capture_output=True, text=True)
    regs = [l for l in r.stderr.splitlines() if "Used" in l]
    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    s = subprocess.run([cuobj, "-sass", f"/tmp/mk/p{V}.cubin"], capture_output=True, text=True).stdout
    n = sum(1 for l in s.splitlines() if l.strip().startswith("/*") and ";" in l)
    from collections import Counter
    ops = Counter(l.split("*/")[1].strip().split()[0].split(".")[0] for l in s.splitlines() if l.strip().startswith("/*") and ";" in l and "*/" in l)
    print(V, regs, "sass", n, ops.most_common(10), "shared", c.metadata.shared)
