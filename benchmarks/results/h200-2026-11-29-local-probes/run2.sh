python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 300 python -m benchmarks tune ab --versions base=.,pf=_v_pf --cases "8,2048,16,128,128:vector;8,1024,8,64,64:vector;4,2048,16,128,128:vector;1,8192,96,128,128:vector" --rounds 3 --out $OUT --name ab-local-prefetch > $OUT/ab.log 2>&1
tail -12 $OUT/ab.log
cd _v_pf && timeout 120 ncu --clock-control none --section SpeedOfLight --section Occupancy -k regex:gla_chunk_local --launch-skip 3 -c 1 python -m benchmarks profile ncu --gate vector --shape 8,2048,16,128,128 > $OUT/ncu-pf.txt 2>&1; cd ..
grep -E "Duration|DRAM Throughput|Registers|Achieved Occ" $OUT/ncu-pf.txt
