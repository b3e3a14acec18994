# The third call: the CUDA tests run2 did not reach (packed sequences at K = 64, the graph capture
# of packed calls, the warp-major rows through Inductor), by name.
#   run: bash benchmarks/results/h200-2026-11-29-warp-rows/run3.sh   carry: [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 230 python -m pytest -v -p no:cacheprovider tests/kernels/test_varlen_kernels.py tests/kernels/test_lowering.py -k "large_heads or graph_capture or warp_major" > $OUT/cuda-tests.log 2>&1; echo "tests rc=$?"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/cuda-tests.log | tail -12
