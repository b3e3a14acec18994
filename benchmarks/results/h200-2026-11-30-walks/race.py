"""Repeated forwards agree bit for bit (clean and poisoned inputs, scalar and constant gates, segments
with their sums summed last chunk first, whole chunks without step masks, packed sequences), and
poisoned ones are NaN exactly where the float64 loop is not finite. Run from the repository root on
a GPU (copied from h200-2026-11-29-terms-check/race.py, with T = 1000 and 8200 added: the masked
path next to the whole-chunk one)."""
import torch
DEVICE = "cuda"
from benchmarks import inputs
from gla_inductor.contract import GLACall
from gla_inductor.kernels import chunk as kchunk
from gla_inductor.reference import naive_recurrent_gla

CASES = [((8, 2048, 16, 128, 128), "scalar", False, None), ((8, 2048, 16, 128, 128), "scalar", True, None),
         ((1, 8192, 16, 128, 128), "scalar", True, None), ((2, 4096, 16, 128, 128), "constant", True, None),
         ((8, 1024, 8, 64, 64), "scalar", True, None), ((1, 8192, 96, 64, 64), "scalar", True, None),
         ((8, 1000, 8, 64, 64), "scalar", True, None), ((1, 8200, 16, 128, 128), "scalar", True, None),
         ((1, 25700, 16, 128, 128), "scalar", True, [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773])]
print("| shape | gate | poisoned | packed | runs differing | reverse runs differing | NaN where the loop is not finite |")
print("|---|---|---|---|---|---|---|")
for shape, gate, poison, lengths in CASES:
    B, T, H, K, V = shape
    q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate="scalar", gate_dtype=torch.bfloat16, device=DEVICE)
    g_gamma = None
    if gate == "constant":
        g, g_gamma = None, -torch.rand(H, device=DEVICE) * 0.1
    if poison:
        v[0, T * 2 // 5, 1, 7] = float("nan"); v[B - 1, T * 3 // 4, 0, V - 3] = float("inf")
        v[B - 1, T * 3 // 4 + 5, 0, V - 3] = float("nan"); v[0, 3, H - 1, 0] = float("-inf")
    cu = None if lengths is None else torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    cells = []
    for reverse in (False, True):
        call = GLACall(q, k, v, g, g_gamma, None, K**-0.5, True, reverse, cu_seqlens=cu)
        runs = [kchunk.forward(call) for _ in range(6)]
        bad = sum(not (torch.equal(o.nan_to_num(), runs[0][0].nan_to_num())
                       and torch.equal(h.nan_to_num(), runs[0][1].nan_to_num())) for o, h in runs[1:])
        cells.append(f"{bad}/5")
    where = "-"
    if poison and lengths is None and B * T * H <= 2 ** 21:
        # the loop in float64 on a slice of heads with the poison (heads 0, 1, H - 1), forward
        hs = sorted({0, 1, H - 1})
        o, _ = kchunk.forward(GLACall(q, k, v, g, g_gamma, None, K**-0.5, True, False))
        sl = lambda x: None if x is None else x[:, :, hs].double()
        o_ref, _ = naive_recurrent_gla(sl(q), sl(k), sl(v), sl(g), g_gamma=None if g_gamma is None else g_gamma[hs].double(),
                                       scale=K**-0.5, output_final_state=True)
        where = str(torch.equal(torch.isfinite(o[:, :, hs]), torch.isfinite(o_ref)))
    print(f"| {shape} | {gate} | {poison} | {lengths is not None} | {cells[0]} | {cells[1]} | {where} |", flush=True)
