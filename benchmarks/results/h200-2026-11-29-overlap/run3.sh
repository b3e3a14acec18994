#!/bin/bash
# host time of the eager backward, base and new, interleaved twice; then the CUDA tests (time-boxed)
R=$PWD
for i in 1 2; do
  PYTHONPATH=/tmp/site:$R/_base python benchmarks/results/h200-2026-11-29-overlap/host_time.py base >> $OUT/host-time.txt 2>&1
  PYTHONPATH=/tmp/site:$R python benchmarks/results/h200-2026-11-29-overlap/host_time.py new >> $OUT/host-time.txt 2>&1
done
timeout 420 python -m pytest -q -p no:cacheprovider tests/kernels/test_overlapped_walks_cuda.py tests/kernels/test_chunk_kernels.py tests/kernels/test_varlen_kernels.py tests/kernels/test_parts.py 2>&1 | tail -6 > $OUT/cuda-tests.log
sort -k2,2 -s $OUT/host-time.txt
cat $OUT/cuda-tests.log
