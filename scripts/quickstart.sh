#!/usr/bin/env bash
# Set up a virtualenv, install gpt2-serve, and serve a GPT-2 model on :8000.
#   MODEL=gpt2-xl bash scripts/quickstart.sh      (any HF GPT-2 hub id or local directory)
# With no model reachable (no hub access, nothing cached), it serves a RANDOM-weight checkpoint
# written by scripts/make_checkpoint.py instead, and says so loudly: its text is gibberish.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gpt2}
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0" || pip install -q torch
pip install -q -e .
if ! python -c "import sys; from engine.worker.models.gpt2 import resolve_model_dir as r; r(sys.argv[1])" \
        "$MODEL" 2>/dev/null; then
    ARCH=$MODEL; case $ARCH in gpt2|gpt2-medium|gpt2-large|gpt2-xl) ;; *) ARCH=gpt2;; esac
    OUT=checkpoints/$ARCH-random
    echo "################################################################################" >&2
    echo "# WARNING: model '$MODEL' is not reachable (no hub access and nothing cached)." >&2
    echo "# Serving a RANDOM-WEIGHT $ARCH checkpoint from $OUT instead: outputs are noise." >&2
    echo "################################################################################" >&2
    [ -f "$OUT/config.json" ] || python scripts/make_checkpoint.py --arch "$ARCH" --out "$OUT"
    MODEL=$OUT
fi
exec gpt2-serve --model "$MODEL" --host 0.0.0.0 --port "${PORT:-8000}" "$@"
