#!/usr/bin/env bash
# Session 12, fourth device call: the ahead run's first iteration from one kernel (draft_chain_start),
# two token rows a sequence in a fixed layout. Then the n-gram oracle at batch 1.
# bench_spec --draft-model gpt2 three times; profile_spec once; the graph, chain and spec
# tests natively (real chain graphs: the draft-ahead path).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for i in 1 2 3; do
  timeout 150 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-c4-run$i > $R/spec_draft4_run$i.log 2>&1
  el "draft run $i"; grep -o '"a": [0-9.]*, "speedup": [0-9.]*' $R/spec_draft4_run$i.log; pack
done
timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 0 --out /tmp/prof > $R/profile_spec4.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec4.json
el "profile"; grep -E "before_|target_decode" $R/profile_spec4.log | cut -c1-300; pack
cd ..
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py tests/test_spec_*.py tests/kernels/test_draft_chain_start_kernel.py \
  tests/kernels/test_pdl_contract.py > $R/gpu_tests4.log 2>&1
echo "rc=$?" >> $R/gpu_tests4.log; tail -3 $R/gpu_tests4.log
el tests; pack
cd scripts
timeout 200 python3 bench_spec.py --model gpt2-xl --rates 0,0.7,1.0 --ks 4 --batches 1 \
  --out $R/ngram4 > $R/spec_ngram4.log 2>&1
el "ngram"; grep -o '"a": [0-9.]*, "speedup": [0-9.]*' $R/spec_ngram4.log; pack
