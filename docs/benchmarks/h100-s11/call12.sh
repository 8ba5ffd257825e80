#!/usr/bin/env bash
# Session 11, twelfth device call, the final tree: bench_spec --draft-model gpt2 (k = 4,
# a = 0.7 and 1) three times; the n-gram oracle's batch sweep (1 and 128 at a = 0.7, k = 4)
# in three rounds of plain, forced and switched runs (--batch-repeats, medians).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for i in 1 2 3; do
  timeout 150 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c12-run$i > $R/spec_draft12_run$i.log 2>&1
  el "draft run $i"; pack
done
timeout 280 python3 bench_spec.py --model gpt2-xl --rates 0.7 --ks 4 --batches 1,128 \
  --batch-repeats 3 --out $R/ngram-batches > $R/spec_ngram12_batches.log 2>&1
el "batches"; grep '"batch"' $R/spec_ngram12_batches.log | cut -c1-200; pack
