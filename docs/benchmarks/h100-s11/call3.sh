#!/usr/bin/env bash
# Session 11, third device call: call 2's fused store reworked (the key loop as before, the
# step's own keys one more tile after it: call 2's stores inside the loop cost 4 us a layer),
# and the skinny table measured at M = 16 too (the 16-token mixed graph). The kernel and graph tests at full size, then profile_spec.py and
# bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1, twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention_kernels.py \
  tests/kernels/test_triton_backend.py tests/kernels/test_store_kv_kernel.py \
  tests/test_draft_chain.py > $R/gpu_tests3.log 2>&1
echo "rc=$?" >> $R/gpu_tests3.log; tail -3 $R/gpu_tests3.log
el tests; pack
cd scripts
timeout 240 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 1 --out /tmp/prof > $R/profile_spec3.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec3.json
el profile; pack
for i in 1 2; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c3-run$i > $R/spec_draft3_run$i.log 2>&1
  el "spec run $i"; pack
done
