#!/usr/bin/env bash
# Set up a virtualenv, install gpt2-serve, and serve a GPT-2 model on :8000 under the name asked
# for, so that `"model": "gpt2"` in a request works whatever weights are behind it.
#   MODEL=gpt2-xl bash scripts/quickstart.sh [gpt2-serve flags]   (hub id or local directory)
#   PORT=9000 serves elsewhere. torch: the CUDA build of deploy/constraints.txt where nvidia-smi
#   sees a GPU, else the CPU build (TORCH_INDEX_URL, TORCH_CUDA_INDEX_URL: scripts/venv.sh).
# A named size (gpt2, gpt2-medium, gpt2-large, gpt2-xl) that cannot be fetched (no hub access,
# nothing cached) is served from a RANDOM-weight checkpoint written by scripts/make_checkpoint.py
# instead, loudly: its text is gibberish. Any other model that cannot be found is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gpt2}
. scripts/venv.sh
if nvidia-smi -L >/dev/null 2>&1; then install_torch cuda; else install_torch cpu; fi
pip install -q -e .

# prints why the model cannot be loaded, in one line (hub chatter on stderr is dropped)
why=$(python - "$MODEL" 2>/dev/null <<'PY'
import sys
from engine.worker.models.gpt2 import resolve_model_dir
try:
    resolve_model_dir(sys.argv[1])
except Exception as exc:
    print(" ".join(str(exc).split()))
PY
)
SERVE=(--model "$MODEL")
if [ -n "$why" ]; then
    case $MODEL in
        gpt2|gpt2-medium|gpt2-large|gpt2-xl) ;;
        *) echo "quickstart: cannot serve '$MODEL': $why" >&2; exit 1;;
    esac
    OUT=checkpoints/$MODEL-random
    echo "################################################################################" >&2
    echo "# WARNING: model '$MODEL' cannot be fetched: $why" >&2
    echo "# Serving a RANDOM-WEIGHT $MODEL checkpoint from $OUT instead, under the name" >&2
    echo "# '$MODEL': its outputs are noise." >&2
    echo "################################################################################" >&2
    [ -f "$OUT/config.json" ] || python scripts/make_checkpoint.py --arch "$MODEL" --dtype float16 --out "$OUT"
    SERVE=(--model "$OUT" --config "configs/$MODEL.yaml")
fi
exec gpt2-serve "${SERVE[@]}" --served-model-name "$MODEL" --host 0.0.0.0 --port "${PORT:-8000}" "$@"
