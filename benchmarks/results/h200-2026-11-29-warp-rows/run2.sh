# The second call: the local kernel's CUDA tests, narrowed (run1's wider set ran past its 170 s
# compiling), packed sequences against FLA, and (8, 1024, 8, 64, 64) against FLA.
#   run: bash benchmarks/results/h200-2026-11-29-warp-rows/run2.sh   carry: [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 130 python -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_kernels.py tests/kernels/test_varlen_kernels.py -k "(vector and local) or large_heads or graph_capture" > $OUT/cuda-tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/cuda-tests.log
timeout 200 python -m benchmarks varlen --impls ours,fla --rounds 3 --fla-budget 40 --out $OUT --name h200-2026-11-29-warp-rows-varlen > $OUT/varlen.log 2>&1; echo "varlen rc=$?"
timeout 190 python -m benchmarks kernels --gates vector --custom "8,1024,8,64,64" --impls ours,fla --rounds 3 --out $OUT --name h200-2026-11-29-warp-rows-small > $OUT/small.log 2>&1; echo "small rc=$?"
grep -A40 "^| case" $OUT/h200-2026-11-29-warp-rows-varlen.md | grep -i "fla\|x " | head -30
grep "^{" $OUT/small.log | python3 -c "import sys,json; [print(d['impl'], d['shape'], round(d['fwd_graph_ms'],4), round(d['fwdbwd_ms'],4)) for d in map(json.loads, sys.stdin)]"
