# block training step, compiled with our backend: base (HEAD before the change, in _base) against the tree
mkdir -p $OUT/blk
R=$PWD
for shape in ${SHAPES:-4,2048,16,128,128 1,8192,16,128,128 8,2048,16,128,128}; do
  for ver in base new; do
    if [ $ver = base ]; then D=$R/_base; else D=$R; fi
    (cd $D && PYTHONPATH=/tmp/site:$D:$R timeout 100 python -m benchmarks block --variants ours --shape $shape --out $OUT/blk --name $ver-$shape > $OUT/blk/$ver-$shape.log 2>&1)
    echo "$ver $shape rc=$? $(grep -E '^\| ours' $OUT/blk/$ver-$shape.md 2>/dev/null | head -1)"
  done
done
