#!/usr/bin/env bash
# Session 12, sixth device call, the final tree: the n-gram oracle's whole default sweep
# (single stream: k = 2, 4, 6 at a = 0, 0.5, 0.7, 0.9, 1, three rounds each of plain,
# forced and switched runs; batches 1, 8, 32, 128 at a = 0.7, k = 4, three rounds; the real
# n-gram proposer on a repetitive workload; pipelining). Then the draft model at k = 4,
# a = 0.7 in nine rounds, with each round's a.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 420 python3 bench_spec.py --model gpt2-xl --out $R/ngram-sweep > $R/spec_ngram6.log 2>&1
el "ngram sweep"; grep -o '"k": [0-9]*, "a": [0-9.]*, "speedup": [0-9.]*\|"speedup_switch_on": [0-9.]*\|"batch": [0-9]*' $R/spec_ngram6.log | head -60; pack
timeout 200 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 --rates 0.7 \
  --stream-repeats 9 --out $R/draft-k4 > $R/spec_draft6_k4.log 2>&1
el "draft k4"; grep -o '"speedups": [^]]*]\|"a_rounds": [^]]*]' $R/spec_draft6_k4.log; pack
