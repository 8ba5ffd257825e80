#!/usr/bin/env bash
# Session 12, first device call: the skinny GEMM's L2 prefetch of its weights between the PDL
# trigger and wait. Kernel tests natively; profile_spec's graph times with the prefetch off
# (GPT2_SERVE_PREFETCH=0) and on; bench_spec --draft-model gpt2 on, off, on.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
timeout 200 python3 -m pytest -q -x tests/kernels/test_skinny_gemm_kernel.py \
  tests/kernels/test_linear_dispatch.py tests/kernels/test_pdl_contract.py \
  > $R/gpu_tests1.log 2>&1
el "tests"; tail -2 $R/gpu_tests1.log; pack
cd scripts
for p in 0 1; do
  GPT2_SERVE_PREFETCH=$p timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 \
    --k 4 --rate 0.7 --output-len 64 --show-steps 0 --out /tmp/prof > $R/profile_prefetch$p.log 2>&1
  cp /tmp/prof/profile_spec.json $R/profile_prefetch$p.json
  el "profile prefetch=$p"; grep -E "before_|device_us" $R/profile_prefetch$p.log | cut -c1-160; pack
done
for run in 1:1 2:0 3:1; do
  i=${run%:*}; p=${run#*:}
  GPT2_SERVE_PREFETCH=$p timeout 150 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 \
    --ks 4 --rates 0.7,1.0 --out $R/draft-run$i-prefetch$p > $R/spec_draft_run$i-prefetch$p.log 2>&1
  el "draft prefetch=$p"; pack
done
grep -h '"speedup"\|speedup' $R/spec_draft_prefetch*.log | cut -c1-200 | tail -12
