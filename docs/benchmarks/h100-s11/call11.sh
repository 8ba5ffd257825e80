#!/usr/bin/env bash
# Session 11, eleventh device call: batch 128 in call 9 gave 0.97x forced, 0.93x with the
# switch-off (session 10: 1.06x / 1.15x). This session's kernels, or the machine? The
# session's first tree (abae4e1, in .before/, carried) and this tree in turn, twice each:
# bench_spec n-gram oracle, k = 4, batch 128 at a = 0.7 (and one stream at a = 0.7).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
ROOT=$PWD
mkdir -p .before/checkpoints
for i in 1 2; do
  for tree in before after; do
    dir=$ROOT; [ $tree = before ] && dir=$ROOT/.before
    (cd $dir/scripts && PYTHONPATH=$dir:/tmp/site timeout 150 python3 bench_spec.py \
      --model gpt2-xl --rates 0.7 --ks 4 --batches 128 --out $R/b128-$tree-$i \
      > $R/spec_b128_${tree}_run$i.log 2>&1)
    el "$tree $i"; grep '"batch"' $R/spec_b128_${tree}_run$i.log; pack
  done
done
