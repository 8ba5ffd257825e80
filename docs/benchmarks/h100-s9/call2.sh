#!/usr/bin/env bash
# Session 9, second device call: the draft-model speculative step again (gpt2 drafting for
# gpt2-xl, k = 4, one stream, a = 0.7), now with host phases timed without the profiler and
# the kernels of each graph it replays (scripts/profile_spec.py).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 300 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 2 --out /tmp/prof > $R/profile_spec2.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec2.json
el profile; pack
