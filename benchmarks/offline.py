"""Two profile tools that need no GPU.

  sm90     ``python -m benchmarks profile sm90 --mode carry --gate vector --bv 64 --warps 4 [--dump DIR]``:
           renders a template with the options the launchers would pass at (B, T, H, K, V) =
           (8, 2048, 16, --k, --v) in bf16, compiles it with ``triton.compile`` for a
           ``GPUTarget("cuda", 90, 32)`` and runs the ptxas bundled with Triton on the PTX: registers,
           spills, and ptxas's warning where it serializes the wgmma instructions. --dump writes the
           TTIR, TTGIR and PTX. Register counts depend on the Triton version, and so does whether a
           template compiles at all (triton 3.6's loop pipeliner rejected code that 3.7.1 compiled):
           put the GPU machine's first on PYTHONPATH (``pip install --no-deps --target DIR
           triton==3.6.0``, then ``PYTHONPATH=DIR:$PWD``) to see its counts and failures.
  ncu-hot  ``python -m benchmarks profile ncu-hot --csv sass.csv``: an Nsight Compute SASS source page
           summarized: stall samples by instruction kind, and the hottest instructions.
"""

from __future__ import annotations

import collections
import csv
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report

# the tensors a template may name: (rank, dtype at the benchmark's bf16 inputs)
TENSORS = {
    "q": (4, "bf16"), "k": (4, "bf16"), "v": (4, "bf16"), "g": (4, "bf16"), "g_gamma": (1, "fp32"),
    "x": (4, "bf16"), "y": (4, "bf16"), "A": (4, "bf16"), "ks": (4, "bf16"), "qs": (4, "bf16"), "dl": (4, "fp32"),
    "h0": (4, "fp32"), "ht": (4, "fp32"), "h": (5, "bf16"), "do": (4, "bf16"), "dh": (5, "bf16"),
    "dk": (4, "bf16"), "dg": (4, "fp32"), "gate_a": (1, "fp32"), "gate_bias": (2, "fp32"), "ds": (4, "fp32"),
    "hs": (5, "fp32"), "cu_seqlens": (1, "i32"),
}
_CARRY = dict(USE_H0=False, SEGMENTS=1, SEGMENT_SUMS=False)
MODES = {  # template, extra options, main output (rank, dtype)
    "scan": ("gla_chunk_scan", dict(WRITE_OUT=True, DUAL=False, STORE_STATES=False, USE_H0=False, STORE_HT=True),
             (4, "bf16")),
    "carry": ("gla_chunk_carry", dict(WRITE_OUT=True, DUAL=False, STORE_STATES=False, STORE_HT=True, **_CARRY),
              (4, "bf16")),
    "carry_dual": ("gla_chunk_carry", dict(WRITE_OUT=True, DUAL=True, STORE_STATES=True, STORE_HT=False, **_CARRY),
                   (4, "bf16")),
    "carry_terms": ("gla_chunk_carry", dict(WRITE_OUT=True, DUAL=False, STORE_STATES=False, STORE_HT=True, TERMS=True,
                                            **_CARRY), (4, "bf16")),
    "carry_states": ("gla_chunk_carry", dict(WRITE_OUT=False, DUAL=False, STORE_STATES=True, STORE_HT=False, **_CARRY),
                     (5, "bf16")),
    # a segmented walk's first launch: each segment's state from a zero start, and its decay
    "carry_sums": ("gla_chunk_carry", dict(WRITE_OUT=False, DUAL=False, STORE_STATES=False, STORE_HT=False, USE_H0=False,
                                           SEGMENTS=8, SEGMENT_SUMS=True), (5, "fp32")),
    "carry_terms_sums": ("gla_chunk_carry", dict(WRITE_OUT=False, DUAL=False, STORE_STATES=False, STORE_HT=False,
                                                 USE_H0=False, TERMS=True, SEGMENTS=8, SEGMENT_SUMS=True), (5, "fp32")),
    "segsum": ("gla_chunk_segsum", dict(DUAL=False, SEGMENTS=8), (5, "fp32")),
    "segsum_dual": ("gla_chunk_segsum", dict(DUAL=True, SEGMENTS=8), (5, "fp32")),
    "local": ("gla_chunk_local", dict(TRANSPOSE=False), (4, "bf16")),
    "local_t": ("gla_chunk_local", dict(TRANSPOSE=True), (4, "bf16")),
    "dqkg": ("gla_chunk_bwd_dqkg", dict(), (4, "bf16")),
}


def add_arguments(p) -> None:
    g = p.add_argument_group("sm90")
    g.add_argument("--mode", choices=list(MODES), default="carry")
    g.add_argument("--bv", type=int, default=64)
    g.add_argument("--bt", type=int, default=64)
    g.add_argument("--warps", type=int, default=4)
    g.add_argument("--stages", type=int, default=2)
    g.add_argument("--dump", metavar="DIR")
    g.add_argument("--fp32", action="store_true", help="fp32 inputs under 'highest' precision ('tf32x3' dots)")
    g.add_argument("--k", type=int, default=128)
    g.add_argument("--v", type=int, default=128)
    g.add_argument("--gate-fn", default="", help="a fused gate function (logsigmoid, softplus)")
    g.add_argument("--no-specialize", action="store_true", help="sizes without divisibility")
    g.add_argument("--maxnreg", type=int, help="cap the registers per thread")
    g.add_argument("--bks", type=int, help="gla_chunk_local's key slice")
    g.add_argument("--bkp", type=int, help="gla_chunk_local's key slice on its steep path")
    g.add_argument("--preload", type=int, choices=[0, 1], help="gla_chunk_local's PRELOAD")
    g.add_argument("--varlen", action="store_true", help="packed sequences (IS_VARLEN)")
    g.add_argument("--segments", type=int, help="the walk's SEGMENTS (the mode's own by default)")
    p.add_argument_group("ncu-hot").add_argument("--csv", help="the SASS source page (ncu --page source --csv)")


def sm90_options(args, template: str, extra: dict) -> tuple:
    """(options, ranks, dtypes) of the template at the requested tiles."""
    from benchmarks import internals

    cfg = internals.default_chunk_config(8, 2048, 16, args.k, args.v, torch.bfloat16, args.gate == "vector",
                                         torch.device("cpu"))
    cfg = internals.ChunkConfig(**{**cfg.__dict__, "block_t": args.bt,
                                   "local_tile": internals.TileConfig(0, args.warps, args.stages)})
    gate_fn = internals.GateFn(args.gate_fn, 1 / 16) if args.gate_fn else internals.GateFn()
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    extra = dict(extra, BV=args.bv, **({"SEGMENTS": args.segments} if args.segments else {}))
    options = internals.sm90_kernel_options(template, cfg, dtype, args.k, args.gate, gate_fn, extra)
    options["IS_VARLEN"] = bool(args.varlen)
    if template == "gla_chunk_local":
        options["BKS"] = args.bks or options["BKS"]
        options["BKP"] = min(args.bkp or options["BKP"], options["BKS"])
        options["PRELOAD"] = options["PRELOAD"] if args.preload is None else bool(args.preload)
    ranks = {n: r for n, (r, _) in TENSORS.items()}
    if args.gate == "scalar":
        ranks["g"] = ranks["dl"] = ranks["ds"] = 3
    dtypes = {n: "fp32" if args.fp32 else d for n, (_, d) in TENSORS.items()}
    return options, ranks, dtypes


def signature(args, fn, names: list, helpers, ranks: dict, dtypes: dict) -> tuple:
    """Triton's run-time specialization, by hand: contiguous last dims give strides of 1 (compiled in
    as constants); the other strides, the pointers and the head sizes are multiples of 16."""
    sig, attrs, ones = {}, {}, set()
    for i, name in enumerate(names):
        scalar = helpers.scalars.get(name)
        if name in dtypes:
            sig[name] = "*" + dtypes[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif scalar is not None and scalar.kind == "stride" and scalar.dim == ranks[scalar.tensor] - 1:
            sig[name] = "constexpr"
            ones.add(name)
        else:
            sig[name] = "i32"
            if scalar is not None and (scalar.kind == "stride" or scalar.dim >= 2) and not args.no_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names:
        sig.setdefault(name, "constexpr")
    constexprs = {(fn.arg_names.index(n),): (1 if n in ones else None) for n, t in sig.items() if t == "constexpr"}
    return sig, constexprs, attrs


def run_sm90(args, result) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from benchmarks.internals import standalone

    template, extra, (out_rank, out_dtype) = MODES[args.mode]
    options, ranks, dtypes = sm90_options(args, template, extra)
    ranks[standalone.OUT], dtypes[standalone.OUT] = out_rank, out_dtype
    source, helpers = standalone.render_source((template, "gla_common"), template, options, ranks)
    path = Path(tempfile.mkdtemp()) / f"{template}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(template, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, template)
    names = [*helpers.pointers, standalone.OUT, *helpers.scalars]  # the kernel's argument order
    sig, constexprs, attrs = signature(args, fn, names, helpers, ranks, dtypes)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=args.warps, num_stages=args.stages,
                                           **(dict(maxnreg=args.maxnreg) if args.maxnreg else {})))
    compile_s = time.perf_counter() - start
    ptx_path = path.with_suffix(".ptx")
    ptx_path.write_text(compiled.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx_path), "-o", os.devnull], capture_output=True,
                         text=True)
    lines = [x for x in res.stderr.splitlines() if "Used" in x or "spill" in x or "wgmma" in x.lower()]
    result.rows.append({"mode": args.mode, "gate": args.gate, "bv": args.bv, "warps": args.warps, "stages": args.stages,
                        "compile_s": compile_s, "shared_bytes": compiled.metadata.shared, "ptxas": lines})
    result.sections.append(f"compiled in {compile_s:.2f} s (triton.compile, this CPU); shared memory "
                           f"{compiled.metadata.shared} bytes (sm_90 limit 232448)\n\n```\n"
                           + "\n".join(lines) + "\n```")
    if args.dump:
        out = Path(args.dump)
        out.mkdir(parents=True, exist_ok=True)
        for key in ("ttir", "ttgir", "ptx"):
            (out / f"{args.mode}_{args.gate}.{key}").write_text(compiled.asm[key])


def run_ncu_hot(args, result) -> None:
    if not args.csv:
        raise SystemExit("profile ncu-hot needs --csv FILE "
                         "(ncu --import X.ncu-rep --page source --csv --print-source sass > FILE)")
    lines = Path(args.csv).read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(('"#"', '"Address"')) or "Source" in x)
    rows = list(csv.DictReader(lines[start:]))
    cols = list(rows[0])
    samples = next(c for c in cols if "Sampling" in c and "All" in c)
    executed = next((c for c in cols if c.startswith("Instructions Executed")), None)
    total = sum(float(r[samples] or 0) for r in rows)
    by_op, inst_by_op = collections.Counter(), collections.Counter()
    for r in rows:
        words = r["Source"].split() or ["?"]
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        by_op[op] += float(r[samples] or 0)
        if executed:
            inst_by_op[op] += float(r[executed] or 0)
    n_inst = max(1, sum(inst_by_op.values()))
    text = [f"stall samples {total:.0f}; instructions executed {sum(inst_by_op.values()):.0f}",
            "op: share of stall samples, share of executed instructions"]
    text += [f"  {op:12s} {s / total:6.1%}  {inst_by_op[op] / n_inst:6.1%}" for op, s in by_op.most_common(25)]
    text += ["hottest instructions:"]
    text += [f"  {float(r[samples] or 0) / total:6.1%}  {r['Source'][:90]}"
             for r in sorted(rows, key=lambda r: -float(r[samples] or 0))[:25]]
    result.sections.append("```\n" + "\n".join(text) + "\n```")


def run(args):
    result = report.new_result(f"profile-{args.tool}", f"Profile: {args.tool}", "cpu")
    {"sm90": run_sm90, "ncu-hot": run_ncu_hot}[args.tool](args, result)
    return result
