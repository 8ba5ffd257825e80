#!/usr/bin/env bash
# Session 12, fifth device call, the final tree: the draft model (gpt2 drafting for gpt2-xl)
# over the whole default sweep (k = 2, 4, 6; a = the draft's own tokens, 0, 0.5, 0.7, 0.9,
# 1), each point the median of three rounds (--stream-repeats); then k = 4 at a = 0.7 and 1
# in two more processes.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 300 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --out $R/draft-sweep \
  > $R/spec_draft5_sweep.log 2>&1
el "sweep"; grep -o '"k": [0-9]*, "a": [0-9.a-z]*, "speedup": [0-9.]*' $R/spec_draft5_sweep.log; pack
for i in 1 2; do
  timeout 150 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-c5-run$i > $R/spec_draft5_run$i.log 2>&1
  el "draft run $i"; grep -o '"a": [0-9.]*, "speedup": [0-9.]*, "speedups": [^]]*]' \
    $R/spec_draft5_run$i.log; pack
done
