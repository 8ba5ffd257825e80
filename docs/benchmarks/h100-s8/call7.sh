#!/usr/bin/env bash
# Session 8, seventh device call: the server on 6 CPUs (0-5), 16 client workers on 6-15, five bursts with
# 2 API servers, then rate 20, one stream and the 10/40/160/640/inf sweep.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 2 --repeats 5 --num-workers 16 --client-cpus 6-15 --sweep-rates 10,40,160,640,inf --sweep-prompts 200" timeout 420 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
