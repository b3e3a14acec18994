#!/usr/bin/env bash
# On the GPU machine, from the repo root: the lowering and fused-gate tests, then the GLA block benchmark (ours vs FLA).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-.}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -x tests/test_lowering.py tests/test_fused_gate.py 2>&1 | tail -30 > $OUT/lowering_tests.log
grep -E "passed|failed|FAILED|Error" $OUT/lowering_tests.log | tail -5
timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/gpu_block.py --out $OUT/block.json 2>&1 | tee $OUT/block.log | grep -v "^{" | tail -8
