#!/usr/bin/env bash
# Set up a virtualenv with the CPU build of torch and the test extras, then run every test.
# Triton kernels run on the CPU under TRITON_INTERPRET=1 (in a subprocess, at small sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
python -m pytest -q "$@"
