#!/usr/bin/env bash
# Session 10, fourth device call: a short step's per-token decode split by context length
# (SHORT_STEP_SPLIT_LEN positions a split) instead of by its mostly-padding row count. The
# attention tests at full size, scripts/profile_spec.py at split lengths 128 (the default)
# and 64, then bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1, twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_backend.py \
  tests/kernels/test_paged_attention_kernels.py > $R/gpu_tests.log 2>&1
echo "rc=$?" >> $R/gpu_tests.log; tail -3 $R/gpu_tests.log
el tests; pack
cd scripts
for split in 128 64; do
  timeout 200 python3 -c "
import runpy, sys
import kernels.backend
kernels.backend.SHORT_STEP_SPLIT_LEN = $split
sys.argv = ['profile_spec.py', '--model', 'gpt2-xl', '--draft-model', 'gpt2', '--k', '4',
            '--rate', '0.7', '--output-len', '64', '--show-steps', '1', '--out', '/tmp/prof']
runpy.run_path('profile_spec.py', run_name='__main__')" > $R/profile_spec4_split$split.log 2>&1
  cp /tmp/prof/profile_spec.json $R/profile_spec4_split$split.json
  el "profile split $split"; pack
done
for i in 1 2; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c4-run$i > $R/spec_draft4_run$i.log 2>&1
  el "spec run $i"; pack
done
