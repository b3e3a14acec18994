# per-kernel split, then Nsight Compute on the scalar forward's two carries at (4, 2048, 16, 128, 128)
# and on the vector forward's three kernels at (8, 1024, 8, 64, 64)
D=benchmarks/results/h200-2026-11-30-walks
mkdir -p $OUT/p
timeout 150 python $D/kernel_split.py > $OUT/p/split.txt 2>&1; echo "split rc=$?"; tail -12 $OUT/p/split.txt
prof() {  # name gate shape regex skip count
  timeout 150 ncu --set full --import-source yes -k "regex:$4" --launch-skip $5 -c $6 -f -o $OUT/p/$1 \
    python -m benchmarks profile ncu --gate $2 --shape $3 > $OUT/p/$1.log 2>&1; echo "$1 rc=$?"
  ncu --import $OUT/p/$1.ncu-rep --page details > $OUT/p/$1-details.txt 2>&1
  ncu --import $OUT/p/$1.ncu-rep --page source --csv --print-source sass > $OUT/p/$1-sass.csv 2>&1
  ncu --import $OUT/p/$1.ncu-rep --page source --csv --print-source cuda > $OUT/p/$1-src.csv 2>&1
}
prof scalar4 scalar 4,2048,16,128,128 gla_chunk_carry 6 2
prof vector8 vector 8,1024,8,64,64 "gla_chunk_local|gla_chunk_carry" 9 3
rm -f $OUT/p/*.ncu-rep
ls -la $OUT/p
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy" $OUT/p/*-details.txt | head -60
tar -czf $OUT/p.tgz -C $OUT p && rm -rf $OUT/p
