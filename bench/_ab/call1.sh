set -u
SHA=$1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/r
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gpu.py -k "two_streams" > $OUT/tests.txt 2>&1
tail -3 $OUT/tests.txt
T="125m:16:2048,125m:4:8192,125m:1:32768,paper:1:8192"
for mode in early off late; do
  echo "== $mode $(date +%T)" >> $OUT/log.txt
  timeout 170 python3 bench/kernels.py --skip-checks --timings $T --sections profile --suffix=-v26a-$mode \
    --commit $SHA --out $OUT/r --launch side_stream=$mode >> $OUT/log.txt 2>&1
  echo "rc=$? $(date +%T)" >> $OUT/log.txt
  grep -A8 "replayed as one CUDA graph" $OUT/r/*-v26a-$mode.md | grep "^|" | tail -4
done
