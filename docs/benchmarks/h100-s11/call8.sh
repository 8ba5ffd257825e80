#!/usr/bin/env bash
# Session 11, eighth device call: profile_spec.py with the device's idle time a step split
# into before the draft (the host's wait, update, schedule, staging) and before the
# verification (the host late with its launch), from CUDA events; twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for i in 1 2; do
  timeout 240 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
    --output-len 64 --show-steps 0 --out /tmp/prof > $R/profile_spec8_run$i.log 2>&1
  cp /tmp/prof/profile_spec.json $R/profile_spec8_run$i.json
  el "profile $i"; grep before_ $R/profile_spec8_run$i.log; pack
done
