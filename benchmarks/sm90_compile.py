"""Compile a GLA kernel for sm_90 without a GPU and report registers, spills and ptxas's warning when
it serializes the tensor-core (wgmma) instructions (ptxas -v).

    python benchmarks/sm90_compile.py carry --gate vector --bv 64 --warps 4 [--dump DIR]

Renders the template with the options ``triton_chunk`` would pass at (B, T, H, K, V) =
(8, 2048, 16, --k, --v) in bf16, compiles it with ``triton.compile`` for a ``GPUTarget("cuda", 90, 32)``,
and runs the ptxas bundled with Triton on the PTX. ``--dump`` writes the TTGIR and PTX to look at
layouts and shared-memory round trips. Register counts depend on the Triton version: put the GPU
machine's (``pip install --target DIR triton==3.6.0``) first on PYTHONPATH to see its counts.
"""

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from gla_inductor import triton_chunk
from gla_inductor.gates import GateFn
from gla_inductor.templates import standalone

# per template: the tensors it may name, (rank, dtype at the benchmark's bf16 inputs)
TENSORS = {
    "q": (4, "bf16"), "k": (4, "bf16"), "v": (4, "bf16"), "g": (4, "bf16"), "g_gamma": (1, "fp32"),
    "x": (4, "bf16"), "y": (4, "bf16"), "A": (4, "bf16"), "ks": (4, "bf16"), "qs": (4, "bf16"), "dl": (4, "fp32"),
    "h0": (4, "fp32"), "ht": (4, "fp32"), "h": (5, "bf16"), "do": (4, "bf16"), "dh": (5, "bf16"),
    "dk": (4, "bf16"), "dg": (4, "fp32"), "gate_a": (1, "fp32"), "gate_bias": (2, "fp32"),
}
MODES = {  # template, extra options, main output (rank, dtype)
    "scan": ("gla_chunk_scan", dict(WRITE_OUT=True, DUAL=False, STORE_STATES=False, USE_H0=False, STORE_HT=True),
             (4, "bf16")),
    "carry": ("gla_chunk_carry", dict(WRITE_OUT=True, DUAL=False, STORE_STATES=False, USE_H0=False, STORE_HT=True,
                                      SEGMENTS=1, SEGMENT_SUMS=False), (4, "bf16")),
    "carry_dual": ("gla_chunk_carry", dict(WRITE_OUT=True, DUAL=True, STORE_STATES=True, USE_H0=False,
                                           STORE_HT=False, SEGMENTS=1, SEGMENT_SUMS=False), (4, "bf16")),
    "carry_states": ("gla_chunk_carry", dict(WRITE_OUT=False, DUAL=False, STORE_STATES=True, USE_H0=False,
                                             STORE_HT=False, SEGMENTS=1, SEGMENT_SUMS=False), (5, "bf16")),
    "local": ("gla_chunk_local", dict(TRANSPOSE=False), (4, "bf16")),
    "local_t": ("gla_chunk_local", dict(TRANSPOSE=True), (4, "bf16")),
    "dqkg": ("gla_chunk_bwd_dqkg", dict(), (4, "bf16")),  # BK: the dqkg tile's block_k
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=list(MODES))
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--bv", type=int, default=64)
    p.add_argument("--bt", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--dump")
    p.add_argument("--fp32", action="store_true", help="fp32 inputs under 'highest' precision ('tf32x3' dots)")
    p.add_argument("--k", type=int, default=128)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--gate-fn", default="", help="a fused gate function (gates.GATE_FNS)")
    p.add_argument("--no-specialize", action="store_true", help="sizes without divisibility (as before)")
    p.add_argument("--maxnreg", type=int, help="cap the registers per thread (Triton's maxnreg option)")
    p.add_argument("--bks", type=int, help="gla_chunk_local's key slice (default: local_key_slice)")
    p.add_argument("--bkp", type=int, help="gla_chunk_local's key slice on its steep path (local_steep_slice)")
    p.add_argument("--preload", type=int, choices=[0, 1], help="gla_chunk_local's PRELOAD (local_preload)")
    args = p.parse_args()

    template, extra, (out_rank, out_dtype) = MODES[args.mode]
    cfg = triton_chunk.default_config(8, 2048, 16, args.k, args.v, torch.bfloat16, args.gate == "vector",
                                      torch.device("cpu"))
    cfg = triton_chunk.ChunkConfig(**{**cfg.__dict__, "block_t": args.bt})
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    gate_fn = GateFn(args.gate_fn, 1 / 16) if args.gate_fn else GateFn()
    options = triton_chunk.kernel_options(cfg, dtype, args.k, args.gate, args.k ** -0.5, False, False, gate_fn)
    options.update(extra, BV=args.bv)
    if args.mode.startswith("local"):
        options = triton_chunk.local_options(options, extra["TRANSPOSE"])
        options["BKS"] = args.bks or options["BKS"]
        options["BKP"] = min(args.bkp or options["BKP"], options["BKS"])
        options["PRELOAD"] = options["PRELOAD"] if args.preload is None else bool(args.preload)
    if args.mode == "dqkg":
        options["BK"] = triton_chunk.dqkg_block_k(cfg, options)
    ranks = {n: r for n, (r, _) in TENSORS.items()}
    ranks[standalone.OUT] = out_rank
    if args.gate == "scalar":
        ranks["g"] = 3
        ranks["dl"] = 3
    source, helpers = standalone.render_source((template, "gla_common"), template, options, ranks)
    path = Path(tempfile.mkdtemp()) / f"{template}.py"
    path.write_text(source)
    import importlib.util

    spec = importlib.util.spec_from_file_location(template, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, template)

    dtypes = {n: "fp32" if args.fp32 else d for n, (_, d) in TENSORS.items()}
    dtypes[standalone.OUT] = out_dtype
    # as Triton specializes the arguments at run time: contiguous last dims give strides equal to 1
    # (compiled in as constants), the other strides and the pointers are multiples of 16
    signature, attrs, ones = {}, {}, set()
    for i, name in enumerate([*helpers.pointers, standalone.OUT, *helpers.scalars]):
        scalar = helpers.scalars.get(name)
        if name in dtypes:
            signature[name] = "*" + dtypes[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif scalar is not None and scalar.kind == "stride" and scalar.dim == ranks[scalar.tensor] - 1:
            signature[name] = "constexpr"
            ones.add(name)
        else:
            signature[name] = "i32"
            # strides, and the head count and head dims (sizes of dims 2 and 3; standalone.py leaves
            # only T unspecialized) are multiples of 16 at the benchmark's shapes
            if scalar is not None and (scalar.kind == "stride" or scalar.dim >= 2) and not args.no_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names:
        if name not in signature:
            signature[name] = "constexpr"
    constexprs = {(fn.arg_names.index(n),): (1 if n in ones else None) for n, t in signature.items()
                  if t == "constexpr"}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=args.warps, num_stages=args.stages,
                                           **(dict(maxnreg=args.maxnreg) if args.maxnreg else {})))
    compile_s = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    ptx_path = path.with_suffix(".ptx")
    ptx_path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx_path), "-o", os.devnull],
                         capture_output=True, text=True)
    print(f"compiled in {compile_s:.2f} s (triton.compile, this CPU); "
          f"shared memory {compiled.metadata.shared} bytes (sm_90 limit 232448)")
    print("\n".join(l for l in res.stderr.splitlines() if "Used" in l or "spill" in l or "wgmma" in l.lower()))
    if args.dump:
        out = Path(args.dump)
        out.mkdir(parents=True, exist_ok=True)
        for key in ("ttir", "ttgir", "ptx"):
            (out / f"{args.mode}_{args.gate}.{key}").write_text(compiled.asm[key])


if __name__ == "__main__":
    main()
