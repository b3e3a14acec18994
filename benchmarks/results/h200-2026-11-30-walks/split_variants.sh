# per-kernel GPU time of each variant: base (HEAD), even (whole chunks only), back (sums last chunk
# first only), new (both; the tree)
D=$PWD/benchmarks/results/h200-2026-11-30-walks
R=$PWD
mkdir -p $OUT/sv
S="scalar:4,2048,16,128,128 scalar:2,4096,16,128,128 scalar:1,8192,16,128,128 scalar:8,2048,16,128,128 vector:8,2048,16,128,128 vector:8,1024,8,64,64 scalar:1,8192,96,64,64"
for ver in base even back new; do
  case $ver in base) V=$R/_base;; even) V=$R/_v_even;; back) V=$R/_v_back;; new) V=$R;; esac
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 100 python $D/kernel_split.py $S > $OUT/sv/$ver.txt 2>&1)
  echo "== $ver rc=$?"; grep "^| [sv]" $OUT/sv/$ver.txt
done
