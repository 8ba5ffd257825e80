#!/usr/bin/env bash
# Session 8, fifth device call: is the load generator the limit? The same bursts with the
# client on 12 CPUs (4-15, 12 workers) and the server on 4 (0-3), five bursts with 2 API servers.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 2 --repeats 5 --num-workers 12 --client-cpus 4-15 --sweep-rates inf --sweep-prompts 100" timeout 300 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
