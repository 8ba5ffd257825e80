#!/usr/bin/env bash
# Session 8, eighth device call: the load generator on aiohttp (call 7's split: server on CPUs
# 0-5, 8 client workers on 6-15), gpt2 then gpt2-xl, three bursts each with 2 API servers.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
OUT=$R MODELS="gpt2 gpt2-xl" SERVE_ARGS="--api-server-counts 2 --repeats 3 --num-workers 8 --client-cpus 6-15 --sweep-rates 10,40,160,640,inf --sweep-prompts 100" timeout 560 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
