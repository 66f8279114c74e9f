#!/bin/bash
# A Ray Tune sweep on a GPU host (run through the `run` tool from a copy of this checkout, wheels on PYTHONPATH):
# jobs/sweep.py with configs/sweep-125m-gpu.yaml, nsa-125m at T = 8192 over l' x n, one GPU a trial and as many
# trials at once as the host has GPUs (the sweep derives it from the cluster and logs why). The whole path runs as a
# user's sweep does: the corpus built and packed once by Ray Data, each trial a Ray Train TorchTrainer on our Triton
# kernels, the trials MLflow child runs of the sweep's run, its summary CSV and Pareto plot logged there.
# What comes back under $OUT: the sweep's log, summary.csv, pareto.png and the MLflow file store (mlruns.tgz), which
# bench/sweep_report.py reads into the record:
#   python bench/sweep_report.py --mlruns <unpacked>/mlruns --sweep sweep-125m-gpu --device "2x NVIDIA H200" \
#       --commit <sha> --pareto <files>/pareto.png --tag=-h200x2-vNN
# Wheels: .whl_ray as bench/train_gpu_scaling.sh's header says, with ray's three ELF binaries (gcs_server, raylet,
# _raylet.so) stripped of their symbol tables (strip --strip-unneeded; RECORD's hashes and sizes updated): 47.6 MiB,
# which with the tree (12.8 MiB, both counted in disk blocks as the tool counts them) fits a call's 64 MiB.
# SWEEP_LIMIT (seconds, default 540) stops the sweep in time for what ran to be packed within a call's 600 s: a
# trial cut short stays UNFINISHED in the store, and the same command on a host that keeps $STORE resumes it.
# EXTRA adds overrides (e.g. EXTRA="--set tune.sel_block=[64] --set tune.token_budget=1310720" for a short check).
set -u
export MLFLOW_ALLOW_FILE_STORE=true  # MLflow 3.x file store opt-in; the GPU host has no sqlalchemy for sqlite
STORE=${STORE:-/tmp/sweep-gpu}
mkdir -p "$STORE"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
SECONDS=0
ARGS=(--config configs/sweep-125m-gpu.yaml --set "data.output_dir=$STORE/outputs"
      --set "tune.storage_path=$STORE/ray_results" --set "tracking.tracking_uri=file:$STORE/mlruns")
# shellcheck disable=SC2086  # EXTRA is a list of words
timeout --signal=INT --kill-after=20 "${SWEEP_LIMIT:-540}" python3 jobs/sweep.py "${ARGS[@]}" ${EXTRA:-} \
  > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? after ${SECONDS}s"
for f in summary.csv pareto.png; do
  cp "$STORE/ray_results/sweep-125m-gpu/$f" "$OUT/" 2>/dev/null || echo "no $f"
done
tar czf "$OUT/mlruns.tgz" -C "$STORE" mlruns 2>/dev/null
grep -a -A12 "^sweep sweep-125m-gpu:" "$OUT/sweep.log" || tail -30 "$OUT/sweep.log"
