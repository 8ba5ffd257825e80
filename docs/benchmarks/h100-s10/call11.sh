#!/usr/bin/env bash
# Session 10, eleventh device call: a short step (at most 16 tokens: the one-stream
# verification) splits its keys in the prefill kernel (SHORT_Q_SPLIT_LEN). The short-q-tile
# knobs with the split length (scripts/sweep_verify_attention.py), the attention kernels'
# tests at full size, then bench_spec --draft-model gpt2 at k = 4, a = 0.7 and 1, twice.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 200 python3 sweep_verify_attention.py --out $R > $R/sweep_verify_attention11.log 2>&1
el sweep; pack
cd ..
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention_kernels.py \
  tests/kernels/test_triton_backend.py > $R/gpu_tests11.log 2>&1
echo "rc=$?" >> $R/gpu_tests11.log; tail -3 $R/gpu_tests11.log
el tests; pack
cd scripts
for i in 1 2; do
  timeout 150 python3 bench_spec.py --model gpt2-xl --draft-model gpt2 --ks 4 \
    --rates 0.7,1.0 --out $R/draft-gpt2-c11-run$i > $R/spec_draft11_run$i.log 2>&1
  el "spec run $i"; pack
done
