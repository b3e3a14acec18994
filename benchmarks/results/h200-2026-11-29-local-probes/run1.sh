set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 330 python -m benchmarks tune ab --versions base=.,c2p=_v_c2p,c2n=_v_c2n,c4n3=_v_c4n3,c2n1=_v_c2n1 --cases "8,2048,16,128,128:vector;8,1024,8,64,64:vector;4,2048,16,128,128:vector" --rounds 2 --out $OUT --name ab-local-chunks > $OUT/ab.log 2>&1
tail -40 $OUT/ab.log
timeout 150 ncu --clock-control none --set full --import-source yes -k regex:gla_chunk_local --launch-skip 3 -c 1 -f -o $OUT/local python -m benchmarks profile ncu --gate vector --shape 8,2048,16,128,128 > $OUT/ncu.log 2>&1
ncu --import $OUT/local.ncu-rep --page details > $OUT/ncu-details.txt 2>&1
ncu --import $OUT/local.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1
python -m benchmarks profile ncu-hot --csv $OUT/sass.csv > $OUT/ncu-hot.txt 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit" $OUT/ncu-details.txt | head -30
head -30 $OUT/ncu-hot.txt
