#!/usr/bin/env bash
# On a GPU node without Docker: run gpt2-serve as the image runs it (entrypoint gpt2-serve, the
# preset from the model's name, HF_HOME and TRITON_CACHE_DIR on their own directories, readiness
# read by the image's HEALTHCHECK command), time launch-to-ready on an empty Triton cache, load
# it with a rate sweep, then time a second start on the filled cache.
#   pip install -e '.[bench]'
#   MODEL=gpt2 OUT=docs/benchmarks/h100/serve bash scripts/image_style_run.sh
# Writes $OUT/$MODEL-{cold,warm}.log, -sweep.{png,json,txt} and -startup.json.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gpt2}
OUT=${OUT:-docs/benchmarks/serve}
PORT=${PORT:-8000}
RATES=${RATES:-10,40,160,640,inf}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-128}
CACHE=$(mktemp -d)
export HF_HOME=$CACHE/huggingface TRITON_CACHE_DIR=$CACHE/triton
mkdir -p "$OUT" "$HF_HOME" "$TRITON_CACHE_DIR"
# No hub on our GPU nodes: random weights in a directory named after the model, so the preset
# follows from the name as it does for `--model /models/gpt2-xl` in the image.
CKPT=checkpoints/image/$MODEL
[ -f "$CKPT/config.json" ] ||
    python scripts/make_checkpoint.py --arch "$MODEL" --dtype float16 --out "$CKPT"

SERVER=""
trap '[ -z "$SERVER" ] || kill "$SERVER" 2>/dev/null || true' EXIT  # no server left behind

start_server() {  # $1: log name. Sets SERVER; prints seconds from launch to ready.
    local t0
    t0=$(python -c "import time; print(time.time())")
    gpt2-serve --model "$CKPT" --served-model-name "$MODEL" --port "$PORT" >"$OUT/$1.log" 2>&1 &
    SERVER=$!
    until python -m server.healthcheck "$SERVER" 2>/dev/null; do
        kill -0 "$SERVER" 2>/dev/null || { tail -5 "$OUT/$1.log" >&2; exit 1; }
        sleep 0.5
    done
    python -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$t0"
}

PLOT=(--plot "$OUT/$MODEL-sweep.png")
if ! python -c "import matplotlib" 2>/dev/null; then
    PLOT=()
    echo "no matplotlib here: plot later with gpt2-bench --replot $OUT/$MODEL-sweep.json" \
        "--plot $OUT/$MODEL-sweep.png" >&2
fi

start_server "$MODEL-cold" >"$CACHE/cold"
echo "cold start (empty Triton cache): $(cat "$CACHE/cold") s"
gpt2-bench --base-url "http://127.0.0.1:$PORT" --sweep-rates "$RATES" \
    --num-prompts "$NUM_PROMPTS" --num-workers 4 \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --disable-tqdm "${PLOT[@]}" --result-file "$OUT/$MODEL-sweep.json" |
    tee "$OUT/$MODEL-sweep.txt"
kill -TERM "$SERVER" && wait "$SERVER" || true
start_server "$MODEL-warm" >"$CACHE/warm"
echo "warm start (Triton cache filled): $(cat "$CACHE/warm") s"
kill -TERM "$SERVER" && wait "$SERVER" || true
printf '{"model": "%s", "cold_start_s": %s, "warm_start_s": %s}\n' \
    "$MODEL" "$(cat "$CACHE/cold")" "$(cat "$CACHE/warm")" >"$OUT/$MODEL-startup.json"
