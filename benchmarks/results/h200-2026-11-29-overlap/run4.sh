#!/bin/bash
# the committed rule (configs.overlap_walks): CUDA tests of the overlap, then A/B against _base
python -m pytest -q -p no:cacheprovider tests/kernels/test_overlapped_walks_cuda.py 2>&1 | tail -3 > $OUT/cuda-tests-rule.log
python -m benchmarks tune ab --versions base=_base,new=. --rounds 2 --out $OUT --name ab-rule \
  --cases "4,2048,16,128,128:vector;1,8192,16,128,128:scalar;8,1024,8,64,64:vector" > $OUT/ab-rule.log 2>&1
cat $OUT/cuda-tests-rule.log
grep "|" $OUT/ab-rule.md
