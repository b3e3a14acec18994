#!/bin/bash
# varlen with the walks overlapped (this tree, against FLA) and before (_base), one call; then the
# varlen and parts CUDA tests (time-boxed).
R=$PWD
python -m benchmarks varlen --impls ours,fla --fla-budget 40 --rounds 3 --out $OUT --name varlen-new > $OUT/varlen-new.log 2>&1
(cd $R/_base && PYTHONPATH=/tmp/site:$R python -m benchmarks varlen --impls ours --rounds 3 --out $OUT --name varlen-base > $OUT/varlen-base.log 2>&1)
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_varlen_kernels.py tests/kernels/test_parts.py 2>&1 | tail -4 > $OUT/cuda-tests.log
rm -f $OUT/*.log.tmp
cat $OUT/cuda-tests.log
grep -E "fwd" $OUT/varlen-new.md | grep -v prefix
grep -E "fwd" $OUT/varlen-base.md | grep -v prefix
