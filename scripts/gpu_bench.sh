#!/usr/bin/env bash
# The GPU-node job: kernel and graph tests at full size, then benchmarks, results under $OUT.
#   OUT=/tmp/out bash scripts/gpu_bench.sh tests latency offline kernels profile serve spec
# Env knobs: MODELS (latency, profile, serve), LATENCY_ARGS, SERVE_ARGS, NUM_PROMPTS and
# OFFLINE_ARGS (offline), SPEC_MODEL and SPEC_ARGS (spec: speculative decoding sweeps,
# scripts/bench_spec.py; spec-draft: SPEC_DRAFTS, default gpt2 and the target's copy, each
# drafting for SPEC_MODEL, results under $OUT/draft-<name>),
# PROFILE_BATCH (e.g. LATENCY_ARGS=--no-mixed-step-graphs for the eager-prefill side of an A/B);
# soak: scripts/soak.py on SOAK_MODEL (default gpt2, a random checkpoint) for SOAK_MINUTES
# (default 10), server flags "--device cuda $SOAK_SERVER_ARGS", soak flags SOAK_ARGS (default
# --concurrency 64), results under $OUT/soak;
# GPT2_SERVE_PDL=0 launches the Triton kernels without programmatic dependent launch.
# The node has torch/triton/transformers but no network: wheels it lacks travel in .whl/ and the
# plain-PyTorch anchor in .anchor/ (copied from ../shared/anchors/).
# Stage `before` runs BEFORE_STAGES (default: latency offline) from the tree in .before/ (carried:
# mkdir .before && git archive BASE | tar -x -C .before), results under $OUT/before, so that
# `bash scripts/gpu_bench.sh before latency offline` compares a base commit with this tree in one run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/benchmarks}
mkdir -p "$OUT" checkpoints
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
    echo "=== $stage ==="
    case $stage in
        tests) python3 -m pytest tests/kernels tests/test_cuda_graphs.py -q -x 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
        latency) python3 scripts/bench_latency.py --models "${MODELS:-gpt2,gpt2-xl}" --anchor .anchor/compiled_decode_anchor.py --out "$OUT" ${LATENCY_ARGS:-} 2>&1 | tee "$OUT/latency.log" | grep -v "it/s" ;;
        offline) python3 scripts/bench_offline.py --model gpt2 --num-prompts "${NUM_PROMPTS:-1000}" --out "$OUT" ${OFFLINE_ARGS:-} 2>&1 | tee "$OUT/offline.log" | grep -v "it/s\]" ;;
        profile) for m in ${MODELS:-gpt2 gpt2-xl}; do python3 scripts/profile_decode.py --model "$m" --batch "${PROFILE_BATCH:-1,64}" 2>&1 | grep -v "it/s"; done | tee "$OUT/profile.log" ;;
        before) for d in .anchor .whl checkpoints; do ln -sfn "../$d" ".before/$d"; done
                OUT=$OUT/before bash .before/scripts/gpu_bench.sh ${BEFORE_STAGES:-latency offline} ;;
        serve) for m in ${MODELS:-gpt2}; do python3 scripts/bench_serve.py --model "$m" --out "$OUT" ${SERVE_ARGS:-}; done 2>&1 | tee "$OUT/serve.log" | grep -v "it/s" ;;
        spec) python3 scripts/bench_spec.py --model "${SPEC_MODEL:-gpt2-xl}" --out "$OUT" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec.log" | grep -v "it/s" ;;
        spec-draft) for d in ${SPEC_DRAFTS:-gpt2 ${SPEC_MODEL:-gpt2-xl}}; do python3 scripts/bench_spec.py --model "${SPEC_MODEL:-gpt2-xl}" --draft-model "$d" --out "$OUT/draft-$(basename "$d")" ${SPEC_ARGS:-}; done 2>&1 | tee "$OUT/spec_draft.log" | grep -v "it/s" ;;
        soak) ckpt=$(cd scripts && python3 -c "from bench_utils import checkpoint_for; print(checkpoint_for('${SOAK_MODEL:-gpt2}'))" | tail -1)
              python3 scripts/soak.py --minutes "${SOAK_MINUTES:-10}" --model "$ckpt" --server-args "--device cuda ${SOAK_SERVER_ARGS:-}" ${SOAK_ARGS:---concurrency 64} --out "$OUT/soak" 2>&1 | tee "$OUT/soak.log" | tail -60 ;;
        kernels) python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
        *) echo "unknown stage $stage" ;;
    esac
done
