#!/usr/bin/env bash
# Session 11, ninth device call: the n-gram targets on this session's tree (the short step's
# fused store and the split NaN fix change every verification step): bench_spec with the
# oracle at n-gram cost, k = 4, one stream at a = 0, 0.7, 1 and batches 1 and 128 at
# a = 0.7 (with the switch-off); then the whole tests/kernels suite natively.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 240 python3 bench_spec.py --model gpt2-xl --rates 0,0.7,1.0 --ks 4 --batches 1,128 \
  --out $R/ngram > $R/spec_ngram9.log 2>&1
el ngram; pack
cd ..
timeout 320 python3 -m pytest -q -p no:cacheprovider tests/kernels > $R/gpu_kernel_tests9.log 2>&1
echo "rc=$?" >> $R/gpu_kernel_tests9.log; tail -3 $R/gpu_kernel_tests9.log
el tests; pack
