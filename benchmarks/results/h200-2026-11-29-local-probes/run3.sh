python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
echo "== base"; PYTHONPATH=/tmp/site:$PWD python _v_probe/kernel_times.py > $OUT/kt-base.txt 2>&1; cat $OUT/kt-base.txt | grep -v "^/"
echo "== terms reading A"; PYTHONPATH=/tmp/site:$PWD/_v_ta:$PWD python _v_probe/kernel_times.py > $OUT/kt-ta.txt 2>&1; cat $OUT/kt-ta.txt | grep -v "^/"
timeout 300 python -m benchmarks tune ab --versions base=.,ta=_v_ta --cases "4,2048,16,128,128:scalar;2,4096,16,128,128:scalar;1,8192,16,128,128:scalar;8,1024,8,64,64:scalar;1,8192,96,64,64:scalar;8,2048,16,128,128:scalar" --rounds 2 --out $OUT --name ab-terms-a > $OUT/ab.log 2>&1
tail -12 $OUT/ab.log
