"""Which part of the carry's new CHECK races at 8 warps: variants patched in, forward run 6 times."""
import sys, torch
from benchmarks import harness, inputs, internals
from gla_inductor.contract import GLACall
from gla_inductor.kernels import chunk as kchunk

C = "gla_chunk_carry"
FIX = "    m_fix = not _gla_all_finite(b_s)\n"
VARIANTS = {
    "cur": [],
    "barrier": [(C, FIX, "    tl.debug_barrier()\n" + FIX)],
    "barrier2": [(C, FIX, "    tl.debug_barrier()\n" + FIX + "    tl.debug_barrier()\n")],
    "no_reduce": [(C, FIX, "    m_fix = False\n")],
    "no_wa": [(C, '{%- set WA = "_gla_finite_or_zero(b_wt)" if CHECK else "b_wt" %}', '{%- set WA = "b_wt" %}')],
}
CASES = [((8, 2048, 4, 256, 512), "vector", False), ((8, 256, 16, 256, 256), "scalar", True),
         ((8, 256, 16, 128, 128), "vector", True), ((8, 256, 16, 256, 256), "vector", True)]
TIMED = [((8, 2048, 16, 128, 128), "scalar"), ((1, 8192, 16, 128, 128), "scalar"), ((4, 2048, 16, 128, 128), "vector")]
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
rows = []
for name in names:
    row = [name]
    with internals.patched_templates(VARIANTS[name]):
        for shape, gate, poison in CASES:
            B, T, H, K, V = shape
            q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate=gate, gate_dtype=torch.bfloat16)
            if poison:
                v[0, T * 2 // 5, 1, 7] = float("nan"); v[B - 1, T * 3 // 4, 0, V - 3] = float("inf")
            runs = [kchunk.forward(GLACall(q, k, v, g, None, None, K**-0.5, True, False)) for _ in range(6)]
            bad = sum(not (torch.equal(o.nan_to_num(), runs[0][0].nan_to_num()) and torch.equal(h.nan_to_num(), runs[0][1].nan_to_num())) for o, h in runs[1:])
            row.append(f"{bad}/5")
        for shape, gate in TIMED:
            q, k, v, g = inputs.gla_inputs(*shape, gate=gate, gate_dtype=torch.bfloat16)
            fn = lambda: kchunk.forward(GLACall(q, k, v, g, None, None, shape[3]**-0.5, False, False))
            row.append(f"{harness.time_one(fn, clock='graph', rounds=3).median:.3f}")
    rows.append(row)
    print(" | ".join(row), flush=True)
print("| variant | " + " | ".join(f"{s}:{g}{' poisoned' if p else ''} runs differing" for s, g, p in CASES) + " | " + " | ".join(f"{s}:{g} ms" for s, g in TIMED) + " |")
for r in rows:
    print("| " + " | ".join(r) + " |")
