# A/B: the tree (sums summed last chunk first, whole chunks without step masks) against HEAD (in _base),
# forward and backward in CUDA graphs, one process per version; then repeats of the new forward
D=benchmarks/results/h200-2026-11-30-walks
mkdir -p $OUT/ab
CASES="4,2048,16,128,128:scalar;2,4096,16,128,128:scalar;1,8192,16,128,128:scalar;8,1024,8,64,64:scalar;1,8192,96,64,64:scalar;8,2048,16,128,128:scalar;8,1024,8,64,64:vector;8,2048,16,128,128:vector;1,8192,16,128,128:vector;8,1000,8,64,64:scalar"
timeout 420 python -m benchmarks tune ab --versions base=_base,new=. --cases "$CASES" --rounds 3 --out $OUT/ab --name ab > $OUT/ab/ab.log 2>&1
echo "ab rc=$?"; grep -E "^\|" $OUT/ab/ab.md | head -30
timeout 150 python $D/race.py > $OUT/ab/race.md 2>&1; echo "race rc=$?"; cat $OUT/ab/race.md | tail -12
