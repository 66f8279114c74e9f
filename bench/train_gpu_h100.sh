#!/bin/bash
# The H100 call of issue 9 (run through the `run` tool from a copy of this checkout; wheels already on PYTHONPATH):
# device facts, an import check of the carried ray/mlflow wheels, then bench/train_throughput.py with 64k tokens per
# optimizer step at SEQ_LENS (default 32768,8192). Each run (compile, Ray start, 6 steps) takes 80-115 s on the
# H100, so all three T (six runs) do not fit in one 10-minute call: run SEQ_LENS=2048 in a second call.
# Arguments go on to bench/train_throughput.py (e.g. --nsa-set train.attention_recompute=true --tag -recompute).
# Results land in $OUT/results.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, ray, mlflow; from mlflow.tracking import MlflowClient; print('torch', torch.__version__, 'triton', triton.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)"
timeout "${BENCH_TIMEOUT:-500}" python3 bench/train_throughput.py --config configs/bench-train-gpu.yaml \
  --seq-lens "${SEQ_LENS:-32768,8192}" --tokens-per-step 65536 --micro-tokens 32768 --warmup 2 --measure 4 \
  --commit "${COMMIT:-unknown}" --out "$OUT/results" "$@"
echo "bench rc=$?"
