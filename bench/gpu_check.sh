#!/usr/bin/env bash
# The engine's CUDA path on a lent GPU (issue 16, item 6): correctness first, then benchmarks 3 and 2.
# Run from a tree holding backends/ and bench/, with a model folder: `bash bench/gpu_check.sh MODEL [DEVICE]`.
# Everything goes to stdout and to $OUT/gpu_log.txt (or ./gpu_log.txt). Each part is time-boxed.
set -u
MODEL=${1:?model folder}
DEVICE=${2:-cuda}
PY=${PYTHON:-python3}
LOG=${OUT:-.}/gpu_log.txt
export PYTHONUNBUFFERED=1
B3_STEPS=${B3_STEPS:-200}
B3_SIZE=${B3_SIZE:-"--streams 256 --tokens 1024"}
B2_STREAMS=${B2_STREAMS:-"16 64 128"}
B2_TIMEOUT=${B2_TIMEOUT:-200}
{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC')  device $DEVICE  model $MODEL"
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  $PY -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  echo "== correctness"
  timeout 90 $PY -m bench.gpu_check --device "$DEVICE" --model "$MODEL"; echo "gpu_check rc $?"
  for run in 1 2 3; do
    echo "== benchmark 3, run $run: python -m bench.engine --steps $B3_STEPS --policies token-pd token-pd-ewma --device $DEVICE $B3_SIZE"
    timeout 90 $PY -m bench.engine --steps "$B3_STEPS" --policies token-pd token-pd-ewma --device "$DEVICE" $B3_SIZE \
      | grep '^overhead'; echo "rc ${PIPESTATUS[0]}"
  done
  echo "== benchmark 3, the other policies once"
  timeout 60 $PY -m bench.engine --steps "$B3_STEPS" --policies fifo lru h2o global-top-m token-pd-per-request \
    --device "$DEVICE" $B3_SIZE | grep '^overhead'; echo "rc ${PIPESTATUS[0]}"
  B2="$PY -m bench.engine --streams 4 --tokens 16 --steps 1 --policies fifo --device $DEVICE --throughput --throughput-mode inprocess --model $MODEL --throughput-streams $B2_STREAMS"
  echo "== benchmark 2 (timeout ${B2_TIMEOUT}s): $B2"
  timeout "$B2_TIMEOUT" $B2; echo "rc $?"
  echo "== done $(date -u '+%H:%M:%S UTC')"
} 2>&1 | tee "$LOG"
