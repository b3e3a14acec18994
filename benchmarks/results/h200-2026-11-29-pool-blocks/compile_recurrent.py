"""Offline sm_90 compile of gla_recurrent for a bf16 pool decode (B = 64-style launch: one step, slot
indices, the state updated in place): registers, spills and shared memory. Kept as run; with the GPU
machine's Triton first on the path:
env -u TRITON_INTERPRET PYTHONPATH=/tmp/tr36:$PWD python compile_recurrent.py --stages 2 [--vfirst 1 --bv 32 --bkb 0 --vbb 16 --warps 1] [--dump DIR]
(with block-stages.patch applied, --stages also reached the template's blocks loop)."""
import argparse
import importlib.util
import os
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from benchmarks.offline import signature
from gla_inductor.kernels import standalone
from gla_inductor.kernels.recurrent import recurrent_options

p = argparse.ArgumentParser()
p.add_argument("--bv", type=int, default=128)
p.add_argument("--warps", type=int, default=2)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--bkb", type=int, default=16)
p.add_argument("--vbb", type=int, default=0)
p.add_argument("--vfirst", type=int, default=0)
p.add_argument("--dump")
a = p.parse_args()
opts = recurrent_options(128, 128, "vector", 0.088, False, block_v=a.bv, use_h0=True, store_ht=True,
                         use_indices=True, ht_is_h0=True, key_block=a.bkb, value_block=a.vbb)
ranks = {"q": 4, "k": 4, "v": 4, "g": 4, "h0": 4, "idx": 1, standalone.OUT: 4}
dtypes = {"q": "bf16", "k": "bf16", "v": "bf16", "g": "bf16", "h0": "bf16", "idx": "i32", standalone.OUT: "bf16"}
source, helpers = standalone.render_source(("gla_recurrent", "gla_common"), "gla_recurrent", opts, ranks)
path = Path(tempfile.mkdtemp()) / "gla_recurrent.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("gla_recurrent", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = module.gla_recurrent
names = [*helpers.pointers, standalone.OUT, *helpers.scalars]
sig, constexprs, attrs = signature(argparse.Namespace(no_specialize=False), fn, names, helpers, ranks, dtypes)
if a.vfirst:  # a V-first pool read as its transpose: h0's key stride is 1, its value stride K
    for n in list(sig):
        s = helpers.scalars.get(n)
        if s is not None and s.tensor == "h0" and s.kind == "stride" and s.dim == 3:
            sig[n] = "i32"
            constexprs.pop((fn.arg_names.index(n),), None)
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
        if s is not None and s.tensor == "h0" and s.kind == "stride" and s.dim == 2:
            sig[n] = "constexpr"
            constexprs[(fn.arg_names.index(n),)] = 1
compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=a.warps, num_stages=a.stages))
ptx = path.with_suffix(".ptx")
ptx.write_text(compiled.asm["ptx"])
ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)
print([x for x in res.stderr.splitlines() if "Used" in x or "spill" in x], "shared", compiled.metadata.shared)
if a.dump:
    Path(a.dump).mkdir(parents=True, exist_ok=True)
    for key in ("ttgir", "ptx"):
        (Path(a.dump) / f"recurrent.{key}").write_text(compiled.asm[key])
