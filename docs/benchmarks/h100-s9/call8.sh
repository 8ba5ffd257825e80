#!/usr/bin/env bash
# Session 9, eighth device call: the CUDA-only tests on the final code (graphs against eager,
# the kernels at full size natively).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/kernels \
  > $R/gpu_tests.log 2>&1
echo "rc=$?" >> $R/gpu_tests.log
tail -5 $R/gpu_tests.log
tar czf $OUT/results.tgz -C $R .
