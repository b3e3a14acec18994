#!/usr/bin/env bash
# On the GPU machine, from the repo root: transformers' Mamba2 (torch path) eager vs default Inductor vs
# gla_inductor (benchmarks/gpu_mamba2.py). Results go to $OUT (or benchmarks/results): NAME.json, NAME.md,
# NAME.log, NAME_tracebacks.txt (NAME: $NAME, default mamba2). Wheels in .whl/ are installed to /tmp/site first.
#   PHASES=mixer bash benchmarks/gpu_mamba2.sh                # the 1.3B-like layer and the 5x target only
#   PHASES=prefill,decode NAME=mamba2_model bash benchmarks/gpu_mamba2.sh
# Budgets: GLA_BENCH_PHASE_S (per phase, default 420 s), GLA_BENCH_TOTAL_S (default 560 s); BENCH_TIMEOUT kills
# the whole run (default 580 s): results are written after every phase, so a kill keeps the finished ones.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results}
NAME=${NAME:-mamba2}
mkdir -p "$OUT"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PY=/opt/torch/.venv/bin/python; else PY=python3; fi
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null | head -1
timeout ${BENCH_TIMEOUT:-580} $PY benchmarks/gpu_mamba2.py --out "$OUT" --name "$NAME" \
  --phases ${PHASES:-mixer,prefill,decode,mixer_grouped} $EXTRA_ARGS 2>&1 | tee "$OUT/$NAME.log" | grep -v "^{" | tail -30
