#!/usr/bin/env bash
# Session 9, first device call: where a draft-model speculative step's time goes (gpt2 drafting
# for gpt2-xl, k = 4, one stream, a = 0.7 and 1), then the skinny GEMM's tile configs for the
# norm-fused layers of gpt2-xl at M = 1, 8, 16 (verification steps replay M = 16 graphs).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
for a in 0.7 1.0; do
  timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate $a \
    --output-len 64 --out /tmp/prof_$a > $R/profile_spec_a$a.log 2>&1
  cp /tmp/prof_$a/profile_spec.json $R/profile_spec_a$a.json
  el "profile a=$a"; pack
done
timeout 300 python3 sweep_skinny.py --widths 1600 --m 1,8,16 --layers qkv,fc > $R/sweep_skinny.log 2>&1
el sweep; pack
