#!/usr/bin/env bash
# Session 11, first device call: where the host's 1.7 ms of ModelRunner.launch goes in a
# speculative step (gpt2 drafting for gpt2-xl, k = 4, a = 0.7: profile_spec.py --cprofile),
# and the skinny GEMM's tile configs on gpt2-xl's MLP projection at M = 16 (the verification
# step's shape, where cuBLAS takes a split-K kernel and a reduce).
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 240 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 4 --cprofile --out /tmp/prof > $R/profile_spec1.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec1.json; cp /tmp/prof/profile_spec_host.txt $R/
el profile; pack
cd ..
timeout 200 python3 scripts/sweep_skinny.py --widths 1600 --m 16 --layers proj,fc \
  > $R/sweep_skinny_m16.log 2>&1
el sweep; pack
