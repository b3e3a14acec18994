# packed sequences cut by their lengths, the later segments first, the sums in four pieces, and no
# sums programs for the last segment: HEAD (in _base) against the tree, ours only, one process per
# version; per-kernel times; fixed-length segmented shapes (the sums' smaller grid) by tune ab
D=$PWD/benchmarks/results/h200-2026-11-30-walks
R=$PWD
mkdir -p $OUT/pk
for ver in base new; do
  case $ver in base) V=$R/_base;; new) V=$R;; esac
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 120 python -m benchmarks varlen --impls ours --rounds 5 --out $OUT/pk --name varlen-$ver > $OUT/pk/varlen-$ver.log 2>&1)
  echo "== $ver rc=$?"; grep -E "^\| (8x2048|mixed12)" $OUT/pk/varlen-$ver.md | grep -v events
done
(PYTHONPATH=/tmp/site:$R timeout 60 python $D/varlen_split.py > $OUT/pk/split-new.txt 2>&1); grep "^| [m8]" $OUT/pk/split-new.txt
CASES="4,2048,16,128,128:scalar;2,4096,16,128,128:scalar;1,8192,16,128,128:scalar;8,1024,8,64,64:scalar;1,8192,96,64,64:scalar;8,1024,8,64,64:vector"
timeout 200 python -m benchmarks tune ab --versions base=_base,new=. --cases "$CASES" --rounds 2 --out $OUT/pk --name ab-fixed > $OUT/pk/ab-fixed.log 2>&1
echo "ab rc=$?"; grep -E "^\|" $OUT/pk/ab-fixed.md
