# The prepared probes in one device call (not yet run): from the repository root, with the wheels
# in .whl/ carried; the variant folders are git-ignored (_v_*).
#   run: bash benchmarks/results/h200-2026-11-29-local-probes/next_call.sh   carry: [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
P=benchmarks/results/h200-2026-11-29-local-probes
for v in perm pdl; do rm -rf _v_$v && mkdir _v_$v && cp -r gla_inductor _v_$v/ && (cd _v_$v && patch -s -p1 < ../$P/$v.patch) || exit; done
timeout 200 python -m benchmarks tune ab --versions base=.,perm=_v_perm --cases "8,2048,16,128,128:vector;8,1024,8,64,64:vector;4,2048,16,128,128:vector;1,8192,96,128,128:vector" --rounds 3 --out $OUT --name ab-warp-rows > $OUT/ab-perm.log 2>&1
timeout 200 python -m benchmarks tune ab --versions base=.,pdl=_v_pdl --cases "4,2048,16,128,128:scalar;2,4096,16,128,128:scalar;1,8192,16,128,128:scalar;8,1024,8,64,64:scalar;1,8192,96,64,64:scalar" --rounds 3 --out $OUT --name ab-pdl > $OUT/ab-pdl.log 2>&1
tail -8 $OUT/ab-perm.log; tail -8 $OUT/ab-pdl.log
