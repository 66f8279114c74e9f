#!/bin/bash
# First GPU call after a change to the core's plumbing (run through the `run` tool from a copy of this checkout,
# about 9.5 minutes on one H100; needs only torch and triton): the Triton kernel tests compiled for the GPU (fp32,
# the nsa::core custom op under torch.compile included; on the H100 they take over 240 s, most of it compiling),
# then the model alone, compiled, NSA against dense at T = 2048 and 32768 with the memory breakdown at each step's
# peak. The bf16 checks against float64 (tests/test_triton_gpu.py) are the same as bench/kernels.py's, which runs
# them before it times anything. Results land in $OUT; read bench/results/kernels-notes.md and
# train-summary.md for what to compare them with.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py \
  --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -15
echo "tests rc=${PIPESTATUS[0]}"
timeout 270 python3 bench/model_step.py --seq-lens 2048,32768 --memory --warmup 2 --measure 3 \
  --out "$OUT" --suffix="${SUFFIX:--validate}" --commit "${COMMIT:-unknown}" 2>&1 | tail -40
echo "model_step rc=${PIPESTATUS[0]}"
