#!/usr/bin/env bash
# Session 12, seventh device call, the final tree: as call 5, now that round r of a point
# replays oracle pattern r in every process (call 5's rounds each drew their own: a = 0.77 in
# one). The draft model's default sweep (three rounds a point), then k = 4 at a = 0.7 and 1
# in nine rounds.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 300 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --out $R/draft-sweep \
  > $R/spec_draft7_sweep.log 2>&1
el "sweep"; grep -o '"k": [0-9]*, "a": [0-9.a-z]*, "speedup": [0-9.]*' $R/spec_draft7_sweep.log; pack
timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 --rates 0.7,1.0 \
  --stream-repeats 9 --out $R/draft-k4 > $R/spec_draft7_k4.log 2>&1
el "k4"; grep -o '"a": [0-9.]*, "speedup": [0-9.]*, "speedups": [^]]*]\|"a_measured": [0-9.]*' \
  $R/spec_draft7_k4.log; pack
