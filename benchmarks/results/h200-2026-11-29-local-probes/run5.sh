python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
R=$PWD
timeout 200 python -m benchmarks tune ab --versions base=.,perm=_v_perm --cases "8,2048,16,128,128:vector;8,1024,8,64,64:vector;4,2048,16,128,128:vector;1,8192,96,128,128:vector;2,16384,16,128,128:vector" --rounds 3 --out $OUT --name ab-local-warp-rows > $OUT/ab.log 2>&1
tail -9 $OUT/ab.log
cd _v_perm
PYTHONPATH=/tmp/site:$R/_v_perm:$R timeout 150 python -m pytest $R/tests/kernels/test_chunk_kernels.py $R/tests/kernels/test_varlen_kernels.py -k "local or vector" -q -x -p no:cacheprovider > $OUT/cuda-tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/cuda-tests.log
PYTHONPATH=/tmp/site:$R/_v_perm:$R timeout 200 python -m benchmarks varlen --impls ours,fla --rounds 3 --fla-budget 40 --out $OUT --name varlen-perm > $OUT/varlen-perm.log 2>&1; echo "varlen rc=$?"
cd $R
timeout 90 python -m benchmarks varlen --impls ours --rounds 3 --out $OUT --name varlen-base > $OUT/varlen-base.log 2>&1; echo "varlen base rc=$?"
grep -A30 "^| case" $OUT/varlen-perm.md | head -24
grep -A30 "^| case" $OUT/varlen-base.md | head -24
