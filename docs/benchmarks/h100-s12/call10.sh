#!/usr/bin/env bash
# Session 12, tenth device call, the final tree: the kernel test files that calls 1 and 9
# did not finish within their time limits (the skinny GEMM's, store_kv's, the backend's).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
timeout 540 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm_kernel.py \
  tests/kernels/test_store_kv_kernel.py tests/kernels/test_triton_backend.py \
  > $R/gpu_kernel_tests10.log 2>&1
echo "rc=$?" >> $R/gpu_kernel_tests10.log; tail -3 $R/gpu_kernel_tests10.log; el "kernel tests"; pack
