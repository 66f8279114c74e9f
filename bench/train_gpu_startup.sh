#!/bin/bash
# The training loop's startup on a node whose local compile caches are empty, with and without the shared compile
# cache (train.compile_cache, pipeline/train/compile_cache.py). Run on a GPU host through the `run` tool, from a
# copy of this checkout with the ray wheels on PYTHONPATH (bench/train_gpu_scaling.sh's header). Three runs of
# jobs/pretrain.py, one after the other, each with Triton and inductor cache folders of its own (a fresh node):
#   first    the run that finds nothing in the shared cache and saves to it after its second step
#   new-node another run over the same storage: it loads what the first saved before its first step
#   control  compile_cache off: a cold node as before, timed in the same call as the other two
# Each run's `startup:` line (rank 0's, pipeline/train/loop.py's Startup) and its losses go to $OUT/startup.md;
# the logs to $OUT/<run>.log. The shared cache folder's listing goes there too.
# An A/B of a loop change on new nodes: RUNS names the runs in order (a name starting with "control" has the cache
# off), and a name holding "-base" runs from BASE_TREE, a copy of the checkout at the commit compared against, e.g.
#   BASE_TREE=/tmp/base RUNS="first new-node-a new-node-base-a new-node-b new-node-base-b" \
#     bash bench/train_gpu_startup.sh
set -u
export MLFLOW_ALLOW_FILE_STORE=true
WORK=${WORK:-/tmp/train-startup}
rm -rf "$WORK" && mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
COMMON=(--config configs/bench-train-gpu.yaml --set data.seq_len=2048 --set train.micro_batch=8
        --set train.global_batch=16 --set train.max_steps=8 --set train.warmup_steps=2 --set train.log_every=4
        --set train.val_every=0 --set train.checkpoint_every=0 --set train.val_batches=1
        --set "data.output_dir=$WORK/data" --set "train.storage_path=$WORK/ray_results")
{
  echo "| run | startup line | loss step 4 / 8 |"
  echo "|---|---|---|"
} > "$OUT/startup.md"
for run in ${RUNS:-first new-node control}; do
  share=true
  case "$run" in control*) share=false ;; esac
  tree=.
  case "$run" in *-base*) tree=${BASE_TREE:?a run named *-base* needs BASE_TREE} ;; esac
  SECONDS=0
  # the tree's own packages first, for the driver and the workers of the Ray cluster the run starts
  (cd "$tree" && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_CACHE_DIR="$WORK/$run/triton" \
    TORCHINDUCTOR_CACHE_DIR="$WORK/$run/inductor" && \
    timeout 240 python3 jobs/pretrain.py "${COMMON[@]}" --set "train.run_name=$run" \
    --set "train.compile_cache=$share" > "$OUT/$run.log" 2>&1)
  echo "$run rc=$? after ${SECONDS}s"
  line=$(grep -a -o "startup: .*" "$OUT/$run.log" | tail -1)
  # Ray prints a worker's line twice in the driver's log (its own and the job's stream): each step's once
  losses=$(grep -a -o -E "step [48]/8 \| loss [0-9.]+" "$OUT/$run.log" | awk '!seen[$0]++ {print $NF}' \
           | paste -sd/ -)
  echo "| $run | ${line:-none} | ${losses:-?} |" >> "$OUT/startup.md"
done
ls -la "$WORK/ray_results/compile_cache" > "$OUT/compile_cache_listing.txt" 2>&1
cp "$WORK"/ray_results/compile_cache/*.json "$OUT/" 2>/dev/null
cat "$OUT/startup.md"
