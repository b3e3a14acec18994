#!/bin/bash
# The backward's walks on two streams: A/B against the tree before (_base), CUDA tests, varlen.
# Run from the repository root on the GPU machine, with PYTHONPATH=/tmp/site:$PWD and $OUT set.
R=$PWD
set -x
python -m pytest -q -p no:cacheprovider tests/kernels/test_overlapped_walks_cuda.py 2>&1 | tail -15 | tee $OUT/cuda-tests-overlap.log
python -m benchmarks tune ab --versions base=_base,new=. --rounds 3 --out $OUT --name ab-overlap \
  --cases "8,2048,16,128,128:vector;8,1024,8,64,64:vector;1,8192,96,128,128:vector;4,2048,16,128,128:vector;2,16384,16,128,128:vector;8,2048,16,128,128:scalar;4,2048,16,128,128:scalar;1,8192,16,128,128:scalar;2,4096,16,128,128:scalar" \
  > $OUT/ab-overlap.log 2>&1
for v in base new; do
  d=$R; [ $v = base ] && d=$R/_base
  (cd $d && PYTHONPATH=/tmp/site:$R python -m benchmarks varlen --impls ours --rounds 3 --out $OUT --name varlen-$v > $OUT/varlen-$v.log 2>&1)
done
python -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_kernels.py tests/kernels/test_varlen_kernels.py tests/kernels/test_parts.py -x 2>&1 | tail -5 | tee $OUT/cuda-tests.log
set +x
tail -40 $OUT/ab-overlap.md
grep -E "fwd\+bwd|scalar fwd \(graph" $OUT/varlen-base.md $OUT/varlen-new.md
