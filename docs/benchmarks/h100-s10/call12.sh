#!/usr/bin/env bash
# Session 10, twelfth device call: after the catch-up forward became one function for the
# chain graphs and the eager path (feed_for_kv), the CUDA chain tests again.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py -k "chain or draft" > $R/gpu_tests12.log 2>&1
echo "rc=$?" >> $R/gpu_tests12.log; tail -3 $R/gpu_tests12.log
tar czf $OUT/results.tgz -C $R .
