#!/usr/bin/env bash
# On the GPU machine, from the repo root: gpu_ablate.py over shapes and gates, forward and (BWD=1)
# forward + backward. env: SWEEP_SHAPES, GATES, ONLY (variants), BWD.
export PYTHONPATH=$PWD
OUT=${OUT:-.}
for shape in ${SWEEP_SHAPES:-1,8192,96,128,128 8,2048,4,256,512 8,1024,8,64,64 4,2048,16,128,128}; do
  for gate in ${GATES:-vector scalar}; do
    for bwd in 0 ${BWD:+1}; do
      timeout ${SWEEP_TIMEOUT:-110} python3 benchmarks/gpu_ablate.py --shape $shape --gate $gate $([ $bwd = 1 ] && echo --bwd) \
        --out $OUT/sweep_${gate}_${shape//,/_}_bwd$bwd.json \
        --only "${ONLY:-base|local_bv64_w4|local_bv64_w4_lw8|local_bv128_w8_lw8|local_bv32_w4_lw8|local_bv64_w8_lw8}" \
        2>&1 | grep "^|" | grep -v -- "---" | sed "s/^/bwd=$bwd /"
    done
  done
done
