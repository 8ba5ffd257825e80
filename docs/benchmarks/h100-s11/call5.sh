#!/usr/bin/env bash
# Session 11, fifth device call (call 4 again: its capture ran the catching-up iteration on zeroed buffers, every row "catching up" at position 0, and a NaN draw indexed past the vocabulary; now no row catches up at capture, and opentelemetry-api, which the newer fastapi wheel imports, travels too): the catch-up folded into the draft's first iteration (a row
# catching up feeds its last draft and its bonus token in one forward, two tokens packed
# varlen, instead of a forward of its own before the chain). The CUDA graph, chain and kernel
# tests, then profile_spec.py and bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1,
# three times.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py tests/test_spec_draft_model.py \
  tests/kernels/test_paged_attention_kernels.py > $R/gpu_tests5.log 2>&1
echo "rc=$?" >> $R/gpu_tests5.log; tail -3 $R/gpu_tests5.log
el tests; pack
cd scripts
timeout 240 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 1 --out /tmp/prof > $R/profile_spec5.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec5.json
el profile; pack
for i in 1 2 3; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c5-run$i > $R/spec_draft5_run$i.log 2>&1
  el "spec run $i"; pack
done
