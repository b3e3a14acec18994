"""Two tools of ``python -m benchmarks tune`` that compare code rather than tiles (CUDA):

  ablate  where the forward's time goes: variants of the kernels that leave one stage out (plain text
          replacements of the template sources, so the variants are easy to read) or change a tile,
          each rendered, compiled and timed. Variants that drop work give wrong outputs on purpose: only
          their time means something, its difference to "base" the cost of what they drop.
          --once runs one call of each named variant (for Nsight Compute, see ``profile ncu``).
  ab      A/B of code versions: forward and backward of the default configs through the public ops
          ``torch.ops.gla_inductor.chunk_fwd`` / ``chunk_bwd`` in CUDA graphs (GPU time), one process per
          version (a folder holding a ``gla_inductor`` package, e.g. ``git archive BASE gla_inductor |
          tar -x -C _base``), versions interleaved per round to spread drift, the best of the rounds;
          outputs checked against the first version's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks import harness, inputs, report

CASES = ("8,2048,16,128,128:vector;1,8192,96,128,128:vector;8,2048,4,256,512:vector;4,2048,16,128,128:vector;"
         "8,1024,8,64,64:vector;2,16384,16,128,128:vector;8,2048,16,128,128:scalar")

# gla_chunk_carry's output in TERMS mode: v^T A^T, then S^T q^T
_TERMS_INTRA = "_gla_dot({{WA}}, b_At.to(DOT_DTYPE), F32_PRECISION)"
_TERMS_INTER = "_gla_dot(b_s.to(DOT_DTYPE), tl.trans(b_x), F32_PRECISION) * b_xf[None, :]"
_TERMS_OUT = f"b_o = {_TERMS_INTRA}\n        b_o = b_o + {_TERMS_INTER}"

# (template, old, new): the replacements of each variant
PATCHES = {
    "base": [],
    # _gla_cumsum's per-chunk branch: always G_L - G (no max-reduction, no second scan)
    "no_gentle_check": [("gla_common", "if tl.max(tl.abs(b_G)) <= 16.0:", "if True:")],
    # the anchored split always taken: the exact pairwise path not compiled in
    "no_safe_check": [("gla_common", "return b_gd, tl.max(tl.abs(b_gd)) <= 64.0", "return b_gd, True")],
    "no_checks": [("gla_common", "if tl.max(tl.abs(b_G)) <= 16.0:", "if True:"),
                  ("gla_common", "return b_gd, tl.max(tl.abs(b_gd)) <= 64.0", "return b_gd, True")],
    # the intra-chunk output A v left out (A computed, then unused: the compiler drops it)
    "no_intra": [("gla_chunk_scan", "b_o = _gla_dot(b_x, b_sd, F32_PRECISION) + _gla_dot(b_A, b_w, F32_PRECISION)",
                  "b_o = _gla_dot(b_x, b_sd, F32_PRECISION)")],
    # the inter-chunk output q S left out
    "no_inter": [("gla_chunk_scan", "b_o = _gla_dot(b_x, b_sd, F32_PRECISION) + _gla_dot(b_A, b_w, F32_PRECISION)",
                  "b_o = _gla_dot(b_A, b_w, F32_PRECISION)")],
    # the state update left out (the state stays the initial one)
    "no_update": [("gla_chunk_scan", "b_s += _gla_dot(tl.trans(b_y), b_w, F32_PRECISION)", "pass")],
    # the output store left out (stored for the first row only, so that o is not dropped)
    "no_store": [("gla_chunk_scan", "m_o = m_t[:, None] & m_v[None, :]",
                  "m_o = (m_t[:, None] & m_v[None, :]) & (o_t[:, None] < 1)")],
    # the carry computing its chunk terms (scalar, constant and no gates): its intra-chunk output
    # v^T A^T (the scores with it), its inter-chunk output S^T q^T, both (the walk then advances the
    # state alone), the state update, the non-finite check
    "terms_no_intra": [("gla_chunk_carry", _TERMS_OUT, "b_o = " + _TERMS_INTER)],
    "terms_no_inter": [("gla_chunk_carry", _TERMS_OUT, "b_o = " + _TERMS_INTRA)],
    "terms_state_only": [("gla_chunk_carry", _TERMS_OUT, "b_o = b_wt.to(tl.float32)")],
    "terms_no_update": [("gla_chunk_carry", "b_s += _gla_dot(b_wy, b_y, F32_PRECISION)", "pass")],
    "terms_no_check": [("gla_chunk_carry", "{%- set CHECK = WRITE_OUT and not DUAL and not STORE_STATES %}",
                        "{%- set CHECK = False %}")],
}


def _configs() -> dict:
    """Tile variants on the base sources: name -> (base config -> config)."""
    from benchmarks.internals import TileConfig

    rep = dataclasses.replace

    def scan(**kw):
        return lambda b: rep(b, scan=rep(b.scan, **kw))

    def local(bv, warps, stages=2, local_warps=4):
        return lambda b: rep(b, local=True, carry=TileConfig(bv, warps, stages),
                             local_tile=TileConfig(0, local_warps, 2))

    return {
        "w16": scan(num_warps=16), "s1": scan(num_stages=1), "s3": scan(num_stages=3),
        "bt32": lambda b: rep(b, block_t=32), "bv64_w8": scan(block_v=64, num_warps=8),
        "local_bv64_w4": local(64, 4), "local_bv64_w4_s3": local(64, 4, 3), "local_bv64_w8": local(64, 8),
        "local_bv128_w8": local(128, 8), "local_bv128_w4": local(128, 4), "local_bv32_w4": local(32, 4),
        "local_bv64_w4_lw8": local(64, 4, local_warps=8), "local_bv128_w8_lw8": local(128, 8, local_warps=8),
        "local_bv32_w4_lw8": local(32, 4, local_warps=8), "local_bv64_w8_lw8": local(64, 8, local_warps=8),
        "fused": lambda b: rep(b, local=False, terms=False),
        "carry_w8": lambda b: rep(b, carry=TileConfig(64, 8, 2)),
        "carry_bv32": lambda b: rep(b, carry=TileConfig(32, 4, 2)),
        "bt64_carry_w8": lambda b: rep(b, block_t=64, carry=TileConfig(64, 8, 2)),
        "bt64_carry_bv32": lambda b: rep(b, block_t=64, carry=TileConfig(32, 4, 2)),
        "local_kernel_only": local(64, 4),  # gla_chunk_local alone
        "local_kernel_only_lw8": local(64, 4, local_warps=8),
    }


def add_arguments(p) -> None:
    g = p.add_argument_group("ablate")
    g.add_argument("--once", action="store_true", help="one call of each variant, no timing (for ncu)")
    g.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no launch overhead)")
    g.add_argument("--bwd", action="store_true", help="time forward + backward (output: dq)")
    g = p.add_argument_group("ab")
    g.add_argument("--versions", help="name=folder,... (each folder holds a gla_inductor package)")
    g.add_argument("--cases", default=CASES, help="'B,T,H,K,V:gate;...' (gate: vector, scalar, constant, none)")


def run_ablate(args, result) -> None:
    from benchmarks import internals

    shape = harness.parse_shapes(args.shapes or (inputs.SWEEP_QUICK if args.quick else inputs.SWEEP_MAIN))[0]
    configs = _configs()
    names = [n for n in [*PATCHES, *configs] if not args.only or n in args.only.split("|")]
    B, T, H, K, V = shape
    for gate in args.gates.split(","):
        q, k, v, g = inputs.sweep_inputs(shape, gate)
        base = internals.default_chunk_config(B, T, H, K, V, q.dtype, gate == "vector", q.device)
        ref = None
        for name in names:
            cfg = configs[name](base) if name in configs else base

            def fwd(cfg=cfg, name=name):
                if name.startswith("local_kernel_only"):
                    return internals.local_kernel(cfg, q, k, v, g, scale=K**-0.5)[0]
                o = internals.chunk_fwd_kernel(q, k, v, g, scale=K**-0.5, config=cfg)[0]
                return internals.chunk_bwd_kernel(q, k, v, g, o, scale=K**-0.5, config=cfg)[0] if args.bwd else o

            row = {"variant": name, "gate": gate, "shape": list(shape)}
            try:
                with internals.patched_templates(PATCHES.get(name, [])):
                    out = fwd()
                    torch.cuda.synchronize()
                    if not args.once:
                        row["ms"] = harness.time_one(fwd, clock="graph" if args.graph else "events",
                                                     rounds=args.rounds).median
                ref = out.float() if name == "base" else ref
                if ref is not None and out.shape == ref.shape:
                    row["rel_err_vs_base"] = harness.rel_err(out, ref)
            except Exception as e:  # a variant that does not compile
                row["error"] = harness.error_text(e)
            harness.log(row)
            result.rows.append(row)


CHILD = r"""
import json, os, sys
sys.path[:0] = [os.path.abspath(sys.argv[3]), os.getcwd()]  # the version's package first
import torch, gla_inductor
from benchmarks import harness, inputs
rows = []
for i, case in enumerate(sys.argv[1].split(";")):
    shape, gate = case.split(":")
    B, T, H, K, V = map(int, shape.split(","))
    q, k, v, g, g_gamma = inputs.ab_inputs(B, T, H, K, V, gate)
    # seeded as the inputs: the outputs of the versions are compared (the gradients with do)
    do = torch.randn(v.shape, device=v.device, generator=torch.Generator(v.device).manual_seed(1)).to(v.dtype)
    fwd = lambda: torch.ops.gla_inductor.chunk_fwd(q, k, v, g, g_gamma, None, K ** -0.5, False, False)[0]
    bwd = lambda: torch.ops.gla_inductor.chunk_bwd(q, k, v, g, g_gamma, None, do, None, K ** -0.5, False)
    with torch.no_grad():
        dq, dk, dv, dg, dg_gamma, _ = bwd()
        outs = (fwd(), dq, dk, dv, dg if g_gamma is None else dg_gamma)
        torch.save([t.cpu() for t in outs], f"{sys.argv[2]}.{i}.pt")
        t = harness.measure({"fwd": fwd, "bwd": bwd}, clock="graph", rounds=2)
    rows.append(dict(case=case, package=os.path.dirname(gla_inductor.__file__), fwd_ms=t["fwd"].median,
                     bwd_ms=t["bwd"].median))
print("ROWS " + json.dumps(rows))
"""


def run_version(folder: str, cases: list, tag: str) -> list:
    done = subprocess.run([sys.executable, "-c", CHILD, ";".join(cases), tag, folder], capture_output=True, text=True,
                          cwd=report.ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ROWS ")), None)
    if line is None:
        raise RuntimeError(f"{folder}: {done.stderr[-2000:]}")
    return json.loads(line[5:])


def run_ab(args, result) -> None:
    if not args.versions:
        raise SystemExit("tune ab needs --versions name=folder,...")
    versions = [v.split("=", 1) for v in args.versions.split(",")]
    cases = [c for c in args.cases.split(";") if c]
    work = tempfile.mkdtemp(prefix="gla-ab-")
    runs = {name: [] for name, _ in versions}
    for r in range(args.rounds):
        for name, folder in versions:
            runs[name].append(run_version(folder, cases, os.path.join(work, name)))
            harness.log({"version": name, "round": r, "rows": runs[name][-1]})
    first = versions[0][0]
    for i, case in enumerate(cases):
        row = {"case": case}
        for name, _ in versions:
            row[f"{name}_fwd_ms"] = min(rr[i]["fwd_ms"] for rr in runs[name])
            row[f"{name}_bwd_ms"] = min(rr[i]["bwd_ms"] for rr in runs[name])
            row[f"{name}_package"] = runs[name][0][i]["package"]
            if name != first:
                a, b = (torch.load(os.path.join(work, f"{n}.{i}.pt")) for n in (name, first))
                errs = {t: harness.rel_err(x, y) for t, x, y in zip(("o", "dq", "dk", "dv", "dg"), a, b)}
                row[f"{name}_rel_err_vs_{first}"] = max(errs.values())
                row[f"{name}_worst_vs_{first}"] = max(errs, key=errs.get)
        result.rows.append(row)


def run(args):
    result = report.new_result(f"tune-{args.tool}", "Ablations of the forward" if args.tool == "ablate" else
                               "A/B of code versions", "cuda", dtype="bfloat16")
    if args.tool == "ablate":
        run_ablate(args, result)
        result.sections.append(report.table(result.rows, [
            ("variant", "variant", ""), ("gate", "gate", ""), ("ms", "ms", ".3f"),
            ("rel. diff to base", "rel_err_vs_base", ".1e"),
            ("error", lambda r: (r.get("error") or "")[:80] or None, "")]))
        return result
    run_ab(args, result)
    names = [v.split("=", 1)[0] for v in args.versions.split(",")]
    cols = [("case", "case", "")] + [(f"{n} {kind}", f"{n}_{kind}_ms", ".3f") for kind in ("fwd", "bwd") for n in names]
    cols += [(f"{n} rel err vs {names[0]}", f"{n}_rel_err_vs_{names[0]}", ".1e") for n in names[1:]]
    cols += [(f"{n} in", f"{n}_worst_vs_{names[0]}", "") for n in names[1:]]
    result.notes.append("ms: the best of the rounds' medians, CUDA-graph replays")
    result.sections.append(report.table(result.rows, cols))
    return result
