# the tree (packed walks cut by length where the host read the offsets; sums' grid without the last
# segment) against FLA in one process; then the packed-sequence tests on the GPU
R=$PWD
mkdir -p $OUT/fin
timeout 230 python -m benchmarks varlen --impls ours,fla --fla-budget 40 --rounds 5 --out $OUT/fin --name varlen-fla > $OUT/fin/varlen-fla.log 2>&1
echo "varlen rc=$?"; grep -E "^\| (8x2048|mixed12)" $OUT/fin/varlen-fla.md | grep -v events | head -40
timeout 110 python -m pytest -q -p no:cacheprovider tests/kernels/test_varlen_kernels.py -x > $OUT/fin/cuda-tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/fin/cuda-tests.log
