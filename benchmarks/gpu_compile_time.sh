#!/usr/bin/env bash
# Compile time of the GLA block (issue 4's second target), cold: every process starts with an
# empty Inductor cache and a Triton cache that holds only FLA's kernels and their autotuning results
# (FLA's run-time autotuning takes minutes and is not compile time; gpu_block.py runs FLA eagerly
# before compiling its variant anyway). Inductor compiles its Triton kernels into TRITON_CACHE_DIR
# when set, so nothing Inductor compiled in an earlier process is reused. gpu_block.py waits for
# Inductor's compile workers before it compiles a variant; the "workers-starting" runs do not.
#
#   OUT=/tmp/out bash benchmarks/gpu_compile_time.sh
# writes $OUT/compile-*.json and .log; prints compile seconds per run and variant.
set -uo pipefail
OUT=${OUT:-/tmp/compile-time}
mkdir -p "$OUT"
export FLA_CACHE_RESULTS=1
FLA_CACHE=$(mktemp -d)
TRITON_CACHE_DIR=$FLA_CACHE python - <<'PY' >"$OUT/fla-warm.log" 2>&1
import sys, torch
sys.path.insert(0, "benchmarks")
import gpu_block as g
block, x, dy = g.make(g.fla_gla, (8, 2048, 16, 128, 128), "cuda", torch.bfloat16)
g.step(block, x, dy)
torch.cuda.synchronize()
PY
echo "fla warm-up: rc $?"
run() {  # name, variants, more options
  local cache
  cache=$(mktemp -d)
  cp -r "$FLA_CACHE" "$cache/triton"
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton \
    python benchmarks/gpu_block.py --compile-only --variants "$2" ${3:-} --out "$OUT/compile-$1.json" \
    >"$OUT/compile-$1.log" 2>&1
  echo "$1: rc $?"
  rm -rf "$cache"
}
run fla-first fla,ours,ours-unfused
run ours-first ours,ours-unfused,fla
run ours-alone ours
run fla-alone fla
# as a script run once on a fresh machine would: Inductor's compile workers still starting
run ours-alone-workers-starting ours --no-worker-wait
run fla-alone-workers-starting fla --no-worker-wait
python - "$OUT" <<'PY'
import glob, json, sys
print("| run | variant | compile s |")
print("|---|---|---|")
for f in sorted(glob.glob(f"{sys.argv[1]}/compile-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f"| {f.split('compile-')[-1][:-5]} | {r['variant']} | {r['compile_s']:.2f} |")
PY
