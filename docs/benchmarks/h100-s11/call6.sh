#!/usr/bin/env bash
# Session 11, sixth device call: call 5's bench died capturing the draft chain for batch
# sizes up to 128 (an out-of-range token id in an iteration's warm-up, after the catching-up
# warm-up had overwritten the first iteration's outputs); the catching-up graph is now
# captured after the iterations. bench_spec --draft-model gpt2, k = 4, a = 0.7 and 1, three
# times, then the chain tests.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for i in 1 2 3; do
  CUDA_LAUNCH_BLOCKING=0 timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 \
    --ks 4 --rates 0.7,1.0 --out $R/draft-gpt2-c6-run$i > $R/spec_draft6_run$i.log 2>&1
  el "spec run $i"; grep -c '"k"' $R/spec_draft6_run$i.log; pack
done
cd ..
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_draft_chain.py \
  tests/test_spec_draft_model.py > $R/gpu_tests6.log 2>&1
echo "rc=$?" >> $R/gpu_tests6.log; tail -2 $R/gpu_tests6.log
el tests; pack
