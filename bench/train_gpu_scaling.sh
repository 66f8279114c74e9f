#!/bin/bash
# Issue 9's scaling and GPU resume check, short form for a host with 2 GPUs (run through the `run` tool from a copy
# of this checkout, wheels on PYTHONPATH): nsa-125m at T=2048 through the whole pipeline (Ray Data -> Ray Train DDP
# over NCCL -> MLflow file store) on the stdlib embedded corpus in byte tokens, 40 steps of 16 x 2048 tokens,
# compiled with CUDA graphs and gradients summed by one all-reduce per step (configs/nsa-125m-2gpu.yaml).
# 40 steps, because a rank's share of this small corpus ends after 329 blocks (41 steps on 2 GPUs, 52 on one):
# there it wraps into its next epoch and Ray Data runs the stream again, a 5-7 s stall of every rank (measured,
# train-summary.md). A pretraining corpus does not wrap within a run; the measurement stays before the wrap.
#   B1  nsa-2gpu: 2 GPUs, stopped after the step-20 checkpoint
#   A   nsa-1gpu: the same config on 1 GPU, the scaling baseline, timed in the same call
#   B2  nsa-2gpu rerun under the same run name: must resume at step 20 and finish
# The MLflow store is packed into $OUT after every phase, so a call cut short still returns what ran.
# The carried wheels need ray[default]'s dashboard packages: jobs/pretrain.py starts its local cluster with the State
# API (pipeline/ray_cluster.py). Made with ../shared/tools/gpu_wheels.py .whl_ray "ray[default,train,data,tune]==2.60.0"
# mlflow-skinny, then py_spy, virtualenv, distlib, platformdirs and python_discovery left out to fit a call's 64 MiB
# (with mlflow-skinny 3.17 also cryptography, cffi, pycparser, gitpython, gitdb, smmap, tzdata and tensorboardx:
# none is imported by ray.init with the dashboard, Ray Data or MLflow's file store; stop 38 ran it so on 2 H100s).
# The call's 64 MiB counts files by disk blocks: at stop 68 the tree took 12 MB so, and the wheels fit only with
# ray/rllib/, ray/llm/ and the dashboard's *.js.map also dropped from ray's wheel (and from its RECORD): 54.6 MB.
# Read back with bench/train_pipeline_report.py --resume-step 20.
set -u
export MLFLOW_ALLOW_FILE_STORE=true  # MLflow 3.x file store opt-in; the GPU host has no sqlalchemy for sqlite
STORE=${STORE:-/tmp/issue9s}
mkdir -p "$STORE"
URI="file:$STORE/mlruns"
COMMON=(--config configs/nsa-125m-2gpu.yaml --set "data.output_dir=$STORE/outputs" --set data.embedded_scope=stdlib
        --set data.val_fraction=0.08 --set "train.storage_path=$STORE/ray_results" --set "tracking.tracking_uri=$URI"
        --set train.max_steps=40 --set train.warmup_steps=6 --set train.log_every=5 --set train.val_every=20
        --set train.checkpoint_every=20 --set tracking.registered_model_name=null)
pack() { tar czf "$OUT/mlruns.tgz" -C "$STORE" mlruns 2>/dev/null; echo "$1 done at ${SECONDS}s"; }
SECONDS=0
python3 - "$URI" "$STORE" <<'PY'
import sys
from mlflow.tracking import MlflowClient
from pipeline.tracking import default_artifact_location
uri, store = sys.argv[1:]
client = MlflowClient(uri)
if client.get_experiment_by_name("nsa-issue9") is None:
    client.create_experiment("nsa-issue9", artifact_location=default_artifact_location(uri, f"{store}/outputs"))
PY
python3 jobs/pretrain.py "${COMMON[@]}" --set train.run_name=nsa-2gpu --set train.debug.stop_after_step=20 \
  > "$OUT/nsa-2gpu-a.log" 2>&1; echo "nsa-2gpu (stop at 20) rc=$?"; pack B1
CUDA_VISIBLE_DEVICES=0 python3 jobs/pretrain.py "${COMMON[@]}" --set train.num_workers=1 --set train.run_name=nsa-1gpu \
  > "$OUT/nsa-1gpu.log" 2>&1; echo "nsa-1gpu rc=$?"; pack A
python3 jobs/pretrain.py "${COMMON[@]}" --set train.run_name=nsa-2gpu > "$OUT/nsa-2gpu-b.log" 2>&1
echo "nsa-2gpu (resumed) rc=$?"; pack B2
grep -ah "resumed from\|tok/s\|done in\|Error" "$OUT"/nsa-*.log | tail -12
