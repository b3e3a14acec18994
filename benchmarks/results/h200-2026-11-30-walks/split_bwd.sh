# per-kernel GPU time of forward + backward: base (HEAD) against even (whole chunks only); then the
# registers and spills of the carries the even variant compiled (Triton's cache, cuobjdump)
D=$PWD/benchmarks/results/h200-2026-11-30-walks
R=$PWD
mkdir -p $OUT/sb
S="scalar+bwd:4,2048,16,128,128 scalar+bwd:1,8192,16,128,128 scalar+bwd:8,2048,16,128,128 vector+bwd:8,2048,16,128,128 vector+bwd:8,1024,8,64,64"
for ver in base even; do
  case $ver in base) V=$R/_base;; even) V=$R/_v_even;; esac
  export TRITON_CACHE_DIR=/tmp/tc-$ver; rm -rf $TRITON_CACHE_DIR
  (cd $V && PYTHONPATH=/tmp/site:$V:$R timeout 150 python $D/kernel_split.py $S scalar:4,2048,16,128,128 > $OUT/sb/$ver.txt 2>&1)
  echo "== $ver rc=$?"; grep "^| [sv]" $OUT/sb/$ver.txt
  B=$(python -c "import triton,os;print(os.path.dirname(triton.__file__))")/backends/nvidia/bin
  for c in $(ls $TRITON_CACHE_DIR/*/gla_chunk_*.cubin 2>/dev/null); do
    n=$(basename $c .cubin)
    py=$(grep -o '"/[^"]*gla_chunk_[^"]*\.py"' $(dirname $c)/$n.source | head -1 | tr -d '"')
    m=$(grep -oE '(SEGMENTS|SEGMENT_SUMS|TERMS|EVEN_T|DUAL|WRITE_OUT|STORE_STATES): tl.constexpr = [A-Za-z0-9]+' $py 2>/dev/null | sed 's/: tl.constexpr = /=/' | tr '\n' ' ')
    echo "$n $m $($B/cuobjdump -res-usage $c 2>/dev/null | grep -o 'REG:[0-9]* STACK:[0-9]*')"
  done | sort | uniq >> $OUT/sb/$ver-regs.txt
  cat $OUT/sb/$ver-regs.txt
done
