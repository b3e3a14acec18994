R=$PWD
mkdir -p $OUT/va
for ver in base new f75; do
  case $ver in base) V=$R/_base;; new) V=$R;; f75) V=$R/_v_f75;; esac
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 110 python -m benchmarks varlen --impls ours --rounds 5 --out $OUT/va --name varlen-$ver > $OUT/va/varlen-$ver.log 2>&1)
  echo "== $ver rc=$?"; grep -E "^\| (8x2048|mixed12)" $OUT/va/varlen-$ver.md | grep -v events | head -8
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 80 python $R/benchmarks/results/h200-2026-11-30-walks/varlen_split.py > $OUT/va/split-$ver.txt 2>&1)
  echo "== split $ver rc=$?"; grep "^| [m8]" $OUT/va/split-$ver.txt | sed 's/gla_chunk_//g'
done
