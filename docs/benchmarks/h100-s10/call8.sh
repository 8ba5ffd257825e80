#!/usr/bin/env bash
# Session 10, eighth device call (call 7 again, after its device-side assert: a catch-up graph read NO_TOKEN as a token id for rows without a catch-up; now clamped): the catch-up folded into the draft's chain graphs (a graph
# per batch size, replayed before the iterations when a row accepted every draft; the draft
# runner captures no step graphs of its own). The CUDA-only graph and attention tests, then
# scripts/profile_spec.py and bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1, twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 1 --out /tmp/prof > $R/profile_spec8.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec8.json
el profile; pack
for i in 1 2; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c8-run$i > $R/spec_draft8_run$i.log 2>&1
  el "spec run $i"; pack
done
cd ..
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py tests/kernels/test_paged_attention_kernels.py \
  tests/kernels/test_triton_backend.py > $R/gpu_tests.log 2>&1
echo "rc=$?" >> $R/gpu_tests.log; tail -3 $R/gpu_tests.log
el tests; pack
