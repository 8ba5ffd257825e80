#!/usr/bin/env bash
# Session 11, tenth device call: call 9's n-gram run at a = 0 (every draft rejected) changed
# the greedy output at token 47. Fp16 rounding or a bug? The same run in fp16 again, then in
# float32 (bench_spec's --dtype, for exactly this question); then the CUDA graph and
# speculative-decoding tests natively.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for dtype in float16 float32; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --rates 0,0.7,1.0 --ks 4 --batches 1 \
    --dtype $dtype --out $R/ngram-$dtype > $R/spec_ngram10_$dtype.log 2>&1
  el "ngram $dtype"; grep -o '"a": [0-9.]*, "speedup": [0-9.]*\|diverged_at": [0-9a-z]*' \
    $R/spec_ngram10_$dtype.log | paste - - ; pack
done
cd ..
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py tests/test_spec_*.py > $R/gpu_tests10.log 2>&1
echo "rc=$?" >> $R/gpu_tests10.log; tail -3 $R/gpu_tests10.log
el tests; pack
