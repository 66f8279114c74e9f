#!/bin/bash
# The H100 call of issue 9 (run through the `run` tool from a copy of this checkout; wheels already on PYTHONPATH):
# device facts, an import check of the carried ray/mlflow wheels, then bench/train_throughput.py at T = 2048, 8192,
# 32768 with 64k tokens per optimizer step. Results land in $OUT/results.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, ray, mlflow; from mlflow.tracking import MlflowClient; print('torch', torch.__version__, 'triton', triton.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)"
timeout "${BENCH_TIMEOUT:-500}" python3 bench/train_throughput.py --config configs/bench-train-gpu.yaml \
  --seq-lens 2048,8192,32768 --tokens-per-step 65536 --micro-tokens 32768 --warmup 2 --measure 4 \
  --commit "${COMMIT:-unknown}" --out "$OUT/results"
echo "bench rc=$?"
