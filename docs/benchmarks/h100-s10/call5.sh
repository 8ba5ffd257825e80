#!/usr/bin/env bash
# Session 10, fifth device call: the code with the per-token attention reverted (the prefill
# kernel verifies again) and the draft's iterations a graph each. The prefill kernel's knobs
# on a graph-padded verification (scripts/sweep_verify_attention.py), scripts/profile_spec.py,
# then bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1, twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 240 python3 sweep_verify_attention.py --out $R > $R/sweep_verify_attention.log 2>&1
el sweep; pack
timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 1 --out /tmp/prof > $R/profile_spec5.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec5.json
el profile; pack
for i in 1 2; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c5-run$i > $R/spec_draft5_run$i.log 2>&1
  el "spec run $i"; pack
done
