#!/usr/bin/env bash
# Session 12, eighth device call, the final tree: the speculation cost model with plain
# steps timed pipelined. The n-gram oracle's whole default sweep again (as call 6: single
# stream k = 2, 4, 6 at a = 0 ... 1, three rounds each; batches 1, 8, 32, 128; the real
# n-gram workload; pipelining), its PNGs.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 420 python3 bench_spec.py --model gpt2-xl --out $R/ngram-sweep > $R/spec_ngram8.log 2>&1
el "ngram sweep"; grep -o '"k": [0-9]*, "a": [0-9.]*, "speedup": [0-9.]*\|"speedup_switch_on": [0-9.]*\|"batch": [0-9]*' $R/spec_ngram8.log | paste - - ; grep -h "cost model" $R/spec_ngram8.log | cut -c1-400; pack
