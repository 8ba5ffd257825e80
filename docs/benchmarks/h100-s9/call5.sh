#!/usr/bin/env bash
# Session 9, fifth device call: call 4 plus verification-only steps without the draft's follow pass (a
# request that accepted every draft feeds its last one in the next fill). Call 4: k + 1 staging
# mirrors for the draft's decode graphs (its
# iterations all queue without waiting) and no host copy of its tokens; graph launch host times.
# Before: drafts on the device (no host sync
# between the draft's iterations and the target's verification step). The speculative
# step's phases (scripts/profile_spec.py), then bench_spec --draft-model gpt2 at k = 4.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 2 --out /tmp/prof > $R/profile_spec5.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec5.json
el profile; pack
timeout 300 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
  --rates 0.7,1.0 --out $R/draft-gpt2 > $R/spec_draft5.log 2>&1
el spec; pack
# the n-gram engine at a = 1, k = 4, one stream, forced and with the switch-off, twice
# (session 8's unexplained 3.10x switched against 3.66x forced)
for i in 1 2; do
  timeout 200 python3 bench_spec.py --model gpt2-xl --rates 1.0 --ks 4 --batches 1 \
    --output-len 128 --out $R/ngram_a1_run$i > $R/spec_ngram_a1_run$i.log 2>&1
  el "ngram a=1 run $i"; pack
done
