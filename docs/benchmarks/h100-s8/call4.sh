#!/usr/bin/env bash
# Session 8, fourth device call: served/offline after the msgspec request decoding, 2 and 3
# API servers, five bursts each, the load generator on CPUs 8-15, and the sweep with 3.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 2,3 --repeats 5 --num-workers 8 --client-cpus 8-15 --sweep-rates 20,160,640,inf --sweep-prompts 200" timeout 400 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
