#!/usr/bin/env bash
# On the GPU machine, from the repo root: forward tile sweeps over the benchmark shapes, vector and
# scalar gates (vector gates with 4 warps at K >= 64 fault on triton 3.6: left out). Results: $OUT/sweep_<gate>_<shape>.json.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-.}
for shape in ${SWEEP_SHAPES:-8,2048,16,128,128 1,8192,96,128,128 4,2048,16,128,128 8,1024,8,64,64 8,2048,4,256,512}; do
  for gate in vector scalar; do
    timeout 120 python3 benchmarks/gpu_schedule.py --shape $shape --gate $gate --out $OUT/sweep_${gate}_${shape//,/_}.json \
      --only "$([ $gate = vector ] && echo 'BV=128 w=8 s=2|BV=32 w=8 s=2' || echo 'BV=64 w=4 s=2|BV=128 w=4 s=2|BV=128 w=8 s=2|BV=32 w=4 s=2')" \
      2>&1 | grep -v "^{" | tail -6
  done
done
