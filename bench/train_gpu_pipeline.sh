#!/bin/bash
# Issue 9's pipeline call on a host with 2 GPUs (run through the `run` tool from a copy of this checkout, wheels on
# PYTHONPATH). Everything writes under $STORE; logs and the MLflow file store (metrics, params; no model weights)
# come back under $OUT. Phases:
#   0  build the installed-packages embedded corpus once; create the MLflow experiment (the two runs of phase A
#      would race to create it)
#   A  the scaling and quality baselines at once, one GPU each: nsa-125m and nsa-125m-dense on 1 GPU
#   B  nsa-125m on 2 GPUs (NCCL; the config's parallelism), stopped after the step-120 (STOP_STEP) checkpoint, then rerun: it resumes there
# bench/train_pipeline_report.py reads the MLflow store back into the numbers and the plot.
set -u
# MLflow 3.x keeps its file store behind this opt-in; the GPU host has no sqlalchemy for a sqlite store.
export MLFLOW_ALLOW_FILE_STORE=true
STORE=${STORE:-/tmp/issue9}
CONFIG=${CONFIG:-configs/nsa-125m-2gpu.yaml}
mkdir -p "$STORE"
URI="file:$STORE/mlruns"
COMMON=(--config "$CONFIG" --set "data.output_dir=$STORE/outputs" --set "train.storage_path=$STORE/ray_results"
        --set "tracking.tracking_uri=$URI" ${EXTRA:-})
ONE_GPU=(--set train.num_workers=1 --set train.checkpoint_every=0 --set tracking.registered_model_name=null)
nvidia-smi --query-gpu=name,memory.total --format=csv || true
SECONDS=0
python3 - "$STORE" "$URI" "$CONFIG" <<'PY'
import sys
from mlflow.tracking import MlflowClient
from pipeline.config import load_job_config
from pipeline.data.corpus import ensure_corpus
from pipeline.tracking import default_artifact_location
store, uri, config = sys.argv[1:]
job = load_job_config(config)
print(ensure_corpus(f"{store}/outputs", job.data.embedded_scope, progress=False))
client = MlflowClient(uri)
if client.get_experiment_by_name(job.tracking.experiment) is None:
    client.create_experiment(job.tracking.experiment, artifact_location=default_artifact_location(uri, f"{store}/outputs"))
PY
[ $? -eq 0 ] || { echo "phase 0 failed"; exit 1; }
echo "phase 0 done at ${SECONDS}s"
GPU_A=${GPU_A:-0}; GPU_B=${GPU_B:-1}
CUDA_VISIBLE_DEVICES=$GPU_A python3 jobs/pretrain.py "${COMMON[@]}" "${ONE_GPU[@]}" --set train.run_name=nsa-1gpu \
  > "$OUT/nsa-1gpu.log" 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=$GPU_B python3 jobs/pretrain.py "${COMMON[@]}" "${ONE_GPU[@]}" --set train.run_name=dense-1gpu \
  --set model.preset=${DENSE_PRESET:-nsa-125m-dense} > "$OUT/dense-1gpu.log" 2>&1 &
B=$!
wait $A; echo "nsa-1gpu rc=$?"; wait $B; echo "dense-1gpu rc=$?"
echo "phase A done at ${SECONDS}s"
tar czf "$OUT/mlruns.tgz" -C "$STORE" mlruns  # what phase A measured comes back even if phase B runs out of time
python3 jobs/pretrain.py "${COMMON[@]}" --set train.run_name=nsa-2gpu --set train.debug.stop_after_step=${STOP_STEP:-120} \
  > "$OUT/nsa-2gpu-a.log" 2>&1; echo "nsa-2gpu (stop at 120) rc=$?"
python3 jobs/pretrain.py "${COMMON[@]}" --set train.run_name=nsa-2gpu > "$OUT/nsa-2gpu-b.log" 2>&1
echo "nsa-2gpu (resumed) rc=$?"
echo "phase B done at ${SECONDS}s"
tar czf "$OUT/mlruns.tgz" -C "$STORE" mlruns
grep -ah "resumed from\|^step \|done in\|Error" "$OUT"/nsa-2gpu-*.log | tail -8
