set -u
SHA=$1
mkdir -p $OUT/r
F=nsa_model/ops/triton_impl.py
cp $F /tmp/ti.orig
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py > $OUT/r/tests-gpu-h100-2026-11-24-v26.txt 2>&1
tail -2 $OUT/r/tests-gpu-h100-2026-11-24-v26.txt
for mut in "            self.stream.wait_stream(main)" "        main.wait_stream(self.stream)"; do
  python3 - "$mut" <<'PY'
import sys; p='nsa_model/ops/triton_impl.py'; s=open(p).read(); m=sys.argv[1]
assert s.count(m+"\n")==1, m; s=s.replace(m+"\n", m[:len(m)-len(m.lstrip())]+"pass  # mutated\n"); open(p,'w').write(s)
PY
  echo "== mutation: $mut" >> $OUT/mutations.txt
  timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gpu.py -k two_streams 2>&1 | grep -E "passed|failed|assert|Error" | head -4 >> $OUT/mutations.txt
  cp /tmp/ti.orig $F
done
cat $OUT/mutations.txt
timeout 280 python3 bench/kernels.py --skip-checks --timings 125m:16:2048,125m:4:8192,125m:1:32768,paper:1:8192,paper:1:65536 --sections profile --suffix=-v26b --commit $SHA --out $OUT/r > $OUT/log.txt 2>&1
echo "bench rc=$?"
grep -A9 "replayed as one CUDA graph" $OUT/r/*-v26b.md | grep "^|"
