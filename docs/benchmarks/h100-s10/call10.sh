#!/usr/bin/env bash
# Session 10, tenth device call: is call 9's n-gram a = 1 (3.50x against 3.80-3.89x in the
# ninth round) this round's change or the machine? The session's first tree (d36a0de,
# unpacked beside this one by `git archive d36a0de | tar -x -C ab_old`) and this one, in
# turn on one machine: bench_spec with the oracle at n-gram cost, a = 1, k = 4, one stream.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
mkdir -p checkpoints && ln -sfn ../checkpoints ab_old/checkpoints
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
for i in 1 2; do
  for tree in ab_old .; do
    name=$([ $tree = . ] && echo new || echo old)
    (cd $tree/scripts && PYTHONPATH=$PWD/..:/tmp/site timeout 150 python3 bench_spec.py \
      --model gpt2-xl --rates 1.0 --ks 4 --batches 1 --out $R/ab_${name}_run$i \
      > $R/ab_${name}_run$i.log 2>&1)
    el "$name run $i"; pack
  done
done
