#!/usr/bin/env bash
# Session 9, sixth device call: call 5's code, the stream also under cProfile (host time on the node).
# Call 5: verification-only steps without the draft's follow pass (a
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
  --output-len 64 --show-steps 2 --cprofile --out /tmp/prof > $R/profile_spec6.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec6.json; cp /tmp/prof/profile_spec_host.txt $R/profile_spec6_host.txt
el profile; pack
