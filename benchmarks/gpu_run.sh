#!/usr/bin/env bash
# On the GPU machine, from the repo root: the kernel tests, then the benchmark against FLA.
# FLA (fla-core 0.6.0, pure Python) may be given as wheels in .whl/. Results go to $OUT (or .).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-.}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -15 > $OUT/tests.log
grep -E "passed|failed|FAILED" $OUT/tests.log
timeout ${BENCH_TIMEOUT:-1800} python3 benchmarks/gpu_gla.py --out $OUT/bench.json --impls ${IMPLS:-ours,fla,naive,compiled} \
  --shapes ${SHAPES:-0,2,1,3,4,5} 2>&1 | tee $OUT/bench.log | grep -v "^{" | tail -16
