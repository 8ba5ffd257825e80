#!/usr/bin/env bash
# Session 12, ninth device call, the final tree: profile_spec (graph times, device gaps with
# the draft queued ahead); the kernel tests natively; the graph, chain and spec tests.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
cd scripts
timeout 200 python3 profile_spec.py --model gpt2-xl --draft-model gpt2 --k 4 --rate 0.7 \
  --output-len 64 --show-steps 0 --out /tmp/prof > $R/profile_spec9.log 2>&1
cp /tmp/prof/profile_spec.json $R/profile_spec9.json
el "profile"; grep -E "before_|target_decode|device_busy|wall_us" $R/profile_spec9.log | cut -c1-400; pack
cd ..
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/kernels > $R/gpu_kernel_tests9.log 2>&1
echo "rc=$?" >> $R/gpu_kernel_tests9.log; tail -2 $R/gpu_kernel_tests9.log; el "kernel tests"; pack
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_draft_chain.py tests/test_spec_*.py > $R/gpu_tests9.log 2>&1
echo "rc=$?" >> $R/gpu_tests9.log; tail -2 $R/gpu_tests9.log; el "tests"; pack
