#!/usr/bin/env bash
# Session 8, third device call: which server process limits a burst (CPU per process), the
# switch-off's lighter prior at a = 0, and the gpt2 draft's real cost at a set acceptance.
set -u
R=/tmp/r; mkdir -p $R /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s); el() { echo "$1 $(( $(date +%s) - T0 )) s"; }
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 2,3 --repeats 3 --num-workers 8 --client-cpus 8-15 --sweep-rates inf --sweep-prompts 100" timeout 220 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
el serve; pack
OUT=$R SPEC_MODEL=gpt2-xl SPEC_ARGS="--rates 0,1.0 --ks 4 --batches 1 --output-len 128" timeout 130 bash scripts/gpu_bench.sh spec > $R/spec_stage.log 2>&1
el spec; pack
OUT=$R SPEC_DRAFTS=gpt2 SPEC_ARGS="--ks 4 --rates 0.7,1.0 --output-len 64" timeout $(( 585 - ($(date +%s) - T0) )) bash scripts/gpu_bench.sh spec-draft > $R/spec_draft_stage.log 2>&1
el draft; pack
