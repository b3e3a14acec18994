# packed sequences: HEAD (in _base) against the tree (each packed sequence's walk cut as far as its
# length asks); ours only, one process per version, then the tree against FLA in one process
R=$PWD
mkdir -p $OUT/va
for ver in base new; do
  case $ver in base) V=$R/_base;; new) V=$R;; esac
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 150 python -m benchmarks varlen --impls ours --rounds 5 --out $OUT/va --name varlen-$ver > $OUT/va/varlen-$ver.log 2>&1)
  echo "== $ver rc=$?"; grep -E "^\| (8x2048|mixed12)" $OUT/va/varlen-$ver.md | head -20
done
for ver in base new; do
  case $ver in base) V=$R/_base;; new) V=$R;; esac
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 100 python $R/benchmarks/results/h200-2026-11-30-walks/varlen_split.py > $OUT/va/split-$ver.txt 2>&1)
  echo "== split $ver rc=$?"; grep "^| [m8]" $OUT/va/split-$ver.txt
done
