export PYTHONPATH=$PWD
for shape in 1,8192,96,128,128 8,2048,4,256,512 8,1024,8,64,64 4,2048,16,128,128; do
  for gate in vector scalar; do
    timeout 110 python3 benchmarks/gpu_ablate.py --shape $shape --gate $gate --out $OUT/sweep_${gate}_${shape//,/_}.json \
      --only "base|local_bv64_w4|local_bv64_w4_lw8|local_bv128_w8_lw8|local_bv32_w4_lw8|local_bv64_w8_lw8" 2>&1 | grep "^|" | grep -v -- "---"
  done
done
