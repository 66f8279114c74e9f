set -u
SHA=$1
mkdir -p $OUT/r
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py > $OUT/r/tests-gpu-h100-2026-11-24-v26c.txt 2>&1
tail -1 $OUT/r/tests-gpu-h100-2026-11-24-v26c.txt
timeout 270 python3 bench/kernels.py --skip-checks --timings 125m:16:2048,125m:4:8192,125m:1:32768,paper:1:8192,paper:1:65536 --sections profile --suffix=-v26c --commit $SHA --out $OUT/r > $OUT/log.txt 2>&1
echo "bench rc=$?"
grep -A9 "replayed as one CUDA graph" $OUT/r/*-v26c.md | grep "^|"
timeout 100 python3 bench/kernels.py --skip-checks --timings 125m:16:2048,125m:4:8192,125m:1:32768 --sections profile --suffix=-v26c-one-stream --commit $SHA --out $OUT/r --launch side_stream=False >> $OUT/log.txt 2>&1
echo "bench rc=$?"
grep -A9 "replayed as one CUDA graph" $OUT/r/*-v26c-one-stream.md | grep "^|"
