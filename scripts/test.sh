#!/usr/bin/env bash
# Set up a virtualenv with the CPU build of torch and the test extras, then run every test.
# The CPU build of torch comes from TORCH_INDEX_URL (default PyTorch's CPU index; see
# scripts/venv.sh). Triton kernels run on the CPU under TRITON_INTERPRET=1 (in a subprocess,
# at small sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
install_torch cpu
pip install -q -e ".[test]"
python -m pytest -q "$@"
