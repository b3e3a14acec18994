#!/usr/bin/env bash
# On the GPU machine, from the repo root: forward-scan ablations (gpu_ablate.py) and an Nsight Compute
# profile of the base kernel. env: GATES (vector scalar), SHAPE, ONLY (variants), NCU (1 to profile).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-.}
SHAPE=${SHAPE:-8,2048,16,128,128}
for gate in ${GATES:-vector scalar}; do
  timeout ${ABLATE_TIMEOUT:-280} python3 benchmarks/gpu_ablate.py --shape $SHAPE --gate $gate ${ONLY:+--only "$ONLY"} \
    --out $OUT/ablate_${gate}.json 2>&1 | grep -v "^{" | tail -20
done
if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for gate in ${NCU_GATES:-vector}; do
    for kernel in ${NCU_KERNELS:-gla_chunk_scan}; do
      name=${gate}_$kernel
      timeout 200 $NCU_BIN --clock-control none --set full -k regex:$kernel -c 1 -f -o $OUT/ncu_$name \
        python3 benchmarks/gpu_ablate.py --shape $SHAPE --gate $gate --only ${NCU_VARIANT:-base} --once > $OUT/ncu_${name}_run.log 2>&1
      $NCU_BIN -i $OUT/ncu_$name.ncu-rep --page details > $OUT/ncu_${name}_details.txt 2>&1
      $NCU_BIN -i $OUT/ncu_$name.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${name}_sass.csv 2>&1
      echo "== $name"
      grep -E "Duration|Registers|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc|Compute \(SM\) Throughput|Memory Throughput|Local Memory Spilling Requests " $OUT/ncu_${name}_details.txt | head -16
      python3 benchmarks/ncu_hot.py $OUT/ncu_${name}_sass.csv > $OUT/ncu_${name}_hot.txt 2>&1; sed -n 2,40p $OUT/ncu_${name}_hot.txt
    done
  done
fi
