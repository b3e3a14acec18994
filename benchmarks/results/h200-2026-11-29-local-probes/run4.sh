python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 200 python -m benchmarks tune ab --versions base=.,ls=_v_ls --cases "8,1024,8,64,64:vector;2,2048,16,128,128:vector" --rounds 3 --out $OUT --name ab-local-sum-splits > $OUT/ab.log 2>&1
tail -6 $OUT/ab.log
timeout 330 python -m benchmarks never-slower --section decode --fla-budget 60 --budget 150 --rounds 3 --out $OUT --name h200-never-slower-decode > $OUT/ns.log 2>&1
echo rc=$?
tail -30 $OUT/ns.log
