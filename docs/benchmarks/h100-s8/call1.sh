#!/usr/bin/env bash
# Session 8, first device call: measure what session 7 changed after its budget (see
# docs/benchmarks/h100-s7/README.md, "Not yet measured"), then profile a warm engine start.
set -u
R=/tmp/r; mkdir -p $R/img /tmp/bin /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/bin:$PATH
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python
printf '#!/bin/sh\nexec python3 -m server "$@"\n' > /tmp/bin/gpt2-serve
printf '#!/bin/sh\nexec python3 -m server.bench.cli "$@"\n' > /tmp/bin/gpt2-bench
chmod +x /tmp/bin/*
pack() { tar czf $OUT/results.tgz -C $R . ; }
T0=$(date +%s)
OUT=$R MODELS=gpt2 SERVE_ARGS="--api-server-counts 1,2 --repeats 3 --num-workers 8 --sweep-rates inf --sweep-prompts 100" timeout 300 bash scripts/gpu_bench.sh serve > $R/serve_stage.log 2>&1
echo "serve stage $(( $(date +%s) - T0 )) s"; pack
# warm start profile: the serve stage filled the Triton and startup caches for this checkpoint
python3 - > $R/warm_profile.txt 2>&1 <<'PY'
import cProfile, pstats, time
t = time.perf_counter(); import torch; torch.empty(1, device="cuda"); print(f"import torch + CUDA init {time.perf_counter()-t:.2f} s")
t = time.perf_counter(); from engine.llm import LLM; print(f"import engine.llm {time.perf_counter()-t:.2f} s")
p = cProfile.Profile(); t = time.perf_counter(); p.enable()
llm = LLM(model="checkpoints/gpt2-random", config_file="configs/gpt2.yaml", device="cuda")
p.disable(); print(f"LLM() {time.perf_counter()-t:.2f} s")
pstats.Stats(p).sort_stats("cumulative").print_stats(60)
pstats.Stats(p).sort_stats("tottime").print_stats(25)
PY
echo "profile $(( $(date +%s) - T0 )) s"; pack
OUT=$R SPEC_MODEL=gpt2-xl SPEC_ARGS="--rates 0 --ks 4 --batches 1,128 --output-len 64 --dtype float32" timeout 200 bash scripts/gpu_bench.sh spec > $R/spec_stage.log 2>&1
echo "spec stage $(( $(date +%s) - T0 )) s"; pack
MODEL=gpt2 OUT=$R/img RATES=inf NUM_PROMPTS=200 timeout $(( 590 - ($(date +%s) - T0) )) bash scripts/image_style_run.sh > $R/img_stage.log 2>&1
echo "img stage $(( $(date +%s) - T0 )) s"; pack
