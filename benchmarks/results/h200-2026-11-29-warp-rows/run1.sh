# The warp-major rows in main: CUDA tests of the chunk kernels, then the vector forward against FLA.
#   run: bash benchmarks/results/h200-2026-11-29-warp-rows/run1.sh   carry: [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_kernels.py tests/kernels/test_varlen_kernels.py -k "vector or large_heads or graph" > $OUT/cuda-tests.log 2>&1; tail -3 $OUT/cuda-tests.log
timeout 360 python -m benchmarks kernels --gates vector --shapes 0,3,4 --impls ours,fla --out $OUT --name h200-2026-11-29-warp-rows-vector > $OUT/kernels.log 2>&1
tail -25 $OUT/kernels.log
